/* The 256-value super-block types against prepared Q8_K-style activations: Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K.
 *
 * Per super-block the weight quants (unsigned: Q2_K 0..3, Q3_K 0..7 with its offset 4,
 * Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 with its offset 32) meet the int8 activations in
 * integer dot products, each 32 (or 16) of them multiplied by their sub-block's integer
 * scale in the same madd; the mins (Q2_K/Q4_K/Q5_K) and the offsets (Q3_K/Q6_K) go through
 * the activation's 16-value block sums. So a super-block costs one or two float products:
 * d_x·d·Σsc·q·x  (- d_x·dmin·Σmn·bsum). The AVX2 tile unpacks a super-block once for its 1–4
 * activation rows; each row keeps its own accumulators, summed in the same order whatever
 * the tile's size. The scalar reference computes the same integers per super-block.
 */
#include <math.h>

#include "qdot.h"

#define K_D(x, n) ((const float *)((x) + (n)))
#define K_BSUMS(x, n) ((const int16_t *)((x) + (n) + 4 * ((n) / QKK)))

static int kquant_size(int type) {
    switch (type) {
    case QT_Q2_K: return 84;
    case QT_Q3_K: return 110;
    case QT_Q4_K: return 144;
    case QT_Q5_K: return 176;
    case QT_Q6_K: return 210;
    }
    return 0;
}

/* ---- scalar reference ---------------------------------------------------------------- */

/* A super-block's 256 quants q (unsigned), the scale of each 16 values (sc), the min of
 * each 16 (mn; for Q3_K/Q6_K the offset·scale is expressed as mn = off·sc with dmin = d),
 * d and dmin, so that value i = d·sc[i/16]·q[i] - dmin·mn[i/16]. */
static void kquant_block(int type, const uint8_t *b, int q[QKK], int sc[16], int mn[16], float *d, float *dmin) {
    switch (type) {
    case QT_Q2_K: {
        const uint8_t *qs = b + 16;
        for (int i = 0; i < 16; i++) { sc[i] = b[i] & 0x0f; mn[i] = b[i] >> 4; }
        for (int g = 0; g < 8; g++)
            for (int l = 0; l < 32; l++) q[32 * g + l] = (qs[32 * (g >> 2) + l] >> (2 * (g & 3))) & 3;
        *d = qd_f16(b + 80);
        *dmin = qd_f16(b + 82);
        return;
    }
    case QT_Q3_K: {
        const uint8_t *hm = b, *qs = b + 32;
        int8_t s[16];
        qd_scales_q3k(b + 96, s);
        for (int i = 0; i < 16; i++) { sc[i] = s[i]; mn[i] = 4 * s[i]; }
        for (int g = 0; g < 8; g++)
            for (int l = 0; l < 32; l++)
                q[32 * g + l] = ((qs[32 * (g >> 2) + l] >> (2 * (g & 3))) & 3) | (((hm[l] >> g) & 1) << 2);
        *d = *dmin = qd_f16(b + 108);
        return;
    }
    case QT_Q4_K:
    case QT_Q5_K: {
        uint8_t s[16];
        qd_scale_min_k4(b + 4, s);
        for (int i = 0; i < 16; i++) { sc[i] = s[i >> 1]; mn[i] = s[8 + (i >> 1)]; }
        const uint8_t *qs = b + (type == QT_Q4_K ? 16 : 48), *qh = b + 16;
        for (int g = 0; g < 8; g++)
            for (int l = 0; l < 32; l++) {
                const uint8_t v = qs[32 * (g >> 1) + l];
                q[32 * g + l] = (g & 1 ? v >> 4 : v & 0x0f) | (type == QT_Q5_K ? ((qh[l] >> g) & 1) << 4 : 0);
            }
        *d = qd_f16(b);
        *dmin = qd_f16(b + 2);
        return;
    }
    default: { /* Q6_K */
        const uint8_t *ql = b, *qh = b + 128;
        for (int i = 0; i < 16; i++) { sc[i] = (int8_t)b[192 + i]; mn[i] = 32 * sc[i]; }
        for (int g = 0; g < 8; g++) {
            const int h = g >> 2, k = g & 3;
            for (int l = 0; l < 32; l++) {
                const uint8_t v = ql[64 * h + 32 * (k & 1) + l];
                q[32 * g + l] = (k & 2 ? v >> 4 : v & 0x0f) | (((qh[32 * h + l] >> (2 * k)) & 3) << 4);
            }
        }
        *d = *dmin = qd_f16(b + 208);
        return;
    }
    }
}

static float ref_dot(int type, const uint8_t *w, const uint8_t *x, int64_t n) {
    const int64_t nb = n / QKK;
    const int8_t *xq = (const int8_t *)x;
    const float *xd = K_D(x, n);
    const int16_t *bsums = K_BSUMS(x, n);
    const int bs = kquant_size(type);
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int q[QKK], sc[16], mn[16];
        float d, dmin;
        kquant_block(type, w + b * bs, q, sc, mn, &d, &dmin);
        int32_t isum = 0, imin = 0;
        for (int i = 0; i < 16; i++) {
            int32_t s = 0;
            for (int l = 0; l < 16; l++) s += q[16 * i + l] * xq[b * QKK + 16 * i + l];
            isum += sc[i] * s;
            imin += mn[i] * bsums[b * 16 + i];
        }
        if (type == QT_Q3_K || type == QT_Q6_K) sum += xd[b] * d * (float)(isum - imin);
        else sum += xd[b] * d * (float)isum - xd[b] * dmin * (float)imin;
    }
    return sum;
}

#define REF_TILE(T, NAME)                                                                             \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        for (int r = 0; r < nr; r++) y[r * ldy] = ref_dot(T, w, x + r * xs, n);                      \
    }
REF_TILE(QT_Q2_K, ref_q2_k)
REF_TILE(QT_Q3_K, ref_q3_k)
REF_TILE(QT_Q4_K, ref_q4_k)
REF_TILE(QT_Q5_K, ref_q5_k)
REF_TILE(QT_Q6_K, ref_q6_k)

/* ---- AVX2 ------------------------------------------------------------------------------ */
#ifdef __AVX2__
/* Bit k of each byte → 0x10 (Q5_K's fifth bit) or 0x04 (Q3_K's third). The 16-bit shifts
 * move each byte's bits into place without crossing into the masked bit of its neighbour. */
#define BIT_TO(v, k, to) _mm256_and_si256((k) <= (to) ? _mm256_slli_epi16(v, (to) - (k)) : _mm256_srli_epi16(v, (k) - (to)), \
                                          _mm256_set1_epi8(1 << (to)))

/* 16 int16 scales (one per 16 values) → the madd multipliers of 32-value group g after
 * maddubs: [s[2g] ×8 | s[2g+1] ×8]. lo/hi are s[0..7] and s[8..15] broadcast to both
 * 128-bit halves, so it is one in-lane byte shuffle. */
static inline __m256i group_scales(__m256i lo, __m256i hi, int g) {
    const int a = (2 * g) & 7, b = a + 1;
    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * b)),
                                          _mm_set1_epi16((short)(0x0100 + 0x0202 * a)));
    return _mm256_shuffle_epi8(g < 4 ? lo : hi, pick);
}

