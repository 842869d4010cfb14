/* The 32-value block types against prepared int8 activations: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
 *
 * Per block, the weight quants q (unsigned: 0..15, 0..31; Q8_0's signed ones by the sign
 * trick, |w|·sign(x, w)) meet the activation's int8 quants in one integer dot product;
 * Q4_0/Q5_0's offset enters through the block sum Σx_q the activation row carries, so
 * d_w·d_x·(Σq·x_q - off·Σx_q) is exact up to one float product per block; Q4_1/Q5_1's min
 * adds m·(d_x·Σx_q). The AVX2 tile unpacks each weight block once for its 1–4 activation
 * rows; each row keeps its own accumulator, summed in the same order whatever the tile's
 * size. The scalar reference computes the same integers and adds block by block.
 */
#include <math.h>

#include "qdot.h"

/* The prepared row (qdot.h): qs[n] | {d_x, d_x·Σx_q} per block | int32 {-8·Σx_q, -16·Σx_q}
 * per block (Q4_0's and Q5_0's offsets). */
#define LEGACY_DX(x, n) ((const float *)((x) + (n)))
#define LEGACY_OFF(x, n) ((const int32_t *)((x) + (n) + 8 * ((n) / QK)))

/* ---- scalar reference ---------------------------------------------------------------- */

/* A block's weight quants as integers (offset applied) and its d, m. */
static void legacy_block(int type, const uint8_t *b, int q[QK], float *d, float *m) {
    *d = qd_f16(b);
    *m = 0.0f;
    const uint8_t *qs;
    uint32_t qh = 0;
    switch (type) {
    case QT_Q8_0:
        for (int j = 0; j < QK; j++) q[j] = (int8_t)b[2 + j];
        return;
    case QT_Q4_0: qs = b + 2; break;
    case QT_Q4_1: *m = qd_f16(b + 2); qs = b + 4; break;
    case QT_Q5_0: memcpy(&qh, b + 2, 4); qs = b + 6; break;
    default: /* Q5_1 */ *m = qd_f16(b + 2); memcpy(&qh, b + 4, 4); qs = b + 8; break;
    }
    for (int j = 0; j < 16; j++) {
        q[j] = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
        q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
    const int off = type == QT_Q4_0 ? 8 : type == QT_Q5_0 ? 16 : 0;
    for (int j = 0; j < QK; j++) q[j] -= off;
}

static int legacy_size(int type) {
    switch (type) {
    case QT_Q4_0: return 18;
    case QT_Q4_1: return 20;
    case QT_Q5_0: return 22;
    case QT_Q5_1: return 24;
    case QT_Q8_0: return 34;
    }
    return 0;
}

static float ref_dot(int type, const uint8_t *w, const uint8_t *x, int64_t n) {
    const int64_t nb = n / QK;
    const int8_t *xq = (const int8_t *)x;
    const float *xd = LEGACY_DX(x, n);
    const int bs = legacy_size(type);
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int q[QK];
        float d, m;
        legacy_block(type, w + b * bs, q, &d, &m);
        int32_t isum = 0;
        for (int j = 0; j < QK; j++) isum += q[j] * xq[b * QK + j];
        sum += d * xd[2 * b] * (float)isum;
        if (type == QT_Q4_1 || type == QT_Q5_1) sum += m * xd[2 * b + 1];
    }
    return sum;
}

#define REF_TILE(T, NAME)                                                                             \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        for (int r = 0; r < nr; r++) y[r * ldy] = ref_dot(T, w, x + r * xs, n);                      \
    }
REF_TILE(QT_Q4_0, ref_q4_0)
REF_TILE(QT_Q4_1, ref_q4_1)
REF_TILE(QT_Q5_0, ref_q5_0)
REF_TILE(QT_Q5_1, ref_q5_1)
REF_TILE(QT_Q8_0, ref_q8_0)

/* ---- AVX2 ------------------------------------------------------------------------------ */
#ifdef __AVX2__
/* 16 bytes of nibbles → 32 bytes: low nibbles (values 0..15) in the low half, high ones
 * above (one broadcast load, one variable shift, one and). */
static inline __m256i nibbles32(const uint8_t *p) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0f));
}

/* 32 bits → 32 bytes, byte j = 0x10 where bit j is set (the 5th bit of value j). */
static inline __m256i bits32_to_0x10(const uint8_t *p) {
    float f; /* broadcast straight from memory: a load, no integer-to-vector move */
    memcpy(&f, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i bytes = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_castps_si256(_mm256_set1_ps(f)), shuf), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(0x10));
}

/* Per block and row: the integer dot product (plus Q4_0/Q5_0's integer offset) as 8 int32
 * lanes, times d·d_x into one of the row's two vector accumulators (even and odd blocks:
 * two chains of FMAs, not one, hide their latency at batch 1); Q4_1/Q5_1's m·(d_x·Σx_q)
 * comes from the same 2-lane product [d, m]·[d_x, d_x·Σx_q] into a third, lane 1 of which
 * is kept. */
