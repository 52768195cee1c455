/* Paged attention on CPU, reading the KV blocks in place (kernels/attention/cpu_attention.py loads it): decode
   rows here, prefill chunks in the second half of the file.

   q        [B, Hq, D]            one query row per decode sequence
   k, v     [NB, BS, Hk, D]       the layer's cache: slot = block * BS + offset
   tables   [B, W] int32          each sequence's physical blocks, in logical order
   seq_lens [B] int32             keys visible to sequence b: [lo_b, seq_len_b), lo_b = seq_len_b - window (>= 0)
   out      [B, Hq, D]

   The G = Hq / Hk query heads that share a KV head read its row once from L1: a token's K row of all Hk
   heads is one contiguous run of Hk * D values, so a block is BS such runs, asked for ahead (below).

   Work item: (sequence, split). A split is a run of at most `split` keys; one sequence is several splits
   only when the step has too few sequences to keep every thread busy, or keys past SPLIT_MAX (bounding the
   scores' scratch). Each thread takes a contiguous run of items, balanced by keys. Batch-invariant mode
   (fixed_split > 0): every split is fixed_split keys from the row's first key, whatever the batch and the
   threads, so a row's sums run in one order in every step (a prefill row too: the launcher hands it in as
   a row of its own). Each item runs a two-pass softmax over its keys, in an order fixed by its keys alone:
       pass 1   s[h, i] = scale * q[h] . k[i]   (soft-capped), m[h] = max_i s[h, i]
       pass 2   p = exp(s - m), l[h] = sum_i p, acc[h] = sum_i p * v[i]
   and leaves (m, l, acc) for its sequence's combine: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
   K and V are each read once; everything else stays in the thread's L1/L2.

   Arithmetic is float32 whatever the cache's type (bfloat16 widened exactly, float16 through F16C).
   Built with OpenMP against the libgomp torch has loaded (same soname): one thread pool in the process. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SPLIT_MIN 256      /* keys: below this a split's fixed costs show */
#define SPLIT_MAX 4096     /* keys: the scores' scratch is Hq * SPLIT_MAX floats a thread */
#define MAX_HEAD_DIM 1024  /* the combine's stack buffer (kernels/attention/cpu_attention.py checks it) */

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

/* The item loop's inner calls (qk, pv), inlined: gcc kept them out of line, and the calls cost 5-8%. */
#define INNER __attribute__((always_inline)) static inline

/* Prefetching. A block is a few KB at a random place in the pool: too short for the hardware prefetcher to
   find its stream before it ends. So while a block is computed, the next one is asked for (into L2), a few
   lines between computations: share j of n asks for the block's lines [j * lines / n, (j + 1) * lines / n).
   (Asked for in bursts of a row or more, the V pass read 1.2-1.3x slower: the requests queue or are dropped.)
   After an item's last K block comes its first V block, after its last V block the thread's next item's
   first K block. */
static inline void prefetch_share(const char *block, int j, int n, int lines) {
    if (!block) return;
    for (int l = j * lines / n; l < (j + 1) * lines / n; l++) __builtin_prefetch(block + 64 * (size_t)l, 0, 2);
}

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
/* s[g * sstride + t] = q[g] . k[t * row] for the G query heads of one KV head over n consecutive key rows k:
   four keys at a time, so each query vector is loaded once for four keys and one reduce4 sums a head's four
   dot products into four adjacent scores. Each product's own sum (its FMAs in order of d, then reduce4's tree,
   the same for each of the four inputs) does not depend on the grouping. q: the queries scaled, in float32;
   qt, scale: the queries as given and the scale, for the variant that multiplies in the cache's type
   (bfloat16 below). */