static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* 16 scales as int8 (Q3_K: six-bit, minus 32), built in registers (llama.cpp's mask trick). */
static inline __m128i q3k_scales(const uint8_t *s) {
    const uint32_t a0 = load32(s), a1 = load32(s + 4), a2 = load32(s + 8), k2 = 0x0f0f0f0f, k1 = 0x03030303;
    const __m128i v = _mm_set_epi32((int)(((a1 >> 4) & k2) | (((a2 >> 6) & k1) << 4)),
                                    (int)(((a0 >> 4) & k2) | (((a2 >> 4) & k1) << 4)),
                                    (int)((a1 & k2) | (((a2 >> 2) & k1) << 4)), (int)((a0 & k2) | ((a2 & k1) << 4)));
    return _mm_sub_epi8(v, _mm_set1_epi8(32));
}

/* Q4_K/Q5_K: 12 bytes → 8 scales (bytes 0..7) and 8 mins (bytes 8..15), in registers. */
static inline __m128i k4_scales_mins(const uint8_t *s) {
    const uint32_t u0 = load32(s), u1 = load32(s + 4), u2 = load32(s + 8);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    return _mm_set_epi32((int)(((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4)), (int)(u1 & k1),
                         (int)((u2 & k2) | (((u0 >> 6) & k3) << 4)), (int)(u0 & k1));
}

/* The 32 unsigned quants of group g (values 32g..32g+31) of a super-block. */
static inline __attribute__((always_inline)) __m256i group_quants(const int T, const uint8_t *blk, int g, __m256i high) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3);
    if (T == QT_Q2_K || T == QT_Q3_K) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (T == QT_Q2_K ? 16 : 32) + 32 * (g >> 2)));
        const __m256i q = _mm256_and_si256((g & 3) ? _mm256_srli_epi16(v, 2 * (g & 3)) : v, m3);
        return T == QT_Q2_K ? q : _mm256_or_si256(q, BIT_TO(high, g, 2));
    }
    if (T == QT_Q4_K || T == QT_Q5_K) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (T == QT_Q4_K ? 16 : 48) + 32 * (g >> 1)));
        const __m256i q = _mm256_and_si256((g & 1) ? _mm256_srli_epi16(v, 4) : v, m4);
        return T == QT_Q4_K ? q : _mm256_or_si256(q, BIT_TO(high, g, 4));
    }
    /* Q6_K: low 4 bits from ql (two 32-byte runs per half, low then high nibbles), top 2 from qh */
    const int h = g >> 2, k = g & 3;
    const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (k & 1)));
    const __m256i hv = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256((k & 2) ? _mm256_srli_epi16(l, 4) : l, m4);
    const __m256i hi = k == 0 ? _mm256_slli_epi16(hv, 4) : k == 1 ? _mm256_slli_epi16(hv, 2)
                     : k == 2 ? hv : _mm256_srli_epi16(hv, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

static inline __attribute__((always_inline)) void tile_kquant(const int T, const int NR, const uint8_t *w,
                                                              const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                              int64_t ldy) {
    const int64_t nb = n / QKK;
    const int bs = T == QT_Q2_K ? 84 : T == QT_Q3_K ? 110 : T == QT_Q4_K ? 144 : T == QT_Q5_K ? 176 : 210;
    const int two = T == QT_Q2_K || T == QT_Q4_K || T == QT_Q5_K; /* mins with their own dmin */
    __m256 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bs;
        _mm_prefetch((const char *)blk + QD_PREFETCH, _MM_HINT_T0); /* qdot.h */
        _mm_prefetch((const char *)blk + QD_PREFETCH + 64, _MM_HINT_T0);
        if (bs > 128) _mm_prefetch((const char *)blk + QD_PREFETCH + 128, _MM_HINT_T0);
        if (bs > 192) _mm_prefetch((const char *)blk + QD_PREFETCH + 192, _MM_HINT_T0);
        float d, dmin = 0.0f;
        __m128i s8; /* the 16 scales (one per 16 values), int8 or uint8 */
        __m256i m16; /* the 16 mins (or offset·scale) as int16 */
        __m256i high = _mm256_setzero_si256(); /* Q3_K's hmask, Q5_K's qh */
        if (T == QT_Q2_K) {
            const __m128i s = _mm_loadu_si128((const __m128i *)blk);
            s8 = _mm_and_si128(s, _mm_set1_epi8(0x0f));
            m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0f)));
            d = qd_f16(blk + 80);
            dmin = qd_f16(blk + 82);
        } else if (T == QT_Q3_K) {
            s8 = q3k_scales(blk + 96);
            m16 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 2);
            d = qd_f16(blk + 108);
            high = _mm256_loadu_si256((const __m256i *)blk);
        } else if (T == QT_Q4_K || T == QT_Q5_K) {
            const __m128i sm = k4_scales_mins(blk + 4);
            const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
            s8 = _mm_shuffle_epi8(sm, dup);
            m16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_srli_si128(sm, 8), dup));
            d = qd_f16(blk);
            dmin = qd_f16(blk + 2);
            if (T == QT_Q5_K) high = _mm256_loadu_si256((const __m256i *)(blk + 16));
        } else { /* Q6_K */
            s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
            m16 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(s8), 5);
            d = qd_f16(blk + 208);
        }
        const __m256i s16 = (T == QT_Q3_K || T == QT_Q6_K) ? _mm256_cvtepi8_epi16(s8) : _mm256_cvtepu8_epi16(s8);
        const __m256i slo = _mm256_permute2x128_si256(s16, s16, 0x00), shi = _mm256_permute2x128_si256(s16, s16, 0x11);
        __m256i isum[4];
        for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) { /* unrolled: g is a constant in every shift and shuffle */
            __m256i q = group_quants(T, blk, g, high), sg = group_scales(slo, shi, g);
            /* computed here, not all eight ahead of the products (which spills them at NR = 4) */
            __asm__ volatile("" : "+x"(q), "+x"(sg));
            for (int r = 0; r < NR; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * xs + b * QKK + 32 * g));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), sg));
                __asm__ volatile("" : "+x"(isum[r]));
            }
        }
        for (int r = 0; r < NR; r++) {
            const uint8_t *xr = x + r * xs;
            const __m256i imin = _mm256_madd_epi16(m16, _mm256_loadu_si256((const __m256i *)(K_BSUMS(xr, n) + 16 * b)));
            const float dx = K_D(xr, n)[b];
            if (two) {
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_set1_ps(dx * dmin), _mm256_cvtepi32_ps(imin), acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * d), _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], imin)),
                                         acc[r]);
            }
        }
    }
    for (int r = 0; r < NR; r++) y[r * ldy] = qd_hsum(acc[r]);
}

#define AVX2_TILE(T, NAME)                                                                            \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        switch (nr) {                                                                                \
        case 4: tile_kquant(T, 4, w, x, xs, n, y, ldy); return;                                      \
        case 3: tile_kquant(T, 3, w, x, xs, n, y, ldy); return;                                      \
        case 2: tile_kquant(T, 2, w, x, xs, n, y, ldy); return;                                      \
        default: tile_kquant(T, 1, w, x, xs, n, y, ldy); return;                                     \
        }                                                                                            \
    }
AVX2_TILE(QT_Q2_K, avx2_q2_k)
AVX2_TILE(QT_Q3_K, avx2_q3_k)
AVX2_TILE(QT_Q4_K, avx2_q4_k)
AVX2_TILE(QT_Q5_K, avx2_q5_k)
AVX2_TILE(QT_Q6_K, avx2_q6_k)
#endif

qtile_fn twq_kquant_tile(int type, int reference) {
#ifdef __AVX2__
    if (!reference) switch (type) {
        case QT_Q2_K: return avx2_q2_k;
        case QT_Q3_K: return avx2_q3_k;
        case QT_Q4_K: return avx2_q4_k;
        case QT_Q5_K: return avx2_q5_k;
        case QT_Q6_K: return avx2_q6_k;
        }
#endif
    (void)reference;
    switch (type) {
    case QT_Q2_K: return ref_q2_k;
    case QT_Q3_K: return ref_q3_k;
    case QT_Q4_K: return ref_q4_k;
    case QT_Q5_K: return ref_q5_k;
    case QT_Q6_K: return ref_q6_k;
    }
    return 0;
}

/* One row → float32 in the reference's order (core/quant/kquants.py): Q2_K/Q4_K/Q5_K
 * (d·sc)·q - (dmin·mn), Q3_K (d·(sc-32))·(q-4), Q6_K (d·sc)·(q-32), each product rounded. */
