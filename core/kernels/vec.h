/* AVX-512 helpers for decode.c's element-wise work (softmax, SiLU, rounding), where the
 * scalar libm calls cost more than the matrix products at batch 16. */
#ifndef TWICE_VEC_H
#define TWICE_VEC_H
#ifdef __AVX512F__
#include <immintrin.h>
#include <stdint.h>

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

/* The lane sums of 16 vectors, each split in two: lane k of *a = the sum of v[k]'s lanes 0-7,
 * of *b = of its lanes 8-15 (a key's two blocks, each scaled on its own; sum16 adds them). A
 * transpose-and-add tree: the first two levels shuffle within 128-bit blocks (cheap), turning
 * each 4 vectors into one whose block j holds their partial sums over block j; the last level
 * gathers the blocks with 128-bit block shuffles. */
static inline __attribute__((always_inline)) void sum16_halves(const __m512 v[16], __m512 *a, __m512 *b) {
    __m512 x[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *u = v + 4 * g;
        const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
        const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
        /* s01 block: [u0, u1, u0, u1] partials, s23: [u2, u3, u2, u3]; 64-bit unpacks pair them */
        x[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    }
    /* p's 128-bit blocks: vectors 0-3 lanes 0-7, 0-3 lanes 8-15, 4-7 lanes 0-7, 4-7 lanes 8-15 */
    const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    *a = _mm512_shuffle_f32x4(p, q, 0x88);
    *b = _mm512_shuffle_f32x4(p, q, 0xdd);
}

/* Lane k = the lane sum of v[k], for 16 vectors: 30 shuffles and 15 adds, 24 of the shuffles
 * in-block. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 a, b;
    sum16_halves(v, &a, &b);
    return _mm512_add_ps(a, b);
}

/* Lanes j .. j+15 that lie in [lo, n): the mask of a row's partial first and last vectors. */
static inline __mmask16 lanes16(int64_t j, int64_t lo, int64_t n) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
    if (lo > j) m &= (__mmask16)~((1u << (lo - j)) - 1);
    return m;
}

/* s[lo, n) → e^(s - m) in place, 16 at a time; returns their sum. With `pack` (AVX-512 BF16
 * builds only) they are stored rounded to bf16 at (uint16_t *)s + j instead, the layout the
 * bf16 p·V dot products read: in place is safe, bf16 j lands at byte 2j, behind float j's
 * byte 4j. */
static inline float exp_sum(float *s, int64_t lo, int64_t n, float m, int pack) {
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = lo / 16 * 16; j < n; j += 16) {
        const __mmask16 live = lanes16(j, lo, n);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), mb)));
        sum = _mm512_add_ps(sum, e);
#ifdef __AVX512BF16__
        if (pack) { _mm256_mask_storeu_epi16((uint16_t *)s + j, live, (__m256i)_mm512_cvtneps_pbh(e)); continue; }
#endif
        (void)pack;
        _mm512_mask_storeu_ps(s + j, live, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* p[0, n) → e^(p - m) / Σ in place (a float32 softmax, m its maximum), 16 at a time; returns Σ. */
static inline float softmax16(float *p, int64_t n, float m) {
    const float sum = exp_sum(p, 0, n, m, 0);
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = lanes16(j, 0, n);
        _mm512_mask_storeu_ps(p + j, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p + j), inv));
    }
    return sum;
}

/* Unpacking two bf16 rows (unpacklo/hi_epi16) orders their 32 elements within 128-bit
 * blocks; accumulators a (from the lo unpack) and b (from the hi one) hold them as
 * 0–3, 8–11, 16–19, 24–27 and 4–7, 12–15, 20–23, 28–31. These return elements 0–15 and
 * 16–31 in order. */
static inline __m512 unpacked_first16(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), b);
}
static inline __m512 unpacked_second16(__m512 a, __m512 b) {
    return _mm512_permutex2var_ps(a, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), b);
}
#endif
#endif