#define DEFINE_QK(SUFFIX, T)                                                                                  \
INNER void qk_##SUFFIX(float *s, int sstride, const float *q, const T *qt, float scale, const T *k, int row, \
                       int n, int G, int D) {                                                                 \
    (void)qt; (void)scale;                                                                                    \
    for (int t0 = 0; t0 < n; t0 += 4) {                                                                       \
        const int tn = n - t0 < 4 ? n - t0 : 4;                                                               \
        const T *k0 = k + (size_t)t0 * row;                                                                   \
        for (int g0 = 0; g0 < G; g0 += 4) {                                                                   \
            const int gn = G - g0 < 4 ? G - g0 : 4;                                                           \
            const float *q0 = q + (size_t)g0 * D;                                                             \
            __m512 a[4][4];                                                                                   \
            _Pragma("GCC unroll 4")                                                                           \
            for (int g = 0; g < 4; g++)                                                                       \
                _Pragma("GCC unroll 4")                                                                       \
                for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();                                    \
            for (int d = 0; d < D; d += 16) {                                                                 \
                const __mmask16 m = D - d >= 16 ? 0xffff : (__mmask16)((1u << (D - d)) - 1);                  \
                __m512 kv[4];                                                                                 \
                _Pragma("GCC unroll 4")                                                                       \
                for (int j = 0; j < 4; j++)                                                                   \
                    kv[j] = j < tn ? vload_##SUFFIX(k0 + (size_t)j * row + d, m) : _mm512_setzero_ps();       \
                _Pragma("GCC unroll 4")                                                                       \
                for (int g = 0; g < 4; g++) {                                                                 \
                    if (g >= gn) break;                                                                       \
                    const __m512 qv = _mm512_maskz_loadu_ps(m, q0 + (size_t)g * D + d);                       \
                    _Pragma("GCC unroll 4")                                                                   \
                    for (int j = 0; j < 4; j++) a[g][j] = _mm512_fmadd_ps(qv, kv[j], a[g][j]);                \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("GCC unroll 4")                                                                           \
            for (int g = 0; g < 4; g++)                                                                       \
                if (g < gn)                                                                                   \
                    _mm_mask_storeu_ps(s + (size_t)(g0 + g) * sstride + t0, (__mmask8)((1u << tn) - 1),       \
                                       reduce4(a[g][0], a[g][1], a[g][2], a[g][3]));                          \
        }                                                                                                     \
    }                                                                                                         \
}
/* acc[g, :] += sum_t p[g * pstride + t] * v[t * row + :] for the G query heads of one KV head over n keys:
   the accumulators stay in registers for the whole run (through memory, each key's update waited on the
   last one's store: most of pass 2's time). 4 heads x 64 dims at a time: 16 of the 32 zmm registers. */
#define DEFINE_PV(SUFFIX, T)                                                                                  \
INNER void pv_##SUFFIX(float *acc, const float *p, int pstride, const T *v, int row, int n, int G, int D,   \
                       const char *ahead, int share0, int shares, int lines) {                                \
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
                if (g0 == 0 && d0 == 0) prefetch_share(ahead, share0 + t, shares, lines);                     \
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
INNER void qk_##SUFFIX(float *s, int sstride, const float *q, const T *qt, float scale, const T *k, int row, \
                       int n, int G, int D) {                                                                 \
    (void)qt; (void)scale;                                                                                    \
    for (int t = 0; t < n; t++)                                                                               \
        for (int g = 0; g < G; g++) {                                                                         \
            const float *qg = q + (size_t)g * D;                                                              \
            const T *kt = k + (size_t)t * row;                                                                \
            float lanes[8] = {0};                                                                             \
            int d = 0;                                                                                        \
            for (; d + 8 <= D; d += 8)                                                                        \
                for (int j = 0; j < 8; j++) lanes[j] += qg[d + j] * from_##SUFFIX(kt[d + j]);                 \
            float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))                                       \
                      + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));                                      \
            for (; d < D; d++) sum += qg[d] * from_##SUFFIX(kt[d]);                                           \
            s[(size_t)g * sstride + t] = sum;                                                                 \
        }                                                                                                     \
}
#define DEFINE_PV(SUFFIX, T)                                                                                  \
INNER void pv_##SUFFIX(float *acc, const float *p, int pstride, const T *v, int row, int n, int G, int D,   \
                       const char *ahead, int share0, int shares, int lines) {                                \
    for (int t = 0; t < n; t++) {                                                                             \
        prefetch_share(ahead, share0 + t, shares, lines);                                                     \
        for (int g = 0; g < G; g++) {                                                                         \
            const float pg = p[(size_t)g * pstride + t];                                                      \
            float *ag = acc + (size_t)g * D;                                                                  \
            _Pragma("omp simd")                                                                               \
            for (int d = 0; d < D; d++) ag[d] += pg * from_##SUFFIX(v[(size_t)t * row + d]);                  \
        }                                                                                                     \
    }                                                                                                         \
}
#endif
DEFINE_QK(f32, float)
DEFINE_QK(f16, _Float16)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* bfloat16 on AVX512_BF16: vdpbf16ps multiplies the queries and keys as given (each product exact in float32)
   and sums them in float32, 32 values an instruction, with no widening: pass 1 was mostly widening. The
   scale multiplies the sum, as torch's own bfloat16 attention scales its scores. */
