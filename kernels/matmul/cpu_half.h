/* IEEE binary16 -> binary32, shared by cpu_int4.c and cpu_w4a8.c (their float16 scales and zeros). */
#ifndef JOBRUNNER_CPU_HALF_H
#define JOBRUNNER_CPU_HALF_H
#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {    /* exact; no F16C needed */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112u) << 23) | (man << 13);
    else if (man == 0) bits = sign;
    else {                                           /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif
