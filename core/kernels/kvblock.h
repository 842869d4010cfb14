/* The KV cache's Q8_0 / Q4_0 blocks (core/cache.py: 32 values of a head vector with an fp16
 * scale, GGUF's layouts) read into registers, for both attentions that read a block cache as
 * stored: the decode step's (decode.c) and the prefill's (prefill.c). */
#ifndef TWICE_KVBLOCK_H
#define TWICE_KVBLOCK_H
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "qdot.h"

/* A Q8_0 / Q4_0 block at b as its scale and its 32 values' int8 multipliers (values 0..15 in
 * lo, 16..31 in hi; Q4_0's q − 8); returns the block's bytes. d·q is exact in float32. */
static inline __attribute__((always_inline)) int64_t block_int8_of(const int q8, const uint8_t *b, float *scale,
                                                                   __m128i *lo, __m128i *hi) {
    *scale = qd_f16(b);
    if (q8) {
        *lo = _mm_loadu_si128((const __m128i *)(b + 2));
        *hi = _mm_loadu_si128((const __m128i *)(b + 18));
        return 34;
    }
    const __m128i x = _mm_loadu_si128((const __m128i *)(b + 2)), m = _mm_set1_epi8(15), e = _mm_set1_epi8(8);
    *lo = _mm_sub_epi8(_mm_and_si128(x, m), e);
    *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), m), e);
    return 18;
}

#ifdef __AVX512F__
/* The 32-value block at b (Q8_0 if q8, else Q4_0) as two vectors of 16 floats: its scale times
 * its int8 multipliers (exact in float32: the reference's dequantized values); returns the
 * next block. */
static inline __attribute__((always_inline)) const uint8_t *widen_block16(const int q8, const uint8_t *b, __m512 *x0,
                                                                          __m512 *x1) {
    float sc;
    __m128i lo, hi;
    b += block_int8_of(q8, b, &sc, &lo, &hi);
    const __m512 scale = _mm512_set1_ps(sc);
    *x0 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    *x1 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)));
    return b;
}

#endif
#endif
#endif