static inline __attribute__((always_inline)) void legacy_step(const int T, const int NR, const uint8_t *blk,
                                                              const uint8_t *x, int64_t xs, int64_t n, int64_t b,
                                                              __m256 *acc, __m128 *accm) {
    const int has_min = T == QT_Q4_1 || T == QT_Q5_1, has_off = T == QT_Q4_0 || T == QT_Q5_0;
    uint32_t dm;
    memcpy(&dm, blk, 4); /* d, and m where the type has one */
    const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    __m256i q, sgn = _mm256_setzero_si256();
    if (T == QT_Q8_0) {
        sgn = _mm256_loadu_si256((const __m256i *)(blk + 2));
        q = _mm256_sign_epi8(sgn, sgn);
    } else if (T == QT_Q4_0) {
        q = nibbles32(blk + 2);
    } else if (T == QT_Q4_1) {
        q = nibbles32(blk + 4);
    } else if (T == QT_Q5_0) {
        q = _mm256_or_si256(nibbles32(blk + 6), bits32_to_0x10(blk + 2));
    } else {
        q = _mm256_or_si256(nibbles32(blk + 8), bits32_to_0x10(blk + 4));
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        /* Row r's quants of block b, its {d_x, d_x·Σx_q}, its offsets: addressed from the row
         * and the block index (row pointers stepped per row were vectorized by gcc into
         * vector registers, extracted again for every load: the tile's real bottleneck). */
        const uint8_t *xr = x + r * xs;
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + b * QK));
        if (T == QT_Q8_0) xv = _mm256_sign_epi8(xv, sgn);
        __m256i p = _mm256_setzero_si256();
        if (has_off) p = _mm256_zextsi128_si256(_mm_cvtsi32_si128(LEGACY_OFF(xr, n)[2 * b + (T == QT_Q5_0)]));
        p = qd_dot_u8s8(p, q, xv);
        const __m128 scales = _mm_mul_ps(dmf, _mm_castpd_ps(_mm_load_sd((const double *)(LEGACY_DX(xr, n) + 2 * b))));
        acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), _mm256_cvtepi32_ps(p), acc[r]);
        if (has_min) accm[r] = _mm_add_ps(accm[r], scales);
    }
}

static inline __attribute__((always_inline)) void tile_legacy(const int T, const int NR, const uint8_t *w,
                                                              const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                              int64_t ldy) {
    const int64_t nb = n / QK;
    const int bs = T == QT_Q4_0 ? 18 : T == QT_Q4_1 ? 20 : T == QT_Q5_0 ? 22 : T == QT_Q5_1 ? 24 : 34;
    __m256 even[4], odd[4];
    __m128 accm[4];
    for (int r = 0; r < NR; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        accm[r] = _mm_setzero_ps();
    }
    const uint8_t *blk = w;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, blk += 2 * bs) {
        /* the weights stream from memory once: ask for them QD_PREFETCH bytes ahead (the
         * hardware prefetcher alone kept a core at ~60% of its read bandwidth) */
        _mm_prefetch((const char *)blk + QD_PREFETCH, _MM_HINT_T0);
        if (2 * bs > 64) _mm_prefetch((const char *)blk + QD_PREFETCH + 64, _MM_HINT_T0);
        legacy_step(T, NR, blk, x, xs, n, b, even, accm);
        legacy_step(T, NR, blk + bs, x, xs, n, b + 1, odd, accm);
    }
    if (b < nb) legacy_step(T, NR, blk, x, xs, n, b, even, accm);
    for (int r = 0; r < NR; r++)
        y[r * ldy] = qd_hsum(_mm256_add_ps(even[r], odd[r])) +
                     ((T == QT_Q4_1 || T == QT_Q5_1) ? _mm_cvtss_f32(_mm_movehdup_ps(accm[r])) : 0.0f);
}

#define AVX2_TILE(T, NAME)                                                                            \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        switch (nr) {                                                                                \
        case 4: tile_legacy(T, 4, w, x, xs, n, y, ldy); return;                                      \
        case 3: tile_legacy(T, 3, w, x, xs, n, y, ldy); return;                                      \
        case 2: tile_legacy(T, 2, w, x, xs, n, y, ldy); return;                                      \
        default: tile_legacy(T, 1, w, x, xs, n, y, ldy); return;                                     \
        }                                                                                            \
    }
AVX2_TILE(QT_Q4_0, avx2_q4_0)
AVX2_TILE(QT_Q4_1, avx2_q4_1)
AVX2_TILE(QT_Q5_0, avx2_q5_0)
AVX2_TILE(QT_Q5_1, avx2_q5_1)
AVX2_TILE(QT_Q8_0, avx2_q8_0)
#endif

qtile_fn twq_legacy_tile(int type, int reference) {
#ifdef __AVX2__
    if (!reference) switch (type) {
        case QT_Q4_0: return avx2_q4_0;
        case QT_Q4_1: return avx2_q4_1;
        case QT_Q5_0: return avx2_q5_0;
        case QT_Q5_1: return avx2_q5_1;
        case QT_Q8_0: return avx2_q8_0;
        }
#endif
    (void)reference;
    switch (type) {
    case QT_Q4_0: return ref_q4_0;
    case QT_Q4_1: return ref_q4_1;
    case QT_Q5_0: return ref_q5_0;
    case QT_Q5_1: return ref_q5_1;
    case QT_Q8_0: return ref_q8_0;
    }
    return 0;
}

/* One row of n values → float32, in the reference's order of operations (core/quant/legacy.py:
 * Q8_0 q·d, Q4_0/Q5_0 d·(q - off), Q4_1/Q5_1 (d·q) + m, each product rounded). */
#ifdef __AVX2__
/* 8 quants (int32 lanes) → d·q, or (d·q) + m with the product rounded first (NOFUSE), as the
 * reference computes them. */
static inline void dq8(__m256i q, __m256 d, __m256 m, int has_min, float *o) {
    __m256 t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
    if (has_min) {
        NOFUSE(t);
        t = _mm256_add_ps(t, m);
    }
    _mm256_storeu_ps(o, t);
}

