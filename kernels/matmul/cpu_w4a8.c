/* int4 weights times int8 activations ("w4a8") on CPU, with AVX-512 VNNI (kernels/matmul/cpu_w4a8.py loads it).

   The contract (cpu_w4a8.py's w4a8_matmul_ref computes it in torch, on the original int4 layout):

       W[n, k] = q[n, k] * s[n, g] + z[n, g],  g = k / G,  q unsigned 0..15, z = -8 s where no zeros are given
       activations x [M, K] float32, quantized per row per group of G columns (columns >= K count as 0):
           amax = max |x[m, group]|; amax == 0: xq = 0, sa = 0; else inv = 127.0f / amax (float32 division),
           xq = rint(x * inv) (float32 multiply, half to even; |xq| <= 127), sa = amax / 127.0f
           xsum[m, g] = sum of x[m, k] over the group (float32, any order)
       out[m, n] = sum_g ( s[n,g] * sa[m,g] * idot[m,n,g] + z[n,g] * xsum[m,g] ) (+ bias[n])
       idot[m, n, g] = sum over the group of q[n, k] * xq[m, k], exact in int32 (vpdpbusd's u8 x s8 order)

   so the only approximation against float is the activations' rounding; against the reference the result
   differs by float32 rounding (the order of the sums) only.

   Weights, repacked once at load (w4a8_pack): per block of 16 output columns (N padded with zero columns), per
   chunk of 8 consecutive k (Kc = ceil(Kp / 8) chunks, Kp = K rounded up to G), 64 bytes: byte 4 c + i holds
   column c's k = 8 j + i in its low nibble and k = 8 j + 4 + i in its high nibble (i < 4). One zmm load is a
   chunk of 16 columns: (v & 15) and (v >> 4 & 15) are vpdpbusd's u8 operands, 16 int32 lanes (the columns)
   each summing 4 consecutive k against 4 activation bytes broadcast ({1to16}). Scales and zeros: float16 or
   float32 [Nb, groups, 16] (zeros NULL: z = -8 s).

   A call first quantizes the M rows into a scratch buffer (xq, sa, xsum; the rows split over the threads, or
   before they start where there are few), then threads split the column blocks. Each walks its columns a tile of NB blocks at a time (four at 1-2 rows:
   decode, where unpacking is the work) and, for each tile, the rows MR at a time, so a tile's weights stay
   in L1 across the rows; a tile's int32 sums live in registers for one group, then go to float32: the
   accumulators get cvt(idot) * (s * sa) + z * xsum. G a multiple of 8 runs that loop; any other even G,
   and builds without AVX-512 VNNI, run the portable loop (plain C, the same integer sums, so the same idot). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"      /* half_to_float */

#ifndef MR
#define MR 4      /* activation rows a tile (at most 8) */
#endif
#ifndef NB        /* column blocks of 16 a tile (at most 4): 4 x 2, 4 x 3 and 3 x 4 tiles measured alike, 5 x 2, */
#define NB 2      /* 6 x 2, 8 x 1 and 2 x 4 5-40% slower (one thread of a 2-core AMD EPYC, group 32) */
#endif
#ifndef NB1
#define NB1 4     /* column blocks a tile at 1-2 rows (1 to 4 measured within 5%) */
#endif

typedef struct {
    const uint8_t *qw; const void *scales, *zeros; int scale_f32; const float *bias; float *out;
    int M, N, K, G, groups, Kc;
    const int8_t *xq; int64_t ldq; const float *sa, *xsum;
} Problem;

