/* A float32 matmul on CPU over a weight packed once into panels (kernels/matmul/cpu_f32.py loads it):

       out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])

   x        [M, K] float32 rows (row stride ldx)
   panels   [ceil(N / 32)][K][32] float32: W's columns in panels of 32, zero past N (f32_pack_panels in Python)
   bias     [ceil(N / 32) * 32] float32 (zero past N), or NULL
   out      [M, N] float32

   cpu_panel.h's micro-tile with no decode: each panel is read where it lies, and every block of up to 12 rows
   runs its outer product over 128 k of it while they are in L1; threads split the panels, so each streams its
   own once a call at any row count (columns() has the loops). At decode sizes oneDNN's float32 reads its
   packed weight at 60-80% of the memory's rate; this runs 1.1-2.5x faster there (RESULTS.md).

   Each out[m, n] is one FMA chain over k in order from zero: its bits do not depend on the rows beside it,
   the row blocks, the chunks of k or the threads (the batch-invariant property, at one row too). AVX-512
   only: f32_kernel_isa() is 0 elsewhere and f32_matmul returns -3 (the caller keeps oneDNN). */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_panel.h"     /* panel_rows, PW */

#define KB 128                   /* k-values of a panel a step: 16 KB, in L1 while the row blocks run over them */
#define ROWS 24                  /* rows a panel step runs: their x (12 KB) and the panel's 16 KB share L1 (64: 0.93-0.97x) */
#define STRIP 256                /* rows a pass over the weight: 2,048 rows as one pass ran at 0.75x oneDNN */
#define A_BYTES (1024 * 1024)    /* x's chunk a thread copies: a strip's rows, as many k as fit (KB at least) */

/* Panels [p0, p1) over every row. Loops: chunks of k (x's rows copied into A at stride kc + 16: rows a power of
   two apart would share L1 sets), panels, slabs of ROWS rows, steps of KB k. A panel's chunk (kc x 128 bytes)
   is read from memory once and stays in L2 while every slab runs over it; x's chunk is re-read from cache, once
   a panel. So the weight is read once a call whatever M. Each out[m, n]: one FMA chain over k in order. */
static void columns(const float *x, int64_t ldx, const float *panels, const float *bias, float *out, int M, int N,
                    int K, int p0, int p1, float *A, float *C, int kc) {
    const int lda = kc + 16;
    for (int c0 = 0; c0 < K; c0 += kc) {
        const int c1 = c0 + kc < K ? c0 + kc : K;
        for (int m = 0; m < M; m++) memcpy(A + (size_t)m * lda, x + (size_t)m * ldx + c0, (size_t)(c1 - c0) * 4);
        for (int p = p0; p < p1; p++) {
            const int n = p * PW, width = N - n < PW ? N - n : PW;     /* the last panel may be short */
            for (int m0 = 0; m0 < M; m0 += ROWS) {
                const int rows = M - m0 < ROWS ? M - m0 : ROWS;
                if (c0 > 0)
                    for (int m = 0; m < rows; m++)
                        memcpy(C + (size_t)m * PW, out + (size_t)(m0 + m) * N + n, (size_t)width * 4);
                for (int k0 = c0; k0 < c1; k0 += KB) {
                    const int kn = c1 - k0 < KB ? c1 - k0 : KB, last = c1 == K && k0 + KB >= c1;
                    const float *P = panels + ((size_t)p * K + k0) * PW;
                    panel_rows(A + (size_t)m0 * lda + (k0 - c0), lda, P, C, PW, rows, kn, k0 == 0, NULL,
                               last && bias ? bias + n : NULL, m0 == 0 ? P + (size_t)kn * PW : NULL);
                }
                for (int m = 0; m < rows; m++)
                    memcpy(out + (size_t)(m0 + m) * N + n, C + (size_t)m * PW, (size_t)width * 4);
            }
        }
    }
}

int f32_kernel_isa(void) { return 1; }

int f32_matmul(const float *x, int64_t ldx, const float *panels, const float *bias, float *out, int M, int N, int K,
               int threads) {
    if (M < 1 || N < 1 || K < 1 || ldx < K || ((uintptr_t)panels & 63)) return -1;
    const int count = (N + PW - 1) / PW, strip = M < STRIP ? M : STRIP;
    int kc = A_BYTES / 4 / strip / KB * KB;
    if (kc < KB) kc = KB;
    if (kc > K) kc = K;
    if (threads > count) threads = count;
    if (threads < 1) threads = 1;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|:failed)")
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *A = aligned_alloc(64, ((size_t)strip * (kc + 16) * 4 + 63) / 64 * 64);
        float *C = aligned_alloc(64, (size_t)ROWS * PW * 4);
        for (int m0 = 0; A && C && m0 < M; m0 += STRIP)
            columns(x + (size_t)m0 * ldx, ldx, panels, bias, out + (size_t)m0 * N, M - m0 < STRIP ? M - m0 : STRIP,
                    N, K, (int)((long)count * t / nt), (int)((long)count * (t + 1) / nt), A, C, kc);
        failed = !(A && C);
        free(A);
        free(C);
    }
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
