/* Weight-only int8 matmul on CPU (kernels/matmul/cpu_int8.py loads it); the activations stay float32:

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
   decode, where widening is the work) or 2, and runs every block of rows over a tile while its bytes
   are in L1, so the weight is read from memory once a call whatever M.

   Activations are not quantized (int8 x int8 with per-row activation scales is w8a8's, a different
   result). Arithmetic float32; the sum over k runs in 16 lanes, reduced at the end, so it differs from
   F.linear's order by rounding only. Builds without AVX-512, and groups that are not a multiple of 16,
   run the portable loop (plain C in the same 16 lanes, which a compiler vectorizes to what the build has). */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#define MR 8      /* activation rows a block */

typedef struct {
    const float *x; int64_t ldx;
    const int8_t *q; const float *scales, *zeros, *bias;
    float *out;
    int M, N, K, G, affine;     /* affine: dequantize per group (groups > 1 or zeros), else scale at the end */
} Problem;

static inline float finish(const Problem *p, int n, float sum) {
    return (p->affine ? sum : sum * p->scales[n]) + (p->bias ? p->bias[n] : 0.0f);
}

/* The portable loop: every row over columns [n0, n1). */
static void block_portable(const Problem *p, int n0, int n1) {
    const int K = p->K, G = p->G, groups = K / G;
    for (int n = n0; n < n1; n++) {
        const int8_t *w = p->q + (size_t)n * K;
        const float *s = p->scales + (size_t)n * groups, *z = p->zeros ? p->zeros + (size_t)n * groups : 0;
        for (int m = 0; m < p->M; m++) {
            const float *x = p->x + (size_t)m * p->ldx;
            float acc[16] = {0};
            for (int g = 0; g < groups; g++) {
                const float sg = p->affine ? s[g] : 1.0f, zg = z ? z[g] : 0.0f;
                const int k0 = g * G, k1 = k0 + G;
                int k = k0;
                for (; k + 16 <= k1; k += 16)
                    for (int l = 0; l < 16; l++) acc[l] += x[k + l] * ((float)w[k + l] * sg + zg);
                for (; k < k1; k++) acc[(k - k0) % 16] += x[k] * ((float)w[k] * sg + zg);
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

static inline __mmask16 lanes(int left) {
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
}

/* 16 weights of column c's row at k widened to float32 (masked: the row's tail). */
static inline __m512 widen(const int8_t *w, __mmask16 mk) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, w)));
}

/* rows [m0, m0 + mr) x columns [n0, n0 + nr); mr <= MR, nr <= 4, affine: constants where it is inlined. */
static inline __attribute__((always_inline)) void tile(const Problem *p, int m0, const int mr, int n0,
                                                       const int nr, const int affine) {
    const int K = p->K, G = p->G, groups = K / G;
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
            for (int c = 0; c < nr; c++) wv[c] = widen(w[c] + k, mk);
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
                const size_t i = (size_t)(n0 + c) * groups + g;
                vs[c] = _mm512_set1_ps(p->scales[i]);
                vz[c] = p->zeros ? _mm512_set1_ps(p->zeros[i]) : _mm512_setzero_ps();
            }
            for (int k = g * G; k < (g + 1) * G; k += 16) {        /* G a multiple of 16: no tail */
                __m512 wv[4];
                _Pragma("GCC unroll 4")
                for (int c = 0; c < nr; c++) wv[c] = _mm512_fmadd_ps(widen(w[c] + k, 0xffff), vs[c], vz[c]);
                _Pragma("GCC unroll 8")
                for (int r = 0; r < mr; r++) {
                    const __m512 xv = _mm512_loadu_ps(x[r] + k);
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
static inline __attribute__((always_inline)) void rows(const Problem *p, int n, const int nr, const int affine) {
    for (int m = 0; m < p->M; m += MR) {
        switch (p->M - m >= MR ? MR : p->M - m) {
        case 8: tile(p, m, 8, n, nr, affine); break;
        case 7: tile(p, m, 7, n, nr, affine); break;
        case 6: tile(p, m, 6, n, nr, affine); break;
        case 5: tile(p, m, 5, n, nr, affine); break;
        case 4: tile(p, m, 4, n, nr, affine); break;
        case 3: tile(p, m, 3, n, nr, affine); break;
        case 2: tile(p, m, 2, n, nr, affine); break;
        default: tile(p, m, 1, n, nr, affine); break;
        }
    }
}

static inline __attribute__((always_inline)) void columns(const Problem *p, int n0, int n1, const int affine) {
    int n = n0;
    if (p->M <= 2)
        for (; n + 4 <= n1; n += 4) rows(p, n, 4, affine);
    for (; n + 2 <= n1; n += 2) rows(p, n, 2, affine);
    for (; n < n1; n++) rows(p, n, 1, affine);
}

static void block_scaled(const Problem *p, int n0, int n1) { columns(p, n0, n1, 0); }
static void block_affine(const Problem *p, int n0, int n1) { columns(p, n0, n1, 1); }
#else
#define HAVE_AVX512 0
#endif

/* Which inner loop this build runs (per channel, or groups a multiple of 16): 1 AVX-512, 0 portable. */
int int8_kernel_isa(void) { return HAVE_AVX512; }

/* 0 done; -2 bad arguments. */
int int8_matmul(const float *x, int64_t ldx, const int8_t *q, const float *scales, const float *zeros,
                const float *bias, float *out, int M, int N, int K, int G, int threads, int portable) {
    if (M < 0 || N < 0 || K < 1 || G < 1 || K % G || ldx < K)
        return -2;
    const int affine = K / G > 1 || zeros != 0;
    const Problem p = {x, ldx, q, scales, zeros, bias, out, M, N, K, G, affine};
    const int fast = HAVE_AVX512 && !portable && (!affine || G % 16 == 0);
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
            if (fast && affine) block_affine(&p, n0, n1);
            else if (fast) block_scaled(&p, n0, n1);
            else
#endif
                block_portable(&p, n0, n1);
        }
    }
    (void)fast;
    return 0;
}
