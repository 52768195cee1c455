/* A float32 matmul on CPU over a weight packed once into panels (kernels/matmul/cpu_f32.py loads it):

       out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])

   x        [M, K] float32 rows (row stride ldx)
   panels   [ceil(N / 32)][K][32] float32: W's columns in panels of 32, zero past N (cpu_f32.pack_panels)
   bias     [ceil(N / 32) * 32] float32 (zero past N), or NULL
   out      [M, N] float32

   Threads split the panels; each streams its own once a call at any row count: a strip of up to 256 rows in
   blocks of up to 12, each block's sums in registers over a panel's k (columns() has the loops). At decode sizes
   oneDNN's float32 reads its packed weight well below the memory's rate: this ran 1.3-1.7x oneDNN's speed at
   one row, 1.0-1.4x at 4 to 16, 1.0-1.3x at 64 and 0.93-1.04x from 256 on the default model's and a 1B model's
   shapes (AMD EPYC Zen 4, 2 threads; RESULTS.md).

   Each out[m, n] is one FMA chain over k in order from zero: its bits do not depend on the rows beside it,
   the row blocks, the chunks of k or the threads (the batch-invariant property, at one row too). AVX-512
   only: f32_kernel_isa() is 0 elsewhere and f32_matmul returns -3 (the caller keeps oneDNN). */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define PW 32                    /* columns a panel: two zmm */
#define MR 12                    /* rows a micro-tile at most: 24 accumulators */
#define STRIP 256                /* rows a pass over the weight (2,048 rows as one pass ran at 0.75x oneDNN) */
#define A_BYTES (2 * 1024 * 1024)    /* x's chunk a pass takes: a strip's rows, as many k as fit (1 MB: 0.9x) */

/* C[0 .. mr, 0 .. 32] (+)= X[r][k] P[k][c] over kn k-values (X's rows ldx apart). first: from zero, else from C;
   bias (or NULL) added at the end. ahead: the first of `count` k-rows of another panel, `step` floats apart,
   prefetched into L2 one a k. mr a constant after inlining. */
