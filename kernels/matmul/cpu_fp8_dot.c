/* fp8 (e4m3) weights times e4m3 activations on CPU through bfloat16 dot products (AVX512_BF16 vdpbf16ps), for
   the compressed-tensors schemes that quantize activations to e4m3 at run time (FP8_DYNAMIC per token, FP8_BLOCK
   per token and group, static per tensor). Built into the int8 library beside cpu_int8.c (cpu_int8.py loads
   both as one; fp8_dot_cpu there):

       out[m, n] = sum over segments S of  xs[m, S] * ws[n / BN, S] * sum_{k in S} xq[m, k] * wq[n, k]  (+ bias[n])

   xq [M, K] the activations' e4m3 values as bfloat16, xs [M, K / Ga] their scales, made by fp8_dot_matmul itself
   first (rows split over the threads; fp8_dot_quantize exports the same for tests): x / s rounded to e4m3 as
   torch's float32 -> float8_e4m3fn cast, s = max |x| / 448 per row and group of Ga columns (float32's epsilon
   where 0) or the static scale, the values cpu_int8.c's fp8_fake_quantize multiplies back by s. wq [N, K] the weight's e4m3 bytes; ws its float32 scales
   [ceil(N / BN), ceil(K / Gw)] (per channel: BN 1, Gw K). A segment is a run of k where neither scale changes
   (both grids' boundaries; one segment, K, per channel and per token or static).

   Why it is exact up to float32 rounding: every e4m3 value is a bfloat16 (<= 4 significant bits, exponents
   2^-9..2^8), and the product of two bfloat16 is exact in float32, so vdpbf16ps (acc += a0 b0 + a1 b1 over
   bf16 pairs: 32 products an instruction, twice a float32 FMA's) sums exact products; the reference
   (shipped_quant.fp8_weight_matmul_ref: e4m3(x / s) * s times q * sw in float32, F.linear) differs from this
   by the rounding of its two scaled factors and the order of the sum only. Its denormal handling (DAZ/FTZ) never
   bites: e4m3 values are multiples of 2^-9, so every product and partial sum is 0 or at least 2^-18.

   Weight bytes -> bfloat16 in registers (widen_bf16): the byte sign-extended to 16 bits; a normal value's bf16
   is its 7 low bits shifted left by 4 plus 120 << 7 (the exponent biases differ by 120); the 7 subnormals
   (exponent field 0: m 2^-9) come from an 8-entry table; then the sign. (The NaN bytes 0x7f, 0xff read as
   +-480; a checkpoint holds none.) Threads split N (multiples of 4); each converts NC columns at a time into
   a scratch of bf16 rows (zero-padded: masked activation loads meet finite weights only) and runs every block
   of RB rows over them in tiles of RB x NR (4 columns at 1-2 rows), so a weight byte is widened once a call
   and an activation block stays in L1 across a chunk. The sum over k runs in 16 lanes, reduced at the end;
   per segment the lanes are scaled into a second set of accumulators (one segment: scaled once at the end).
   Builds without AVX512_BF16 (the portable one, or a CPU without it) have no such form: fp8_dot_isa() 0 and
   the calls return -3; cpu_int8.c's float32 fp8 form serves them. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_e4m3.h"     /* e4m3_round */

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#ifndef NC
#define NC 16     /* weight columns a thread widens into its scratch at a time (a multiple of 4) */
#endif
#ifndef RB
#define RB 8      /* activation rows a tile (at most 8; 8 beat 4 and 6 with segments too, spills and all) */
#endif
#ifndef NR
#define NR 2      /* columns a tile past 2 rows (at most 4) */
#endif

typedef struct {
    const uint16_t *xq; const float *xs; const uint8_t *q; const float *ws; const float *bias; float *out;
    int M, N, K, Kp, Ga, Gw, BN, wgroups, segmented;   /* Kp: a scratch row's length; wgroups = ceil(K / Gw) */
    int int8;                                          /* q: int8 values, not e4m3 bytes */
} Dot;

/* 32 e4m3 bytes -> their 32 bfloat16 values, exactly (the header). */
static inline __m512i widen_bf16(__m256i bytes) {
    const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80, 0x3b00, 0);
    const __m512i w = _mm512_cvtepi8_epi16(bytes);
    const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07f0)),
                                            _mm512_set1_epi16(0x3c00));
    const __m512i mag = _mm512_mask_mov_epi16(_mm512_permutexvar_epi16(w, sub),
                                              _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x78)), normal);
    return _mm512_or_si512(mag, _mm512_and_si512(w, _mm512_set1_epi16((short)0x8000)));
}