/* One block of a 32-value type → 32 floats, vectorized; the same values as the scalar loop. */
static void dequantize_block_avx2(int type, const uint8_t *b, float *o) {
    const __m256 d = _mm256_set1_ps(qd_f16(b));
    if (type == QT_Q8_0) {
        for (int j = 0; j < QK; j += 8)
            dq8(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + j))), d, d, 0, o + j);
        return;
    }
    const int has_min = type == QT_Q4_1 || type == QT_Q5_1;
    const __m256 m = _mm256_set1_ps(has_min ? qd_f16(b + 2) : 0.0f);
    uint32_t qh = 0;
    const uint8_t *qs = b + (type == QT_Q4_0 ? 2 : type == QT_Q4_1 ? 4 : type == QT_Q5_0 ? 6 : 8);
    if (type == QT_Q5_0 || type == QT_Q5_1) memcpy(&qh, b + (type == QT_Q5_0 ? 2 : 4), 4);
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), lowmask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, lowmask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lowmask);
    const int off = type == QT_Q4_0 ? 8 : type == QT_Q5_0 ? 16 : 0;
    const __m256i offv = _mm256_set1_epi32(off), shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i qhv = _mm256_set1_epi32((int)qh), one = _mm256_set1_epi32(1);
    for (int j = 0; j < QK; j += 8) { /* values j..j+7: low nibbles of bytes j..j+7, then high ones of bytes j-16.. */
        const __m128i src = j < 16 ? _mm_srli_si128(lo, 0) : hi;
        const __m128i bytes = (j & 8) ? _mm_srli_si128(src, 8) : src;
        __m256i q = _mm256_cvtepu8_epi32(bytes);
        if (qh) {
            const __m256i bits = _mm256_and_si256(_mm256_srlv_epi32(qhv, _mm256_add_epi32(shifts, _mm256_set1_epi32(j))), one);
            q = _mm256_or_si256(q, _mm256_slli_epi32(bits, 4));
        }
        dq8(_mm256_sub_epi32(q, offv), d, m, has_min, o + j);
    }
}
#endif

/* One block as stored → 32 floats (the reference's values). */
static void dequantize_block(int type, const uint8_t *blk, float *o) {
#ifdef __AVX2__
    dequantize_block_avx2(type, blk, o);
#else
    int q[QK];
    float d, m;
    legacy_block(type, blk, q, &d, &m);
    if (type == QT_Q4_1 || type == QT_Q5_1) {
        /* The products first, whole, then the adds: the memory barrier between the two loops
         * keeps the compiler from fusing them (a fused multiply-add would round once, the
         * reference twice) while both loops still vectorize. */
        float t[QK];
        for (int j = 0; j < QK; j++) t[j] = d * (float)q[j];
        __asm__ volatile("" : : "r"(t) : "memory");
        for (int j = 0; j < QK; j++) o[j] = t[j] + m;
    } else {
        for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
    }
#endif
}

int twq_legacy_dequantize(int type, const uint8_t *w, int64_t n, float *out) {
    const int bs = legacy_size(type);
    if (!bs) return -1;
    for (int64_t b = 0; b < n / QK; b++) dequantize_block(type, w + b * bs, out + b * QK);
    return 0;
}

/* ---- the interleaved 8-row layout (x8: core/quant/interleave.py) ------------------------
 * A group of 8 rows, block by block (8·size bytes per block): d[8] | m[8] (Q4_1, Q5_1) |
 * qh[8] (Q5_0, Q5_1; uint32) | the quants in runs of 32 bytes, run c = bytes 4c..4c+3 of
 * rows 0..7. Per (activation row, block) one integer dot product gives the 8 weight rows'
 * sums in the 8 int32 lanes of a vector, so one conversion and one fused multiply-add
 * (scale d_w[8]·d_x) serve 8 weight rows: row i of the group accumulates
 * acc = fma(d_i·d_x, Σ_j q_ij·x_j, acc) block after block (then acc = fma(m_i, d_x·Σx_q, acc)
 * for Q4_1/Q5_1: one accumulator a row, so 8 rows' fit in the registers beside their sums). */

static int x8_fields(int type, int *qh_at) { /* where the quants start in a block of the group */
    const int has_min = type == QT_Q4_1 || type == QT_Q5_1, five = type == QT_Q5_0 || type == QT_Q5_1;
    *qh_at = 16 + 16 * has_min;
    return *qh_at + 32 * five;
}

/* Row i's block as stored, from block `blk` of an x8 group. */
static void x8_block(int type, const uint8_t *blk, int i, uint8_t *out) {
    const int bs = legacy_size(type);
    int qh_at;
    const int q_at = x8_fields(type, &qh_at), q_bytes = type == QT_Q8_0 ? 32 : 16;
    memcpy(out, blk + 2 * i, 2);
    int at = 2;
    if (type == QT_Q4_1 || type == QT_Q5_1) { memcpy(out + at, blk + 16 + 2 * i, 2); at += 2; }
    if (type == QT_Q5_0 || type == QT_Q5_1) { memcpy(out + at, blk + qh_at + 4 * i, 4); at += 4; }
    for (int c = 0; c < q_bytes / 4; c++) memcpy(out + at + 4 * c, blk + q_at + 32 * c + 4 * i, 4);
    (void)bs;
}

/* One group of 8 rows as stored (`in`, 8 rows of n values) → the x8 layout (`out`, the same
 * size; not overlapping `in`). The same bytes as core/quant/interleave.py's interleave. */
int twq_x8_interleave_group(int type, const uint8_t *in, int64_t n, uint8_t *out) {
    const int bs = legacy_size(type);
    if (!bs) return -1;
    const int64_t nb = n / QK, row_bytes = nb * bs;
    int qh_at;
    const int q_at = x8_fields(type, &qh_at), runs = (type == QT_Q8_0 ? 32 : 16) / 4;
    const int has_min = type == QT_Q4_1 || type == QT_Q5_1, five = type == QT_Q5_0 || type == QT_Q5_1;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = out + b * 8 * bs;
        for (int i = 0; i < 8; i++) {
            const uint8_t *blk = in + i * row_bytes + b * bs;
            int at = 2;
            memcpy(o + 2 * i, blk, 2);
            if (has_min) { memcpy(o + 16 + 2 * i, blk + at, 2); at += 2; }
            if (five) { memcpy(o + qh_at + 4 * i, blk + at, 4); at += 4; }
            for (int c = 0; c < runs; c++) memcpy(o + q_at + 32 * c + 4 * i, blk + at + 4 * c, 4);
        }
    }
    return 0;
}

