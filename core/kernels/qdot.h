/* Shared pieces of the quantized-weight kernels (qdot.c, qdot_legacy.c, qdot_kquants.c).
 *
 * A weight row is stored as GGUF blocks, exactly as in the file (layouts: core/quant/
 * __init__.py). The activations are quantized once per call to int8 blocks (q_prepare),
 * so each block's dot product is integer arithmetic (AVX2 maddubs + madd, or VNNI dpbusd)
 * with the weight's quants as the unsigned operand and the activation's as the signed one;
 * a type's offset (Q4_0's 8, Q6_K's 32, ...) and mins go through the activation's block sums.
 *
 * Prepared activation rows (q_act_bytes bytes each, a multiple of 64):
 * - 32-value types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0): int8 qs[n] | float {d, d·Σq}[n/32] |
 *   int32 {-8·Σq, -16·Σq}[n/32] (the offsets of Q4_0 and Q5_0);
 * - 256-value types (Q2_K..Q6_K, as llama.cpp's Q8_K): int8 qs[n] | float d[n/256] |
 *   int16 bsums[n/16] (the sum of each 16 quants);
 * - F32/F16/BF16 weights: the n float32 values.
 * Quantization: d = max|x|/127 per block, q = round-to-nearest-even(x·(1/d)) (so |q| ≤ 127).
 * A prepared row is the same for every type of a family (all five 32-value types, all five
 * K types), so matrices of mixed types that share an input can share its preparation.
 */
#ifndef TWICE_QDOT_H
#define TWICE_QDOT_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum {
    QT_F32 = 0, QT_F16 = 1, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7, QT_Q8_0 = 8,
    QT_Q2_K = 10, QT_Q3_K = 11, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14, QT_BF16 = 30,
};
#define QK 32
#define QKK 256
/* A 32-value type's id + QT_X8: its rows in the interleaved 8-row layout (core/quant/
 * interleave.py; qdot_legacy.c's x8 tiles): the same bytes per row and the same prepared
 * activations as the type's, in memory only (never in a file). */
#define QT_X8 256

/* One weight row against nr (1–4; an x8 tile: 8 weight rows, 1–8 for the types of
 * twq_x8_tile_rows) prepared activation rows, x + r·xs each: y[r·ldy] for r < nr.
 * Every row's result is computed by the same instructions in the same order whatever nr is
 * (batch invariance). */
typedef void (*qtile_fn)(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy);

/* How far ahead (bytes) the AVX2 tiles prefetch a weight row they stream (software prefetch:
 * measured, one thread, 1536×8960 at 1 row, load ~7: Q8_0 9.2→11.1 GB/s, Q5_0 7.0→8.9, Q4_K
 * 6.7→8.5, Q6_K 9.5→12.2; 2–4 KB ahead all alike, 512 B too short). Rows are contiguous, so
 * near a row's end this fetches the next row's start (past the last row: a prefetch never
 * faults). Only the order of memory requests changes, never a result. */
#ifndef QD_PREFETCH
#define QD_PREFETCH 2048
#endif

/* Part `part` (of `parts`) of a block's prefetch (a macro: GCC dropped the prefetches of an
 * inline function's loop inside the unrolled tiles): its cache lines spread over the loop through
 * the block, a few at each step (a block's 27-54 prefetches in one burst at its start stalled
 * the loads queued behind them: Q6_K's x8 tiles streamed at half the rows-as-stored speed). */
#define QD_PREFETCH_PART(p, bytes, part, parts, hint)                                                 \
    for (int l_ = (part) * (((bytes) + 64 * (parts) - 1) / (64 * (parts)) * 64);                          \
         l_ < ((part) + 1) * (((bytes) + 64 * (parts) - 1) / (64 * (parts)) * 64) && l_ < (bytes); l_ += 64) \
        _mm_prefetch((const char *)(p) + l_, hint)

/* A two-group tile's dispatch: nr activation rows (of x, y, with xs, ldy in scope) in calls of
 * 16, 8, 4, 2 or 1 rows, CALL(NR) one call with NR a compile-time constant. */
#define QD_BY_POWERS(CALL)                                                                            \
    while (nr > 0) {                                                                                 \
        const int t_ = nr >= 16 ? 16 : nr >= 8 ? 8 : nr >= 4 ? 4 : nr >= 2 ? 2 : 1;                   \
        switch (t_) {                                                                                \
        case 16: CALL(16); break;                                                                    \
        case 8: CALL(8); break;                                                                      \
        case 4: CALL(4); break;                                                                      \
        case 2: CALL(2); break;                                                                      \
        default: CALL(1); break;                                                                     \
        }                                                                                            \
        nr -= t_, x += t_ * xs, y += t_ * ldy;                                                       \
    }