int twq_kquant_dequantize(int type, const uint8_t *w, int64_t n, float *out) {
    const int bs = kquant_size(type);
    if (!bs) return -1;
    for (int64_t b = 0; b < n / QKK; b++) {
        int q[QKK], sc[16], mn[16];
        float d, dmin;
        kquant_block(type, w + b * bs, q, sc, mn, &d, &dmin);
        float *o = out + b * QKK;
        for (int i = 0; i < 16; i++) {
            const float dl = d * (float)sc[i];
            if (type == QT_Q3_K || type == QT_Q6_K) {
                const int off = type == QT_Q3_K ? 4 : 32;
                for (int l = 0; l < 16; l++) o[16 * i + l] = dl * (float)(q[16 * i + l] - off);
            } else {
                const float ml = dmin * (float)mn[i];
                for (int l = 0; l < 16; l++) {
                    float t = dl * (float)q[16 * i + l];
                    NOFUSE(t);
                    o[16 * i + l] = t - ml;
                }
            }
        }
    }
    return 0;
}

/* ---- Q4_K in the interleaved 8-row layout (x8: core/quant/interleave.py) ---------------
 * A group of 8 rows, super-block by super-block (8·144 = 1152 bytes each): d[8] | dmin[8]
 * (fp16, rows 0..7) | the 12 packed scale bytes byte-major (byte 32 + 8j + i: row i's byte
 * j) | the quants in runs of 32 bytes, run c (0..31) = bytes 4c..4c+3 of rows 0..7 (so
 * `& 0x0f` gives values 64(c/8) + 4(c%8).. of every row, `>> 4` the same + 32).
 * Per (activation row, sub-block of 32 values) 8 integer dot products (dpbusd, a 4-byte
 * broadcast of the activation) give the 8 weight rows' unscaled sums in 8 int32 lanes;
 * one multiply by the rows' scales per sub-block, the mins through the activation's block
 * sums, and per super-block one conversion and two fused multiply-adds serve 8 rows:
 * row i accumulates acc = fma(d_x·d_i, isum, acc); acc = fma(-(d_x·dmin_i), imin, acc)
 * with isum = Σ sc·q·x and imin = Σ mn·bsum the exact integers of the reference
 * (llama.cpp's repacked block_q4_Kx8 works alike). The result differs from the rows as
 * stored only by float rounding (their AVX2 tile sums 8 lanes per row); a row's result is
 * the same in any tile (batch invariance). */
#define KX8_B (8 * 144)

/* ---- Q6_K x8: a group's super-block is 8·210 = 1680 bytes: d[8] (fp16, rows 0..7) | the
 * 16 int8 scales byte-major (byte 16 + 8j + i: row i's scale j) | the 192 quant bytes (ql
 * 0..127, then qh 128..191 of each row) in runs of 32 bytes, run c (0..47) = bytes 4c..4c+3
 * of rows 0..7: ql run c at 144 + 32c, qh run c' at 1168 + 32c'. ql run 16h + 8p + j (h, p
 * in 0..1, j in 0..7) pairs with qh run 8h + j: its low nibbles are values 32(4h + p) +
 * 4j.. (qh bits 2p..), its high nibbles values 32(4h + p + 2) + 4j.. (qh bits 2p + 4..).
 * The -32 offset goes through the activation's block sums: imin = 32·Σ sc·bsum, and per
 * super-block one fused multiply-add, acc = fma(d_x·d_i, isum - imin, acc), the integers of
 * the reference (ref_dot's Q6_K). */
#define KX8_Q6 (8 * 210)
#define KX8_Q6_QL 144
#define KX8_Q6_QH (144 + 1024)

static void kx8_block_q6(const uint8_t *blk, int i, uint8_t out[210]) {
    memcpy(out + 208, blk + 2 * i, 2);
    for (int j = 0; j < 16; j++) out[192 + j] = blk[16 + 8 * j + i];
    for (int c = 0; c < 48; c++) memcpy(out + 4 * c, blk + KX8_Q6_QL + 32 * c + 4 * i, 4);
}

/* Row i's super-block as stored, from super-block `blk` of an x8 group. */
static void kx8_block(const uint8_t *blk, int i, uint8_t out[144]) {
    memcpy(out, blk + 2 * i, 2);
    memcpy(out + 2, blk + 16 + 2 * i, 2);
    for (int j = 0; j < 12; j++) out[4 + j] = blk[32 + 8 * j + i];
    for (int c = 0; c < 32; c++) memcpy(out + 16 + 4 * c, blk + 128 + 32 * c + 4 * i, 4);
}

/* One group of 8 Q4_K rows as stored (`in`) → the x8 layout (`out`, not overlapping). */
int twq_kx8_interleave_group(int type, const uint8_t *in, int64_t n, uint8_t *out) {
    if ((type != QT_Q4_K && type != QT_Q6_K) || n % QKK) return -1;
    if (type == QT_Q6_K) {
        const int64_t nb = n / QKK, row_bytes = nb * 210;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + b * KX8_Q6;
            for (int i = 0; i < 8; i++) {
                const uint8_t *blk = in + i * row_bytes + b * 210;
                memcpy(o + 2 * i, blk + 208, 2);
                for (int j = 0; j < 16; j++) o[16 + 8 * j + i] = blk[192 + j];
                for (int c = 0; c < 48; c++) memcpy(o + KX8_Q6_QL + 32 * c + 4 * i, blk + 4 * c, 4);
            }
        }
        return 0;
    }
    const int64_t nb = n / QKK, row_bytes = nb * 144;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = out + b * KX8_B;
        for (int i = 0; i < 8; i++) {
            const uint8_t *blk = in + i * row_bytes + b * 144;
            memcpy(o + 2 * i, blk, 2);
            memcpy(o + 16 + 2 * i, blk + 2, 2);
            for (int j = 0; j < 12; j++) o[32 + 8 * j + i] = blk[4 + j];
            for (int c = 0; c < 32; c++) memcpy(o + 128 + 32 * c + 4 * i, blk + 16 + 4 * c, 4);
        }
    }
    return 0;
}

int twq_kx8_dequantize_row(int type, const uint8_t *group, int i, int64_t n, float *out) {
    if ((type != QT_Q4_K && type != QT_Q6_K) || i < 0 || i >= 8) return -1;
    if (type == QT_Q6_K) {
        uint8_t t6[210];
        for (int64_t b = 0; b < n / QKK; b++) {
            kx8_block_q6(group + b * KX8_Q6, i, t6);
            twq_kquant_dequantize(type, t6, QKK, out + b * QKK);
        }
        return 0;
    }
    uint8_t tmp[144];
    for (int64_t b = 0; b < n / QKK; b++) {
        kx8_block(group + b * KX8_B, i, tmp);
        twq_kquant_dequantize(type, tmp, QKK, out + b * QKK);
    }
    return 0;
}

#ifdef __FMA__
#define KX8_FMA(a, b, c) fmaf((a), (b), (c))
#else
#define KX8_FMA(a, b, c) ((a) * (b) + (c))
#endif

/* The scalar x8 reference of Q4_K (d·isum − dmin·imin, two FMAs) and of Q6_K (d·(isum − imin):
 * its −32 offset through the block sums, one FMA): each row's block as stored, the same integers
 * and float steps as the SIMD tiles. */
