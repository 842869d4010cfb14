/* bfloat16 ⇄ float32 for the kernels (shared by gemv.c and decode.c). bf16 is the top
 * half of a float32, so widening is a shift; narrowing rounds to nearest even, as torch does. */
#ifndef TWICE_BF16_H
#define TWICE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
#endif
