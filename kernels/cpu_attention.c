/* Paged decode attention on CPU, reading the KV blocks in place (kernels/cpu_attention.py loads it).

   q        [B, Hq, D]            one query row per decode sequence
   k, v     [NB, BS, Hk, D]       the layer's cache: slot = block * BS + offset
   tables   [B, W] int32          each sequence's physical blocks, in logical order
   seq_lens [B] int32             keys visible to sequence b: [lo_b, seq_len_b), lo_b = seq_len_b - window (>= 0)
   out      [B, Hq, D]

   The G = Hq / Hk query heads that share a KV head read its row once from L1: a token's K row of all Hk
   heads is one contiguous run of Hk * D values, so a block is BS such runs and the prefetcher streams it.

   Work item: (sequence, split). A split is a run of at most `split` keys; one sequence is several splits
   only when the step has too few sequences to keep every thread busy, or keys past SPLIT_MAX (bounding the
   scores' scratch). Each item runs a two-pass softmax over its keys:
       pass 1   s[h, i] = scale * q[h] . k[i]   (soft-capped), m[h] = max_i s[h, i]
       pass 2   p = exp(s - m), l[h] = sum_i p, acc[h] = sum_i p * v[i]
   and leaves (m, l, acc) for its sequence's combine: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
   K and V are each read once; everything else stays in the thread's L1/L2.

   Arithmetic is float32 whatever the cache's type (bfloat16 widened exactly, float16 through F16C).
   Built with OpenMP against the libgomp torch has loaded (same soname): one thread pool in the process. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SPLIT_MIN 256      /* keys: below this a split's fixed costs show */
#define SPLIT_MAX 4096     /* keys: the scores' scratch is Hq * SPLIT_MAX floats a thread */

/* exp(x) for x <= 0 (scores minus their max): Cody-Waite reduction, degree-6 polynomial (rel. error < 2e-7);
   plain arithmetic, so the compiler vectorizes the loop that calls it (libm's expf it would not). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

static inline float from_f32(float x) { return x; }
static inline float to_f32(float x) { return x; }
static inline float from_bf16(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) {          /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float from_f16(_Float16 x) { return (float)x; }
static inline _Float16 to_f16(float x) { return (_Float16)x; }

/* The two inner loops, per KV head: qk (pass 1's scores) and pv (pass 2's weighted sum of V). Written with
   AVX-512 intrinsics where the compiler targets them; portable loops elsewhere. (An omp simd reduction left
   gcc summing a dot product's lanes one by one through the stack: most of pass 1's time.) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
static inline __m512 vload_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 vload_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 vload_f16(const _Float16 *p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
/* The sums of four vectors' lanes, as one 4-lane vector: 14 shuffles and adds for four dot products, where
   four _mm512_reduce_add_ps take 32. */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));   /* a0 a1 a0 a1 */
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));   /* a2 a3 a2 a3 */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xee)); /* a0..a3 */
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
/* s[g * sstride] = q[g] . k for the G query heads of one KV head and one key row k (the cache's type, read
   and widened once for four heads) */
#define DEFINE_QK(SUFFIX, T)                                                                                  \
static inline void qk_##SUFFIX(float *s, int sstride, const float *q, const T *k, int G, int D) {           \
    for (int g0 = 0; g0 < G; g0 += 4) {                                                                       \
        const int gn = G - g0 < 4 ? G - g0 : 4;                                                               \
        const float *q0 = q + (size_t)g0 * D;                                                                 \
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};   \
        for (int d = 0; d < D; d += 16) {                                                                     \
            const __mmask16 m = D - d >= 16 ? 0xffff : (__mmask16)((1u << (D - d)) - 1);                      \
            const __m512 kv = vload_##SUFFIX(k + d, m);                                                       \
            _Pragma("GCC unroll 4")                                                                           \
            for (int g = 0; g < 4; g++)                                                                       \
                if (g < gn) a[g] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q0 + (size_t)g * D + d), kv, a[g]); \
        }                                                                                                     \
        float r[4];                                                                                           \
        _mm_storeu_ps(r, reduce4(a[0], a[1], a[2], a[3]));                                                    \
        for (int g = 0; g < gn; g++) s[(size_t)(g0 + g) * sstride] = r[g];                                   \
    }                                                                                                         \
}
/* acc[g, :] += sum_t p[g * pstride + t] * v[t * row + :] for the G query heads of one KV head over n keys:
   the accumulators stay in registers for the whole run (through memory, each key's update waited on the
   last one's store: most of pass 2's time). 4 heads x 64 dims at a time: 16 of the 32 zmm registers. */
