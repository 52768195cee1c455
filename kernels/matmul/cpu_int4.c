/* Group-wise int4 matmul on CPU over the packed nibbles (kernels/matmul/cpu_int4.py loads it):

       out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),   W[n, k] = q[n, k] * s[n, g] + z[n, g],  g = k / G

   x        [M, K] float32 rows (row stride ldx)
   packed   [N, Kp / 2] uint8    Kp = K rounded up to G; nibble order of a group (kernels/matmul/quant_matmul.py):
                                 byte j holds k = j (low nibble) and k = G/2 + j (high nibble)
   scales   [N, Kp / G] float16 or float32 (scale_f32)
   zeros    the same shape and type, or NULL: symmetric, z = -8 s (Q4_0's and GPTQ's unsigned offset)
   out      [M, N] float32

   No float copy of W is made (at most 128 x 32 of it, in L1). Two AVX-512 loops; threads split N (OpenMP, the
   libgomp torch has loaded):
   - the tile loop (under PANEL_MIN_ROWS rows: decode, where unpacking is the work): each 16 bytes of a weight
     row are widened to 32 nibbles in two zmm registers, dequantized there (one FMA each: q * s + z) and
     multiplied into the activations of up to 8 rows at once; columns by threes (3+ rows) or fours (1-2 rows:
     four independent rows keep the FMA units fed). The sum over k runs in 16 lanes, reduced at the end.
   - the panel path (more rows: large decode batches, prefill; cpu_panel.h has the loop): a weight decoded once
     per 128 rows into a float panel in L1, then an outer product over it, as a float GEMM runs; 1.05-1.36x the
     tile loop from 24 rows, and as fast as oneDNN over dequantized slices or faster up to 2,048 rows.
   Columns past K (the last group's padding) never meet an activation.

   Arithmetic is float32, so a result differs from F.linear's by the order of the sum only. A G that is not a
   multiple of 32, and builds without AVX-512, run the portable loop (plain C, the same dequantization); the
   panel path takes G of 32, 64 and 128. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"      /* half_to_float */

#define MR 8      /* activation rows a block */
#define PANEL_MIN_ROWS 24   /* rows from which the panel path runs: below, the tile loop is faster (decoding is the work) */


typedef struct {
    const float *x; int64_t ldx;
    const uint8_t *packed; const void *scales, *zeros; int scale_f32;
    const float *bias; float *out;
    int M, N, K, Kp, G;
} Problem;

static inline void scale_zero(const Problem *p, int n, int g, float *s, float *z) {
    const size_t i = (size_t)n * (p->Kp / p->G) + g;
    if (p->scale_f32) {
        *s = ((const float *)p->scales)[i];
        *z = p->zeros ? ((const float *)p->zeros)[i] : -8.0f * *s;
    } else {
        *s = half_to_float(((const uint16_t *)p->scales)[i]);
        *z = p->zeros ? half_to_float(((const uint16_t *)p->zeros)[i]) : -8.0f * *s;
    }
}

/* The portable loop: rows [m0, m1) x columns [n0, n1). */
static void block_portable(const Problem *p, int m0, int m1, int n0, int n1) {
    const int G = p->G, half = G / 2, groups = p->Kp / G;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = p->packed + (size_t)n * (p->Kp / 2);
        for (int m = m0; m < m1; m++) {
            const float *x = p->x + (size_t)m * p->ldx;
            float acc = 0.0f;
            for (int g = 0; g < groups; g++) {
                float s, z;
                scale_zero(p, n, g, &s, &z);
                const uint8_t *b = row + (size_t)g * half;
                const int k0 = g * G;
                for (int j = 0; j < half; j++) {
                    const int klo = k0 + j, khi = k0 + half + j;
                    if (klo < p->K) acc += x[klo] * ((float)(b[j] & 15) * s + z);
                    if (khi < p->K) acc += x[khi] * ((float)(b[j] >> 4) * s + z);
                }
            }
            p->out[(size_t)m * p->N + n] = acc + (p->bias ? p->bias[n] : 0.0f);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1
#include "cpu_panel.h"
#include "cpu_int4_scales.h"   /* int4_group_scales */

static inline __mmask16 lanes(int left) {
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
}

/* Scales and zeros of groups [g, g + 16) of column n (fewer at the row's end) into s[], z[] as float32. */
static inline void sz16(const Problem *p, int n, int g, float *s, float *z) {
    const int groups = p->Kp / p->G, left = groups - g;
    const __mmask16 m = lanes(left);
    const size_t i = (size_t)n * groups + g;
    __m512 vs, vz;
    if (p->scale_f32) {
        vs = _mm512_maskz_loadu_ps(m, (const float *)p->scales + i);
        vz = p->zeros ? _mm512_maskz_loadu_ps(m, (const float *)p->zeros + i) : _mm512_setzero_ps();
    } else {
        vs = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p->scales + i));
        vz = p->zeros ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p->zeros + i)) : _mm512_setzero_ps();
    }
    if (!p->zeros) vz = _mm512_mul_ps(vs, _mm512_set1_ps(-8.0f));
    _mm512_storeu_ps(s, vs);
    _mm512_storeu_ps(z, vz);
}