int twq_x8_dequantize_row(int type, const uint8_t *group, int i, int64_t n, float *out) {
    const int bs = legacy_size(type);
    if (!bs || i < 0 || i >= 8) return -1;
    uint8_t tmp[34];
    for (int64_t b = 0; b < n / QK; b++) {
        x8_block(type, group + b * 8 * bs, i, tmp);
        dequantize_block(type, tmp, out + b * QK);
    }
    return 0;
}

/* fma where the build has it (then the AVX2 tile and this reference agree bit for bit),
 * else a product and a sum (within float rounding of it). */
#ifdef __FMA__
#define X8_FMA(a, b, c) fmaf((a), (b), (c))
#else
#define X8_FMA(a, b, c) ((a) * (b) + (c))
#endif

static void ref_x8(int type, int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,
                   int64_t ldy) {
    const int64_t nb = n / QK;
    const int bs = legacy_size(type), has_min = type == QT_Q4_1 || type == QT_Q5_1;
    for (int r = 0; r < nr; r++) {
        const uint8_t *xr = x + r * xs;
        const int8_t *xq = (const int8_t *)xr;
        const float *xd = LEGACY_DX(xr, n);
        for (int i = 0; i < 8; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t tmp[34];
                int q[QK];
                float d, m;
                x8_block(type, w + b * 8 * bs, i, tmp);
                legacy_block(type, tmp, q, &d, &m);
                int32_t isum = 0;
                for (int j = 0; j < QK; j++) isum += q[j] * xq[b * QK + j];
                acc = X8_FMA(d * xd[2 * b], (float)isum, acc);
                if (has_min) acc = X8_FMA(m, xd[2 * b + 1], acc);
            }
            y[r * ldy + i] = acc;
        }
    }
}

#define REF_X8_TILE(T, NAME)                                                                          \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        ref_x8(T, nr, w, x, xs, n, y, ldy);                                                          \
    }
REF_X8_TILE(QT_Q4_0, ref_x8_q4_0)
REF_X8_TILE(QT_Q4_1, ref_x8_q4_1)
REF_X8_TILE(QT_Q5_0, ref_x8_q5_0)
REF_X8_TILE(QT_Q5_1, ref_x8_q5_1)
REF_X8_TILE(QT_Q8_0, ref_x8_q8_0)

#ifdef __AVX2__
/* The x8 tiles' constants of a 32-value type T (a compile-time constant there): whether it has
 * mins (Q4_1/Q5_1), offsets (Q4_0/Q5_0) and 5th bits (Q5_0/Q5_1); a row's block bytes (bs); in
 * a group's block (B = 8·bs bytes: d[8] | m[8] | qh | quants), where qh and the quants start. */
#define X8_LAYOUT(T)                                                                                  \
    const int has_min = (T) == QT_Q4_1 || (T) == QT_Q5_1, has_off = (T) == QT_Q4_0 || (T) == QT_Q5_0; \
    const int five = (T) == QT_Q5_0 || (T) == QT_Q5_1;                                                \
    const int bs = (T) == QT_Q4_0 ? 18 : (T) == QT_Q4_1 ? 20 : (T) == QT_Q5_0 ? 22 : (T) == QT_Q5_1 ? 24 : 34; \
    const int qh_at = 16 + 16 * has_min, q_at = qh_at + 32 * five, B = 8 * bs

/* 4 bytes of an activation row, broadcast to the 8 lanes (one vpbroadcastd from memory). */
static inline __m256i bcast4(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return _mm256_castps_si256(_mm256_set1_ps(f));
}

/* The 5th bits of 4 values of each of the 8 rows as 0x10 bytes: bits 4c'..4c'+3 of each
 * lane's qh (c' = 0..7: values 4c'.., bits in byte c'/2, its low or high nibble). */
static inline __m256i x8_high_bits(__m256i qh, const int c) {
    const int byte = c / 2;
    const __m256i shuf = _mm256_setr_epi8(byte, byte, byte, byte, 4 + byte, 4 + byte, 4 + byte, 4 + byte,
                                          8 + byte, 8 + byte, 8 + byte, 8 + byte, 12 + byte, 12 + byte, 12 + byte,
                                          12 + byte, byte, byte, byte, byte, 4 + byte, 4 + byte, 4 + byte, 4 + byte,
                                          8 + byte, 8 + byte, 8 + byte, 8 + byte, 12 + byte, 12 + byte, 12 + byte,
                                          12 + byte);
    const __m256i bit = c % 2 ? _mm256_set1_epi32((int)0x80402010u) : _mm256_set1_epi32(0x08040201);
    const __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(qh, shuf), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(t, bit), _mm256_set1_epi8(0x10));
}

#if defined(__AVX512BITALG__) && defined(__AVX512VL__) && defined(__AVX512BW__)
/* vpshufbitqmb's selector for the 5th bits of values first..first+3 of each row: byte b of
 * each 64-bit lane (two rows' qh) names bit first + b of its first row (b < 4) or of its
 * second (32 + first + b - 4), so mask bit 4i + t is bit first + t of row i's qh. */
static inline long long x8_bit_selector(int first) {
    unsigned long long v = 0;
    for (int b = 0; b < 4; b++)
        v |= (unsigned long long)(first + b) << (8 * b) | (unsigned long long)(32 + first + b) << (8 * (b + 4));
    return (long long)v;
}
#endif