/* 32 int8 values -> their 32 bfloat16 values, exactly (|q| <= 128 has at most 8 significant bits). */
static inline __m512i widen_int8_bf16(__m256i bytes) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

static inline __mmask32 lanes32(int left) {
    return left >= 32 ? (__mmask32)0xffffffffu : left > 0 ? (__mmask32)((1u << left) - 1) : (__mmask32)0;
}

/* Weight rows [n0, n1) widened into scratch rows of Kp, zeros past K. */
static void widen_rows(const Dot *p, int n0, int n1, uint16_t *scratch) {
    for (int n = n0; n < n1; n++) {
        const uint8_t *w = p->q + (size_t)n * p->K;
        uint16_t *o = scratch + (size_t)(n - n0) * p->Kp;
        for (int k = 0; k < p->Kp; k += 32) {
            const __mmask32 mk = lanes32(p->K - k);
            const __m256i bytes = _mm256_maskz_loadu_epi8(mk, w + k);
            _mm512_storeu_si512(o + k, _mm512_maskz_mov_epi16(mk, p->int8 ? widen_int8_bf16(bytes) : widen_bf16(bytes)));
        }
    }
}

/* 16 floats -> e4m3_round's values, lane by lane (the same bit operations; NaN aside). */
static inline __m512i e4m3_round16(__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
    const __m512i u = _mm512_castps_si512(v), sign = _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u));
    const __m512i a = _mm512_xor_si512(u, sign);
    const __m512 sub = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(16384.0f)),
                                     _mm512_set1_ps(16384.0f));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7ffff)), odd),
                                            _mm512_set1_epi32((int)0xfff00000u));
    const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23));
    return _mm512_or_si512(_mm512_mask_mov_epi32(normal, small, _mm512_castps_si512(sub)), sign);
}

/* One row: its groups' scales into xs, its e4m3 values' bf16 bits into xq (the header's quantization). */
static void quantize_row(const float *x, uint16_t *xq, float *xs, int K, int G, const float *static_scale) {
    for (int k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        float s;
        if (static_scale) {
            s = *static_scale;
        } else {
            __m512 amax = _mm512_setzero_ps();
            for (int k = k0; k < k0 + G; k += 16)
                amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes32(k0 + G - k), x + k)));
            s = _mm512_reduce_max_ps(amax) / 448.0f;
            if (s == 0.0f) s = 1.1920928955078125e-07f;
        }
        xs[g] = s;
        const __m512 vs = _mm512_set1_ps(s);
        for (int k = k0; k < k0 + G; k += 16) {
            const __mmask16 mk = (__mmask16)lanes32(k0 + G - k);
            const __m512i r = e4m3_round16(_mm512_div_ps(_mm512_maskz_loadu_ps(mk, x + k), vs));
            _mm256_mask_storeu_epi16(xq + k, mk, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
        }
    }
}
#else
#define HAVE_BF16_DOT 0

static void quantize_row(const float *x, uint16_t *xq, float *xs, int K, int G, const float *static_scale) {
    for (int k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        float s;
        if (static_scale) {
            s = *static_scale;
        } else {
            float amax = 0.0f;
            for (int k = k0; k < k0 + G; k++) amax = fmaxf(amax, fabsf(x[k]));
            s = amax / 448.0f;
            if (s == 0.0f) s = 1.1920928955078125e-07f;
        }
        xs[g] = s;
        for (int k = k0; k < k0 + G; k++) {
            const float v = e4m3_round(x[k] / s);
            uint32_t bits;
            memcpy(&bits, &v, 4);
            xq[k] = (uint16_t)(bits >> 16);        /* exact: an e4m3 value's low 16 bits are 0 */
        }
    }
}
#endif

/* x's rows as e4m3 bfloat16 and their scales: xq [M, K] (bf16 bits), xs [M, K / G]; s as the header says,
   *static_scale for every row where given (G = K). 0 done; -2 bad arguments. */
int fp8_dot_quantize(const float *x, int64_t ldx, uint16_t *xq, float *xs, int M, int K, int G,
                     const float *static_scale, int threads) {
    if (M < 0 || K < 1 || G < 1 || K % G || ldx < K || (static_scale && G != K))
        return -2;
    if (threads < 1 || (long)M * K < 65536) threads = 1;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int m = 0; m < M; m++)
        quantize_row(x + (size_t)m * ldx, xq + (size_t)m * K, xs + (size_t)m * (K / G), K, G, static_scale);
    return 0;
}

#if HAVE_BF16_DOT
static inline int next_edge(const Dot *p, int k0) {
    const int a = (k0 / p->Ga + 1) * p->Ga, w = (k0 / p->Gw + 1) * p->Gw;
    const int e = a < w ? a : w;
    return e < p->K ? e : p->K;
}

