/* Group-wise int4 weights times bfloat16 activations on CPU through bfloat16 dot products (AVX512_BF16
   vdpbf16ps), the int4 library's bf16 form (built in with cpu_int4.c; cpu_int4.py: int4_bf16_matmul_cpu):

       out[m, n] = sum over groups g of  s[n, g] * D[m, n, g] + z[n, g] * X[m, g]   (+ bias[n])
       D[m, n, g] = sum_{k in g} x[m, k] * q[n, k],   X[m, g] = sum_{k in g} x[m, k]

   x [M, K] bfloat16; packed, scales, zeros as cpu_int4.c's (zeros NULL: symmetric, q taken as q - 8 and no X
   term); out [M, N] float32, or bfloat16 (out_bf16: rounded once, to nearest even, as torch rounds).

   Why it is the product up to float32 rounding: a nibble (0..15, or -8..7) is exactly a bfloat16, and the
   product of two bfloat16 is exact in float32, so vdpbf16ps (acc += a0 b0 + a1 b1 over bf16 pairs: 32 products
   an instruction, twice a float32 FMA's) sums exact products, and each group's sum is scaled once. The
   bfloat16 reference (the weight dequantized to bfloat16, F.linear) rounds every weight to 8 bits first; this
   never rounds the weight, so it is the closer of the two to the exact product.

   Pairs. Byte j of a group's packed bytes holds k = j (low nibble) and k = G/2 + j (high nibble), so the kernel
   pairs those two k: xi, a copy of x made per call, holds (x[k], x[k + G/2]) as one dword at the byte's index,
   and a weight dword is the byte's two nibbles looked up as bfloat16 (vpermw over a 32-word table: the index's
   bit 4 is ignored by repeating the 16 values). A panel is 64 bytes (128 k) of 32 columns: load_transposed
   (cpu_panel.h) turns 16 columns' 64 bytes into dwords of 16 columns, each dword 4 bytes, so a panel row of 16
   columns costs a vpmultishiftqb (where the CPU has VBMI; else two shifts and a blend) and the lookup. Then blocks of up to MR rows run an outer product over the
   panel, a group at a time: per pair, two weight vectors and a broadcast a row feed two vdpbf16ps a row; at
   the group's end the group sums are scaled into the row's totals. Each out[m, n] is one chain over the groups
   in order, whatever the rows beside it, the chunk or the threads. Threads split N in whole panels; x is read
   in chunks of k whose rows fit X_CHUNK, as cpu_panel.h's driver does. AVX512_BF16 only: int4_bf16_isa() is 0
   elsewhere and the call returns -3 (the caller widens to float32 and runs cpu_int4.c). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include "cpu_panel.h"     /* load_transposed, PW, SLAB, X_CHUNK */
#include "cpu_int4_scales.h"
#define HAVE_BF16 1
#define MR 6      /* rows a micro-tile: 12 group sums and 12 totals in registers */
#define PB 64     /* bytes (pairs) of a column a panel: 128 k */

typedef struct {
    const uint32_t *xi; int ldxi;          /* M rows of Kp / 2 pairs (row stride ldxi dwords) */
    const float *xsum; int groups;         /* [M, groups] X, or NULL (symmetric) */
    const uint8_t *packed; const void *scales, *zeros; int scale_f32;
    const float *bias; float *out;         /* float32 out, or the sums between chunks of k where out16 is set */
    uint16_t *out16;                       /* bfloat16 out, or NULL */
    int M, N, Kp, G;
} Bf16Problem;

/* The 16 bfloat16 values of a nibble, twice (vpermw reads 5 index bits; bit 4 is then ignored). */
static inline __m512i nibble_table(int symmetric) {
    const __m512i q = _mm512_and_si512(_mm512_setr_epi32(0x00010000, 0x00030002, 0x00050004, 0x00070006,
        0x00090008, 0x000b000a, 0x000d000c, 0x000f000e, 0x00010000, 0x00030002, 0x00050004, 0x00070006,
        0x00090008, 0x000b000a, 0x000d000c, 0x000f000e), _mm512_set1_epi16(15));
    const __m512i v = symmetric ? _mm512_sub_epi16(q, _mm512_set1_epi16(8)) : q;
    /* small integers as bfloat16: via float32's top half (exact) */
    const __m512i lo = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(v));
    const __m512i hi = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1));
    const __m512i flo = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(lo)), 16);
    const __m512i fhi = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(hi)), 16);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(flo)), _mm512_cvtepi32_epi16(fhi), 1);
}