/* Run c of a block's 4-bit quants as the 8 rows' low and high values (with their 5th bits for
 * Q5_0/Q5_1): the weight bytes every x8 tile multiplies. With AVX-512 BITALG the 5th bits come
 * as a byte mask from one bit gather each (vpshufbitqmb) and a masked add (two operations,
 * not x8_high_bits' four and an or): the same bytes. */
static inline __attribute__((always_inline)) void x8_values(const uint8_t *blk, int q_at, int five, __m256i qh,
                                                            int c, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + q_at + 32 * c));
    *lo = _mm256_and_si256(raw, low);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    if (five) {
#if defined(__AVX512BITALG__) && defined(__AVX512VL__) && defined(__AVX512BW__)
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        const __mmask32 ml = _mm256_bitshuffle_epi64_mask(qh, _mm256_set1_epi64x(x8_bit_selector(4 * c)));
        const __mmask32 mh = _mm256_bitshuffle_epi64_mask(qh, _mm256_set1_epi64x(x8_bit_selector(16 + 4 * c)));
        *lo = _mm256_mask_add_epi8(*lo, ml, *lo, bit4);
        *hi = _mm256_mask_add_epi8(*hi, mh, *hi, bit4);
#else
        *lo = _mm256_or_si256(*lo, x8_high_bits(qh, c));
        *hi = _mm256_or_si256(*hi, x8_high_bits(qh, 4 + c));
#endif
    }
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define X8_VNNI 1
/* VNNI (dpbusd: Σ of 4 u8·s8 products into an int32 lane, one instruction for maddubs + madd
 * + add): per run, one dpbusd per activation row, its 4 bytes broadcast from memory (a load,
 * no shuffle). Q8_0's signed weights as w + 128 (xor 0x80, once per run for all rows), the
 * 128·Σx_q that adds taken back by starting the row's sum at 8·(-16·Σx_q) (the prepared row's
 * Q5_0 offset); Q4_0/Q5_0's sums start at their offsets. Integer sums are exact, so isum and
 * everything after it are the AVX2 tile's (and the scalar reference's) bits. Two sums per
 * row (even and odd runs, or low and high nibbles) halve the dpbusd chain. */
static inline __attribute__((always_inline)) void tile_x8(const int T, const int NR, const uint8_t *w,
                                                          const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                          int64_t ldy) {
    X8_LAYOUT(T);
    const int64_t nb = n / QK;
    __m256 acc[8];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * B;
        for (int l = 0; l < B; l += 64) _mm_prefetch((const char *)blk + QD_PREFETCH + l, _MM_HINT_T0);
        __m256i s[8], t[8];
        for (int r = 0; r < NR; r++) {
            const int32_t *off = LEGACY_OFF(x + r * xs, n) + 2 * b;
            t[r] = _mm256_setzero_si256();
            if (has_off) s[r] = bcast4((const uint8_t *)(off + (T == QT_Q5_0)));
            else if (T == QT_Q8_0) s[r] = _mm256_slli_epi32(bcast4((const uint8_t *)(off + 1)), 3);
            else s[r] = _mm256_setzero_si256();
        }
        if (T == QT_Q8_0) {
            for (int c = 0; c < 8; c += 2) {
                const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + q_at + 32 * c)),
                                                    _mm256_set1_epi8((char)0x80));
                const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + q_at + 32 * c + 32)),
                                                    _mm256_set1_epi8((char)0x80));
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) {
                    const uint8_t *xb = x + r * xs + b * QK + 4 * c;
                    s[r] = qd_dot_u8s8(s[r], w0, bcast4(xb));
                    if (NR > 4) s[r] = qd_dot_u8s8(s[r], w1, bcast4(xb + 4)); /* one chain a row: NR of them */
                    else t[r] = qd_dot_u8s8(t[r], w1, bcast4(xb + 4));
                }
            }
        } else {
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + qh_at)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i lo, hi;
                x8_values(blk, q_at, five, qh, c, &lo, &hi);
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) {
                    const uint8_t *xb = x + r * xs + b * QK + 4 * c;
                    s[r] = qd_dot_u8s8(s[r], lo, bcast4(xb));
                    if (NR > 4) s[r] = qd_dot_u8s8(s[r], hi, bcast4(xb + 16));
                    else t[r] = qd_dot_u8s8(t[r], hi, bcast4(xb + 16));
                }
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 mw = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < NR; r++) {
            const float *dx = LEGACY_DX(x + r * xs, n) + 2 * b;
            const __m256i isum = NR > 4 ? s[r] : _mm256_add_epi32(s[r], t[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx)), _mm256_cvtepi32_ps(isum), acc[r]);
            if (has_min) acc[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(dx + 1), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BITALG__) && defined(__AVX512VL__)
#define X8_ZMM 1
/* The 8-row tile in 512-bit vectors: two runs of the group per vector, lane 2i row i's run c
 * and lane 2i+1 its run c+1 (the weights permuted once per block for all 8 activation rows),
 * so one 8-byte broadcast and one dpbusd serve 16 lanes: half tile_x8's broadcasts and
 * dpbusds. Row i's two lanes are summed (exact, integer) two activation rows at a time, into
 * one vector: each 128-bit lane holds weight rows 2j, 2j+1 of the first activation row, then
 * of the second, and the conversion, scale and multiply-add run once for both rows (the scales
 * d_w and d_x permuted to match). Every weight row meets the same integer sum and the same
 * float operations in the same order as in tile_x8 and the reference: the same bits.
 * (Two groups per vector instead read two weight streams and ran no faster.) */