INNER void qk_bf16(float *s, int sstride, const float *q, const uint16_t *qt, float scale, const uint16_t *k,
                   int row, int n, int G, int D) {
    (void)q;
    for (int t0 = 0; t0 < n; t0 += 4) {
        const int tn = n - t0 < 4 ? n - t0 : 4;
        const uint16_t *k0 = k + (size_t)t0 * row;
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int gn = G - g0 < 4 ? G - g0 : 4;
            const uint16_t *q0 = qt + (size_t)g0 * D;
            __m512 a[4][4];
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++)
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 32) {
                const __mmask32 m = D - d >= 32 ? 0xffffffffu : (__mmask32)((1u << (D - d)) - 1);
                __m512bh kv[4];
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
                    kv[j] = (__m512bh)(j < tn ? _mm512_maskz_loadu_epi16(m, k0 + (size_t)j * row + d)
                                              : _mm512_setzero_si512());
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {
                    if (g >= gn) break;
                    const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q0 + (size_t)g * D + d);
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) a[g][j] = _mm512_dpbf16_ps(a[g][j], qv, kv[j]);
                }
            }
            const __m128 sc = _mm_set1_ps(scale);
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++)
                if (g < gn)
                    _mm_mask_storeu_ps(s + (size_t)(g0 + g) * sstride + t0, (__mmask8)((1u << tn) - 1),
                                       _mm_mul_ps(reduce4(a[g][0], a[g][1], a[g][2], a[g][3]), sc));
        }
    }
}
#else
DEFINE_QK(bf16, uint16_t)
#endif
DEFINE_PV(f32, float)
DEFINE_PV(bf16, uint16_t)
DEFINE_PV(f16, _Float16)

typedef struct { int b, start, stop; } Item;   /* keys [start, stop) of sequence b */

/* What one call works on; the item functions read it, the entry points fill it. */
typedef struct {
    const void *q, *k, *v;
    const int32_t *tables;
    int64_t table_stride;
    const Item *items;
    int Hq, Hk, G, D, BS, row, split;            /* row: Hk * D values a slot */
    float scale, softcap;
    float *part;                                  /* per item: m [Hq], l [Hq], acc [Hq, D] */
} Work;

/* The first key a row of seq_len L sees: L - window under a sliding window, else 0. */
static inline int first_key(int L, int window) { return (window > 0 && L > window) ? L - window : 0; }

/* Splits each sequence's visible keys into items of at most `split` keys (fixed_split when > 0, else chosen
   from the batch); returns their count. */
static int plan_items(const int32_t *seq_lens, int B, int window, int threads, int fixed_split, Item **items_out,
                      int *split_out) {
    long total = 0;
    for (int b = 0; b < B; b++) {
        total += seq_lens[b] - first_key(seq_lens[b], window);
    }
    long split = (total + 4L * threads - 1) / (4L * threads);   /* about four items a thread */
    if (split < SPLIT_MIN) split = SPLIT_MIN;
    if (fixed_split > 0) split = fixed_split;
    if (split > SPLIT_MAX) split = SPLIT_MAX;
    int n = 0;
    for (int b = 0; b < B; b++) {
        const int L = seq_lens[b], lo = first_key(L, window);
        n += (int)((L - lo + split - 1) / split) + (L == lo);
    }
    Item *items = malloc(sizeof(Item) * (size_t)n);
    if (!items) return -1;
    int i = 0;
    for (int b = 0; b < B; b++) {
        const int L = seq_lens[b], lo = first_key(L, window);
        if (L == lo) { items[i++] = (Item){b, lo, lo}; continue; }
        for (int s = lo; s < L; s += (int)split) items[i++] = (Item){b, s, s + split < L ? s + (int)split : L};
    }
    *items_out = items;
    *split_out = (int)split;
    return n;
}

/* The first item of thread t of nt: items in order, cut where the keys before reach t / nt of all. Each
   thread takes a contiguous run (so it knows its next item, to prefetch), balanced by keys. */
static int first_item(const Item *items, int n, int t, int nt, long total) {
    const long goal = total * t / nt;
    long seen = 0;
    int i = 0;
    while (i < n && seen < goal) { seen += items[i].stop - items[i].start; i++; }
    return i;
}

/* The sum of x[0..n) in one order fixed by n alone: 16 lanes (lane j sums x[j], x[j + 16], ...), then a fixed
   tree. (An omp simd reduction may sum in another order where the scratch's alignment differs.) */