/* Byte t of each dword of r as a vpermw index pair: its low nibble in the low word's bits 0..3, its high nibble
   in the high word's (the bits above them are ignored by the table's repetition, or zero). */
static inline __attribute__((always_inline)) __m512i nibble_pair(__m512i r, const int t) {
#if defined(__AVX512VBMI__)
    /* vpmultishiftqb: byte b of a qword takes the 8 bits at offset ctrl[b]: the low word's byte 8t on, the high
       word's 8t + 4 on, in each of the qword's two dwords */
    const long long lo = 8 * t, hi = 8 * t + 4;
    const long long ctrl = lo | hi << 16 | (lo + 32) << 32 | (hi + 32) << 48;
    return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(ctrl), r);
#else
    return _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(r, 8 * t), t < 2 ? _mm512_slli_epi32(r, 12 - 8 * t)
                                   : _mm512_srli_epi32(r, 8 * t - 12));
#endif
}

/* Columns [n0, n0 + 16) at bytes [b0, b0 + nb) into P[pair][c0 + 0..15] as bfloat16 pairs. */
static inline void decode16(const Bf16Problem *p, __m512i table, int n0, int b0, int nb, uint32_t *P, int c0) {
    const size_t rowb = (size_t)p->Kp / 2;
    __m512i r[16];                                       /* r[u]: bytes 4u..4u+3 of the 16 columns */
    load_transposed(p->packed + (size_t)n0 * rowb + b0, rowb, (int)rowb - b0, r);
    _Pragma("GCC unroll 16")
    for (int u = 0; u < 16; u++) {
        if (4 * u >= nb) break;
        _Pragma("GCC unroll 4")
        for (int t = 0; t < 4; t++)
            _mm512_store_si512(P + (size_t)(4 * u + t) * PW + c0,
                               _mm512_permutexvar_epi16(nibble_pair(r[u], t), table));
    }
}

/* rows [0, mr) of xi (at the panel's first pair) over the panel's nb pairs: groups of gp pairs, their scales
   S[g][32] and Z[g][32]; totals in C (row stride PW), from zero where first; X: the rows' group sums at the
   panel's first group. mr a constant after inlining. */
static inline __attribute__((always_inline)) void micro(const uint32_t *xi, int ldxi, const uint32_t *P, int nb,
                                                        int gp, const float *S, const float *Z, const float *X,
                                                        int ldX, float *C, const int mr, int first) {
    __m512 tot[MR][2];
    _Pragma("GCC unroll 6")
    for (int r = 0; r < mr; r++) {
        tot[r][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(C + (size_t)r * PW);
        tot[r][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(C + (size_t)r * PW + 16);
    }
    for (int g = 0, b = 0; b < nb; g++, b += gp) {
        __m512 acc[MR][2];
        _Pragma("GCC unroll 6")
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int j = b; j < b + gp; j++) {
            const __m512bh w0 = (__m512bh)_mm512_load_si512(P + (size_t)j * PW);
            const __m512bh w1 = (__m512bh)_mm512_load_si512(P + (size_t)j * PW + 16);
            _Pragma("GCC unroll 6")
            for (int r = 0; r < mr; r++) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xi[(size_t)r * ldxi + j]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            }
        }
        const __m512 s0 = _mm512_load_ps(S + g * PW), s1 = _mm512_load_ps(S + g * PW + 16);
        _Pragma("GCC unroll 6")
        for (int r = 0; r < mr; r++) {
            tot[r][0] = _mm512_fmadd_ps(acc[r][0], s0, tot[r][0]);
            tot[r][1] = _mm512_fmadd_ps(acc[r][1], s1, tot[r][1]);
        }
        if (X) {
            const __m512 z0 = _mm512_load_ps(Z + g * PW), z1 = _mm512_load_ps(Z + g * PW + 16);
            _Pragma("GCC unroll 6")
            for (int r = 0; r < mr; r++) {
                const __m512 xs = _mm512_set1_ps(X[(size_t)r * ldX + g]);
                tot[r][0] = _mm512_fmadd_ps(xs, z0, tot[r][0]);
                tot[r][1] = _mm512_fmadd_ps(xs, z1, tot[r][1]);
            }
        }
    }
    _Pragma("GCC unroll 6")
    for (int r = 0; r < mr; r++) {
        _mm512_store_ps(C + (size_t)r * PW, tot[r][0]);
        _mm512_store_ps(C + (size_t)r * PW + 16, tot[r][1]);
    }
}

