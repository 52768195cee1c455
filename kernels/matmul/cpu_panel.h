/* The panel path of the CPU weight kernels (cpu_int4.c, cpu_int8.c): a float32 GEMM whose packing step is the
   weight's dequantization. A kernel decodes KB k-values of PW = 32 columns into a float panel P[k][32] (its own
   widening; this header's load_transposed turns 16 rows of 64 bytes into dwords of 16 columns), then panel_rows
   runs every block of up to PR activation rows over it as an outer product: per k, two weight vectors and one
   broadcast a row feed two FMAs a row. A weight is decoded once per SLAB rows (the tile loops decode it once per 8), and
   no horizontal sum is left. Each out[m, n] is one FMA chain over k in order (panel_columns says how the
   copies keep it so). AVX-512 only; included where the kernels' AVX-512 loops are compiled. */
#ifndef JOBRUNNER_CPU_PANEL_H
#define JOBRUNNER_CPU_PANEL_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PW 32     /* columns a panel: two zmm */
#define PR 12     /* activation rows a micro-tile at most: 24 accumulators */
#define SLAB 128  /* rows a pass over the panels: a panel's out tile C (16 KB) stays in L1 (384: 0.85-0.9x) */
#define X_CHUNK (256 * 1024)    /* bytes of x a pass over the panels reads: they stay in L2 for the next panel */

/* k-values a pass over the panels takes: a multiple of kb whose M rows of x fit X_CHUNK (kb at least). Panels
   inside a chunk, chunks outside: a panel walking all of K would read M x K of x from memory again each panel
   (12 MB at 384 rows of a 1B model's down projection). */
static inline int panel_chunk(int M, int kb) {
    const int kc = X_CHUNK / (4 * (M > 0 ? M : 1)) / kb * kb;
    return kc < kb ? kb : kc;
}

static inline void transpose16(__m512i *r) {     /* r[i] dword j -> r[j] dword i */
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]); }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]); r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88); t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88); t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) { r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88); r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd); }
}

/* 64 bytes of each of 16 rows (row stride `stride`, `left` bytes of each before its end), transposed: r[u] holds
   bytes 4u..4u+3 of the 16 rows. The rows' bytes 128 on are prefetched into L1 and 512 on into L2: 32 rows a
   panel are more streams than the hardware prefetcher follows (+3-8% at 24-64 rows on a 1B model's shapes for
   the first, +2-8% more at 16-64 for the second in int8; 256 and 512 ahead into L1 gained less). */
static inline __attribute__((always_inline)) void load_transposed(const uint8_t *rows, size_t stride, int left,
                                                                 __m512i *r) {
    const __mmask64 m = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    _Pragma("GCC unroll 16")
    for (int c = 0; c < 16; c++) {
        r[c] = _mm512_maskz_loadu_epi8(m, rows + (size_t)c * stride);
        if (left > 128) _mm_prefetch((const char *)(rows + (size_t)c * stride + 128), _MM_HINT_T0);
        if (left > 512) _mm_prefetch((const char *)(rows + (size_t)c * stride + 512), _MM_HINT_T1);
    }
    transpose16(r);
}

/* out[0 .. mr, 0 .. 32] (+)= X[r][k] P[k][c] over kn k-values (X: the rows' first k of the panel, row stride ldx;
   out row stride ldo). first: start from zero, else from out. The last panel of k passes scale (32 columns'
   factors, or NULL) and bias (or NULL): out = acc * scale + bias. mr a constant after inlining. */
static inline __attribute__((always_inline)) void panel_micro(const float *X, int64_t ldx, const float *P,
                                                              float *out, int64_t ldo, const int mr, int kn,
                                                              int first, const float *scale, const float *bias) {
    __m512 acc[PR][2];
    _Pragma("GCC unroll 12")
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)r * ldo);
        acc[r][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (size_t)r * ldo + 16);
    }
    for (int k = 0; k < kn; k++) {
        const __m512 w0 = _mm512_load_ps(P + (size_t)k * PW), w1 = _mm512_load_ps(P + (size_t)k * PW + 16);
        _Pragma("GCC unroll 12")
        for (int r = 0; r < mr; r++) {
            const __m512 xb = _mm512_set1_ps(X[(size_t)r * ldx + k]);
            acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    const __m512 s0 = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);
    const __m512 s1 = scale ? _mm512_loadu_ps(scale + 16) : _mm512_set1_ps(1.0f);
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12")
    for (int r = 0; r < mr; r++) {
        float *o = out + (size_t)r * ldo;
        _mm512_storeu_ps(o, scale ? _mm512_fmadd_ps(acc[r][0], s0, b0) : _mm512_add_ps(acc[r][0], b0));
        _mm512_storeu_ps(o + 16, scale ? _mm512_fmadd_ps(acc[r][1], s1, b1) : _mm512_add_ps(acc[r][1], b1));
    }
}

/* M rows over the panel P in ceil(M / PR) blocks of near-equal size: panel_micro's arguments, X and out at
   row 0. A row's sum does not depend on its block. */