static inline __attribute__((always_inline)) void tile_x8_zmm(const int T, const int NR, const uint8_t *w,
                                                              const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                              int64_t ldy) {
    X8_LAYOUT(T);
    const int64_t nb = n / QK;
    const __m512i runs = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i pairs = _mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7);
    __m512 acc[8]; /* rows 2p, 2p+1 */
    for (int p = 0; p < NR / 2; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * B;
        for (int l = 0; l < B; l += 64) _mm_prefetch((const char *)blk + QD_PREFETCH + l, _MM_HINT_T0);
        __m512i W[4]; /* the weights meeting activation bytes 8k..8k+7 of the block */
        if (T == QT_Q8_0) {
            for (int k = 0; k < 4; k++)
                W[k] = _mm512_permutexvar_epi32(
                    runs, _mm512_xor_si512(_mm512_loadu_si512(blk + q_at + 64 * k), _mm512_set1_epi8((char)0x80)));
        } else {
            /* runs 2k, 2k+1 permuted before the unpacking: a 64-bit lane is then row i's 8 bytes,
             * and its 5th bits are bits 8k.. (low nibbles) or 16 + 8k.. (high) of the row's qh,
             * widened into the lane */
            const __m512i low = _mm512_set1_epi8(0x0f);
            const __m512i qh = five ? _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(blk + qh_at)))
                                    : _mm512_setzero_si512();
            for (int k = 0; k < 2; k++) { /* values 8k.. (low nibbles) and 16 + 8k.. (high) */
                const __m512i raw = _mm512_permutexvar_epi32(runs, _mm512_loadu_si512(blk + q_at + 64 * k));
                __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                if (five) {
                    const __m512i bit4 = _mm512_set1_epi8(0x10);
                    const long long first = 0x0706050403020100LL + 0x0808080808080808LL * k;
                    lo = _mm512_mask_add_epi8(lo, _mm512_bitshuffle_epi64_mask(qh, _mm512_set1_epi64(first)), lo, bit4);
                    hi = _mm512_mask_add_epi8(hi, _mm512_bitshuffle_epi64_mask(qh, _mm512_set1_epi64(first + 0x1010101010101010LL)),
                                              hi, bit4);
                }
                W[k] = lo;
                W[2 + k] = hi;
            }
        }
        const __m512 dw = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk))));
        const __m512 mw = has_min ? _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_cvtph_ps(
                                                                 _mm_loadu_si128((const __m128i *)(blk + 16)))))
                                  : _mm512_setzero_ps();
#pragma GCC unroll 2
        for (int h = 0; h < (NR + 7) / 8; h++) { /* 8 rows at a time: their sums in the registers */
            const int H = NR - 8 * h < 8 ? NR - 8 * h : 8;
            __m512i s[8];
#pragma GCC unroll 8
            for (int r = 0; r < H; r++) {
                const int32_t *off = LEGACY_OFF(x + (8 * h + r) * xs, n) + 2 * b;
                const uint8_t *xb = x + (8 * h + r) * xs + b * QK;
                /* the offset once per weight row: in its even lane */
                if (has_off) s[r] = _mm512_maskz_set1_epi32(0x5555, off[T == QT_Q5_0]);
                else if (T == QT_Q8_0) s[r] = _mm512_maskz_set1_epi32(0x5555, off[1] * 8);
                else s[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    long long v;
                    memcpy(&v, xb + 8 * k, 8);
                    s[r] = _mm512_dpbusd_epi32(s[r], W[k], _mm512_set1_epi64(v));
                }
            }
#pragma GCC unroll 4
            for (int p = 0; p < H / 2; p++) {
                const __m512i isum = qd_add_lane_pairs(s[2 * p], s[2 * p + 1]);
                const float *dx0 = LEGACY_DX(x + (8 * h + 2 * p) * xs, n) + 2 * b, *dx1 = LEGACY_DX(x + (8 * h + 2 * p + 1) * xs, n) + 2 * b;
                __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(dx0[0])); /* (a broadcast d_x for both rows: slower) */
                sc = _mm512_mask_mul_ps(sc, 0xCCCC, dw, _mm512_set1_ps(dx1[0]));
                acc[4 * h + p] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(isum), acc[4 * h + p]);
                if (has_min) {
                    acc[4 * h + p] = _mm512_mask3_fmadd_ps(mw, _mm512_set1_ps(dx0[1]), acc[4 * h + p], 0x3333);
                    acc[4 * h + p] = _mm512_mask3_fmadd_ps(mw, _mm512_set1_ps(dx1[1]), acc[4 * h + p], 0xCCCC);
                }
            }
        }
    }
    qd_store_row_pairs(acc, NR / 2, y, ldy);
}

/* Two consecutive groups (16 weight rows) in 512-bit vectors: lane i weight row i of the
 * first group, lane 8 + i of the second, so every lane holds one weight row's run and an
 * activation's 4 bytes meet all 16 lanes as dpbusd's broadcast memory operand (no broadcast
 * of its own, no lane sums after it): per activation row and block one chain of dpbusds, one
 * conversion and one fused multiply-add for 16 weight rows. The weights are unpacked once per
 * block for all NR activation rows (1, 2, 4, 8 or 16). The integers and float steps of tile_x8 and
 * the reference: the same bits. */