/* Every row of the slab over one panel, in balanced blocks of up to MR rows. */
static void panel_rows_bf16(const Bf16Problem *p, const uint32_t *xi, const float *X, const uint32_t *P, int nb,
                            const float *S, const float *Z, float *C, int M, int first) {
    const int tiles = (M + MR - 1) / MR, gp = p->G / 2;
    for (int t = 0, m = 0; t < tiles; t++) {
        const int mr = (M - m) / (tiles - t);
        const uint32_t *x = xi + (size_t)m * p->ldxi;
        const float *xs = X ? X + (size_t)m * p->groups : NULL;
        float *c = C + (size_t)m * PW;
        m += mr;
        switch (mr) {
        case 6: micro(x, p->ldxi, P, nb, gp, S, Z, xs, p->groups, c, 6, first); break;
        case 5: micro(x, p->ldxi, P, nb, gp, S, Z, xs, p->groups, c, 5, first); break;
        case 4: micro(x, p->ldxi, P, nb, gp, S, Z, xs, p->groups, c, 4, first); break;
        case 3: micro(x, p->ldxi, P, nb, gp, S, Z, xs, p->groups, c, 3, first); break;
        case 2: micro(x, p->ldxi, P, nb, gp, S, Z, xs, p->groups, c, 2, first); break;
        default: micro(x, p->ldxi, P, nb, gp, S, Z, xs, p->groups, c, 1, first); break;
        }
    }
}

/* Panels [n0, n1) over rows [m0, m0 + M), pairs in chunks of kc. */
static void columns_bf16(const Bf16Problem *p, int m0, int M, int n0, int n1, float *C, int kc) {
    uint32_t P[PB * PW] __attribute__((aligned(64)));
    float S[(PB / 16) * PW] __attribute__((aligned(64))), Z[(PB / 16) * PW] __attribute__((aligned(64)));
    const __m512i table = nibble_table(p->zeros == NULL);
    const int rowb = p->Kp / 2, gp = p->G / 2;
    const uint32_t *xi = p->xi + (size_t)m0 * p->ldxi;
    const float *X = p->xsum ? p->xsum + (size_t)m0 * p->groups : NULL;
    float *out = p->out ? p->out + (size_t)m0 * p->N : NULL;
    uint16_t *out16 = p->out16 ? p->out16 + (size_t)m0 * p->N : NULL;
    for (int c0 = 0; c0 < rowb; c0 += kc) {
        const int c1 = c0 + kc < rowb ? c0 + kc : rowb;
        for (int n = n0; n < n1; n += PW) {
            if (c0 > 0)
                for (int m = 0; m < M; m++) memcpy(C + (size_t)m * PW, out + (size_t)m * p->N + n, PW * 4);
            for (int b0 = c0; b0 < c1; b0 += PB) {
                const int nb = c1 - b0 < PB ? c1 - b0 : PB, g0 = b0 / gp;
                decode16(p, table, n, b0, nb, P, 0);
                decode16(p, table, n + 16, b0, nb, P, 16);
                for (int g = 0; g < nb / gp; g++) {
                    __m512 vs, vz;
                    for (int h = 0; h < 2; h++) {
                        int4_group_scales(p->scales, p->zeros, p->scale_f32, p->groups, n + 16 * h, g0 + g, &vs, &vz);
                        _mm512_store_ps(S + g * PW + 16 * h, vs);
                        _mm512_store_ps(Z + g * PW + 16 * h, vz);
                    }
                }
                panel_rows_bf16(p, xi + b0, X ? X + g0 : NULL, P, nb, S, Z, C, M, b0 == 0);
            }
            for (int m = 0; m < M; m++) {
                const float *c = C + (size_t)m * PW;
                if (c1 < rowb) {
                    memcpy(out + (size_t)m * p->N + n, c, PW * 4);
                    continue;
                }
                const __m512 lo = p->bias ? _mm512_add_ps(_mm512_load_ps(c), _mm512_loadu_ps(p->bias + n))
                                          : _mm512_load_ps(c);
                const __m512 hi = p->bias ? _mm512_add_ps(_mm512_load_ps(c + 16), _mm512_loadu_ps(p->bias + n + 16))
                                          : _mm512_load_ps(c + 16);
                if (out16) {
                    _mm512_storeu_si512(out16 + (size_t)m * p->N + n, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                } else {
                    _mm512_storeu_ps(out + (size_t)m * p->N + n, lo);
                    _mm512_storeu_ps(out + (size_t)m * p->N + n + 16, hi);
                }
            }
        }
    }
}

/* Row m of x into xi's pairs (zeros past K) and, where wanted, its group sums. */
static void pair_row(const uint16_t *x, int K, int Kp, int G, uint32_t *xi, float *xsum) {
    const int half = G / 2;
    for (int k0 = 0, g = 0; k0 < Kp; k0 += G, g++) {
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < half; j += 16) {
            const int lo = k0 + j, hi = k0 + half + j;
            const __mmask16 mlo = lo >= K ? 0 : K - lo >= 16 ? 0xffff : (__mmask16)((1u << (K - lo)) - 1);
            const __mmask16 mhi = hi >= K ? 0 : K - hi >= 16 ? 0xffff : (__mmask16)((1u << (K - hi)) - 1);
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mlo, x + lo));
            const __m512i b = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mhi, x + hi));
            _mm512_storeu_si512(xi + k0 / 2 + j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            if (xsum)
                sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                                                       _mm512_castsi512_ps(_mm512_slli_epi32(b, 16))));
        }
        if (xsum) xsum[g] = _mm512_reduce_add_ps(sum);
    }
}
#else
#define HAVE_BF16 0
#endif