static inline float sum_fixed(const float *x, int n) {
    float lanes[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += x[i + j];
    for (int j = 0; i < n; i++, j++) lanes[j] += x[i];
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lanes[j] += lanes[j + w];
    return lanes[0];
}

static inline const char *block_of(const Work *w, const void *cache, const Item *it, int key, size_t elem) {
    const int32_t *table = w->tables + (int64_t)it->b * w->table_stride;
    return (const char *)cache + (size_t)table[key / w->BS] * w->BS * w->row * elem;
}

/* One item: pass 1 (scores), the softmax's max and sum, pass 2 (V), into w->part[it]. qf: [Hq, D] scratch,
   scores: [Hq, split]. next: the thread's next item, or NULL. */
#define DEFINE_ITEM(SUFFIX, T)                                                                                \
static void item_##SUFFIX(const Work *w, int it, const Item *next, float *qf, float *scores) {               \
    const Item *x = &w->items[it];                                                                            \
    const int Hq = w->Hq, G = w->G, D = w->D, BS = w->BS, row = w->row, split = w->split;                     \
    const int len = x->stop - x->start, lines = (BS * row * (int)sizeof(T) + 63) / 64;                        \
    float *m = w->part + (size_t)it * Hq * (D + 2), *l = m + Hq, *acc = l + Hq;                               \
    const T *q = (const T *)w->q + (size_t)x->b * Hq * D;                                                     \
    for (int i = 0; i < Hq * D; i++) qf[i] = from_##SUFFIX(q[i]) * w->scale;                                  \
    for (int pass = 0; pass < 2; pass++) {                                                                    \
        const void *cache = pass == 0 ? w->k : w->v;                                                          \
        if (pass == 1) memset(acc, 0, sizeof(float) * (size_t)Hq * D);                                        \
        for (int blk = x->start / BS; blk * BS < x->stop; blk++) {                                            \
            const int t0 = (x->start > blk * BS ? x->start : blk * BS) - blk * BS;                            \
            const int t1 = (x->stop < (blk + 1) * BS ? x->stop : (blk + 1) * BS) - blk * BS;                  \
            const T *kv = (const T *)block_of(w, cache, x, blk * BS, sizeof(T));                              \
            const char *ahead = (blk + 1) * BS < x->stop ? block_of(w, cache, x, (blk + 1) * BS, sizeof(T))   \
                              : pass == 0 ? block_of(w, w->v, x, x->start, sizeof(T))                         \
                              : next ? block_of(w, w->k, next, next->start, sizeof(T)) : NULL;                \
            const int i0 = blk * BS + t0 - x->start;                                                          \
            if (pass == 0) {                                                                                  \
                for (int t = t0; t < t1; t += 4) {                                                            \
                    const int n = t1 - t < 4 ? t1 - t : 4;                                                    \
                    for (int kh = 0; kh < w->Hk; kh++) {                                                      \
                        prefetch_share(ahead, (t - t0) / 4 * w->Hk + kh, (t1 - t0 + 3) / 4 * w->Hk, lines);   \
                        qk_##SUFFIX(scores + (size_t)kh * G * split + i0 + t - t0, split, qf + (size_t)kh * G * D, \
                                    q + (size_t)kh * G * D, w->scale, kv + (size_t)t * row + (size_t)kh * D, row, \
                                    n, G, D);                                                                 \
                    }                                                                                         \
                }                                                                                             \
            } else {                                                                                          \
                for (int kh = 0; kh < w->Hk; kh++)                                                            \
                    pv_##SUFFIX(acc + (size_t)kh * G * D, scores + (size_t)kh * G * split + i0, split,        \
                                kv + (size_t)t0 * row + (size_t)kh * D, row, t1 - t0, G, D,                   \
                                ahead, kh * (t1 - t0), w->Hk * (t1 - t0), lines);                             \
            }                                                                                                 \
        }                                                                                                     \
        if (pass == 0)                                                                                        \
            for (int h = 0; h < Hq; h++) {                                                                    \
                float *sh = scores + (size_t)h * split, mx = -INFINITY, sum = 0.0f;                           \
                if (w->softcap > 0.0f)                                                                        \
                    for (int i = 0; i < len; i++) sh[i] = w->softcap * tanhf(sh[i] / w->softcap);             \
                for (int i = 0; i < len; i++) mx = sh[i] > mx ? sh[i] : mx;                                   \
                for (int i = 0; i < len; i++) sh[i] = exp_nonpos(sh[i] - mx);                                 \
                sum = sum_fixed(sh, len);                                                                     \
                m[h] = mx;                                                                                    \
                l[h] = sum;                                                                                   \
            }                                                                                                 \
    }                                                                                                         \
}

