/* Weight-only int8 and fp8 (e4m3) matmuls on CPU (kernels/matmul/cpu_int8.py loads them); the activations
   stay float32:

       out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),   W[n, k] = q[n, k] * s[n, g] (+ z[n, g]),  g = k / G

   x        [M, K] float32 rows (row stride ldx)
   q        [N, K] int8, a row per output channel (Int8Linear's qweight, unchanged)
   scales   [N, K / G] float32: G = K one scale per channel (our `--quantization int8`, the lm_head of int4
            mode), G = 32 GGUF Q8_0, a shipped checkpoint's group size
   zeros    the same shape, or NULL (symmetric); a shipped asymmetric checkpoint's -z s
   out      [M, N] float32

   No float copy of W is made. Per channel without zeros the sum runs over the integers as float32
   (x * q: exact products) and is scaled once at the end; with groups or zeros each 16 weights are widened
   and dequantized in a zmm register (one FMA: q * s + z), so W's values are those the reference computes up
   to one rounding. Either way a weight vector is converted once per block of up to 8 activation rows.
   Threads split N (OpenMP, the libgomp torch has loaded); each walks its columns in tiles of 4 (1-2 rows:
   decode, where widening is the work) or 3 (24 accumulators for 8 rows: 2-8% over tiles of 2 at 16 rows),
   and runs every block of rows over a tile while its bytes are in L1, so the weight is read from memory
   once a call whatever M. From PANEL_MIN_ROWS rows the panel path runs instead (cpu_panel.h: 128 x 32 weights
   widened into a float panel in L1, an outer product over it; the comment above decode16 here).

   fp8 (fp8_weight_matmul, a shipped compressed-tensors float-quantized checkpoint's): q [N, K] e4m3 bytes,
   scales per channel [N, 1] (G = K) or per [BN, G] block [ceil(N / BN), ceil(K / G)] (FP8_BLOCK), no zeros;
   the last group of a row may be short. The one difference from int8 is the widening: an e4m3 byte's 7 low
   bits shifted left by 7 under its sign are the IEEE float16 of its value times 2^-8, exactly (subnormals
   too: the exponent biases differ by 8), which _mm512_cvtph_ps widens; the 2^8 goes into the scale.
   (The two NaN bytes 0x7f, 0xff read as +-480; a checkpoint holds none.) The portable loop reads the
   same values from a 256-entry table.

   Activations are not quantized (int8 x int8 with per-row activation scales is w8a8's, a different
   result). Arithmetic float32; the sum over k runs in 16 lanes, reduced at the end, so it differs from
   F.linear's order by rounding only. Builds without AVX-512, and groups that are not a multiple of 16,
   run the portable loop (plain C in the same 16 lanes, which a compiler vectorizes to what the build has). */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_e4m3.h"     /* e4m3_round */

#define MR 8      /* activation rows a block */
#define PANEL_MIN_ROWS 16   /* rows from which the panel path runs: below, the tile loop is faster (widening is the work) */

typedef struct {
    const float *x; int64_t ldx;
    const int8_t *q; const float *scales, *zeros, *bias;
    float *out;
    const float *table;         /* fp8: the 256 bytes' values times 2^-8 (the portable loop's); int8: NULL */
    float smul;                 /* the scales' factor: 1 (int8), 2^8 (fp8) */
    int M, N, K, G, BN, groups; /* groups = ceil(K / G); a scale row covers BN weight rows */
    int affine;                 /* dequantize per group (groups > 1 or zeros), else scale at the end */
} Problem;

static inline float scale_at(const Problem *p, int n, int g) {
    return p->scales[(size_t)(n / p->BN) * p->groups + g] * p->smul;
}

static inline float finish(const Problem *p, int n, float sum) {
    return (p->affine ? sum : sum * scale_at(p, n, 0)) + (p->bias ? p->bias[n] : 0.0f);
}

static inline float weight_at(const Problem *p, const int8_t *w, int k) {
    return p->table ? p->table[(uint8_t)w[k]] : (float)w[k];
}