/* Row m of x quantized: xq [ldq] (zero past K), sa and xsum [groups]. */
static __attribute__((unused)) void quantize_row(const float *x, int8_t *xq, int64_t ldq, float *sa, float *xsum, int K, int G) {
    const int groups = (K + G - 1) / G;
    memset(xq, 0, (size_t)ldq);
    for (int g = 0; g < groups; g++) {
        const int k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
        float mx[16] = {0}, sm[16] = {0};
        int k = k0;
        for (; k + 16 <= k1; k += 16)
            for (int i = 0; i < 16; i++) {
                const float v = x[k + i], a = fabsf(v);
                mx[i] = a > mx[i] ? a : mx[i];
                sm[i] += v;
            }
        for (int i = 0; k < k1; k++, i++) {
            const float a = fabsf(x[k]);
            mx[i] = a > mx[i] ? a : mx[i];
            sm[i] += x[k];
        }
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < 16; i++) {
            amax = mx[i] > amax ? mx[i] : amax;
            sum += sm[i];
        }
        xsum[g] = sum;
        sa[g] = amax / 127.0f;
        if (amax == 0.0f) continue;                        /* xq stays 0, sa is 0 */
        const float inv = 127.0f / amax;
        for (k = k0; k < k1; k++) xq[k] = (int8_t)lrintf(x[k] * inv);
    }
}


static inline float scale_at(const Problem *p, const void *t, size_t i) {
    return p->scale_f32 ? ((const float *)t)[i] : half_to_float(((const uint16_t *)t)[i]);
}

static inline void scale_zero(const Problem *p, int b, int g, int c, float *s, float *z) {
    const size_t i = ((size_t)b * p->groups + g) * 16 + c;
    *s = scale_at(p, p->scales, i);
    *z = p->zeros ? scale_at(p, p->zeros, i) : -8.0f * *s;
}

/* The portable loop: column blocks [b0, b1), all rows. */
static void blocks_portable(const Problem *p, int b0, int b1) {
    const int G = p->G;
    for (int b = b0; b < b1; b++) {
        const uint8_t *w = p->qw + (size_t)b * p->Kc * 64;
        for (int c = 0; c < 16 && b * 16 + c < p->N; c++) {
            const int n = b * 16 + c;
            for (int m = 0; m < p->M; m++) {
                const int8_t *xq = p->xq + (size_t)m * p->ldq;
                float acc = 0.0f;
                for (int g = 0; g < p->groups; g++) {
                    int32_t idot = 0;
                    for (int k = g * G; k < (g + 1) * G; k++) {
                        const uint8_t byte = w[(size_t)(k >> 3) * 64 + c * 4 + (k & 3)];
                        idot += (int32_t)((k & 4) ? byte >> 4 : byte & 15) * xq[k];
                    }
                    float s, z;
                    scale_zero(p, b, g, c, &s, &z);
                    const size_t i = (size_t)m * p->groups + g;
                    acc += (float)idot * (s * p->sa[i]) + z * p->xsum[i];
                }
                p->out[(size_t)m * p->N + n] = acc + (p->bias ? p->bias[n] : 0.0f);
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1
#define QUANTIZE_ROW quantize_row_avx512

static inline __mmask16 lanes(int left) {
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
}

static inline __m512 load16(const Problem *p, const void *t, size_t i) {   /* 16 scales or zeros as float32 */
    return p->scale_f32 ? _mm512_loadu_ps((const float *)t + i)
                        : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)t + i)));
}