/* out[b, h] = sum over b's items s of e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s */
#define DEFINE_COMBINE(SUFFIX, T)                                                                             \
static void combine_##SUFFIX(const Work *w, int first, int last, T *out) {                                  \
    const int Hq = w->Hq, D = w->D;                                                                           \
    float o[MAX_HEAD_DIM];                                                                                    \
    for (int h = 0; h < Hq; h++) {                                                                            \
        float M = -INFINITY, den = 0.0f;                                                                      \
        for (int it = first; it < last; it++) {                                                               \
            const float mi = w->part[(size_t)it * Hq * (D + 2) + h];                                          \
            M = mi > M ? mi : M;                                                                              \
        }                                                                                                     \
        for (int d = 0; d < D; d++) o[d] = 0.0f;                                                              \
        for (int it = first; it < last; it++) {                                                               \
            if (w->items[it].stop == w->items[it].start) continue;                                            \
            const float *pm = w->part + (size_t)it * Hq * (D + 2);                                            \
            const float c = exp_nonpos(pm[h] - M), *ah = pm + 2 * Hq + (size_t)h * D;                         \
            den += c * pm[Hq + h];                                                                            \
            for (int d = 0; d < D; d++) o[d] += c * ah[d];                                                    \
        }                                                                                                     \
        const float inv = den > 0.0f ? 1.0f / den : 0.0f;                                                     \
        T *oh = out + (size_t)h * D;                                                                          \
        for (int d = 0; d < D; d++) oh[d] = to_##SUFFIX(o[d] * inv);                                          \
    }                                                                                                         \
}