static inline void ref_kx8(const int T, int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,
                           int64_t ldy) {
    const int64_t nb = n / QKK;
    for (int r = 0; r < nr; r++) {
        const uint8_t *xr = x + r * xs;
        const int8_t *xq = (const int8_t *)xr;
        const float *xd = K_D(xr, n);
        const int16_t *bsums = K_BSUMS(xr, n);
        for (int i = 0; i < 8; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t tmp[210];
                int q[QKK], sc[16], mn[16];
                float d, dmin;
                if (T == QT_Q6_K)
                    kx8_block_q6(w + b * KX8_Q6, i, tmp);
                else
                    kx8_block(w + b * KX8_B, i, tmp);
                kquant_block(T, tmp, q, sc, mn, &d, &dmin);
                int32_t isum = 0, imin = 0;
                for (int s = 0; s < 16; s++) {
                    int32_t t = 0;
                    for (int l = 0; l < 16; l++) t += q[16 * s + l] * xq[b * QKK + 16 * s + l];
                    isum += sc[s] * t;
                    imin += mn[s] * bsums[b * 16 + s];
                }
                if (T == QT_Q6_K) {
                    acc = KX8_FMA(xd[b] * d, (float)(isum - imin), acc);
                } else {
                    acc = KX8_FMA(xd[b] * d, (float)isum, acc);
                    acc = KX8_FMA(-(xd[b] * dmin), (float)imin, acc);
                }
            }
            y[r * ldy + i] = acc;
        }
    }
}

static void ref_kx8_q4_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    ref_kx8(QT_Q4_K, nr, w, x, xs, n, y, ldy);
}

static void ref_kx8_q6_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    ref_kx8(QT_Q6_K, nr, w, x, xs, n, y, ldy);
}

#ifdef __AVX2__
/* A Q4_K x8 super-block's 8 rows' scales and mins, 6 bits each from its 12 packed bytes
 * (byte-major at 32..127: A, B, C): sm[8k + i], mn[8k + i] row i's of sub-block k. */
static inline void kx8_scales_mins(const uint8_t *blk, uint8_t sm[64], uint8_t mn[64]) {
    const __m256i low = _mm256_set1_epi8(0x0f), m63 = _mm256_set1_epi8(63), m30 = _mm256_set1_epi8(0x30);
    const __m256i A = _mm256_loadu_si256((const __m256i *)(blk + 32));
    const __m256i B = _mm256_loadu_si256((const __m256i *)(blk + 64));
    const __m256i C = _mm256_loadu_si256((const __m256i *)(blk + 96));
    _mm256_storeu_si256((__m256i *)sm, _mm256_and_si256(A, m63));
    _mm256_storeu_si256((__m256i *)(sm + 32), _mm256_or_si256(_mm256_and_si256(C, low),
                                                              _mm256_and_si256(_mm256_srli_epi16(A, 2), m30)));
    _mm256_storeu_si256((__m256i *)mn, _mm256_and_si256(B, m63));
    _mm256_storeu_si256((__m256i *)(mn + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(C, 4), low),
                                                              _mm256_and_si256(_mm256_srli_epi16(B, 2), m30)));
}

/* G (1 or 2) consecutive groups of 8 weight rows × NR activation rows: with G = 2 each
 * activation broadcast feeds two groups' dot products (half the shuffles per multiply,
 * which bound the one-group tile); every (weight row, activation row) pair goes through
 * the same instructions in the same order whatever G and NR (batch invariance). */
static inline __attribute__((always_inline)) void tile_kx8(const int G, const int NR, const uint8_t *w,
                                                           const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                           int64_t ldy) {
    const int64_t nb = n / QKK, gs = nb * KX8_B; /* gs: a group's bytes */
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[2][4];
    for (int g = 0; g < G; g++) for (int r = 0; r < NR; r++) acc[g][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t sm[2][64], mn[2][64]; /* per group: scales of sub-blocks 0..7, then mins of 0..7: 8 rows each */
        __m256i isum[2][4], imin[2][4];
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + g * gs + b * KX8_B;
            for (int l = 0; l < KX8_B; l += 64) _mm_prefetch((const char *)blk + QD_PREFETCH + l, _MM_HINT_T0);
            kx8_scales_mins(blk, sm[g], mn[g]);
            for (int r = 0; r < NR; r++) isum[g][r] = imin[g][r] = _mm256_setzero_si256();
        }
        /* mins: int32 lane i = mn_i[2k] | mn_i[2k+1] << 16, against (bsum32[2k], bsum32[2k+1]) */
        for (int k = 0; k < 4; k++) {
            __m256i mp[2];
            for (int g = 0; g < G; g++) {
                const __m128i t = _mm_loadu_si128((const __m128i *)(mn[g] + 16 * k));
                mp[g] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(t, _mm_srli_si128(t, 8)));
            }
            for (int r = 0; r < NR; r++) {
                const int16_t *bs = K_BSUMS(x + r * xs, n) + 16 * b + 4 * k;
                const uint32_t word = (uint16_t)(bs[0] + bs[1]) | (uint32_t)(uint16_t)(bs[2] + bs[3]) << 16;
                const __m256i wv = _mm256_set1_epi32((int)word);
                for (int g = 0; g < G; g++) imin[g][r] = _mm256_add_epi32(imin[g][r], _mm256_madd_epi16(mp[g], wv));
            }
        }
        for (int k = 0; k < 4; k++) { /* sub-blocks 2k (low nibbles) and 2k + 1 (high) */
            __m256i s[2][4], t[2][4];
            for (int g = 0; g < G; g++) for (int r = 0; r < NR; r++) s[g][r] = t[g][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i lo[2], hi[2];
                for (int g = 0; g < G; g++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + g * gs + b * KX8_B + 128 + 32 * (8 * k + j)));
                    lo[g] = _mm256_and_si256(raw, low);
                    hi[g] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                }
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) { /* 16-byte loads + in-lane shuffles (the load pipes bind) */
                    const uint8_t *xb = x + r * xs + b * QKK + 64 * k + 16 * (j / 4);
                    const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb));
                    const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 32)));
                    __m256i al, ah;
                    switch (j % 4) {
                    case 0: al = _mm256_shuffle_epi32(xl, 0x00); ah = _mm256_shuffle_epi32(xh, 0x00); break;
                    case 1: al = _mm256_shuffle_epi32(xl, 0x55); ah = _mm256_shuffle_epi32(xh, 0x55); break;
                    case 2: al = _mm256_shuffle_epi32(xl, 0xaa); ah = _mm256_shuffle_epi32(xh, 0xaa); break;
                    default: al = _mm256_shuffle_epi32(xl, 0xff); ah = _mm256_shuffle_epi32(xh, 0xff); break;
                    }
                    for (int g = 0; g < G; g++) {
                        s[g][r] = qd_dot_u8s8(s[g][r], lo[g], al);
                        t[g][r] = qd_dot_u8s8(t[g][r], hi[g], ah);
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                const __m256i sl = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm[g] + 16 * k)));
                const __m256i sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm[g] + 16 * k + 8)));
                for (int r = 0; r < NR; r++)
                    isum[g][r] = _mm256_add_epi32(isum[g][r], _mm256_add_epi32(_mm256_mullo_epi32(s[g][r], sl),
                                                                               _mm256_mullo_epi32(t[g][r], sh)));
            }
        }
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + g * gs + b * KX8_B;
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
            for (int r = 0; r < NR; r++) {
                const __m256 dx = _mm256_set1_ps(K_D(x + r * xs, n)[b]);
                acc[g][r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, dw), _mm256_cvtepi32_ps(isum[g][r]), acc[g][r]);
                acc[g][r] = _mm256_fnmadd_ps(_mm256_mul_ps(dx, mw), _mm256_cvtepi32_ps(imin[g][r]), acc[g][r]);
            }
        }
    }
    for (int g = 0; g < G; g++) for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + r * ldy + 8 * g, acc[g][r]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KX8_ZMM 1
