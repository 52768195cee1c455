/* The group scales and zeros of 16 columns as float32 vectors, shared by cpu_int4.c's panel path and
   cpu_int4_bf16.c. Scales and zeros are [N, groups], float16 or float32; no zeros: z = -8 s. AVX-512 only. */
#ifndef JOBRUNNER_CPU_INT4_SCALES_H
#define JOBRUNNER_CPU_INT4_SCALES_H
#include <immintrin.h>
#include <stdint.h>

/* 16 float16 values at element offsets idx of `halves`, as float32: each read from the aligned dword holding it
   (never past a page the tensor is on), its half picked by its byte offset. */
static inline __m512 gather_halves(const void *halves, __m512i idx) {
    const uintptr_t at = (uintptr_t)halves;
    const __m512i bytes = _mm512_add_epi32(_mm512_slli_epi32(idx, 1), _mm512_set1_epi32((int)(at & 3)));
    const __m512i word = _mm512_andnot_si512(_mm512_set1_epi32(3), bytes);
    const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(2)), 3);   /* 16 or 0 */
    const __m512i w = _mm512_srlv_epi32(_mm512_i32gather_epi32(word, (const void *)(at & ~(uintptr_t)3), 1), hi);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
}

/* Scales and zeros of group g of columns [n0, n0 + 16), gathered. */
static inline void int4_group_scales(const void *scales, const void *zeros, int scale_f32, int groups, int n0,
                                     int g, __m512 *vs, __m512 *vz) {
    const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_set1_epi32(groups), _mm512_setr_epi32(
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), _mm512_set1_epi32(n0 * groups + g));
    *vs = scale_f32 ? _mm512_i32gather_ps(idx, scales, 4) : gather_halves(scales, idx);
    if (!zeros) *vz = _mm512_mul_ps(*vs, _mm512_set1_ps(-8.0f));
    else *vz = scale_f32 ? _mm512_i32gather_ps(idx, zeros, 4) : gather_halves(zeros, idx);
}
#endif