/* rows [m0, m0 + mr) x columns [n0, n0 + nr); mr <= MR, nr <= 4; both constants where it is inlined. */
static inline __attribute__((always_inline)) void tile(const Problem *p, int m0, const int mr, int n0, const int nr) {
    const int G = p->G, half = G / 2, groups = p->Kp / G;
    const size_t rowb = (size_t)p->Kp / 2;
    __m512 acc[MR][4];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < MR; r++)
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    float sb[4][16], zb[4][16];       /* 16 groups' scales and zeros of each column, widened 16 at a time */
    for (int g = 0; g < groups; g++) {
        if (g % 16 == 0)
            _Pragma("GCC unroll 4")
            for (int c = 0; c < nr; c++) sz16(p, n0 + c, g, sb[c], zb[c]);
        __m512 vs[4], vz[4];
        _Pragma("GCC unroll 4")
        for (int c = 0; c < nr; c++) {
            vs[c] = _mm512_set1_ps(sb[c][g % 16]);
            vz[c] = _mm512_set1_ps(zb[c][g % 16]);
        }
        const int k0 = g * G;
        for (int j = 0; j < half; j += 16) {
            const int klo = k0 + j, khi = k0 + half + j;
            const __mmask16 mlo = lanes(p->K - klo), mhi = lanes(p->K - khi);
            __m512 wlo[4], whi[4];
            _Pragma("GCC unroll 4")
            for (int c = 0; c < nr; c++) {
                const uint8_t *b = p->packed + (size_t)(n0 + c) * rowb + (size_t)g * half + j;
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                wlo[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), vs[c], vz[c]);
                whi[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), vs[c], vz[c]);
            }
            _Pragma("GCC unroll 8")
            for (int r = 0; r < mr; r++) {
                const float *x = p->x + (size_t)(m0 + r) * p->ldx;
                const __m512 xlo = _mm512_maskz_loadu_ps(mlo, x + klo), xhi = _mm512_maskz_loadu_ps(mhi, x + khi);
                _Pragma("GCC unroll 4")
                for (int c = 0; c < nr; c++)
                    acc[r][c] = _mm512_fmadd_ps(xhi, whi[c], _mm512_fmadd_ps(xlo, wlo[c], acc[r][c]));
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4")
        for (int c = 0; c < nr; c++)
            p->out[(size_t)(m0 + r) * p->N + n0 + c] =
                _mm512_reduce_add_ps(acc[r][c]) + (p->bias ? p->bias[n0 + c] : 0.0f);
}

/* Columns [n0, n1) of rows [m0, m0 + mr): mr a constant after inlining. Tiles of 4 columns for 1-2 rows (decoding
   the nibbles is the work), else 3 (24 accumulators: 3-8% over tiles of 2 at 16 rows, the same bits). */
static inline __attribute__((always_inline)) void columns(const Problem *p, int m0, const int mr, int n0, int n1) {
    int n = n0;
    if (mr <= 2)
        for (; n + 4 <= n1; n += 4) tile(p, m0, mr, n, 4);
    else
        for (; n + 3 <= n1; n += 3) tile(p, m0, mr, n, 3);
    for (; n + 2 <= n1; n += 2) tile(p, m0, mr, n, 2);
    for (; n < n1; n++) tile(p, m0, mr, n, 1);
}

static void block_avx512(const Problem *p, int m0, int m1, int n0, int n1) {
    for (int m = m0; m < m1; m += MR) {
        switch (m1 - m >= MR ? MR : m1 - m) {
        case 8: columns(p, m, 8, n0, n1); break;
        case 7: columns(p, m, 7, n0, n1); break;
        case 6: columns(p, m, 6, n0, n1); break;
        case 5: columns(p, m, 5, n0, n1); break;
        case 4: columns(p, m, 4, n0, n1); break;
        case 3: columns(p, m, 3, n0, n1); break;
        case 2: columns(p, m, 2, n0, n1); break;
        default: columns(p, m, 1, n0, n1); break;
        }
    }
}

/* The panel path (PANEL_MIN_ROWS rows and more; G dividing KB; cpu_panel.h has the loop): each 64 bytes of 16
   columns' rows are transposed in registers, their nibbles widened and dequantized into the panel. */