/* Q4_K's x8 tile in 512-bit vectors (8 or 16 activation rows): two runs of the group per
 * vector, lane 2i row i's run 2m and lane 2i+1 its run 2m+1 (permuted once per sub-block
 * pair for all the rows), so one 8-byte activation broadcast and one dpbusd serve 16 lanes:
 * half tile_kx8's broadcasts and dot products. A row's two lanes of its low-nibble sums and
 * of its high-nibble sums are added into one vector (integers, exact), lanes 4j.. holding
 * weight rows 2j, 2j+1 of the two sub-blocks, so one multiply by the scales serves both
 * sub-blocks. Per super-block two activation rows share a vector for the float work: each
 * 128-bit lane holds weight rows 2j, 2j+1 of the first activation row, then of the second
 * (d_w, dmin_w permuted to match, the mins' integer sums computed in that layout). Every
 * (weight row, activation row) pair meets the same integers and the same float operations in
 * the same order as in tile_kx8 and the reference: the same bits. */
static inline __attribute__((always_inline)) void tile_kx8_zmm(const int NR, const uint8_t *w, const uint8_t *x,
                                                               int64_t xs, int64_t n, float *y, int64_t ldy) {
    const int64_t nb = n / QKK;
    const __m512i runs = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i pairs = _mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[8]; /* activation rows 2p, 2p+1 */
    for (int p = 0; p < NR / 2; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * KX8_B;
        for (int l = 0; l < KX8_B; l += 64) _mm_prefetch((const char *)blk + QD_PREFETCH + l, _MM_HINT_T0);
        uint8_t sm[64], mn[64]; /* scales of sub-blocks 0..7, then mins: byte 8k + i row i's of sub-block k */
        kx8_scales_mins(blk, sm, mn);
        /* per sub-block pair k: int32 lanes 4j.. = the scales of sub-block 2k, rows 2j, 2j+1, then
         * of sub-block 2k+1 (the layout of a row's summed lanes below) */
        __m512i sc[4], mp[4];
        for (int k = 0; k < 4; k++) {
            const __m128i t = _mm_loadu_si128((const __m128i *)(sm + 16 * k));
            sc[k] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi16(t, _mm_srli_si128(t, 8)));
            /* mins: int32 lane i = mn_i[2k] | mn_i[2k+1] << 16, lanes 4j.. rows 2j, 2j+1 twice */
            const __m128i u = _mm_loadu_si128((const __m128i *)(mn + 16 * k));
            mp[k] = _mm512_permutexvar_epi32(pairs, _mm512_castsi256_si512(
                                                        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(u, _mm_srli_si128(u, 8)))));
        }
        const __m512 dw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk))));
        const __m512 mw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))));
#pragma GCC unroll 2
        for (int h = 0; h < NR / 8; h++) { /* 8 activation rows at a time: their sums in the registers */
            __m512i isum[8];
            for (int r = 0; r < 8; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) { /* sub-blocks 2k (low nibbles) and 2k + 1 (high) */
                __m512i lo[4], hi[4];
#pragma GCC unroll 4
                for (int m = 0; m < 4; m++) {
                    const __m512i raw = _mm512_permutexvar_epi32(runs, _mm512_loadu_si512(blk + 128 + 32 * (8 * k + 2 * m)));
                    lo[m] = _mm512_and_si512(raw, low);
                    hi[m] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                }
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const uint8_t *xb = x + (8 * h + r) * xs + b * QKK + 64 * k;
                    __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();
#pragma GCC unroll 4
                    for (int m = 0; m < 4; m++) {
                        long long v, u;
                        memcpy(&v, xb + 8 * m, 8);
                        memcpy(&u, xb + 32 + 8 * m, 8);
                        s = _mm512_dpbusd_epi32(s, lo[m], _mm512_set1_epi64(v));
                        t = _mm512_dpbusd_epi32(t, hi[m], _mm512_set1_epi64(u));
                    }
                    const __m512i st = qd_add_lane_pairs(s, t);
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(st, sc[k]));
                }
            }
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                const int r0 = 8 * h + 2 * p;
                const __m512i is = qd_add_lane_halves(isum[2 * p], isum[2 * p + 1]);
                const int16_t *bs0 = K_BSUMS(x + r0 * xs, n) + 16 * b, *bs1 = K_BSUMS(x + (r0 + 1) * xs, n) + 16 * b;
                __m512i im = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const uint32_t w0 = (uint16_t)(bs0[4 * k] + bs0[4 * k + 1]) | (uint32_t)(uint16_t)(bs0[4 * k + 2] + bs0[4 * k + 3]) << 16;
                    const uint32_t w1 = (uint16_t)(bs1[4 * k] + bs1[4 * k + 1]) | (uint32_t)(uint16_t)(bs1[4 * k + 2] + bs1[4 * k + 3]) << 16;
                    const __m512i wv = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)w0), 0xCCCC, (int)w1);
                    im = _mm512_add_epi32(im, _mm512_madd_epi16(mp[k], wv));
                }
                const float dx0 = K_D(x + r0 * xs, n)[b], dx1 = K_D(x + (r0 + 1) * xs, n)[b];
                const __m512 dx = _mm512_mask_mov_ps(_mm512_set1_ps(dx0), 0xCCCC, _mm512_set1_ps(dx1));
                acc[4 * h + p] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(is), acc[4 * h + p]);
                acc[4 * h + p] = _mm512_fnmadd_ps(_mm512_mul_ps(dx, mw), _mm512_cvtepi32_ps(im), acc[4 * h + p]);
            }
        }
    }
    qd_store_row_pairs(acc, NR / 2, y, ldy);
}
#endif

#ifdef KX8_ZMM
/* Q4_K's two consecutive groups (16 weight rows) in 512-bit vectors: lane i weight row i of
 * the first group, lane 8 + i of the second, so every lane is one weight row's run and an
 * activation's 4 bytes meet all 16 lanes as dpbusd's broadcast memory operand (no broadcast
 * of its own, no lane sums): per activation row and sub-block one chain of 8 dpbusds and one
 * multiply by the 16 rows' scales. A sub-block's weights are unpacked once for all NR rows
 * (1, 2, 4, 8 or 16). The integers and float steps of tile_kx8 and the reference: the same bits. */
static inline __attribute__((always_inline)) void tile_kx8x2_zmm(const int NR, const uint8_t *w, const uint8_t *x,
                                                                 int64_t xs, int64_t n, float *y, int64_t ldy) {
    const int64_t nb = n / QKK, second = nb * KX8_B;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[16];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * KX8_B, *blk2 = blk + second;
        uint8_t sm[2][64], mn[2][64];
        kx8_scales_mins(blk, sm[0], mn[0]);
        kx8_scales_mins(blk2, sm[1], mn[1]);
        __m512i isum[16];
        for (int r = 0; r < NR; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int sb = 0; sb < 8; sb++) { /* sub-block sb: the low (even) or high (odd) nibbles of runs 8(sb/2).. */
            QD_PREFETCH_PART(blk + 2 * second, KX8_B, sb, 8, _MM_HINT_T1); /* the next pair of groups' super-block */
            QD_PREFETCH_PART(blk2 + 2 * second, KX8_B, sb, 8, _MM_HINT_T1);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(sm[0] + 8 * sb)),
                                                                       _mm_loadl_epi64((const __m128i *)(sm[1] + 8 * sb))));
            __m512i W[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int at = 128 + 32 * (8 * (sb / 2) + j);
                const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + at))),
                                                       _mm256_loadu_si256((const __m256i *)(blk2 + at)), 1);
                W[j] = _mm512_and_si512(sb % 2 ? _mm512_srli_epi16(raw, 4) : raw, low);
            }