static inline void panel_rows(const float *X, int64_t ldx, const float *P, float *out, int64_t ldo, int M, int kn,
                              int first, const float *scale, const float *bias) {
    const int tiles = (M + PR - 1) / PR;
    for (int t = 0, m = 0; t < tiles; t++) {
        const int mr = (M - m) / (tiles - t);    /* balanced: 16 rows run as 8 + 8, not 12 + 4 */
        const float *x = X + (size_t)m * ldx;
        float *o = out + (size_t)m * ldo;
        m += mr;
        switch (mr) {
        case 12: panel_micro(x, ldx, P, o, ldo, 12, kn, first, scale, bias); break;
        case 11: panel_micro(x, ldx, P, o, ldo, 11, kn, first, scale, bias); break;
        case 10: panel_micro(x, ldx, P, o, ldo, 10, kn, first, scale, bias); break;
        case 9: panel_micro(x, ldx, P, o, ldo, 9, kn, first, scale, bias); break;
        case 8: panel_micro(x, ldx, P, o, ldo, 8, kn, first, scale, bias); break;
        case 7: panel_micro(x, ldx, P, o, ldo, 7, kn, first, scale, bias); break;
        case 6: panel_micro(x, ldx, P, o, ldo, 6, kn, first, scale, bias); break;
        case 5: panel_micro(x, ldx, P, o, ldo, 5, kn, first, scale, bias); break;
        case 4: panel_micro(x, ldx, P, o, ldo, 4, kn, first, scale, bias); break;
        case 3: panel_micro(x, ldx, P, o, ldo, 3, kn, first, scale, bias); break;
        case 2: panel_micro(x, ldx, P, o, ldo, 2, kn, first, scale, bias); break;
        default: panel_micro(x, ldx, P, o, ldo, 1, kn, first, scale, bias); break;
        }
    }
}

/* What a kernel hands the driver: its rows and output, and three functions over its own problem (`kernel`). */
typedef struct {
    const float *x; int64_t ldx;          /* M rows of K */
    float *out;                           /* M rows of N */
    int M, N, K, kb;                      /* kb: k-values a decoded panel (a multiple of 4) */
    const float *bias;                    /* [N] or NULL */
    const void *kernel;
    void (*decode)(const void *kernel, int n, int k0, float *P);     /* columns [n, n + PW) at k0 into P[k][PW] */
    int (*scale)(const void *kernel, int n, float *scale);           /* their factors into scale[PW]: 1, or 0 none */
    void (*tile)(const void *kernel, int m0, int rows, int n0, int n1);   /* the tile loop over rows and columns */
} PanelJob;

/* Whole panels [n0, n1) over rows [m0, m0 + M). x is copied a chunk at a time into A at row stride kc + 16, so no
   two rows of a micro-tile share an L1 set (x's rows lie a power of two apart in most models: at 8 KB, 12 rows
   thrash an 8-way L1); each panel's out tile is accumulated in C (M x PW, contiguous, for the same reason: out's
   rows 32 KB apart ran the path at 0.75x its rate) and copied out at a chunk's end, so every out[m, n] is one FMA
   chain over k in order whatever the chunk size. */
static void panel_columns(const PanelJob *j, int m0, int M, int n0, int n1, float *A, float *C, int kc) {
    float P[256 * PW] __attribute__((aligned(64)));      /* kb <= 256 */
    float scale[PW];
    const float *x = j->x + (size_t)m0 * j->ldx;
    float *out = j->out + (size_t)m0 * j->N;
    const int lda = kc + 16;
    for (int c0 = 0; c0 < j->K; c0 += kc) {
        const int c1 = c0 + kc < j->K ? c0 + kc : j->K, final = c1 == j->K;
        for (int m = 0; m < M; m++) memcpy(A + (size_t)m * lda, x + (size_t)m * j->ldx + c0, (size_t)(c1 - c0) * 4);
        for (int n = n0; n < n1; n += PW) {
            if (c0 > 0)
                for (int m = 0; m < M; m++) memcpy(C + (size_t)m * PW, out + (size_t)m * j->N + n, PW * 4);
            const int scaled = final && j->scale && j->scale(j->kernel, n, scale);
            for (int k0 = c0; k0 < c1; k0 += j->kb) {
                const int kn = c1 - k0 < j->kb ? c1 - k0 : j->kb, last = final && k0 + j->kb >= c1;
                j->decode(j->kernel, n, k0, P);
                panel_rows(A + (k0 - c0), lda, P, C, PW, M, kn, k0 == 0, last && scaled ? scale : NULL,
                           last && j->bias ? j->bias + n : NULL);
            }
            for (int m = 0; m < M; m++) memcpy(out + (size_t)m * j->N + n, C + (size_t)m * PW, PW * 4);
        }
    }
}

/* The job over `threads` threads: each a run of whole panels, over slabs of SLAB rows; the last thread also runs
   the columns past the last whole panel through the tile loop. Without memory for A and C, the tile loop. */
static void panel_run(const PanelJob *j, int threads) {
    const int whole = j->N / PW, rows = j->M < SLAB ? j->M : SLAB;
    const int kc = panel_chunk(rows, j->kb);
    if (threads < 1) threads = 1;
    if (whole < threads) threads = whole;
    _Pragma("omp parallel num_threads(threads)")
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int n0 = (int)((long)whole * t / nt) * PW, n1 = (int)((long)whole * (t + 1) / nt) * PW;
        float *A = aligned_alloc(64, ((size_t)rows * (kc + 16) * 4 + 63) / 64 * 64);
        float *C = aligned_alloc(64, (size_t)rows * PW * 4);
        for (int m0 = 0; m0 < j->M; m0 += SLAB) {
            const int M = j->M - m0 < SLAB ? j->M - m0 : SLAB;
            if (A && C) panel_columns(j, m0, M, n0, n1, A, C, kc);
            else j->tile(j->kernel, m0, M, n0, n1);
            if (t == nt - 1 && whole * PW < j->N) j->tile(j->kernel, m0, M, whole * PW, j->N);
        }
        free(A);
        free(C);
    }
}
#endif
