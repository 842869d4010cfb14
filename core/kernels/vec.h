/* AVX-512 helpers for decode.c's element-wise work (softmax, SiLU, rounding), where the
 * scalar libm calls cost more than the matrix products at batch 16. */
#ifndef TWICE_VEC_H
#define TWICE_VEC_H
#ifdef __AVX512F__
#include <immintrin.h>

/* e^x to within 2 ulp (Cephes expf): x = n·ln2 + r with |r| ≤ ln2/2, e^r by its degree-7
 * series, times 2^n by scalef (which saturates to 0 or inf as expf does). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7228f)), _mm512_set1_ps(-103.9721f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Rounds each lane to the nearest bfloat16 (ties to even, NaN kept), as f32_to_bf16. */
static inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(r), v);
}

/* Adds the even and the odd lanes of two vectors: lanes 0–7 hold pair sums of a, 8–15 of b.
 * Four levels of folds turn 16 vectors into one whose lane k is vector k's lane sum. */
static inline __m512 fold(__m512 a, __m512 b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

/* Lane k = the lane sum of v[k], for 16 vectors. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 l1[8], l2[4];
    for (int k = 0; k < 8; k++) l1[k] = fold(v[2 * k], v[2 * k + 1]);
    for (int k = 0; k < 4; k++) l2[k] = fold(l1[2 * k], l1[2 * k + 1]);
    return fold(fold(l2[0], l2[1]), fold(l2[2], l2[3]));
}
#endif
#endif