/* quantize_row's arithmetic, 16 columns at a time (the same bits; xsum summed in another order). */
static void quantize_row_avx512(const float *x, int8_t *xq, int64_t ldq, float *sa, float *xsum, int K, int G) {
    const int groups = (K + G - 1) / G;
    memset(xq, 0, (size_t)ldq);
    for (int g = 0; g < groups; g++) {
        const int k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
        __m512 mx = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
        for (int k = k0; k < k1; k += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(lanes(k1 - k), x + k);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            sm = _mm512_add_ps(sm, v);
        }
        const float amax = _mm512_reduce_max_ps(mx);
        xsum[g] = _mm512_reduce_add_ps(sm);
        sa[g] = amax / 127.0f;
        if (amax == 0.0f) continue;
        const __m512 inv = _mm512_set1_ps(127.0f / amax);
        for (int k = k0; k < k1; k += 16) {
            const __mmask16 m = lanes(k1 - k);
            const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), inv),
                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm512_mask_cvtepi32_storeu_epi8(xq + k, m, q);
        }
    }
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* rows [m0, m0 + mr) x column blocks [b0, b0 + nb); mr <= MR, nb <= 4, both constants where it is inlined. */
static inline __attribute__((always_inline)) void tile(const Problem *p, int m0, const int mr, int b0, const int nb) {
    const int cpg = p->G / 8, groups = p->groups;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MR][4];
    _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++) acc[r][c] = _mm512_setzero_ps();
    const uint8_t *w[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++) w[c] = p->qw + (size_t)(b0 + c) * p->Kc * 64;
    for (int g = 0; g < groups; g++) {
        __m512i dot[MR][4];
        _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)
            _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++) dot[r][c] = _mm512_setzero_si512();
        const int8_t *xg = p->xq + (size_t)m0 * p->ldq + (size_t)g * p->G;
        for (int j = 0; j < cpg; j++) {
            __m512i lo[4], hi[4];
            _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w[c] + ((size_t)g * cpg + j) * 64));
                lo[c] = _mm512_and_si512(v, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) {
                const __m512i xl = bcast4(xg + r * p->ldq + j * 8), xh = bcast4(xg + r * p->ldq + j * 8 + 4);
                _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++)
                    dot[r][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][c], lo[c], xl), hi[c], xh);
            }
        }
        __m512 s[4], z[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++) {
            const size_t i = ((size_t)(b0 + c) * groups + g) * 16;
            s[c] = load16(p, p->scales, i);
            z[c] = p->zeros ? load16(p, p->zeros, i) : _mm512_mul_ps(s[c], _mm512_set1_ps(-8.0f));
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++) {
            const size_t i = (size_t)(m0 + r) * groups + g;
            const __m512 sa = _mm512_set1_ps(p->sa[i]), xs = _mm512_set1_ps(p->xsum[i]);
            _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), _mm512_mul_ps(s[c], sa),
                                            _mm512_fmadd_ps(z[c], xs, acc[r][c]));
        }
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < nb; c++) {
        const int n = (b0 + c) * 16, left = p->N - n;
        const __mmask16 mask = lanes(left);
        const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(mask, p->bias + n) : _mm512_setzero_ps();
        _Pragma("GCC unroll 4") for (int r = 0; r < mr; r++)
            _mm512_mask_storeu_ps(p->out + (size_t)(m0 + r) * p->N + n, mask, _mm512_add_ps(acc[r][c], bias));
    }
}

/* All rows of column blocks [b, b + nb): nb a constant after inlining. */
static inline __attribute__((always_inline)) void rows(const Problem *p, int b, const int nb) {
    for (int m = 0; m < p->M; m += MR) {
        switch (p->M - m >= MR ? MR : p->M - m) {
        case 8: if (MR >= 8) tile(p, m, 8, b, nb); break;
        case 7: if (MR >= 7) tile(p, m, 7, b, nb); break;
        case 6: if (MR >= 6) tile(p, m, 6, b, nb); break;
        case 5: if (MR >= 5) tile(p, m, 5, b, nb); break;
        case 4: if (MR >= 4) tile(p, m, 4, b, nb); break;
        case 3: if (MR >= 3) tile(p, m, 3, b, nb); break;
        case 2: if (MR >= 2) tile(p, m, 2, b, nb); break;
        default: tile(p, m, 1, b, nb); break;
        }
    }
}

static void blocks_vnni(const Problem *p, int b0, int b1) {
    const int width = p->M <= 2 ? NB1 : NB;
    for (int b = b0; b < b1; b += width) {
        switch (b1 - b >= width ? width : b1 - b) {
        case 4: if (NB >= 4 || NB1 >= 4) rows(p, b, 4); break;
        case 3: if (NB >= 3 || NB1 >= 3) rows(p, b, 3); break;
        case 2: rows(p, b, 2); break;
        default: rows(p, b, 1); break;
        }
    }
}
#else
#define HAVE_VNNI 0
#define QUANTIZE_ROW quantize_row
#endif