static inline __attribute__((always_inline)) void tile_x8x2_zmm(const int T, const int NR, const uint8_t *w,
                                                                const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                                int64_t ldy) {
    X8_LAYOUT(T);
    const int64_t nb = n / QK, second = nb * B; /* the second group: 8 rows after the first */
    const int runs = T == QT_Q8_0 ? 8 : 4;
    __m512 acc[16];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * B, *blk2 = blk + second;
        for (int l = 0; l < B; l += 64) { /* the next pair of groups, block by block, into L2 (kquants' Q6_K) */
            _mm_prefetch((const char *)blk + 2 * second + l, _MM_HINT_T1);
            _mm_prefetch((const char *)blk2 + 2 * second + l, _MM_HINT_T1);
        }
        __m512i W[8]; /* the weights meeting activation bytes 4c..4c+3 of the block (4-bit: run c's
                       * low nibbles are values 4c.., its high ones 16 + 4c..) */
        for (int c = 0; c < runs; c++) {
            const __m512i raw = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + q_at + 32 * c))),
                _mm256_loadu_si256((const __m256i *)(blk2 + q_at + 32 * c)), 1);
            if (T == QT_Q8_0) {
                W[c] = _mm512_xor_si512(raw, _mm512_set1_epi8((char)0x80));
            } else {
                const __m512i low = _mm512_set1_epi8(0x0f);
                W[c] = _mm512_and_si512(raw, low);
                W[4 + c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        }
        if (five) { /* each lane's 5th bits: values 4c.. (low nibbles) and 16 + 4c.. (high) */
            const __m512i qh = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + qh_at))),
                _mm256_loadu_si256((const __m256i *)(blk2 + qh_at)), 1);
            const __m512i bit4 = _mm512_set1_epi8(0x10);
            for (int c = 0; c < 8; c++)
                W[c] = _mm512_mask_add_epi8(W[c], _mm512_bitshuffle_epi64_mask(qh, _mm512_set1_epi64(x8_bit_selector(4 * c))),
                                            W[c], bit4);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)blk)), _mm_loadu_si128((const __m128i *)blk2), 1));
        const __m512 mw = has_min ? _mm512_cvtph_ps(_mm256_inserti128_si256(
                                        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 16))),
                                        _mm_loadu_si128((const __m128i *)(blk2 + 16)), 1))
                                  : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            const uint8_t *xr = x + r * xs, *xb = xr + b * QK;
            const int32_t *off = LEGACY_OFF(xr, n) + 2 * b;
            __m512i s;
            if (has_off) s = _mm512_set1_epi32(off[T == QT_Q5_0]);
            else if (T == QT_Q8_0) s = _mm512_set1_epi32(off[1] * 8);
            else s = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) s = qd_dpbusd_bcast(s, W[c], xb + 4 * c);
            const float *dx = LEGACY_DX(xr, n) + 2 * b;
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx[0])), _mm512_cvtepi32_ps(s), acc[r]);
            if (has_min) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx[1]), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif
#else
static inline __attribute__((always_inline)) void tile_x8(const int T, const int NR, const uint8_t *w,
                                                          const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                          int64_t ldy) {
    X8_LAYOUT(T);
    const int64_t nb = n / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * B;
        for (int l = 0; l < B; l += 64) _mm_prefetch((const char *)blk + QD_PREFETCH + l, _MM_HINT_T0);
        __m256i s[4];
        if (T == QT_Q8_0) {
            for (int r = 0; r < NR; r++) s[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + q_at + 32 * c));
                const __m256i aw = _mm256_sign_epi8(wv, wv);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const __m256i xv = _mm256_sign_epi8(bcast4(x + r * xs + b * QK + 4 * c), wv);
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
                }
            }
        } else {
            /* int16 sums of maddubs pairs: u4·s8 pairs ≤ 3810, 8 of them fit; u5: 7874, 4 */
            __m256i p[4];
            for (int r = 0; r < NR; r++) { p[r] = _mm256_setzero_si256(); s[r] = _mm256_setzero_si256(); }
            const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + qh_at)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                __m256i lo, hi;
                x8_values(blk, q_at, five, qh, c, &lo, &hi);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const uint8_t *xb = x + r * xs + b * QK;
                    __m256i al, ah;
                    if (five) { /* broadcasts from memory (the shuffles below spill here: 2.4x slower) */
                        al = bcast4(xb + 4 * c);
                        ah = bcast4(xb + 16 + 4 * c);
                    } else { /* Q4: the FP load pipes bind (llvm-mca): 16-byte loads + in-lane shuffles, 6-8% faster */
                        const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb));
                        const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 16)));
                        switch (c) {
                        case 0: al = _mm256_shuffle_epi32(xl, 0x00); ah = _mm256_shuffle_epi32(xh, 0x00); break;
                        case 1: al = _mm256_shuffle_epi32(xl, 0x55); ah = _mm256_shuffle_epi32(xh, 0x55); break;
                        case 2: al = _mm256_shuffle_epi32(xl, 0xaa); ah = _mm256_shuffle_epi32(xh, 0xaa); break;
                        default: al = _mm256_shuffle_epi32(xl, 0xff); ah = _mm256_shuffle_epi32(xh, 0xff); break;
                        }
                    }
                    p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(lo, al));
                    p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(hi, ah));
                }
                if (five && c == 1)
                    for (int r = 0; r < NR; r++) { s[r] = _mm256_madd_epi16(p[r], ones); p[r] = _mm256_setzero_si256(); }
            }
            for (int r = 0; r < NR; r++) s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p[r], ones));
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 mw = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const uint8_t *xr = x + r * xs;
            __m256i isum = s[r];
            if (has_off) {
                float off;
                memcpy(&off, LEGACY_OFF(xr, n) + 2 * b + (T == QT_Q5_0), 4);
                isum = _mm256_add_epi32(isum, _mm256_castps_si256(_mm256_set1_ps(off)));
            }
            const float *dx = LEGACY_DX(xr, n) + 2 * b;
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx)), _mm256_cvtepi32_ps(isum), acc[r]);
            if (has_min) acc[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(dx + 1), acc[r]);
        }
    }
    for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
#endif