#pragma GCC unroll 16
            for (int r = 0; r < NR; r++) {
                const uint8_t *xb = x + r * xs + b * QKK + 32 * sb;
                __m512i t = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) t = qd_dpbusd_bcast(t, W[j], xb + 4 * j);
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(t, sc));
            }
        }
        /* mins: int32 lane i = mn_i[2k] | mn_i[2k+1] << 16, against (bsum32[2k], bsum32[2k+1]) */
        __m512i mp[4];
        for (int k = 0; k < 4; k++) {
            const __m128i a = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(mn[0] + 16 * k)),
                                                 _mm_loadl_epi64((const __m128i *)(mn[1] + 16 * k)));
            const __m128i c = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(mn[0] + 16 * k + 8)),
                                                 _mm_loadl_epi64((const __m128i *)(mn[1] + 16 * k + 8)));
            mp[k] = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, c), _mm_unpacklo_epi8(a, c)));
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)blk)), _mm_loadu_si128((const __m128i *)blk2), 1));
        const __m512 mw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 16))), _mm_loadu_si128((const __m128i *)(blk2 + 16)), 1));
        for (int r = 0; r < NR; r++) {
            __m512i imin = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const int16_t *bs = K_BSUMS(x + r * xs, n) + 16 * b + 4 * k;
                const uint32_t word = (uint16_t)(bs[0] + bs[1]) | (uint32_t)(uint16_t)(bs[2] + bs[3]) << 16;
                imin = _mm512_add_epi32(imin, _mm512_madd_epi16(mp[k], _mm512_set1_epi32((int)word)));
            }
            const __m512 dx = _mm512_set1_ps(K_D(x + r * xs, n)[b]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(isum[r]), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dx, mw), _mm512_cvtepi32_ps(imin), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

#ifdef KX8_ZMM
/* 5-16 rows: 16 or 8 in 512-bit vectors, the rest in the 256-bit tile (a function of its own,
 * so that the 1-4 row tiles compile as before) */
static __attribute__((noinline)) void zmm_kx8_q4_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n,
                                                  float *y, int64_t ldy) {
    if (nr == 16) { tile_kx8_zmm(16, w, x, xs, n, y, ldy); return; }
    if (nr >= 8) { tile_kx8_zmm(8, w, x, xs, n, y, ldy); nr -= 8, x += 8 * xs, y += 8 * ldy; }
    if (nr >= 4) { tile_kx8(1, 4, w, x, xs, n, y, ldy); nr -= 4, x += 4 * xs, y += 4 * ldy; }
    switch (nr) {
    case 3: tile_kx8(1, 3, w, x, xs, n, y, ldy); return;
    case 2: tile_kx8(1, 2, w, x, xs, n, y, ldy); return;
    case 1: tile_kx8(1, 1, w, x, xs, n, y, ldy); return;
    }
}
#endif

static __attribute__((noinline)) void avx2_kx8_q4_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    switch (nr) {
    case 4: tile_kx8(1, 4, w, x, xs, n, y, ldy); return;
    case 3: tile_kx8(1, 3, w, x, xs, n, y, ldy); return;
    case 2: tile_kx8(1, 2, w, x, xs, n, y, ldy); return;
    default: tile_kx8(1, 1, w, x, xs, n, y, ldy); return;
    }
}

#ifndef KX8_ZMM /* (the 512-bit tiles take 8 and 16 rows one group at a time) */
/* Two consecutive groups (16 weight rows, y[r·ldy + i] for i < 16). */
static void avx2_kx8x2_q4_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,
                            int64_t ldy) {
    switch (nr) {
    case 4: tile_kx8(2, 4, w, x, xs, n, y, ldy); return;
    case 3: tile_kx8(2, 3, w, x, xs, n, y, ldy); return;
    case 2: tile_kx8(2, 2, w, x, xs, n, y, ldy); return;
    default: tile_kx8(2, 1, w, x, xs, n, y, ldy); return;
    }
}
#endif
#endif

#ifdef __AVX2__
static inline __attribute__((always_inline)) void tile_kx8_q6(const int NR, const uint8_t *w, const uint8_t *x,
                                                              int64_t xs, int64_t n, float *y, int64_t ldy) {
    const int64_t nb = n / QKK;
    const __m256i low = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * KX8_Q6;
        for (int l = 0; l < KX8_Q6; l += 64) _mm_prefetch((const char *)blk + QD_PREFETCH + l, _MM_HINT_T0);
        __m256i isum[4], imin[4];
        for (int r = 0; r < NR; r++) imin[r] = _mm256_setzero_si256();
        /* offsets: int32 lane i = sc_i[2k] | sc_i[2k+1] << 16 (int16), against (bsum[2k], bsum[2k+1]) */
        for (int k = 0; k < 8; k++) {
            const __m128i t = _mm_loadu_si128((const __m128i *)(blk + 16 + 16 * k));
            const __m256i sp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(t, _mm_srli_si128(t, 8)));
            for (int r = 0; r < NR; r++) {
                const int16_t *bs = K_BSUMS(x + r * xs, n) + 16 * b + 2 * k;
                const uint32_t word = (uint16_t)bs[0] | (uint32_t)(uint16_t)bs[1] << 16;
                imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(sp, _mm256_set1_epi32((int)word)));
            }
        }
        /* the sums start at −32·Σ sc·bsum (the −32 offset), so the offsets need no registers of
         * their own through the products (they spilled there); the same integers at the end */
        for (int r = 0; r < NR; r++) isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(imin[r], 5));
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
            for (int p = 0; p < 2; p++)
#pragma GCC unroll 2
                for (int half = 0; half < 2; half++) { /* sub-blocks 2(4h + p) + half and 2(4h + p + 2) + half */
                    __m256i s[4], t[4];
                    for (int r = 0; r < NR; r++) s[r] = t[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
                    for (int jj = 0; jj < 4; jj++) {
                        const int j = 4 * half + jj;
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + KX8_Q6_QL + 32 * (16 * h + 8 * p + j)));
                        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + KX8_Q6_QH + 32 * (8 * h + j)));
                        const __m256i hl = p ? _mm256_slli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4);
                        const __m256i hh = p ? _mm256_srli_epi16(qh, 2) : qh;
                        const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_and_si256(hl, m30));
                        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                                           _mm256_and_si256(hh, m30));
#pragma GCC unroll 4
                        for (int r = 0; r < NR; r++) {
                            const uint8_t *xb = x + r * xs + b * QKK + 32 * (4 * h + p) + 16 * half;
                            const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 64)));
                            /* one of the pair a broadcast load, the other an in-lane shuffle: the
                             * load pipes and the vector pipes share the work */
                            const __m256i al = _mm256_set1_epi32((int)load32(xb + 4 * jj));
                            __m256i ah;
                            switch (jj) {
                            case 0: ah = _mm256_shuffle_epi32(xh, 0x00); break;
                            case 1: ah = _mm256_shuffle_epi32(xh, 0x55); break;
                            case 2: ah = _mm256_shuffle_epi32(xh, 0xaa); break;
                            default: ah = _mm256_shuffle_epi32(xh, 0xff); break;
                            }
                            s[r] = qd_dot_u8s8(s[r], lo, al);
                            t[r] = qd_dot_u8s8(t[r], hi, ah);
                        }
                    }
                    const int sl_at = 2 * (4 * h + p) + half, sh_at = sl_at + 4;
                    const __m256i sl = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * sl_at)));
                    const __m256i sh = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * sh_at)));
                    for (int r = 0; r < NR; r++)
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(s[r], sl),
                                                                             _mm256_mullo_epi32(t[r], sh)));
                }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        for (int r = 0; r < NR; r++) {
            const __m256 dx = _mm256_set1_ps(K_D(x + r * xs, n)[b]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dx, dw), _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#ifdef KX8_ZMM
/* Q6_K's x8 tile in 512-bit vectors (8 or 16 activation rows), as tile_kx8_zmm: two runs of
 * the group per vector (ql and qh permuted alike, once per 8 rows), one 8-byte activation
 * broadcast and one dpbusd for 16 lanes; a row's low- and high-nibble sums of one 16-value
 * half added lane pair by lane pair into one vector (lanes 4j..: rows 2j, 2j+1 of the two
 * sub-blocks), one multiply by both sub-blocks' scales; the −32 offset (32·Σ sc·bsum)
 * subtracted once per super-block in the two-row layout of the float work. The integers and
 * float steps of tile_kx8_q6 and the reference: the same bits. */
static inline __attribute__((always_inline)) void tile_kx8_q6_zmm(const int NR, const uint8_t *w, const uint8_t *x,
                                                                  int64_t xs, int64_t n, float *y, int64_t ldy) {
    const int64_t nb = n / QKK;
    const __m512i runs = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i pairs = _mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7);
    const __m512i low = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[8]; /* activation rows 2p, 2p+1 */
    for (int p = 0; p < NR / 2; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * KX8_Q6;
        for (int l = 0; l < KX8_Q6; l += 64) _mm_prefetch((const char *)blk + QD_PREFETCH + l, _MM_HINT_T0);
        const __m512 dw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk))));