static inline __attribute__((always_inline)) void micro(const float *X, int64_t ldx, const float *P, float *C,
                                                        const int mr, int kn, int first, const float *bias,
                                                        const float *ahead, int step, int count) {
    __m512 acc[MR][2];
    _Pragma("GCC unroll 12")
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(C + r * PW);
        acc[r][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(C + r * PW + 16);
    }
    for (int k = 0; k < kn; k++, P += PW) {
        const __m512 w0 = _mm512_load_ps(P), w1 = _mm512_load_ps(P + 16);
        if (k < count) {
            _mm_prefetch((const char *)(ahead + (size_t)k * step), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + (size_t)k * step + 16), _MM_HINT_T1);
        }
        _Pragma("GCC unroll 12")
        for (int r = 0; r < mr; r++) {
            const __m512 xb = _mm512_set1_ps(X[(size_t)r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12")
    for (int r = 0; r < mr; r++) {
        _mm512_store_ps(C + r * PW, _mm512_add_ps(acc[r][0], b0));
        _mm512_store_ps(C + r * PW + 16, _mm512_add_ps(acc[r][1], b1));
    }
}

static void micro_any(const float *X, int64_t ldx, const float *P, float *C, int mr, int kn, int first,
                      const float *bias, const float *ahead, int step, int count) {
    switch (mr) {
    case 12: micro(X, ldx, P, C, 12, kn, first, bias, ahead, step, count); break;
    case 11: micro(X, ldx, P, C, 11, kn, first, bias, ahead, step, count); break;
    case 10: micro(X, ldx, P, C, 10, kn, first, bias, ahead, step, count); break;
    case 9: micro(X, ldx, P, C, 9, kn, first, bias, ahead, step, count); break;
    case 8: micro(X, ldx, P, C, 8, kn, first, bias, ahead, step, count); break;
    case 7: micro(X, ldx, P, C, 7, kn, first, bias, ahead, step, count); break;
    case 6: micro(X, ldx, P, C, 6, kn, first, bias, ahead, step, count); break;
    case 5: micro(X, ldx, P, C, 5, kn, first, bias, ahead, step, count); break;
    case 4: micro(X, ldx, P, C, 4, kn, first, bias, ahead, step, count); break;
    case 3: micro(X, ldx, P, C, 3, kn, first, bias, ahead, step, count); break;
    case 2: micro(X, ldx, P, C, 2, kn, first, bias, ahead, step, count); break;
    default: micro(X, ldx, P, C, 1, kn, first, bias, ahead, step, count); break;
    }
}

/* Row block b of M rows: blocks of near-equal size (16 rows run as 8 + 8, not 12 + 4). A row's sum does not
   depend on its block. */
static inline void block_of(int M, int b, int *start, int *size) {
    const int blocks = (M + MR - 1) / MR;
    *start = M * b / blocks;
    *size = M * (b + 1) / blocks - *start;
}

/* Panels [p0, p1) over the k-values [c0, c1) of M rows of X (row stride ldx, at k = c0): each block of rows runs
   a panel's k-values with its sums in registers (steps of 128 k, the sums in memory between, ran 0.85-0.93x),
   reading them from L2, where the blocks over the panel before prefetched them, each a share of its k-rows.
   Each out[m, n]: one FMA chain over k in order, continued from out where c0 > 0. */
static void columns(const float *X, int64_t ldx, const float *panels, const float *bias, float *out, int M, int N,
                    int K, int c0, int c1, int p0, int p1, float *C) {
    const int blocks = (M + MR - 1) / MR, kw = c1 - c0;
    for (int p = p0; p < p1; p++) {
        const int n = p * PW, width = N - n < PW ? N - n : PW;     /* the last panel may be short */
        const float *P = panels + ((size_t)p * K + c0) * PW;
        const float *next = panels + ((size_t)(p + 1) * K + c0) * PW;
        for (int b = 0, m, mr; b < blocks; b++) {
            block_of(M, b, &m, &mr);
            if (c0 > 0)
                for (int r = 0; r < mr; r++)
                    memcpy(C + (size_t)r * PW, out + (size_t)(m + r) * N + n, (size_t)width * 4);
            /* the next panel's k-rows b, b + blocks, ... into L2 */
            micro_any(X + (size_t)m * ldx, ldx, P, C, mr, kw, c0 == 0, c1 == K && bias ? bias + n : NULL,
                      next + (size_t)b * PW, blocks * PW, p + 1 < p1 ? (kw - b + blocks - 1) / blocks : 0);
            for (int r = 0; r < mr; r++)
                memcpy(out + (size_t)(m + r) * N + n, C + (size_t)r * PW, (size_t)width * 4);
        }
    }
}

/* Whether a block's rows at this stride crowd an L1 set (32 KB, 8 ways of 64 sets) past 6 of its ways: then x is
   copied to a stride that spreads them (rows 8 KB apart, as a 2,048-wide model's are, all fall in one set;
   1,536 floats apart, 6 do, and copying them ran 0.95x reading them in place). */
static int crowded(int64_t ldx) {
    int hits[64] = {0}, most = 0;
    for (int r = 0; r < MR; r++) {
        const int set = (int)(((uint64_t)r * (uint64_t)ldx * 4 / 64) % 64);
        if (++hits[set] > most) most = hits[set];
    }
    return most > 6;
}

int f32_kernel_isa(void) { return 1; }

/* Threads split the panels; strips of up to STRIP rows, each over chunks of k whose rows fit A_BYTES. Where
   the rows crowd L1 (crowded), each chunk of x is first copied into A at row stride kc + 16, the threads
   sharing the copy. */
int f32_matmul(const float *x, int64_t ldx, const float *panels, const float *bias, float *out, int M, int N, int K,
               int threads) {
    if (M < 1 || N < 1 || K < 1 || ldx < K || ((uintptr_t)panels & 63)) return -1;
    const int count = (N + PW - 1) / PW, strip = M < STRIP ? M : STRIP, copy = M > 1 && crowded(ldx);
    int kc = A_BYTES / 4 / strip / 16 * 16;     /* at least 2,048 */
    if (kc > K) kc = K;
    float *A = copy ? aligned_alloc(64, ((size_t)strip * (kc + 16) * 4 + 63) / 64 * 64) : NULL;
    if (copy && !A) return -2;
    if (threads > count) threads = count;
    if (threads < 1) threads = 1;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|:failed)")
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((long)count * t / nt), p1 = (int)((long)count * (t + 1) / nt);
        float *C = aligned_alloc(64, (size_t)MR * PW * 4);
        failed = !C;
        for (int m0 = 0; m0 < M; m0 += STRIP) {
            const int rows = M - m0 < STRIP ? M - m0 : STRIP;
            for (int c0 = 0; c0 < K; c0 += kc) {
                const int c1 = c0 + kc < K ? c0 + kc : K;
                if (copy) {
                    _Pragma("omp for schedule(static)")
                    for (int m = 0; m < rows; m++)
                        memcpy(A + (size_t)m * (kc + 16), x + (size_t)(m0 + m) * ldx + c0, (size_t)(c1 - c0) * 4);
                }
                if (C)
                    columns(copy ? A : x + (size_t)m0 * ldx + c0, copy ? kc + 16 : ldx, panels, bias,
                            out + (size_t)m0 * N, rows, N, K, c0, c1, p0, p1, C);
                if (copy) {
                    _Pragma("omp barrier")      /* every thread done with A before the next chunk's copy */
                }
            }
        }
        free(C);
    }
    free(A);
    return failed ? -2 : 0;
}
#else
int f32_kernel_isa(void) { return 0; }

int f32_matmul(const float *x, int64_t ldx, const float *panels, const float *bias, float *out, int M, int N, int K,
               int threads) {
    (void)x; (void)ldx; (void)panels; (void)bias; (void)out; (void)M; (void)N; (void)K; (void)threads;
    return -3;
}
#endif