#define KB 128    /* k-values a decoded panel: 64 bytes of a column's row */

/* Columns [n0, n0 + 16) of the block at byte b0 of their rows, dequantized into P[k][c0 + 0..15]. G a constant
   where it is inlined (32, 64 or 128), so the group arithmetic is shifts and the 16 dwords stay in registers. */
static inline __attribute__((always_inline)) void decode16(const Problem *p, const int G, int n0, int b0, float *P,
                                                          int c0) {
    const int half = G / 2;
    const size_t rowb = (size_t)p->Kp / 2;
    const int left = (int)rowb - b0;                       /* a multiple of 16: whole units */
    __m512i r[16];                                         /* r[u]: bytes 4u..4u+3 of the 16 columns */
    load_transposed(p->packed + (size_t)n0 * rowb + b0, rowb, left, r);
    const __m512i low = _mm512_set1_epi32(15);
    __m512 vs = _mm512_setzero_ps(), vz = vs;
    _Pragma("GCC unroll 16")
    for (int u = 0; u < 16; u++) {
        if (4 * u >= left) break;
        const int j = (4 * u) % half;                      /* byte in its group; a group starts at j == 0 */
        if (j == 0) int4_group_scales(p->scales, p->zeros, p->scale_f32, p->Kp / G, n0, (b0 + 4 * u) / half, &vs, &vz);
        const int klo = (4 * u / half) * G + j;           /* k of the low nibble, in the block */
        _Pragma("GCC unroll 4")
        for (int t = 0; t < 4; t++) {
            const __m512i q = _mm512_srli_epi32(r[u], 8 * t);
            _mm512_store_ps(P + (size_t)(klo + t) * PW + c0,
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), vs, vz));
            _mm512_store_ps(P + (size_t)(klo + t + half) * PW + c0,
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q, 4), low)), vs, vz));
        }
    }
}

/* Both halves of the panel at column n (G: 32, 64 or 128). */
static void decode_panel(const Problem *p, int n, int b0, float *P) {
    switch (p->G) {
    case 32: decode16(p, 32, n, b0, P, 0); decode16(p, 32, n + 16, b0, P, 16); break;
    case 64: decode16(p, 64, n, b0, P, 0); decode16(p, 64, n + 16, b0, P, 16); break;
    default: decode16(p, 128, n, b0, P, 0); decode16(p, 128, n + 16, b0, P, 16); break;
    }
}

static void panel_decode(const void *kernel, int n, int k0, float *P) { decode_panel(kernel, n, k0 / 2, P); }

static void panel_tile(const void *kernel, int m0, int rows, int n0, int n1) {
    block_avx512(kernel, m0, m0 + rows, n0, n1);
}

static void run_panels(const Problem *p, int threads) {
    const PanelJob job = {p->x, p->ldx, p->out, p->M, p->N, p->K, KB, p->bias, p, panel_decode, NULL, panel_tile};
    panel_run(&job, threads);
}
#else
#define HAVE_AVX512 0
#endif

/* Which inner loop this build runs for G a multiple of 32: 1 AVX-512, 0 portable. */
int int4_kernel_isa(void) { return HAVE_AVX512; }

/* 0 done; -2 bad arguments. */
int int4_matmul(const float *x, int64_t ldx, const uint8_t *packed, const void *scales, const void *zeros,
                int scale_f32, const float *bias, float *out, int M, int N, int K, int Kp, int G, int threads,
                int portable) {
    if (M < 0 || N < 0 || K < 0 || G < 2 || G % 2 || Kp % G || Kp < K || Kp - K >= G || ldx < K)
        return -2;
    const Problem p = {x, ldx, packed, scales, zeros, scale_f32, bias, out, M, N, K, Kp, G};
    const int fast = HAVE_AVX512 && !portable && G % 32 == 0;
#if HAVE_AVX512
    if (fast && M >= PANEL_MIN_ROWS && KB % G == 0 && N >= PW) {
        run_panels(&p, threads);
        return 0;
    }
#endif
    if (threads < 1) threads = 1;
    if ((long)N < 8L * threads) threads = N / 8 > 1 ? N / 8 : 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* each thread a contiguous run of columns, cut on multiples of 4 */
        const int quads = (N + 3) / 4;
        const int n0 = (int)((long)quads * t / nt) * 4, n1c = (int)((long)quads * (t + 1) / nt) * 4;
        const int n1 = n1c < N ? n1c : N;
        if (n0 < n1) {
#if HAVE_AVX512
            if (fast) block_avx512(&p, 0, M, n0, n1);
            else
#endif
                block_portable(&p, 0, M, n0, n1);
        }
    }
    (void)fast;
    return 0;
}