/* The entry point for one cache dtype: 0, or -1 when scratch could not be allocated. */
#define DEFINE_DECODE(NAME, SUFFIX, T)                                                                            \
int decode_attention_##NAME(const T *q, const T *k, const T *v, const int32_t *tables, int64_t table_stride, \
                              const int32_t *seq_lens, T *out, int B, int Hq, int Hk, int D, int BS, int window, \
                              float scale, float softcap, int threads, int fixed_split) {                     \
    if (B <= 0) return 0;                                                                                     \
    if (D > MAX_HEAD_DIM || Hk <= 0 || Hq % Hk || fixed_split < 0 || fixed_split > SPLIT_MAX) return -2;      \
    Item *items = NULL;                                                                                       \
    int split = 0;                                                                                            \
    const int n = plan_items(seq_lens, B, window, threads, fixed_split, &items, &split);                      \
    if (n < 0) return -1;                                                                                     \
    float *part = malloc(sizeof(float) * (size_t)n * Hq * (D + 2));                                          \
    if (!part) { free(items); return -1; }                                                                    \
    const Work w = {q, k, v, tables, table_stride, items, Hq, Hk, Hq / Hk, D, BS, Hk * D, split, scale,      \
                    softcap, part};                                                                           \
    long total = 0;                                                                                           \
    for (int i = 0; i < n; i++) total += items[i].stop - items[i].start;                                     \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel num_threads(threads)")                                                              \
    {                                                                                                         \
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();                                       \
        const int lo = first_item(items, n, t, nt, total), hi = first_item(items, n, t + 1, nt, total);       \
        float *qf = malloc(sizeof(float) * ((size_t)Hq * D + (size_t)Hq * split));                            \
        if (!qf) {                                                                                            \
            _Pragma("omp atomic write")                                                                       \
            failed = 1;                                                                                       \
        } else                                                                                                \
            for (int it = lo; it < hi; it++)                                                                  \
                item_##SUFFIX(&w, it, it + 1 < hi ? &items[it + 1] : NULL, qf, qf + (size_t)Hq * D);          \
        free(qf);                                                                                             \
        _Pragma("omp barrier")                                                                                \
        /* a sequence's items are consecutive: split the sequences between the threads */                    \
        if (!failed) {                                                                                        \
            const int b0 = (int)((long)B * t / nt), b1 = (int)((long)B * (t + 1) / nt);                       \
            int it = 0;                                                                                       \
            while (it < n && items[it].b < b0) it++;                                                          \
            for (int b = b0; b < b1; b++) {                                                                   \
                const int first = it;                                                                         \
                while (it < n && items[it].b == b) it++;                                                      \
                combine_##SUFFIX(&w, first, it, out + (size_t)b * Hq * D);                                    \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    free(items);                                                                                              \
    free(part);                                                                                               \
    return failed ? -1 : 0;                                                                                   \
}

DEFINE_ITEM(f32, float)
DEFINE_ITEM(bf16, uint16_t)
DEFINE_ITEM(f16, _Float16)
DEFINE_COMBINE(f32, float)
DEFINE_COMBINE(bf16, uint16_t)
DEFINE_COMBINE(f16, _Float16)
DEFINE_DECODE(float32, f32, float)
DEFINE_DECODE(bfloat16, bf16, uint16_t)
DEFINE_DECODE(float16, f16, _Float16)

/* ---------------------------------------------------------------------------------------------------------------
   Prefill attention in place (AVX-512; head_dim a multiple of 16; arithmetic in float32 whatever the cache's type).

   q, out   [T, Hq, D]          the step's rows; chunk c's queries are rows [starts[c], starts[c + 1])
   k, v     [NB, BS, Hk, D]     the layer's cache, this step's keys already written
   tables   [n, W] int32        each chunk's blocks;  seq_lens [n]: its keys, the chunk's own included

   The query at position p of its sequence sees keys [0, p] (positions: the chunk's last query is seq_len - 1):
   the context and the chunk's own keys in one pass, causal, no merge. Work item: (KV head, chunk, tile of
   PF_ROWS rows), a row one (query, head) of the KV head's G; the threads take items in turn. A thread copies its
   (KV head, chunk)'s keys into panels [keys / 32][D][32] and its values into rows [keys][D] (as far as its items
   need; the next chunk keeps the keys of the blocks both share, a common prefix), then each tile runs a flash
   loop over panels of 32 keys from key 0: scores in registers (12 rows x 32 keys), an online softmax, the
   values' weighted sum. A row's sums run in an order fixed by its own keys:
   its bits do not depend on the chunking, the batch or the threads. */
#if defined(__AVX512F__)
#define PF_ROWS 12
#define PF_KEYS 32
#define PREFILL_MAX_KEYS 65536   /* a thread's copies: 2 * keys * D floats (python/cpu_attention.py checks) */

/* exp(x) for x <= 0, 16 lanes: exp_nonpos's reduction and polynomial */
static inline __m512 exp16_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* A thread's copy of one (chunk, KV head)'s keys and values in float32, filled up to `ready` keys (a multiple
   of 32, the last panel's keys past seq_len zero: they are masked, and a zero value times a zero weight adds
   nothing). */
typedef struct { int chunk, kh, ready; float *kt, *vr; } PrefillCopy;

/* The keys of c->chunk's copy that chunk c can keep: those in the leading blocks both tables share (a shared
   prefix: the same physical blocks, the same keys), below both sequences' lengths. */
static int prefill_copy_kept(const PrefillCopy *c, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                             int chunk, int BS) {
    if (c->chunk < 0) return 0;
    const int32_t *a = tables + (int64_t)c->chunk * table_stride, *b = tables + (int64_t)chunk * table_stride;
    const int lo = seq_lens[c->chunk] < seq_lens[chunk] ? seq_lens[c->chunk] : seq_lens[chunk];
    int keys = 0;
    while (keys < lo && a[keys / BS] == b[keys / BS]) keys += BS;
    keys = keys < lo ? keys : lo;
    return keys < c->ready ? keys : c->ready;
}

#define DEFINE_PREFILL_COPY(SUFFIX, T)                                                                        \
static void prefill_copy_##SUFFIX(PrefillCopy *c, const T *k, const T *v, const int32_t *table, int seq_len,  \
                                  int need, int BS, int Hk, int D) {                                         \
    const int row = Hk * D;                                                                                   \
    for (int t = c->ready; t < need; t++) {                                                                   \
        float *kp = c->kt + (size_t)(t / PF_KEYS) * D * PF_KEYS + t % PF_KEYS, *vp = c->vr + (size_t)t * D;   \
        if (t < seq_len) {                                                                                    \
            const size_t slot = (size_t)table[t / BS] * BS + t % BS;                                          \
            const T *kr = k + slot * row + (size_t)c->kh * D, *vs = v + slot * row + (size_t)c->kh * D;       \
            for (int d = 0; d < D; d++) kp[(size_t)d * PF_KEYS] = from_##SUFFIX(kr[d]);                       \
            for (int d = 0; d < D; d++) vp[d] = from_##SUFFIX(vs[d]);                                         \
        } else {                                                                                              \
            for (int d = 0; d < D; d++) kp[(size_t)d * PF_KEYS] = 0.0f;                                       \
            memset(vp, 0, sizeof(float) * (size_t)D);                                                         \
        }                                                                                                     \
    }                                                                                                         \
    if (need > c->ready) c->ready = need;                                                                     \
}

/* One tile: R (<= PF_ROWS) rows of queries qs [PF_ROWS][D] (scaled; rows past R repeat the last), row r seeing
   keys [0, last[r]]; leaves o[r] = softmax(scores) . values. */