#pragma GCC unroll 2
        for (int hh = 0; hh < NR / 8; hh++) { /* 8 activation rows at a time: their sums in the registers */
            __m512i isum[8];
            for (int r = 0; r < 8; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
                for (int p = 0; p < 2; p++) {
                    __m512i lo[4], hi[4], sc[2];
#pragma GCC unroll 4
                    for (int m = 0; m < 4; m++) {
                        const __m512i raw = _mm512_permutexvar_epi32(runs, _mm512_loadu_si512(blk + KX8_Q6_QL + 32 * (16 * h + 8 * p + 2 * m)));
                        const __m512i qh = _mm512_permutexvar_epi32(runs, _mm512_loadu_si512(blk + KX8_Q6_QH + 32 * (8 * h + 2 * m)));
                        const __m512i hl = p ? _mm512_slli_epi16(qh, 2) : _mm512_slli_epi16(qh, 4);
                        const __m512i hq = p ? _mm512_srli_epi16(qh, 2) : qh;
                        lo[m] = _mm512_ternarylogic_epi32(_mm512_and_si512(raw, low), hl, m30, 0xF8);
                        hi[m] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), hq, m30, 0xF8);
                    }
#pragma GCC unroll 2
                    for (int half = 0; half < 2; half++) { /* int32 lanes 4j..: sub-block sl_at rows 2j, 2j+1, then sh_at */
                        const int sl_at = 2 * (4 * h + p) + half, sh_at = sl_at + 4;
                        const __m128i t = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * sl_at)),
                                                             _mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * sh_at)));
                        sc[half] = _mm512_cvtepi8_epi32(_mm_unpacklo_epi16(t, _mm_srli_si128(t, 8)));
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < 8; r++) {
                        const uint8_t *xb = x + (8 * hh + r) * xs + b * QKK + 32 * (4 * h + p);
#pragma GCC unroll 2
                        for (int half = 0; half < 2; half++) {
                            __m512i s = _mm512_setzero_si512(), u = _mm512_setzero_si512();
#pragma GCC unroll 2
                            for (int m = 2 * half; m < 2 * half + 2; m++) {
                                long long v, v2;
                                memcpy(&v, xb + 8 * m, 8);
                                memcpy(&v2, xb + 64 + 8 * m, 8);
                                s = _mm512_dpbusd_epi32(s, lo[m], _mm512_set1_epi64(v));
                                u = _mm512_dpbusd_epi32(u, hi[m], _mm512_set1_epi64(v2));
                            }
                            const __m512i st = qd_add_lane_pairs(s, u);
                            isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(st, sc[half]));
                        }
                    }
                }
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                const int r0 = 8 * hh + 2 * q;
                __m512i is = qd_add_lane_halves(isum[2 * q], isum[2 * q + 1]);
                const int16_t *bs0 = K_BSUMS(x + r0 * xs, n) + 16 * b, *bs1 = K_BSUMS(x + (r0 + 1) * xs, n) + 16 * b;
                __m512i im = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    const __m128i t = _mm_loadu_si128((const __m128i *)(blk + 16 + 16 * k));
                    const __m512i sp = _mm512_permutexvar_epi32(pairs, _mm512_castsi256_si512(
                                                                           _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(t, _mm_srli_si128(t, 8)))));
                    const uint32_t w0 = (uint16_t)bs0[2 * k] | (uint32_t)(uint16_t)bs0[2 * k + 1] << 16;
                    const uint32_t w1 = (uint16_t)bs1[2 * k] | (uint32_t)(uint16_t)bs1[2 * k + 1] << 16;
                    const __m512i wv = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)w0), 0xCCCC, (int)w1);
                    im = _mm512_add_epi32(im, _mm512_madd_epi16(sp, wv));
                }
                is = _mm512_sub_epi32(is, _mm512_slli_epi32(im, 5));
                const float dx0 = K_D(x + r0 * xs, n)[b], dx1 = K_D(x + (r0 + 1) * xs, n)[b];
                const __m512 dx = _mm512_mask_mov_ps(_mm512_set1_ps(dx0), 0xCCCC, _mm512_set1_ps(dx1));
                acc[4 * hh + q] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(is), acc[4 * hh + q]);
            }
        }
    }
    qd_store_row_pairs(acc, NR / 2, y, ldy);
}
#endif

#ifdef KX8_ZMM
/* Q6_K's two consecutive groups (16 weight rows) in 512-bit vectors, as tile_kx8x2_zmm: lane i
 * weight row i of the first group, lane 8 + i of the second; a run's 6-bit values (its ql
 * nibbles with two qh bits each, one ternary logic) meet an activation's 4 bytes as dpbusd's
 * broadcast operand; per activation row and 16-value sub-block one chain of 4 dpbusds and one
 * multiply by the 16 rows' scales; the −32 offset (32·Σ sc·bsum) once per super-block. The
 * integers and float steps of tile_kx8_q6 and the reference: the same bits. */
static inline __attribute__((always_inline)) void tile_kx8x2_q6_zmm(const int NR, const uint8_t *w, const uint8_t *x,
                                                                    int64_t xs, int64_t n, float *y, int64_t ldy) {
    const int64_t nb = n / QKK, second = nb * KX8_Q6;
    const __m512i low = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[16];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * KX8_Q6, *blk2 = blk + second;
        __m512i isum[16];
        for (int r = 0; r < NR; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int q = 0; q < 8; q++) { /* ql runs 16h + 8p.. (q = 4h + 2p + nib): their low (nib 0) or high nibbles */
            const int h = q / 4, p = q / 2 % 2, nib = q % 2;
            /* the next pair of groups' super-block, a few lines a step, into L2: prefetches into L1
             * hold its miss buffers until filled, and at one row (the weights streaming from
             * memory) that halved the read speed; into L2 the tile reads at or above the rows
             * as stored from one row on */
            QD_PREFETCH_PART(blk + 2 * second, KX8_Q6, q, 8, _MM_HINT_T1);
            QD_PREFETCH_PART(blk2 + 2 * second, KX8_Q6, q, 8, _MM_HINT_T1);
            __m512i W[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int at = KX8_Q6_QL + 32 * (16 * h + 8 * p + j), hat = KX8_Q6_QH + 32 * (8 * h + j);
                const __m512i ql = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + at))),
                                                      _mm256_loadu_si256((const __m256i *)(blk2 + at)), 1);
                const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + hat))),
                                                      _mm256_loadu_si256((const __m256i *)(blk2 + hat)), 1);
                const __m512i hb = nib ? (p ? _mm512_srli_epi16(qh, 2) : qh) : (p ? _mm512_slli_epi16(qh, 2) : _mm512_slli_epi16(qh, 4));
                W[j] = _mm512_ternarylogic_epi32(_mm512_and_si512(nib ? _mm512_srli_epi16(ql, 4) : ql, low), hb, m30, 0xF8);
            }
            /* W[j] holds values 128h + 32p + 64·nib + 4j..: sub-blocks sa (j < 4) and sa + 1 */
            const int sa = 8 * h + 2 * p + 4 * nib;
            const __m512i sca = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * sa)),
                                                                        _mm_loadl_epi64((const __m128i *)(blk2 + 16 + 8 * sa))));
            const __m512i scb = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(blk + 24 + 8 * sa)),
                                                                        _mm_loadl_epi64((const __m128i *)(blk2 + 24 + 8 * sa))));