/* Which loop this build runs for G a multiple of 8: 1 AVX-512 VNNI, 0 portable. */
int w4a8_kernel_isa(void) { return HAVE_VNNI; }

static int64_t row_bytes(int K, int G) {                       /* xq's row stride: Kc * 8 rounded up to 64 */
    const int64_t kp = (int64_t)(K + G - 1) / G * G;
    return ((kp + 7) / 8 * 8 + 63) / 64 * 64;
}

/* The activations' quantization alone (the tests compare its bits with the reference): x [M, K] (row
   stride ldx) -> xq [M, ldq] int8 (zero past K), sa and xsum [M, groups] float32. 0 done; -2 bad arguments. */
int w4a8_quantize(const float *x, int64_t ldx, int8_t *xq, int64_t ldq, float *sa, float *xsum, int M, int K,
                  int G, int threads) {
    if (M < 0 || K < 1 || G < 2 || ldx < K || ldq < K) return -2;
    const int groups = (K + G - 1) / G;
    if (threads < 1) threads = 1;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int m = 0; m < M; m++)
        QUANTIZE_ROW(x + (size_t)m * ldx, xq + (size_t)m * ldq, ldq, sa + (size_t)m * groups,
                     xsum + (size_t)m * groups, K, G);
    return 0;
}

/* x [M, K] float32 (row stride ldx); qw [ceil(N / 16), Kc, 64] uint8; scales, zeros [ceil(N / 16), groups, 16]
   float16, or float32 where scale_f32 (zeros NULL: z = -8 s); bias [N] or NULL; out [M, N] float32.
   0 done; -2 bad arguments; -3 no memory. */
int w4a8_matmul(const float *x, int64_t ldx, const uint8_t *qw, const void *scales, const void *zeros,
                int scale_f32, const float *bias, float *out, int M, int N, int K, int G, int threads,
                int portable) {
    if (M < 0 || N < 0 || K < 1 || G < 2 || G % 2 || ldx < K) return -2;
    if (M == 0 || N == 0) return 0;
    const int groups = (K + G - 1) / G, Kc = (groups * G + 7) / 8, Nb = (N + 15) / 16;
    const int64_t ldq = row_bytes(K, G);
    const size_t xq_bytes = ((size_t)M * ldq + 63) / 64 * 64, f_bytes = (size_t)M * groups * sizeof(float);
    int8_t *xq = aligned_alloc(64, xq_bytes + ((2 * f_bytes + 63) / 64 * 64));
    if (!xq) return -3;
    float *sa = (float *)(xq + xq_bytes), *xsum = sa + (size_t)M * groups;
    const Problem p = {qw, scales, zeros, scale_f32, bias, out, M, N, K, G, groups, Kc, xq, ldq, sa, xsum};
    const int fast = HAVE_VNNI && !portable && G % 8 == 0;
    if (threads < 1) threads = 1;
    if (threads > Nb) threads = Nb;
    const int few = (int64_t)M * K <= 32768;          /* a few rows: quantized before the threads start */
    for (int m = 0; few && m < M; m++)
        QUANTIZE_ROW(x + (size_t)m * ldx, xq + (size_t)m * ldq, ldq, sa + (size_t)m * groups,
                     xsum + (size_t)m * groups, K, G);
    _Pragma("omp parallel num_threads(threads)")
    {
        if (!few) {
            _Pragma("omp for schedule(static)")
            for (int m = 0; m < M; m++)
                QUANTIZE_ROW(x + (size_t)m * ldx, xq + (size_t)m * ldq, ldq, sa + (size_t)m * groups,
                             xsum + (size_t)m * groups, K, G);
        }   /* the implied barrier: every row quantized before any thread reads them */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int b0 = (int)((long)Nb * t / nt), b1 = (int)((long)Nb * (t + 1) / nt);
        if (b0 < b1) {
#if HAVE_VNNI
            if (fast) blocks_vnni(&p, b0, b1);
            else
#endif
                blocks_portable(&p, b0, b1);
        }
    }
    (void)fast;
    free(xq);
    return 0;
}