static void prefill_tile(const float *qs, const int *last, int R, const float *kt, const float *vr, int D, float *o,
                         float *p) {
    float m[PF_ROWS], l[PF_ROWS], corr[PF_ROWS];
    for (int r = 0; r < PF_ROWS; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(o, 0, sizeof(float) * PF_ROWS * (size_t)D);
    const int kmax = last[R - 1];
    for (int p0 = 0; p0 <= kmax; p0 += PF_KEYS) {
        const float *panel = kt + (size_t)(p0 / PF_KEYS) * D * PF_KEYS;
        __m512 s[PF_ROWS][2];
        for (int r = 0; r < PF_ROWS; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 k0 = _mm512_loadu_ps(panel + (size_t)d * PF_KEYS);
            const __m512 k1 = _mm512_loadu_ps(panel + (size_t)d * PF_KEYS + 16);
#pragma GCC unroll 12
            for (int r = 0; r < PF_ROWS; r++) {
                const __m512 qb = _mm512_set1_ps(qs[(size_t)r * D + d]);
                s[r][0] = _mm512_fmadd_ps(qb, k0, s[r][0]);
                s[r][1] = _mm512_fmadd_ps(qb, k1, s[r][1]);
            }
        }
        for (int r = 0; r < PF_ROWS; r++) {
            const int seen = last[r] - p0 + 1;        /* keys of this panel row r sees */
            const __mmask16 v0 = seen >= 16 ? 0xffff : seen > 0 ? (__mmask16)((1u << seen) - 1) : 0;
            const __mmask16 v1 = seen >= 32 ? 0xffff : seen > 16 ? (__mmask16)((1u << (seen - 16)) - 1) : 0;
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, v0, s[r][0]),
                                                                _mm512_mask_mov_ps(ninf, v1, s[r][1])));
            const float mnew = mx > m[r] ? mx : m[r];
            corr[r] = m[r] == -INFINITY ? 0.0f : exp_nonpos(m[r] - mnew);
            const __m512 mv = _mm512_set1_ps(mnew);
            const __m512 e0 = _mm512_maskz_mov_ps(v0, exp16_nonpos(_mm512_sub_ps(s[r][0], mv)));
            const __m512 e1 = _mm512_maskz_mov_ps(v1, exp16_nonpos(_mm512_sub_ps(s[r][1], mv)));
            l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
            m[r] = mnew;
            _mm512_storeu_ps(p + r * PF_KEYS, e0);
            _mm512_storeu_ps(p + r * PF_KEYS + 16, e1);
        }
        const int nt = kmax - p0 + 1 < PF_KEYS ? kmax - p0 + 1 : PF_KEYS;
        const float *vpanel = vr + (size_t)p0 * D;
        for (int r0 = 0; r0 < PF_ROWS; r0 += 6)
            for (int d0 = 0; d0 < D; d0 += 64) {
                const int nv = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
                __m512 a[6][4];
#pragma GCC unroll 6
                for (int r = 0; r < 6; r++) {
                    const __m512 c = _mm512_set1_ps(corr[r0 + r]);
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++)
                        a[r][j] = j < nv ? _mm512_mul_ps(c, _mm512_loadu_ps(o + (size_t)(r0 + r) * D + d0 + 16 * j))
                                         : _mm512_setzero_ps();
                }
                for (int t = 0; t < nt; t++) {
                    __m512 x[4];
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++)
                        x[j] = j < nv ? _mm512_loadu_ps(vpanel + (size_t)t * D + d0 + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 6
                    for (int r = 0; r < 6; r++) {
                        const __m512 pb = _mm512_set1_ps(p[(r0 + r) * PF_KEYS + t]);
#pragma GCC unroll 4
                        for (int j = 0; j < 4; j++)
                            if (j < nv) a[r][j] = _mm512_fmadd_ps(pb, x[j], a[r][j]);
                    }
                }
#pragma GCC unroll 6
                for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++)
                        if (j < nv) _mm512_storeu_ps(o + (size_t)(r0 + r) * D + d0 + 16 * j, a[r][j]);
            }
    }
    for (int r = 0; r < R; r++) {
        const float inv = 1.0f / l[r];
        for (int d = 0; d < D; d++) o[(size_t)r * D + d] *= inv;
    }
}