#pragma GCC unroll 16
            for (int r = 0; r < NR; r++) {
                const uint8_t *xb = x + r * xs + b * QKK + 16 * sa;
                __m512i ta = _mm512_setzero_si512(), tb = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    ta = qd_dpbusd_bcast(ta, W[j], xb + 4 * j);
                    tb = qd_dpbusd_bcast(tb, W[4 + j], xb + 16 + 4 * j);
                }
                isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(ta, sca), _mm512_mullo_epi32(tb, scb)));
            }
        }
        /* offsets: int32 lane i = sc_i[2k] | sc_i[2k+1] << 16 (int16), against (bsum[2k], bsum[2k+1]) */
        __m512i sp[8];
        for (int k = 0; k < 8; k++) {
            const __m128i a = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(blk + 16 + 16 * k)),
                                                 _mm_loadl_epi64((const __m128i *)(blk2 + 16 + 16 * k)));
            const __m128i c = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(blk + 24 + 16 * k)),
                                                 _mm_loadl_epi64((const __m128i *)(blk2 + 24 + 16 * k)));
            sp[k] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, c), _mm_unpacklo_epi8(a, c)));
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)blk)), _mm_loadu_si128((const __m128i *)blk2), 1));
        for (int r = 0; r < NR; r++) {
            const int16_t *bs = K_BSUMS(x + r * xs, n) + 16 * b;
            __m512i im = _mm512_setzero_si512();
            for (int k = 0; k < 8; k++) {
                const uint32_t word = (uint16_t)bs[2 * k] | (uint32_t)(uint16_t)bs[2 * k + 1] << 16;
                im = _mm512_add_epi32(im, _mm512_madd_epi16(sp[k], _mm512_set1_epi32((int)word)));
            }
            const __m512 dx = _mm512_set1_ps(K_D(x + r * xs, n)[b]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, dw), _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r], _mm512_slli_epi32(im, 5))), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

#ifdef KX8_ZMM
/* 5-16 rows: 16 or 8 in 512-bit vectors, the rest in the 256-bit tile (a function of its own,
 * so that the 1-4 row tiles compile as before) */
static __attribute__((noinline)) void zmm_kx8_q6_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n,
                                                  float *y, int64_t ldy) {
    if (nr == 16) { tile_kx8_q6_zmm(16, w, x, xs, n, y, ldy); return; }
    if (nr >= 8) { tile_kx8_q6_zmm(8, w, x, xs, n, y, ldy); nr -= 8, x += 8 * xs, y += 8 * ldy; }
    if (nr >= 4) { tile_kx8_q6(4, w, x, xs, n, y, ldy); nr -= 4, x += 4 * xs, y += 4 * ldy; }
    switch (nr) {
    case 3: tile_kx8_q6(3, w, x, xs, n, y, ldy); return;
    case 2: tile_kx8_q6(2, w, x, xs, n, y, ldy); return;
    case 1: tile_kx8_q6(1, w, x, xs, n, y, ldy); return;
    }
}
#endif

static __attribute__((noinline)) void avx2_kx8_q6_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    switch (nr) {
    case 4: tile_kx8_q6(4, w, x, xs, n, y, ldy); return;
    case 3: tile_kx8_q6(3, w, x, xs, n, y, ldy); return;
    case 2: tile_kx8_q6(2, w, x, xs, n, y, ldy); return;
    default: tile_kx8_q6(1, w, x, xs, n, y, ldy); return;
    }
}
#endif

#ifdef KX8_ZMM
/* 5-16 rows in the 512-bit tiles, 1-4 in the 256-bit ones (functions of their own: the 1-4 row
 * tiles compile as in builds without the 512-bit ones) */
static void wide_kx8_q4_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    if (nr > 4) zmm_kx8_q4_k(nr, w, x, xs, n, y, ldy);
    else avx2_kx8_q4_k(nr, w, x, xs, n, y, ldy);
}

static void wide_kx8_q6_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    if (nr > 4) zmm_kx8_q6_k(nr, w, x, xs, n, y, ldy);
    else avx2_kx8_q6_k(nr, w, x, xs, n, y, ldy);
}
#endif

#ifdef KX8_ZMM
/* Two Q4_K or Q6_K groups (16 weight rows, y[r·ldy + i] for i < 16) × 1-16 activation rows. */
#define KX8X2_Q4_K(NR) tile_kx8x2_zmm(NR, w, x, xs, n, y, ldy)
#define KX8X2_Q6_K(NR) tile_kx8x2_q6_zmm(NR, w, x, xs, n, y, ldy)
static void zmm_kx8x2_q4_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    QD_BY_POWERS(KX8X2_Q4_K)
}

static void zmm_kx8x2_q6_k(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y, int64_t ldy) {
    QD_BY_POWERS(KX8X2_Q6_K)
}
#endif

/* The x8 tiles of a K type (`type`: its own id; Q4_K, Q6_K): 8 weight rows × 1–4 activation
 * rows, y[r·ldy + i] for i < 8. */
qtile_fn twq_kx8_tile(int type, int reference) {
    if (type != QT_Q4_K && type != QT_Q6_K) return 0;
#ifdef __AVX2__
#ifdef KX8_ZMM
    if (!reference) return type == QT_Q6_K ? wide_kx8_q6_k : wide_kx8_q4_k;
#endif
    if (!reference) return type == QT_Q6_K ? avx2_kx8_q6_k : avx2_kx8_q4_k;
#endif
    (void)reference;
    return type == QT_Q6_K ? ref_kx8_q6_k : ref_kx8_q4_k;
}

/* A tile of two consecutive groups (16 weight rows) where this build has one, else NULL
 * (q_gemm then runs the one-group tile per group). */
qtile_fn twq_kx8_pair_tile(int type) {
#ifdef __AVX2__
#ifdef KX8_ZMM
    if (type == QT_Q4_K) return zmm_kx8x2_q4_k;
    if (type == QT_Q6_K) return zmm_kx8x2_q6_k;
#else
    if (type == QT_Q4_K) return avx2_kx8x2_q4_k;
#endif
#endif
    (void)type;
    return 0;
}

/* The fewest activation rows q_gemm gives a K type's two-group tile (below that, one group a
 * tile: two weight streams read slower from memory at a few rows, Q4_K 0.5-0.7x at 1-4 rows).
 * Q6_K's 512-bit two-group tile streams at or above the rows as stored from one row on. */
int twq_kx8_pair_from(int type) {
#ifdef KX8_ZMM
    if (type == QT_Q6_K || type == QT_Q4_K) return 1;
#endif
    (void)type;
    return 8;
}

/* Whether loading should interleave a K type (1) or keep its rows as stored (0): Q6_K only
 * where its two-group tile runs every batch (its one-group tiles stream at 0.4-0.8x the rows
 * as stored at 1-4 rows, which is where most runs are). */
int twq_kx8_at_load(int type) {
#ifdef KX8_ZMM
    return type == QT_Q4_K || type == QT_Q6_K;
#else
    return type == QT_Q4_K;
#endif
}

/* The most activation rows one x8 tile call of a K type takes: 16 with the 512-bit tiles (a
 * super-block's weights unpacked once for 8 rows, its scales once for 16), else 4. */
int twq_kx8_tile_rows(int type) {
#ifdef KX8_ZMM
    return 16;
#endif
    (void)type;
    return 4;
}