/* The portable loop: every row over columns [n0, n1). */
static void block_portable(const Problem *p, int n0, int n1) {
    const int K = p->K, G = p->G, groups = p->groups;
    for (int n = n0; n < n1; n++) {
        const int8_t *w = p->q + (size_t)n * K;
        const float *z = p->zeros ? p->zeros + (size_t)n * groups : 0;
        for (int m = 0; m < p->M; m++) {
            const float *x = p->x + (size_t)m * p->ldx;
            float acc[16] = {0};
            for (int g = 0; g < groups; g++) {
                const float sg = p->affine ? scale_at(p, n, g) : 1.0f, zg = z ? z[g] : 0.0f;
                const int k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
                int k = k0;
                for (; k + 16 <= k1; k += 16)
                    for (int l = 0; l < 16; l++) acc[l] += x[k + l] * (weight_at(p, w, k + l) * sg + zg);
                for (; k < k1; k++) acc[(k - k0) % 16] += x[k] * (weight_at(p, w, k) * sg + zg);
            }
            float sum = 0.0f;
            for (int l = 0; l < 16; l++) sum += acc[l];
            p->out[(size_t)m * p->N + n] = finish(p, n, sum);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1
#include "cpu_panel.h"

static inline __mmask16 lanes(int left) {
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
}

/* 16 weights of column c's row at k widened to float32 (masked: the row's tail). fp8: the byte sign-extended
   to 16 bits and shifted left by 7 holds the sign in bits 15 and 14 and the 7 low bits in 13..7; bit 14
   cleared, it is the float16 of the e4m3 value times 2^-8 (the header). */
static inline __m512 widen(const int8_t *w, __mmask16 mk, const int fp8) {
    const __m128i b = _mm_maskz_loadu_epi8(mk, w);
    if (fp8)
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                                _mm256_set1_epi16((short)0xbf80)));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

/* rows [m0, m0 + mr) x columns [n0, n0 + nr); mr <= MR, nr <= 4, affine and fp8: constants where it is
   inlined. */
static inline __attribute__((always_inline)) void tile(const Problem *p, int m0, const int mr, int n0,
                                                       const int nr, const int affine, const int fp8) {
    const int K = p->K, G = p->G, groups = p->groups;
    const float *x[MR];
    const int8_t *w[4];
    __m512 acc[MR][4];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < MR; r++) {
        x[r] = p->x + (size_t)(m0 + (r < mr ? r : 0)) * p->ldx;
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    }
    _Pragma("GCC unroll 4")
    for (int c = 0; c < 4; c++) w[c] = p->q + (size_t)(n0 + (c < nr ? c : 0)) * K;
    if (!affine) {
        for (int k = 0; k < K; k += 16) {
            const __mmask16 mk = lanes(K - k);
            __m512 wv[4];
            _Pragma("GCC unroll 4")
            for (int c = 0; c < nr; c++) wv[c] = widen(w[c] + k, mk, fp8);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < mr; r++) {
                const __m512 xv = _mm512_maskz_loadu_ps(mk, x[r] + k);
                _Pragma("GCC unroll 4")
                for (int c = 0; c < nr; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
    } else {
        for (int g = 0; g < groups; g++) {
            __m512 vs[4], vz[4];
            _Pragma("GCC unroll 4")
            for (int c = 0; c < nr; c++) {
                vs[c] = _mm512_set1_ps(scale_at(p, n0 + c, g));
                vz[c] = p->zeros ? _mm512_set1_ps(p->zeros[(size_t)(n0 + c) * groups + g]) : _mm512_setzero_ps();
            }
            const int end = (g + 1) * G < K ? (g + 1) * G : K;    /* G a multiple of 16: a tail at K only */
            for (int k = g * G; k < end; k += 16) {
                const __mmask16 mk = lanes(end - k);
                __m512 wv[4];
                _Pragma("GCC unroll 4")
                for (int c = 0; c < nr; c++) wv[c] = _mm512_fmadd_ps(widen(w[c] + k, mk, fp8), vs[c], vz[c]);
                _Pragma("GCC unroll 8")
                for (int r = 0; r < mr; r++) {
                    const __m512 xv = _mm512_maskz_loadu_ps(mk, x[r] + k);
                    _Pragma("GCC unroll 4")
                    for (int c = 0; c < nr; c++) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
                }
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4")
        for (int c = 0; c < nr; c++)
            p->out[(size_t)(m0 + r) * p->N + n0 + c] = finish(p, n0 + c, _mm512_reduce_add_ps(acc[r][c]));
}

/* Every block of rows over the columns [n, n + nr): the tile's weight bytes stay in L1 between blocks. */
static inline __attribute__((always_inline)) void rows(const Problem *p, int n, const int nr, const int affine,
                                                       const int fp8) {
    for (int m = 0; m < p->M; m += MR) {
        switch (p->M - m >= MR ? MR : p->M - m) {
        case 8: tile(p, m, 8, n, nr, affine, fp8); break;
        case 7: tile(p, m, 7, n, nr, affine, fp8); break;
        case 6: tile(p, m, 6, n, nr, affine, fp8); break;
        case 5: tile(p, m, 5, n, nr, affine, fp8); break;
        case 4: tile(p, m, 4, n, nr, affine, fp8); break;
        case 3: tile(p, m, 3, n, nr, affine, fp8); break;
        case 2: tile(p, m, 2, n, nr, affine, fp8); break;
        default: tile(p, m, 1, n, nr, affine, fp8); break;
        }
    }
}

static inline __attribute__((always_inline)) void columns(const Problem *p, int n0, int n1, const int affine,
                                                          const int fp8) {
    int n = n0;
    if (p->M <= 2)
        for (; n + 4 <= n1; n += 4) rows(p, n, 4, affine, fp8);
    else
        for (; n + 3 <= n1; n += 3) rows(p, n, 3, affine, fp8);
    for (; n + 2 <= n1; n += 2) rows(p, n, 2, affine, fp8);
    for (; n < n1; n++) rows(p, n, 1, affine, fp8);
}

static void block_fast(const Problem *p, int n0, int n1) {
    const int fp8 = p->table != 0;
    if (p->affine && fp8) columns(p, n0, n1, 1, 1);
    else if (p->affine) columns(p, n0, n1, 1, 0);
    else if (fp8) columns(p, n0, n1, 0, 1);
    else columns(p, n0, n1, 0, 0);
}

/* The panel path (PANEL_MIN_ROWS rows and more; cpu_panel.h has the loop): 64 bytes of 16 columns' rows
   transposed in registers, each byte widened as widen() does and, with groups or zeros, dequantized into the
   panel; per channel the panel holds the integers (fp8: their values times 2^-8) and the scale comes at the end,
   as in the tile loop. */
#define KB 128    /* k-values a decoded panel: twice 64 bytes of a column's row */

/* Byte t of each dword of r widened to float32 (int8: its integer; fp8: as widen()). */
static inline __attribute__((always_inline)) __m512 widen_byte(__m512i r, const int t, const int fp8) {
    const __m512i b = _mm512_srai_epi32(_mm512_slli_epi32(r, 24 - 8 * t), 24);      /* sign-extended */
    if (fp8)
        return _mm512_cvtph_ps(_mm256_and_si256(_mm512_cvtepi32_epi16(_mm512_slli_epi32(b, 7)),
                                                _mm256_set1_epi16((short)0xbf80)));
    return _mm512_cvtepi32_ps(b);
}

/* Scales (times smul) and zeros of group g of 16 columns, whose first scale and zero are at srow and zrow. */
static inline void group_vectors(const Problem *p, __m512i srow, __m512i zrow, int g, __m512 *vs, __m512 *vz) {
    const __m512i at = _mm512_set1_epi32(g);
    *vs = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(srow, at), p->scales, 4), _mm512_set1_ps(p->smul));
    *vz = p->zeros ? _mm512_i32gather_ps(_mm512_add_epi32(zrow, at), p->zeros, 4) : _mm512_setzero_ps();
}

/* Columns [n0, n0 + 16) at k0 into P[k][c0 + 0..15]; affine and fp8 constants where it is inlined. */
static inline __attribute__((always_inline)) void decode16(const Problem *p, int n0, int k0, float *P, int c0,
                                                          const int affine, const int fp8) {
    const int left = p->K - k0;
    __m512i r[16];                                         /* r[u]: k0 + 4u .. 4u + 3 of the 16 columns */
    load_transposed((const uint8_t *)p->q + (size_t)n0 * p->K + k0, p->K, left, r);
    __m512 vs = _mm512_setzero_ps(), vz = vs;
    __m512i srow = _mm512_setzero_si512(), zrow = srow;      /* each column's first scale and zero */
    if (affine) {
        int first[16];
        for (int c = 0; c < 16; c++) first[c] = (n0 + c) / p->BN * p->groups;
        srow = _mm512_loadu_si512(first);
        zrow = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set1_epi32(p->groups), _mm512_setr_epi32(
            0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), _mm512_set1_epi32(n0 * p->groups));
    }
    int group = -1;
    _Pragma("GCC unroll 16")
    for (int u = 0; u < 16; u++) {
        if (4 * u >= left) break;
        if (affine && (k0 + 4 * u) / p->G != group) {     /* G a multiple of 16: 4 k-values share a group */
            group = (k0 + 4 * u) / p->G;
            group_vectors(p, srow, zrow, group, &vs, &vz);
        }
        _Pragma("GCC unroll 4")
        for (int t = 0; t < 4; t++) {
            const __m512 w = widen_byte(r[u], t, fp8);
            _mm512_store_ps(P + (size_t)(4 * u + t) * PW + c0, affine ? _mm512_fmadd_ps(w, vs, vz) : w);
        }
    }
}

static inline __attribute__((always_inline)) void decode32(const Problem *p, int n, int k0, float *P,
                                                          const int affine, const int fp8) {
    for (int k = k0; k < k0 + KB && k < p->K; k += 64) {
        decode16(p, n, k, P + (size_t)(k - k0) * PW, 0, affine, fp8);
        decode16(p, n + 16, k, P + (size_t)(k - k0) * PW, 16, affine, fp8);
    }
}

static void panel_decode(const void *kernel, int n, int k0, float *P) {
    const Problem *p = kernel;
    const int fp8 = p->table != 0;
    if (p->affine && fp8) decode32(p, n, k0, P, 1, 1);
    else if (p->affine) decode32(p, n, k0, P, 1, 0);
    else if (fp8) decode32(p, n, k0, P, 0, 1);
    else decode32(p, n, k0, P, 0, 0);
}

static int panel_scale(const void *kernel, int n, float *scale) {     /* per channel: the scale at the end */
    const Problem *p = kernel;
    for (int c = 0; c < PW && !p->affine; c++) scale[c] = scale_at(p, n + c, 0);
    return !p->affine;
}

static void panel_tile(const void *kernel, int m0, int rows, int n0, int n1) {
    Problem slab = *(const Problem *)kernel;
    slab.x += (size_t)m0 * slab.ldx;
    slab.out += (size_t)m0 * slab.N;
    slab.M = rows;
    block_fast(&slab, n0, n1);
}

static void run_panels(const Problem *p, int threads) {
    const PanelJob job = {p->x, p->ldx, p->out, p->M, p->N, p->K, KB, p->bias, p, panel_decode, panel_scale,
                          panel_tile};
    panel_run(&job, threads);
}
#else
#define HAVE_AVX512 0
#endif

/* Which inner loop this build runs (per channel, or groups a multiple of 16): 1 AVX-512, 0 portable. */
int int8_kernel_isa(void) { return HAVE_AVX512; }

static int run(const Problem *p, int threads, int portable) {
    const int N = p->N;
    const int fast = HAVE_AVX512 && !portable && (!p->affine || p->G % 16 == 0);
#if HAVE_AVX512
    if (fast && p->M >= PANEL_MIN_ROWS && N >= PW) {
        run_panels(p, threads);
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
            if (fast) block_fast(p, n0, n1);
            else
#endif
                block_portable(p, n0, n1);
        }
    }
    (void)fast;
    return 0;
}

/* 0 done; -2 bad arguments. */
int int8_matmul(const float *x, int64_t ldx, const int8_t *q, const float *scales, const float *zeros,
                const float *bias, float *out, int M, int N, int K, int G, int threads, int portable) {
    if (M < 0 || N < 0 || K < 1 || G < 1 || K % G || ldx < K)
        return -2;
    const Problem p = {x, ldx, q, scales, zeros, bias, out, 0, 1.0f, M, N, K, G, 1, K / G, K / G > 1 || zeros != 0};
    return run(&p, threads, portable);
}

static float fp8_table[256];            /* e4m3 byte -> its value times 2^-8, as the float16 reading gives */

__attribute__((constructor)) static void fill_fp8_table(void) {      /* when the library is loaded */
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7 - 8) : ldexpf(m / 8.0f, -6 - 8);
        fp8_table[b] = b & 128 ? -v : v;
    }
}