/* 1 where this build has the bf16 form (AVX512_BF16), else 0. */
int int4_bf16_isa(void) { return HAVE_BF16; }

/* out: float32, or bfloat16 where out_bf16. 0 done; -2 bad arguments; -3 no bf16 form in this build (or G not
   32, 64, 128, or N not a multiple of 32); -4 out of memory. */
int int4_bf16_matmul(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, const void *zeros,
                     int scale_f32, const float *bias, void *out, int out_bf16, int M, int N, int K, int Kp, int G,
                     int threads) {
    if (M < 0 || N < 0 || K < 0 || G < 2 || G % 2 || Kp % G || Kp < K || Kp - K >= G || ldx < K)
        return -2;
#if HAVE_BF16
    if ((G != 32 && G != 64 && G != 128) || N % PW)
        return -3;
    if (M == 0 || N == 0)
        return 0;
    const int groups = Kp / G, rowb = Kp / 2, ldxi = rowb + 16;      /* + 16: rows not a power of two apart */
    uint32_t *xi = aligned_alloc(64, ((size_t)M * ldxi * 4 + 63) / 64 * 64);
    float *xsum = zeros ? malloc((size_t)M * groups * 4) : NULL;
    const int whole = N / PW, rows = M < SLAB ? M : SLAB;
    int kc = X_CHUNK / (4 * rows) / PB * PB;                       /* pairs a chunk: a multiple of PB */
    if (kc < PB) kc = PB;
    /* bfloat16 out over chunks of k: the sums between chunks kept in float32 */
    float *sums = out_bf16 && kc < rowb ? malloc((size_t)M * N * 4) : NULL;
    if (!xi || (zeros && !xsum) || (out_bf16 && kc < rowb && !sums)) {
        free(xi); free(xsum); free(sums);
        return -4;
    }
    const Bf16Problem p = {xi, ldxi, xsum, groups, packed, scales, zeros, scale_f32, bias,
                           out_bf16 ? sums : out, out_bf16 ? out : NULL, M, N, Kp, G};
    if (threads < 1) threads = 1;
    if (whole < threads) threads = whole;
    int failed = 0;
    _Pragma("omp parallel num_threads(threads) reduction(|:failed)")     /* one region: a fork costs ~10 us */
    {
        _Pragma("omp for schedule(static)")                              /* (its barrier: every row paired) */
        for (int m = 0; m < M; m++)
            pair_row(x + (size_t)m * ldx, K, Kp, G, xi + (size_t)m * ldxi, xsum ? xsum + (size_t)m * groups : NULL);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int n0 = (int)((long)whole * t / nt) * PW, n1 = (int)((long)whole * (t + 1) / nt) * PW;
        float *C = aligned_alloc(64, (size_t)rows * PW * 4);
        if (!C) failed = 1;
        else
            for (int m0 = 0; m0 < M; m0 += SLAB)
                columns_bf16(&p, m0, M - m0 < SLAB ? M - m0 : SLAB, n0, n1, C, kc);
        free(C);
    }
    free(xi);
    free(xsum);
    free(sums);
    return failed ? -4 : 0;
#else
    (void)x; (void)packed; (void)scales; (void)zeros; (void)scale_f32; (void)bias; (void)out; (void)out_bf16;
    (void)threads;
    return -3;
#endif
}