/* Keeps the compiler from fusing a product into the following add (dequantize must round
 * the product first, as the reference does). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define NOFUSE(v) __asm__("" : "+x"(v))
#else
#define NOFUSE(v) do { volatile float nofuse_ = (v); (v) = nofuse_; } while (0)
#endif

static inline float qd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t u;
    float f;
    if (exp == 0) { /* zero or subnormal: mant · 2^-24, exact */
        f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    }
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float qd_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Q4_K/Q5_K: 12 bytes → 8 six-bit scales (out[0..7]) and 8 mins (out[8..15]). */
static inline void qd_scale_min_k4(const uint8_t *s, uint8_t out[16]) {
    for (int j = 0; j < 4; j++) {
        out[j] = s[j] & 63;
        out[8 + j] = s[4 + j] & 63;
        out[4 + j] = (s[8 + j] & 0x0f) | ((s[j] >> 6) << 4);
        out[12 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
    }
}

/* Q3_K: 12 bytes → 16 six-bit scales minus 32. */
static inline void qd_scales_q3k(const uint8_t *s, int8_t out[16]) {
    for (int i = 0; i < 16; i++) {
        const int low = i < 8 ? s[i] & 0x0f : s[i - 8] >> 4;
        const int high = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        out[i] = (int8_t)((low | (high << 4)) - 32);
    }
}

static inline int64_t qd_round64(int64_t v) { return (v + 63) / 64 * 64; }

#ifdef __AVX2__
static inline float qd_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* acc + Σ of each 4 adjacent u8·s8 products, as int32 lanes (no product pair exceeds int16
 * for our operands, so maddubs never saturates and both forms agree exactly). */
static inline __m256i qd_dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* acc + u (u8 weights) · the 4 signed bytes at p in every lane: dpbusd with its broadcast
 * memory operand (GCC otherwise broadcasts into a register first: one more operation a
 * dpbusd, where the 16-lane tiles are bound by operations, not by the products). */
static inline __m512i qd_dpbusd_bcast(__m512i acc, __m512i u, const void *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}
#endif

#ifdef __AVX512F__
/* Integer lane sums of two vectors, per 128-bit block (the 512-bit x8 tiles): pairs, the
 * adjacent lanes (0+1, 2+3) of s then of t; halves, lanes 0+2 and 1+3 of s then of t. */
static inline __m512i qd_add_lane_pairs(__m512i s, __m512i t) {
    const __m512 a = _mm512_castsi512_ps(s), c = _mm512_castsi512_ps(t);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, c, _MM_SHUFFLE(2, 0, 2, 0))),
                            _mm512_castps_si512(_mm512_shuffle_ps(a, c, _MM_SHUFFLE(3, 1, 3, 1))));
}

static inline __m512i qd_add_lane_halves(__m512i s, __m512i t) {
    const __m512 a = _mm512_castsi512_ps(s), c = _mm512_castsi512_ps(t);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, c, _MM_SHUFFLE(1, 0, 1, 0))),
                            _mm512_castps_si512(_mm512_shuffle_ps(a, c, _MM_SHUFFLE(3, 2, 3, 2))));
}

/* The 512-bit x8 tiles' results: acc[p] holds activation rows 2p and 2p + 1 of a group's 8
 * weight rows, lanes (0, 1, 4, 5, 8, 9, 12, 13) the first row's and the rest the second's. */
static inline void qd_store_row_pairs(const __m512 *acc, int pairs, float *y, int64_t ldy) {
    const __m512i first = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i second = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int p = 0; p < pairs; p++) {
        _mm256_storeu_ps(y + 2 * p * ldy, _mm512_castps512_ps256(_mm512_permutexvar_ps(first, acc[p])));
        _mm256_storeu_ps(y + (2 * p + 1) * ldy, _mm512_castps512_ps256(_mm512_permutexvar_ps(second, acc[p])));
    }
}
#endif

/* qdot_legacy.c / qdot_kquants.c: the tiles of each family, the AVX2 one where the CPU has
 * it (NULL otherwise) and the portable scalar reference. */
qtile_fn twq_legacy_tile(int type, int reference);
qtile_fn twq_kquant_tile(int type, int reference);
int twq_legacy_dequantize(int type, const uint8_t *w, int64_t n, float *out);
/* x8 (`type`: the 32-value type's own id): tiles of 8 weight rows (a group) × 1–4 activation
 * rows, y[r·ldy + i] for i < 8; row i of a group → float32 (the type's dequantized values). */
qtile_fn twq_x8_tile(int type, int reference);
qtile_fn twq_x8_pair_tile(int type); /* two groups (16 weight rows) a call, or NULL */
int twq_x8_pair_from(int type);      /* the fewest activation rows given to it */
int twq_x8_dequantize_row(int type, const uint8_t *group, int i, int64_t n, float *out);
int twq_x8_tile_rows(int type); /* the most activation rows an x8 tile of this 32-value type takes: 4 or 8 */
int twq_x8_interleave_group(int type, const uint8_t *in, int64_t n, uint8_t *out);
int twq_kquant_dequantize(int type, const uint8_t *w, int64_t n, float *out);
/* x8 of a K type (Q4_K, Q6_K: its id + QT_X8; qdot_kquants.c): tiles of 8 weight rows × 1–4
 * activation rows (y[r·ldy + i] for i < 8), row i of a group → float32, a group → x8. */
qtile_fn twq_kx8_tile(int type, int reference);
/* Two consecutive x8 groups (16 weight rows: y[r·ldy + i] for i < 16), each row's result bit
 * for bit the one-group tile's; NULL where the build has none for the type. */
qtile_fn twq_kx8_pair_tile(int type);
int twq_kx8_tile_rows(int type); /* the most activation rows an x8 tile of this K type takes: 4 or 16 */
int twq_kx8_pair_from(int type); /* the fewest activation rows given to its two-group tile */
int twq_kx8_at_load(int type);   /* whether loading interleaves it */
int twq_kx8_dequantize_row(int type, const uint8_t *group, int i, int64_t n, float *out);
int twq_kx8_interleave_group(int type, const uint8_t *in, int64_t n, uint8_t *out);
#endif