/* rows [m0, m0 + mr) x columns [n0, n0 + nr), whose bf16 rows are w0 + c Kp; mr, nr, seg constants inlined. */
static inline __attribute__((always_inline)) void tile(const Dot *p, const uint16_t *w0, int m0, const int mr,
                                                       int n0, const int nr, const int seg) {
    const int K = p->K, Kp = p->Kp;
    const uint16_t *x[8];
    __m512 acc[8][4], tot[8][4];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++) {
        x[r] = p->xq + (size_t)(m0 + r) * K;
        _Pragma("GCC unroll 4")
        for (int c = 0; c < nr; c++) acc[r][c] = tot[r][c] = _mm512_setzero_ps();
    }
    for (int k0 = 0, end; k0 < K; k0 = end) {
        end = seg ? next_edge(p, k0) : K;
        for (int k = k0; k < end; k += 32) {
            const __mmask32 mk = lanes32(end - k);
            __m512bh wv[4];
            _Pragma("GCC unroll 4")
            for (int c = 0; c < nr; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w0 + (size_t)c * Kp + k);
            _Pragma("GCC unroll 8")
            for (int r = 0; r < mr; r++) {
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x[r] + k);
                _Pragma("GCC unroll 4")
                for (int c = 0; c < nr; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
            }
        }
        if (seg) {
            const int ga = p->K / p->Ga, a = k0 / p->Ga, g = k0 / p->Gw;
            _Pragma("GCC unroll 8")
            for (int r = 0; r < mr; r++)
                _Pragma("GCC unroll 4")
                for (int c = 0; c < nr; c++) {
                    const float s = p->xs[(size_t)(m0 + r) * ga + a] * p->ws[(size_t)((n0 + c) / p->BN) * p->wgroups + g];
                    tot[r][c] = _mm512_fmadd_ps(acc[r][c], _mm512_set1_ps(s), tot[r][c]);
                    acc[r][c] = _mm512_setzero_ps();
                }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < mr; r++)
        _Pragma("GCC unroll 4")
        for (int c = 0; c < nr; c++) {
            const int n = n0 + c;
            float v = _mm512_reduce_add_ps(seg ? tot[r][c] : acc[r][c]);
            if (!seg) v *= p->xs[m0 + r] * p->ws[(size_t)(n / p->BN) * p->wgroups];
            p->out[(size_t)(m0 + r) * p->N + n] = v + (p->bias ? p->bias[n] : 0.0f);
        }
}

/* Every block of rows over the chunk's columns [c0, c1) (scratch: their bf16 rows), tiles of nr columns. */
static inline __attribute__((always_inline)) void chunk(const Dot *p, const uint16_t *scratch, int c0, int c1,
                                                        const int nr, const int seg) {
    for (int m = 0; m < p->M; m += RB) {
        const int mr = p->M - m < RB ? p->M - m : RB;
        for (int n = c0; n < c1; n += nr) {
            const uint16_t *w0 = scratch + (size_t)(n - c0) * p->Kp;
            const int left = c1 - n;
#define TILE(MRV) \
            if (left >= nr) tile(p, w0, m, MRV, n, nr, seg); \
            else if (left >= 2) { tile(p, w0, m, MRV, n, 2, seg); if (left == 3) tile(p, w0 + 2 * (size_t)p->Kp, m, MRV, n + 2, 1, seg); } \
            else tile(p, w0, m, MRV, n, 1, seg)
            switch (mr) {
            case 8: TILE(8); break;
            case 7: TILE(7); break;
            case 6: TILE(6); break;
            case 5: TILE(5); break;
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            default: TILE(1); break;
            }
#undef TILE
        }
    }
}

static void columns(const Dot *p, int n0, int n1, uint16_t *scratch) {
    for (int c0 = n0; c0 < n1; c0 += NC) {
        const int c1 = c0 + NC < n1 ? c0 + NC : n1;
        widen_rows(p, c0, c1, scratch);
        if (p->segmented && p->M <= 2) chunk(p, scratch, c0, c1, 4, 1);
        else if (p->segmented) chunk(p, scratch, c0, c1, 2, 1);
        else if (p->M <= 2) chunk(p, scratch, c0, c1, 4, 0);
        else chunk(p, scratch, c0, c1, NR, 0);
    }
}
#endif

/* 1 where this build has the bf16 form (AVX512_BF16), else 0. */
int fp8_dot_isa(void) { return HAVE_BF16_DOT; }