#define DEFINE_PV(SUFFIX, T)                                                                                  \
static inline void pv_##SUFFIX(float *acc, const float *p, int pstride, const T *v, int row, int n, int G, int D) { \
    for (int g0 = 0; g0 < G; g0 += 4) {                                                                       \
        const int gn = G - g0 < 4 ? G - g0 : 4;                                                               \
        for (int d0 = 0; d0 < D; d0 += 64) {                                                                  \
            __mmask16 m[4];                                                                                   \
            __m512 a[4][4];                                                                                   \
            _Pragma("GCC unroll 4")                                                                           \
            for (int c = 0; c < 4; c++) {                                                                     \
                const int r = D - d0 - 16 * c;                                                                \
                m[c] = r >= 16 ? 0xffff : r > 0 ? (__mmask16)((1u << r) - 1) : 0;                             \
            }                                                                                                 \
            _Pragma("GCC unroll 4")                                                                           \
            for (int g = 0; g < 4; g++)                                                                       \
                _Pragma("GCC unroll 4")                                                                       \
                for (int c = 0; c < 4; c++)                                                                   \
                    a[g][c] = g < gn ? _mm512_maskz_loadu_ps(m[c], acc + (size_t)(g0 + g) * D + d0 + 16 * c)  \
                                     : _mm512_setzero_ps();                                                   \
            for (int t = 0; t < n; t++) {                                                                     \
                const T *vr = v + (size_t)t * row + d0;                                                       \
                __m512 x[4];                                                                                  \
                _Pragma("GCC unroll 4")                                                                       \
                for (int c = 0; c < 4; c++) x[c] = vload_##SUFFIX(vr + 16 * c, m[c]);                         \
                _Pragma("GCC unroll 4")                                                                       \
                for (int g = 0; g < 4; g++) {                                                                 \
                    if (g >= gn) break;                                                                       \
                    const __m512 pb = _mm512_set1_ps(p[(size_t)(g0 + g) * pstride + t]);                      \
                    _Pragma("GCC unroll 4")                                                                   \
                    for (int c = 0; c < 4; c++) a[g][c] = _mm512_fmadd_ps(pb, x[c], a[g][c]);                 \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("GCC unroll 4")                                                                           \
            for (int g = 0; g < 4; g++)                                                                       \
                if (g < gn)                                                                                   \
                    _Pragma("GCC unroll 4")                                                                   \
                    for (int c = 0; c < 4; c++)                                                               \
                        _mm512_mask_storeu_ps(acc + (size_t)(g0 + g) * D + d0 + 16 * c, m[c], a[g][c]);       \
        }                                                                                                     \
    }                                                                                                         \
}
#else
#define DEFINE_QK(SUFFIX, T)                                                                                  \
static inline void qk_##SUFFIX(float *s, int sstride, const float *q, const T *k, int G, int D) {           \
    for (int g = 0; g < G; g++) {                                                                             \
        const float *qg = q + (size_t)g * D;                                                                  \
        float lanes[8] = {0};                                                                                 \
        int d = 0;                                                                                            \
        for (; d + 8 <= D; d += 8)                                                                            \
            for (int j = 0; j < 8; j++) lanes[j] += qg[d + j] * from_##SUFFIX(k[d + j]);                      \
        float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])); \
        for (; d < D; d++) sum += qg[d] * from_##SUFFIX(k[d]);                                                \
        s[(size_t)g * sstride] = sum;                                                                         \
    }                                                                                                         \
}
#define DEFINE_PV(SUFFIX, T)                                                                                  \
static inline void pv_##SUFFIX(float *acc, const float *p, int pstride, const T *v, int row, int n, int G, int D) { \
    for (int t = 0; t < n; t++)                                                                               \
        for (int g = 0; g < G; g++) {                                                                         \
            const float pg = p[(size_t)g * pstride + t];                                                      \
            float *ag = acc + (size_t)g * D;                                                                  \
            _Pragma("omp simd")                                                                               \
            for (int d = 0; d < D; d++) ag[d] += pg * from_##SUFFIX(v[(size_t)t * row + d]);                  \
        }                                                                                                     \
}
#endif
DEFINE_QK(f32, float)
DEFINE_QK(bf16, uint16_t)
DEFINE_QK(f16, _Float16)
DEFINE_PV(f32, float)
DEFINE_PV(bf16, uint16_t)
DEFINE_PV(f16, _Float16)

/* The next block's row, asked for while this block's row is computed: a block is a few KB at a random place
   in the pool, too short for the hardware prefetcher to find its stride before it ends. */
static inline void prefetch_row(const void *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 2);
}