#ifdef X8_ZMM
#define X8_EIGHT(T) tile_x8_zmm(T, 8, w, x, xs, n, y, ldy)
#elif defined(X8_VNNI)
#define X8_EIGHT(T) tile_x8(T, 8, w, x, xs, n, y, ldy)
#endif
#ifdef X8_VNNI /* tiles of up to 8 activation rows (the weights' unpacking shared by all 8) */
#define X8_WIDE_CASES(T)                                                                              \
        case 8: X8_EIGHT(T); return;                                                                 \
        case 7: tile_x8(T, 7, w, x, xs, n, y, ldy); return;                                          \
        case 6: tile_x8(T, 6, w, x, xs, n, y, ldy); return;                                          \
        case 5: tile_x8(T, 5, w, x, xs, n, y, ldy); return;
#else
#define X8_WIDE_CASES(T)
#endif
#ifdef X8_ZMM /* 16 rows: the weights' unpacking shared by 16; 9-15: 8 and the rest */
#define X8_SIXTEEN(T)                                                                                 \
        if (nr > 8) {                                                                                \
            if (nr == 16) { tile_x8_zmm(T, 16, w, x, xs, n, y, ldy); return; }                       \
            X8_EIGHT(T);                                                                             \
            nr -= 8, x += 8 * xs, y += 8 * ldy;                                                      \
        }
#else
#define X8_SIXTEEN(T)
#endif
#define AVX2_X8_TILE(T, NAME)                                                                         \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        X8_SIXTEEN(T)                                                                                \
        switch (nr) {                                                                                \
        X8_WIDE_CASES(T)                                                                             \
        case 4: tile_x8(T, 4, w, x, xs, n, y, ldy); return;                                          \
        case 3: tile_x8(T, 3, w, x, xs, n, y, ldy); return;                                          \
        case 2: tile_x8(T, 2, w, x, xs, n, y, ldy); return;                                          \
        default: tile_x8(T, 1, w, x, xs, n, y, ldy); return;                                         \
        }                                                                                            \
    }
AVX2_X8_TILE(QT_Q4_0, avx2_x8_q4_0)
AVX2_X8_TILE(QT_Q4_1, avx2_x8_q4_1)
AVX2_X8_TILE(QT_Q5_0, avx2_x8_q5_0)
AVX2_X8_TILE(QT_Q5_1, avx2_x8_q5_1)
AVX2_X8_TILE(QT_Q8_0, avx2_x8_q8_0)
#endif

#ifdef X8_ZMM
/* Two groups (16 weight rows, y[r·ldy + i] for i < 16) × 1-16 activation rows, 16, 8, 4, 2
 * or 1 a tile. */
#define X8X2_CALL(NR) tile_x8x2_zmm(T_, NR, w, x, xs, n, y, ldy)
#define ZMM_X8X2_TILE(T, NAME)                                                                        \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        const int T_ = (T);                                                                          \
        QD_BY_POWERS(X8X2_CALL)                                                                      \
    }
ZMM_X8X2_TILE(QT_Q4_0, zmm_x8x2_q4_0)
ZMM_X8X2_TILE(QT_Q4_1, zmm_x8x2_q4_1)
ZMM_X8X2_TILE(QT_Q5_0, zmm_x8x2_q5_0)
ZMM_X8X2_TILE(QT_Q5_1, zmm_x8x2_q5_1)
ZMM_X8X2_TILE(QT_Q8_0, zmm_x8x2_q8_0)
#endif

/* The fewest activation rows q_gemm gives the two-group tile: 2 with the 512-bit tile (at one
 * row the one-group tile streams as fast: 0.90-1.07x there, 1.1-1.7x at 2-4 rows), else none. */
int twq_x8_pair_from(int type) {
    (void)type;
#ifdef X8_ZMM
    return 2;
#else
    return 1 << 30;
#endif
}

/* A tile of two consecutive groups (16 weight rows) where this build has one, else NULL
 * (q_gemm then runs the one-group tile per group). */
qtile_fn twq_x8_pair_tile(int type) {
#ifdef X8_ZMM
    switch (type) {
    case QT_Q4_0: return zmm_x8x2_q4_0;
    case QT_Q4_1: return zmm_x8x2_q4_1;
    case QT_Q5_0: return zmm_x8x2_q5_0;
    case QT_Q5_1: return zmm_x8x2_q5_1;
    case QT_Q8_0: return zmm_x8x2_q8_0;
    }
#endif
    (void)type;
    return 0;
}

/* The most activation rows one x8 tile call of a 32-value type takes: 16 with 512-bit VNNI
 * (tile_x8_zmm: a block's weights unpacked once for 16 rows), 8 with 256-bit VNNI, else 4. */
int twq_x8_tile_rows(int type) {
#ifdef X8_ZMM
    return 16;
#endif
#ifdef X8_VNNI
    return 8;
#endif
    (void)type;
    return 4;
}

/* Whether this build's x8 tiles use VNNI's dpbusd (the tests check that a CPU with it runs it). */
int twq_x8_vnni(void) {
#ifdef X8_VNNI
    return 1;
#else
    return 0;
#endif
}

/* The x8 tiles of a 32-value type (`type`: the type's own id): one tile call computes 8
 * weight rows (a group) against 1–4 activation rows, y[r·ldy + i] for i < 8. */
qtile_fn twq_x8_tile(int type, int reference) {
#ifdef __AVX2__
    if (!reference) switch (type) {
        case QT_Q4_0: return avx2_x8_q4_0;
        case QT_Q4_1: return avx2_x8_q4_1;
        case QT_Q5_0: return avx2_x8_q5_0;
        case QT_Q5_1: return avx2_x8_q5_1;
        case QT_Q8_0: return avx2_x8_q8_0;
        }
#endif
    (void)reference;
    switch (type) {
    case QT_Q4_0: return ref_x8_q4_0;
    case QT_Q4_1: return ref_x8_q4_1;
    case QT_Q5_0: return ref_x8_q5_0;
    case QT_Q5_1: return ref_x8_q5_1;
    case QT_Q8_0: return ref_x8_q8_0;
    }
    return 0;
}