/* n e4m3 bytes -> bfloat16 bits through the kernel's own widening (tests read every byte). 0; -3 no form. */
int fp8_dot_widen(const uint8_t *q, uint16_t *out, int n) {
#if HAVE_BF16_DOT
    for (int k = 0; k < n; k += 32) {
        const __mmask32 mk = lanes32(n - k);
        _mm512_mask_storeu_epi16(out + k, mk, widen_bf16(_mm256_maskz_loadu_epi8(mk, q + k)));
    }
    return 0;
#else
    (void)q, (void)out, (void)n;
    return -3;
#endif
}

/* fp8_dot_matmul over x's rows in float32 (quantized here) or, xb, in bfloat16 as they are (weight-only fp8
   under bfloat16 activations: every bfloat16 times an e4m3 value is exact in float32 too; xs 1, Ga = K); int8:
   q holds int8 values (each exactly a bfloat16 too), not e4m3 bytes. */
static int dot_run(const float *x, const uint16_t *xb, int64_t ldx, const float *static_scale, int Ga,
                   const uint8_t *q, int int8, const float *ws, int Gw, int BN, const float *bias, float *out, int M,
                   int N, int K, int threads) {
    if (M < 0 || N < 0 || K < 1 || Ga < 1 || K % Ga || ldx < K || Gw < 1 || BN < 1 || (static_scale && Ga != K)
        || (xb && Ga != K))
        return -2;
#if HAVE_BF16_DOT
    const int wgroups = (K + Gw - 1) / Gw;
    uint16_t *xq = malloc((size_t)M * K * sizeof(uint16_t) + 64);
    float *xs = malloc((size_t)M * (K / Ga) * sizeof(float) + 64);
    const Dot p = {xq, xs, q, ws, bias, out, M, N, K, (K + 31) / 32 * 32 + 32, Ga, Gw, BN, wgroups,
                   Ga < K || wgroups > 1, int8};
    if (threads < 1) threads = 1;
    if ((long)N < 8L * threads) threads = N / 8 > 1 ? N / 8 : 1;
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -4;
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|:failed)")
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int m = (int)((long)M * t / nt); m < (int)((long)M * (t + 1) / nt); m++) {
            if (xb) {
                memcpy(xq + (size_t)m * K, xb + (size_t)m * ldx, (size_t)K * sizeof(uint16_t));
                xs[m] = 1.0f;
            } else {
                quantize_row(x + (size_t)m * ldx, xq + (size_t)m * K, xs + (size_t)m * (K / Ga), K, Ga, static_scale);
            }
        }
        _Pragma("omp barrier")
        const int quads = (N + 3) / 4;      /* each thread a contiguous run of columns, cut on multiples of 4 */
        const int n0 = (int)((long)quads * t / nt) * 4, n1c = (int)((long)quads * (t + 1) / nt) * 4;
        const int n1 = n1c < N ? n1c : N;
        uint16_t *scratch = n0 < n1 ? aligned_alloc(64, (size_t)NC * p.Kp * sizeof(uint16_t)) : 0;
        if (n0 < n1 && !scratch) failed = 1;
        else if (n0 < n1) columns(&p, n0, n1, scratch);
        free(scratch);
    }
    free(xq);
    free(xs);
    return failed ? -4 : 0;
#else
    (void)x, (void)xb, (void)q, (void)int8, (void)ws, (void)bias, (void)out, (void)threads;
    return -3;
#endif
}

/* out [M, N] = the header's sum over x [M, K] (rows ldx apart), quantized here as fp8_dot_quantize does (groups of
   Ga; static_scale: G = K), q [N, K] e4m3 bytes, ws [ceil(N / BN), ceil(K / Gw)]. 0 done; -2 bad arguments;
   -3 no bf16 form in this build; -4 no memory. */
int fp8_dot_matmul(const float *x, int64_t ldx, const float *static_scale, int Ga, const uint8_t *q, const float *ws,
                   int Gw, int BN, const float *bias, float *out, int M, int N, int K, int threads) {
    return dot_run(x, NULL, ldx, static_scale, Ga, q, 0, ws, Gw, BN, bias, out, M, N, K, threads);
}

/* fp8_dot_matmul for x [M, K] bfloat16 bits taken as they are: out = ws * sum x q (+ bias); int8: q [N, K] holds
   int8 values (symmetric int8 weights: per channel, Gw = K, or groups of Gw), not e4m3 bytes. */
int fp8_dot_matmul_bf16(const uint16_t *x, int64_t ldx, const uint8_t *q, int int8, const float *ws, int Gw, int BN,
                        const float *bias, float *out, int M, int N, int K, int threads) {
    return dot_run(NULL, x, ldx, NULL, K, q, int8, ws, Gw, BN, bias, out, M, N, K, threads);
}