typedef struct { int b, start, stop; } Item;   /* keys [start, stop) of sequence b */

/* Splits each sequence's visible keys into items; returns their count (items: at least B entries, and
   one per `split` keys). */
static int plan_items(const int32_t *seq_lens, int B, int window, int threads, Item **items_out, int *split_out) {
    long total = 0;
    for (int b = 0; b < B; b++) {
        int L = seq_lens[b], lo = (window > 0 && L > window) ? L - window : 0;
        total += L - lo;
    }
    long split = (total + 4L * threads - 1) / (4L * threads);   /* about four items a thread */
    if (split < SPLIT_MIN) split = SPLIT_MIN;
    if (split > SPLIT_MAX) split = SPLIT_MAX;
    int n = 0;
    for (int b = 0; b < B; b++) {
        int L = seq_lens[b], lo = (window > 0 && L > window) ? L - window : 0;
        n += (int)((L - lo + split - 1) / split) + (L == lo);
    }
    Item *items = malloc(sizeof(Item) * (size_t)n);
    int i = 0;
    for (int b = 0; b < B; b++) {
        int L = seq_lens[b], lo = (window > 0 && L > window) ? L - window : 0;
        if (L == lo) { items[i++] = (Item){b, lo, lo}; continue; }
        for (int s = lo; s < L; s += (int)split) items[i++] = (Item){b, s, s + split < L ? s + (int)split : L};
    }
    *items_out = items;
    *split_out = (int)split;
    return n;
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE, QK, PV)                                                           \
int NAME(const T *q, const T *k, const T *v, const int32_t *tables, int64_t table_stride,                   \
         const int32_t *seq_lens, T *out, int B, int Hq, int Hk, int D, int BS, int window, float scale,      \
         float softcap, int threads) {                                                                        \
    if (B <= 0) return 0;                                                                                     \
    const int G = Hq / Hk, row = Hk * D;                                                                      \
    Item *items;                                                                                              \
    int split;                                                                                                \
    const int n = plan_items(seq_lens, B, window, threads, &items, &split);                                   \
    /* per item: m [Hq], l [Hq], acc [Hq, D] */                                                               \
    float *part = malloc(sizeof(float) * (size_t)n * Hq * (D + 2));                                          \
    if (!items || !part) { free(items); free(part); return -1; }                                              \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel num_threads(threads)")                                                              \
    {                                                                                                         \
        float *qf = malloc(sizeof(float) * ((size_t)Hq * D + (size_t)Hq * split));                            \
        float *scores = qf + (size_t)Hq * D;                      /* [Hq, split] */                           \
        if (!qf) { _Pragma("omp atomic write") failed = 1; }                                                  \
        _Pragma("omp for schedule(dynamic, 1)")                                                               \
        for (int it = 0; it < n; it++) {                                                                      \
            if (!qf) continue;                                                                                \
            const Item w = items[it];                                                                         \
            const int32_t *table = tables + (int64_t)w.b * table_stride;                                      \
            const int len = w.stop - w.start;                                                                 \
            float *m = part + (size_t)it * Hq * (D + 2), *l = m + Hq, *acc = l + Hq;                          \
            for (int t = w.start % BS; t < BS; t++)                                                           \
                prefetch_row(k + ((int64_t)table[w.start / BS] * BS + t) * row, row * (int)sizeof(T));        \
            for (int x = 0; x < Hq * D; x++) qf[x] = LOAD(q[(size_t)w.b * Hq * D + x]) * scale;               \
            /* pass 1: scores */                                                                              \
            for (int blk = w.start / BS; blk * BS < w.stop; blk++) {                                          \
                const int t0 = (w.start > blk * BS ? w.start : blk * BS) - blk * BS;                          \
                const int t1 = (w.stop < (blk + 1) * BS ? w.stop : (blk + 1) * BS) - blk * BS;                \
                const T *kb = k + (int64_t)table[blk] * BS * row;                                             \
                /* the next K block; after the last, pass 2's first V block */                                \
                const T *kn = (blk + 1) * BS < w.stop ? k + (int64_t)table[blk + 1] * BS * row                \
                                                      : v + (int64_t)table[w.start / BS] * BS * row;          \
                for (int t = t0; t < t1; t++) {                                                               \
                    const int i = blk * BS + t - w.start;                                                     \
                    prefetch_row(kn + (size_t)t * row, row * (int)sizeof(T));                                 \
                    for (int kh = 0; kh < Hk; kh++)                                                           \
                        QK(scores + (size_t)kh * G * split + i, split, qf + (size_t)kh * G * D,               \
                           kb + (size_t)t * row + (size_t)kh * D, G, D);                                      \
                }                                                                                             \
            }                                                                                                 \
            for (int h = 0; h < Hq; h++) {                                                                    \
                float *sh = scores + (size_t)h * split, mx = -INFINITY, sum = 0.0f;                           \
                if (softcap > 0.0f)                                                                           \
                    for (int i = 0; i < len; i++) sh[i] = softcap * tanhf(sh[i] / softcap);                   \
                for (int i = 0; i < len; i++) mx = sh[i] > mx ? sh[i] : mx;                                   \
                _Pragma("omp simd reduction(+:sum)")                                                          \
                for (int i = 0; i < len; i++) { sh[i] = exp_nonpos(sh[i] - mx); sum += sh[i]; }               \
                m[h] = mx;                                                                                    \
                l[h] = sum;                                                                                   \
            }                                                                                                 \
            /* pass 2: the weighted sum of V */                                                               \
            memset(acc, 0, sizeof(float) * (size_t)Hq * D);                                                   \
            for (int blk = w.start / BS; blk * BS < w.stop; blk++) {                                          \
                const int t0 = (w.start > blk * BS ? w.start : blk * BS) - blk * BS;                          \
                const int t1 = (w.stop < (blk + 1) * BS ? w.stop : (blk + 1) * BS) - blk * BS;                \
                const T *vb = v + (int64_t)table[blk] * BS * row;                                             \
                const T *vn = (blk + 1) * BS < w.stop ? v + (int64_t)table[blk + 1] * BS * row : vb;          \
                for (int t = t0; t < t1; t++) prefetch_row(vn + (size_t)t * row, row * (int)sizeof(T));      \
                const int i0 = blk * BS + t0 - w.start;                                                       \
                for (int kh = 0; kh < Hk; kh++)                                                               \
                    PV(acc + (size_t)kh * G * D, scores + (size_t)kh * G * split + i0, split,                 \
                       vb + (size_t)t0 * row + (size_t)kh * D, row, t1 - t0, G, D);                           \
            }                                                                                                 \
        }                                                                                                     \
        /* the combine: items of one sequence are consecutive */                                              \
        _Pragma("omp for schedule(static)")                                                                   \
        for (int b = 0; b < B; b++) {                                                                         \
            int first = 0;                                                                                    \
            { int lo_ = 0, hi_ = n; while (lo_ < hi_) { int mid = (lo_ + hi_) / 2;                            \
                if (items[mid].b < b) lo_ = mid + 1; else hi_ = mid; } first = lo_; }                        \
            int last = first;                                                                                 \
            while (last < n && items[last].b == b) last++;                                                    \
            for (int h = 0; h < Hq; h++) {                                                                    \
                float M = -INFINITY, den = 0.0f, o[1024];                                                    \
                for (int it = first; it < last; it++) {                                                       \
                    const float mi = part[(size_t)it * Hq * (D + 2) + h];                                     \
                    M = mi > M ? mi : M;                                                                      \
                }                                                                                             \
                for (int d = 0; d < D; d++) o[d] = 0.0f;                                                      \
                for (int it = first; it < last; it++) {                                                       \
                    const float *pm = part + (size_t)it * Hq * (D + 2);                                       \
                    if (items[it].stop == items[it].start) continue;                                          \
                    const float c = exp_nonpos(pm[h] - M), *ah = pm + 2 * Hq + (size_t)h * D;                 \
                    den += c * pm[Hq + h];                                                                    \
                    for (int d = 0; d < D; d++) o[d] += c * ah[d];                                            \
                }                                                                                             \
                T *oh = out + ((size_t)b * Hq + h) * D;                                                       \
                const float inv = den > 0.0f ? 1.0f / den : 0.0f;                                             \
                for (int d = 0; d < D; d++) oh[d] = STORE(o[d] * inv);                                        \
            }                                                                                                 \
        }                                                                                                     \
        free(qf);                                                                                             \
    }                                                                                                         \
    free(items);                                                                                              \
    free(part);                                                                                               \
    return failed ? -1 : 0;                                                                                   \
}

DEFINE_DECODE(decode_attention_float32, float, from_f32, to_f32, qk_f32, pv_f32)
DEFINE_DECODE(decode_attention_bfloat16, uint16_t, from_bf16, to_bf16, qk_bf16, pv_bf16)
DEFINE_DECODE(decode_attention_float16, _Float16, from_f16, to_f16, qk_f16, pv_f16)

/* The largest head_dim the combine's stack buffer takes (the loader checks it). */
int decode_attention_max_head_dim(void) { return 1024; }