/* x times W = e4m3 q [N, K] * scales[n / BN, k / G] (per channel: BN 1, G K); 0 done, -2 bad arguments. */
int fp8_matmul(const float *x, int64_t ldx, const uint8_t *q, const float *scales, const float *bias, float *out,
               int M, int N, int K, int G, int BN, int threads, int portable) {
    if (M < 0 || N < 0 || K < 1 || G < 1 || BN < 1 || ldx < K)
        return -2;
    const int groups = (K + G - 1) / G;
    const Problem p = {x, ldx, (const int8_t *)q, scales, 0, bias, out, fp8_table, 256.0f, M, N, K, G, BN, groups,
                       groups > 1};
    return run(&p, threads, portable);
}

/* Rows [n0, n1) of W = q * scales[n / BN, k / G] as float32 into out [n1 - n0, K]: dequantize_fp8's values bit for
   bit (the product of the two exact factors q 2^-8 and s 2^8, rounded once), for the calls of many rows that
   oneDNN multiplies faster over a float slice of the weight than the kernel over the bytes. */
int fp8_dequantize(const uint8_t *q, const float *scales, float *out, int n0, int n1, int K, int G, int BN,
                   int threads, int portable) {
    if (n0 < 0 || n1 < n0 || K < 1 || G < 1 || BN < 1)
        return -2;
    const int groups = (K + G - 1) / G;
    const int fast = HAVE_AVX512 && !portable;
    if (threads < 1 || (long)(n1 - n0) * K < 65536) threads = 1;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int n = n0; n < n1; n++) {
        const int8_t *w = (const int8_t *)q + (size_t)n * K;
        float *o = out + (size_t)(n - n0) * K;
        for (int g = 0; g < groups; g++) {
            const float s = scales[(size_t)(n / BN) * groups + g] * 256.0f;
            const int end = (g + 1) * G < K ? (g + 1) * G : K;
            int k = g * G;
#if HAVE_AVX512
            if (fast)
                for (; k < end; k += 16) {
                    const __mmask16 mk = lanes(end - k);
                    _mm512_mask_storeu_ps(o + k, mk, _mm512_mul_ps(widen(w + k, mk, 1), _mm512_set1_ps(s)));
                }
#endif
            for (; k < end; k++) o[k] = fp8_table[(uint8_t)w[k]] * s;
        }
    }
    (void)fast;
    return 0;
}

/* The activations of an fp8 scheme, fake-quantized as shipped_quant.fake_quantize_fp8 does, bit for bit:
   out[m, k] = e4m3(x[m, k] / s) * s with s = *static_scale (per tensor), or per row and group of G columns
   max |x| / 448 (0: float32's epsilon). x [M, K] (row stride ldx), out [M, K]. 0 done; -2 bad arguments. */
int fp8_fake_quantize(const float *x, int64_t ldx, float *out, int M, int K, int G, const float *static_scale,
                      int threads) {
    if (M < 0 || K < 1 || G < 1 || K % G || ldx < K)
        return -2;
    if (threads < 1 || (long)M * K < 65536) threads = 1;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * ldx;
        float *om = out + (size_t)m * K;
        for (int k0 = 0; k0 < K; k0 += G) {
            float s;
            if (static_scale) {
                s = *static_scale;
            } else {
                float amax = 0.0f;
                for (int k = k0; k < k0 + G; k++) amax = fmaxf(amax, fabsf(xm[k]));
                s = amax / 448.0f;
                if (s == 0.0f) s = 1.1920928955078125e-07f;
            }
            for (int k = k0; k < k0 + G; k++) om[k] = e4m3_round(xm[k] / s) * s;
        }
    }
    return 0;
}