/* 0; -1: scratch could not be allocated; -2: arguments the kernel does not take (the caller's torch path serves) */
#define DEFINE_PREFILL(NAME, SUFFIX, T)                                                                               \
int prefill_attention_##NAME(const T *q, const T *k, const T *v, const int32_t *tables, int64_t table_stride,         \
                             const int32_t *starts, const int32_t *seq_lens, T *out, int n, int Hq, int Hk, int D,    \
                             int BS, float scale, int threads) {                                                      \
    if (n <= 0) return 0;                                                                                             \
    if (D % 16 || D <= 0 || Hk <= 0 || Hq % Hk) return -2;                                                            \
    const int G = Hq / Hk;                                                                                            \
    int max_keys = 0;                                                                                                 \
    for (int c = 0; c < n; c++) {                                                                                     \
        const int L = starts[c + 1] - starts[c];                                                                      \
        if (L <= 0 || seq_lens[c] < L || seq_lens[c] > PREFILL_MAX_KEYS) return -2;                                   \
        max_keys = seq_lens[c] > max_keys ? seq_lens[c] : max_keys;                                                   \
    }                                                                                                                 \
    /* items: (KV head, chunk, tile) in that order; tile_start[c]: the chunk's first among a KV head's tiles */       \
    long *tile_start = malloc(sizeof(long) * (size_t)(n + 1));                                                        \
    if (!tile_start) return -1;                                                                                       \
    tile_start[0] = 0;                                                                                                \
    for (int c = 0; c < n; c++)                                                                                       \
        tile_start[c + 1] = tile_start[c] + ((long)(starts[c + 1] - starts[c]) * G + PF_ROWS - 1) / PF_ROWS;          \
    const long per_head = tile_start[n], items = per_head * Hk;                                                       \
    const int padded = (max_keys + PF_KEYS - 1) / PF_KEYS * PF_KEYS;                                                  \
    int failed = 0;                                                                                                   \
    _Pragma("omp parallel num_threads(threads)")                                                                      \
    {                                                                                                                 \
        PrefillCopy cp = {-1, -1, 0, NULL, NULL};                                                                     \
        float *kt = malloc(sizeof(float) * (size_t)padded * D), *vr = malloc(sizeof(float) * (size_t)padded * D);     \
        float *qs = malloc(sizeof(float) * (size_t)PF_ROWS * D * 2 + sizeof(float) * PF_ROWS * PF_KEYS);              \
        if (!kt || !vr || !qs) {                                                                                      \
            _Pragma("omp atomic write")                                                                           \
            failed = 1;                                                                                               \
        }                                                                                                             \
        cp.kt = kt;                                                                                                   \
        cp.vr = vr;                                                                                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                                   \
        for (long it = 0; it < items; it++) {                                                                         \
            if (failed) continue;                                                                                     \
            const int kh = (int)(it / per_head);                                                                      \
            const long at = it % per_head;                                                                            \
            int c = 0;                                                                                                \
            while (tile_start[c + 1] <= at) c++;                                                                      \
            const int tile = (int)(at - tile_start[c]);                                                               \
            const int L = starts[c + 1] - starts[c], ctx = seq_lens[c] - L;                                           \
            const int f0 = tile * PF_ROWS, R = L * G - f0 < PF_ROWS ? L * G - f0 : PF_ROWS;                           \
            int last[PF_ROWS];                                                                                        \
            float *o = qs + (size_t)PF_ROWS * D, *p = o + (size_t)PF_ROWS * D;                                        \
            for (int r = 0; r < PF_ROWS; r++) {                                                                       \
                const int f = f0 + (r < R ? r : R - 1), pos = f / G, h = kh * G + f % G;                              \
                last[r] = ctx + pos;                                                                                  \
                const T *qr = q + ((size_t)(starts[c] + pos) * Hq + h) * D;                                           \
                for (int d = 0; d < D; d++) qs[(size_t)r * D + d] = from_##SUFFIX(qr[d]) * scale;                     \
            }                                                                                                         \
            if (cp.chunk != c || cp.kh != kh) {                                                                       \
                cp.ready = cp.kh == kh ? prefill_copy_kept(&cp, tables, table_stride, seq_lens, c, BS) : 0;           \
                cp.chunk = c;                                                                                         \
                cp.kh = kh;                                                                                           \
            }                                                                                                         \
            const int need = (last[R - 1] / PF_KEYS + 1) * PF_KEYS;                                                   \
            prefill_copy_##SUFFIX(&cp, k, v, tables + (int64_t)c * table_stride, seq_lens[c], need, BS, Hk, D);       \
            prefill_tile(qs, last, R, kt, vr, D, o, p);                                                               \
            for (int r = 0; r < R; r++) {                                                                             \
                const int f = f0 + r;                                                                                 \
                T *dst = out + ((size_t)(starts[c] + f / G) * Hq + kh * G + f % G) * D;                               \
                for (int d = 0; d < D; d++) dst[d] = to_##SUFFIX(o[(size_t)r * D + d]);                               \
            }                                                                                                         \
        }                                                                                                             \
        free(kt);                                                                                                     \
        free(vr);                                                                                                     \
        free(qs);                                                                                                     \
    }                                                                                                                 \
    free(tile_start);                                                                                                 \
    return failed ? -1 : 0;                                                                                           \
}

DEFINE_PREFILL_COPY(f32, float)
DEFINE_PREFILL_COPY(bf16, uint16_t)
DEFINE_PREFILL_COPY(f16, _Float16)
DEFINE_PREFILL(float32, f32, float)
DEFINE_PREFILL(bfloat16, bf16, uint16_t)
DEFINE_PREFILL(float16, f16, _Float16)
#endif
