/* float32 -> e4m3 rounding shared by cpu_int8.c (fp8_fake_quantize) and cpu_fp8_dot.c (fp8_dot_quantize): one
   definition, so the two quantize activations to the same values bit for bit. */
#ifndef JOBRUNNER_CPU_E4M3_H
#define JOBRUNNER_CPU_E4M3_H
#include <stdint.h>
#include <string.h>

/* v clamped to +-448 and rounded to the nearest e4m3 value, ties to even, as torch casts float32 to
   float8_e4m3fn (below 2^-6 onto multiples of 2^-9, else onto 3 mantissa bits). */
static inline float e4m3_round(float v) {
    v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
    uint32_t u, sub_bits;
    memcpy(&u, &v, 4);
    const uint32_t sign = u & 0x80000000u, a = u ^ sign;
    float mag;
    memcpy(&mag, &a, 4);
    const float sub = (mag + 16384.0f) - 16384.0f;          /* both forms, then one chosen: it vectorizes */
    memcpy(&sub_bits, &sub, 4);
    const uint32_t normal = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;
    const uint32_t r = (a < (121u << 23) ? sub_bits : normal) | sign;
    float out;
    memcpy(&out, &r, 4);
    return out;
}
#endif
