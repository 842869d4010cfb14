/* Quantized weights on the CPU: the GGUF blocks are read as stored (no float copy).
 *
 *   q_row_bytes / q_act_bytes   sizes of a weight row and of a prepared activation row
 *   q_act_family                which types share a prepared row
 *   q_prepare                   float32 activations → int8 blocks (once per product)
 *   q_gemm                      y = W x for 1..any activation rows (integer block dot products)
 *   q_gemm_reference            the same with the portable scalar code (for the tests)
 *   q_dequantize                weight rows → float32, bit-exact with twice.core.quant
 *   q_dequantize_at             the same for rows [first, first + nrows) (an embedding lookup)
 *   q_interleave                a 32-value type's rows → its x8 layout, in place
 *
 * A 32-value type's id + QT_X8 is its interleaved 8-row layout (qdot.h): q_gemm then
 * computes 8 output rows per tile (out: whole groups of 8), q_dequantize whole groups.
 *
 * The families live in qdot_legacy.c (32-value blocks) and qdot_kquants.c (256-value
 * super-blocks); the plain float types (F32/F16/BF16) are here. Layouts: qdot.h.
 *
 * Threads split the output rows (OpenMP, torch's libgomp). Each output row is read once
 * for a tile of up to 4 activation rows (8 for some x8 types: twq_x8_tile_rows), then for the
 * next ones, from L1, so a batch costs
 * little more memory traffic than one row. A row's result never depends on the number of
 * rows in the call: every (activation row, output row) pair is computed by the same
 * instructions in the same order in any tile (batch invariance; tests/test_qkernels.py).
 */
#include <math.h>
#include <stdlib.h>

#include "qdot.h"

static int is_legacy(int t) { return t == QT_Q4_0 || t == QT_Q4_1 || t == QT_Q5_0 || t == QT_Q5_1 || t == QT_Q8_0; }
static int is_kquant(int t) { return t >= QT_Q2_K && t <= QT_Q6_K; }
static int is_float(int t) { return t == QT_F32 || t == QT_F16 || t == QT_BF16; }
/* A 32-value type's interleaved layout (qdot.h QT_X8), and a type id without it. */
static int is_x8_able(int t) { return is_legacy(t) || t == QT_Q4_K || t == QT_Q6_K; } /* K: qdot_kquants.c */
static int is_x8(int t) { return t >= QT_X8 && is_x8_able(t - QT_X8); }
static int base_type(int t) { return is_x8(t) ? t - QT_X8 : t; }

int64_t q_row_bytes(int type, int64_t n) {
    type = base_type(type);
    static const struct { int type, block, size; } sizes[] = {
        {QT_F32, 1, 4}, {QT_F16, 1, 2}, {QT_BF16, 1, 2}, {QT_Q4_0, 32, 18}, {QT_Q4_1, 32, 20},
        {QT_Q5_0, 32, 22}, {QT_Q5_1, 32, 24}, {QT_Q8_0, 32, 34}, {QT_Q2_K, 256, 84}, {QT_Q3_K, 256, 110},
        {QT_Q4_K, 256, 144}, {QT_Q5_K, 256, 176}, {QT_Q6_K, 256, 210},
    };
    if (n <= 0) return -1;
    for (unsigned i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].type == type) return n % sizes[i].block ? -1 : n / sizes[i].block * sizes[i].size;
    return -1;
}

int64_t q_act_bytes(int type, int64_t n) {
    type = base_type(type);
    if (q_row_bytes(type, n) < 0) return -1;
    if (is_float(type)) return 4 * n;
    if (is_legacy(type)) return qd_round64(n + 16 * (n / QK));
    return qd_round64(n + 4 * (n / QKK) + 2 * (n / 16));
}

/* Which prepared layout a type's activations take: 0 float32 values (F32/F16/BF16), 1 the
 * 32-value int8 blocks (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0), 2 the 256-value ones (Q2_K..Q6_K); -1 for
 * an unknown type. Types of one family read the same prepared bytes, so matrices that share an
 * input need one q_prepare per family, not one per type. */
int q_act_family(int type) {
    type = base_type(type);
    return is_float(type) ? 0 : is_legacy(type) ? 1 : is_kquant(type) ? 2 : -1;
}

/* x[0, len) → q[0, len) int8 with d = max|x|/127, q = nearest-even(x·(1/d)), and the sum of
 * each 16 quants in sums[len/16]; returns d. (The AVX2 path gives the same bytes.) */
static float quantize_block(const float *x, int len, int8_t *q, int16_t *sums) {
#ifdef __AVX2__
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < len; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), nosign));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.0f;
    for (int j = 0; j < len; j++) amax = fmaxf(amax, fabsf(x[j]));
#endif
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
#ifdef __AVX2__
    const __m256 vid = _mm256_set1_ps(id);
    for (int j = 0; j < len; j += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), vid),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* packs interleave the 128-bit halves; the permute puts the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + j), p);
        /* sums of 8 bytes made unsigned (+128 each), then of 16 */
        __m256i t = _mm256_sad_epu8(_mm256_xor_si256(p, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
        t = _mm256_add_epi64(t, _mm256_shuffle_epi32(t, 0x4e));
        sums[j / 16] = (int16_t)(_mm256_extract_epi32(t, 0) - 2048);
        sums[j / 16 + 1] = (int16_t)(_mm256_extract_epi32(t, 4) - 2048);
    }
#else
    for (int j = 0; j < len; j++) q[j] = (int8_t)(int)nearbyintf(x[j] * id);
    for (int i = 0; i < len / 16; i++) {
        int t = 0;
        for (int l = 0; l < 16; l++) t += q[16 * i + l];
        sums[i] = (int16_t)t;
    }
#endif
    return d;
}

static void prepare_row(int type, const float *x, int64_t n, uint8_t *out) {
    int8_t *qs = (int8_t *)out;
    if (is_float(type)) {
        memcpy(out, x, 4 * n);
        return;
    }
    if (is_legacy(type)) {
        const int64_t nb = n / QK;
        float *d = (float *)(out + n); /* {d, d·Σq} per block */
        int32_t *offsets = (int32_t *)(out + n + 8 * nb); /* {-8·Σq, -16·Σq}: Q4_0's, Q5_0's */
        for (int64_t b = 0; b < nb; b++) {
            int16_t sums[2];
            d[2 * b] = quantize_block(x + b * QK, QK, qs + b * QK, sums);
            const int32_t s = sums[0] + sums[1];
            offsets[2 * b] = -8 * s;
            offsets[2 * b + 1] = -16 * s;
            d[2 * b + 1] = d[2 * b] * (float)s;
        }
        memset(out + n + 16 * nb, 0, q_act_bytes(type, n) - (n + 16 * nb));
        return;
    }
    const int64_t nb = n / QKK;
    float *d = (float *)(out + n);
    int16_t *bsums = (int16_t *)(out + n + 4 * nb);
    for (int64_t b = 0; b < nb; b++) d[b] = quantize_block(x + b * QKK, QKK, qs + b * QKK, bsums + 16 * b);
    memset(out + n + 36 * nb, 0, q_act_bytes(type, n) - (n + 36 * nb));
}

void q_prepare(int type, const float *x, int64_t n, int64_t rows, void *xq) {
    type = base_type(type);
    const int64_t xs = q_act_bytes(type, n);
    if (xs < 0) return;
    for (int64_t r = 0; r < rows; r++) prepare_row(type, x + r * n, n, (uint8_t *)xq + r * xs);
}

/* ---- float weights (F32, F16, BF16) against float32 activations ------------------------ */

static inline float float_weight(int type, const uint8_t *w, int64_t i) {
    if (type == QT_F32) { float f; memcpy(&f, w + 4 * i, 4); return f; }
    return type == QT_F16 ? qd_f16(w + 2 * i) : qd_bf16(w + 2 * i);
}

static float ref_float_dot(int type, const uint8_t *w, const float *x, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += float_weight(type, w, i) * x[i];
    return s;
}

#define REF_FLOAT_TILE(T, NAME)                                                                       \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        for (int r = 0; r < nr; r++) y[r * ldy] = ref_float_dot(T, w, (const float *)(x + r * xs), n); \
    }
REF_FLOAT_TILE(QT_F32, ref_f32)
REF_FLOAT_TILE(QT_F16, ref_f16)
REF_FLOAT_TILE(QT_BF16, ref_bf16)

#ifdef __AVX2__
static inline __m256 load8(const int T, const uint8_t *w, int64_t i) {
    if (T == QT_F32) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)(w + 2 * i));
    if (T == QT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Per row: 4 accumulators over 32 values at a time, then 8 at a time into the first, then a
 * scalar tail, summed (a0+a1)+(a2+a3) — the same for every row in any tile. */
static inline __attribute__((always_inline)) void tile_float(const int T, const int NR, const uint8_t *w,
                                                             const uint8_t *x, int64_t xs, int64_t n, float *y,
                                                             int64_t ldy) {
    __m256 a[4][4];
    for (int r = 0; r < NR; r++) for (int k = 0; k < 4; k++) a[r][k] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++) {
            const __m256 wv = load8(T, w, i + 8 * k);
            for (int r = 0; r < NR; r++)
                a[r][k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps((const float *)(x + r * xs) + i + 8 * k), a[r][k]);
        }
    for (; i + 8 <= n; i += 8) {
        const __m256 wv = load8(T, w, i);
        for (int r = 0; r < NR; r++) a[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps((const float *)(x + r * xs) + i), a[r][0]);
    }
    for (int r = 0; r < NR; r++) {
        float s = qd_hsum(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
        const float *xr = (const float *)(x + r * xs);
        for (int64_t j = i; j < n; j++) s += float_weight(T, w, j) * xr[j];
        y[r * ldy] = s;
    }
}

#define AVX2_FLOAT_TILE(T, NAME)                                                                      \
    static void NAME(int nr, const uint8_t *w, const uint8_t *x, int64_t xs, int64_t n, float *y,     \
                     int64_t ldy) {                                                                  \
        switch (nr) {                                                                                \
        case 4: tile_float(T, 4, w, x, xs, n, y, ldy); return;                                       \
        case 3: tile_float(T, 3, w, x, xs, n, y, ldy); return;                                       \
        case 2: tile_float(T, 2, w, x, xs, n, y, ldy); return;                                       \
        default: tile_float(T, 1, w, x, xs, n, y, ldy); return;                                      \
        }                                                                                            \
    }
AVX2_FLOAT_TILE(QT_F32, avx2_f32)
AVX2_FLOAT_TILE(QT_F16, avx2_f16)
AVX2_FLOAT_TILE(QT_BF16, avx2_bf16)
#endif

static qtile_fn tile_for(int type, int reference) {
    if (is_x8(type)) return is_kquant(base_type(type)) ? twq_kx8_tile(base_type(type), reference)
                                                       : twq_x8_tile(base_type(type), reference);
    if (is_legacy(type)) return twq_legacy_tile(type, reference);
    if (is_kquant(type)) return twq_kquant_tile(type, reference);
#ifdef __AVX2__
    if (!reference) switch (type) {
        case QT_F32: return avx2_f32;
        case QT_F16: return avx2_f16;
        case QT_BF16: return avx2_bf16;
        }
#endif
    switch (type) {
    case QT_F32: return ref_f32;
    case QT_F16: return ref_f16;
    case QT_BF16: return ref_bf16;
    }
    return 0;
}

/* The two-group tile of an x8 type for `rows` activation rows where the build has one and
 * the type declares it from that many rows on (twq_x8_pair_from, twq_kx8_pair_from: where it
 * reads at least as fast as one group a tile); NULL: one group per tile. Either tile gives a
 * row the same bits. */
static qtile_fn pair_tile_for(int type, int64_t rows) {
    if (!is_x8(type)) return 0;
    const int t = base_type(type), k = is_kquant(t);
    if (rows < (k ? twq_kx8_pair_from(t) : twq_x8_pair_from(t))) return 0;
    return k ? twq_kx8_pair_tile(t) : twq_x8_pair_tile(t);
}

/* The most activation rows one SIMD tile call of this type takes (x8 types: 4, 8 or 16, else 4). */
static int tile_rows_for(int type) {
    if (!is_x8(type)) return 4;
    return is_legacy(base_type(type)) ? twq_x8_tile_rows(base_type(type)) : twq_kx8_tile_rows(base_type(type));
}

/* pair: a tile of two groups (16 weight rows) or NULL; step: activation rows per tile call. */
static void gemm_with(qtile_fn fn, qtile_fn pair, int step, int type, const void *w, int64_t out, int64_t n,
                      const void *xq, int64_t rows, float *y, int64_t ldy, int threads) {
    const int64_t wb = q_row_bytes(type, n), xs = q_act_bytes(type, n);
    if (!fn || wb < 0 || out <= 0 || rows <= 0) return;
    const uint8_t *W = w, *X = xq;
    if (is_x8(type)) { /* a tile computes a group of 8 weight rows (out is whole groups), or two */
        const int64_t groups = out / 8, units = pair ? (groups + 1) / 2 : groups;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const int64_t g = pair ? 2 * u : u;
            const qtile_fn f = pair && g + 1 < groups ? pair : fn;
            for (int64_t b = 0; b < rows; b += step)
                f(rows - b < step ? (int)(rows - b) : step, W + 8 * g * wb, X + b * xs, xs, n, y + b * ldy + 8 * g, ldy);
        }
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++)
        for (int64_t b = 0; b < rows; b += step)
            fn(rows - b < step ? (int)(rows - b) : step, W + o * wb, X + b * xs, xs, n, y + b * ldy + o, ldy);
}

void q_gemm(int type, const void *w, int64_t out, int64_t n, const void *xq, int64_t rows, float *y, int64_t ldy,
            int threads) {
    gemm_with(tile_for(type, 0), pair_tile_for(type, rows), tile_rows_for(type), type, w, out, n, xq, rows, y, ldy, threads);
}

void q_gemm_reference(int type, const void *w, int64_t out, int64_t n, const void *xq, int64_t rows, float *y,
                      int64_t ldy, int threads) {
    gemm_with(tile_for(type, 1), 0, 4, type, w, out, n, xq, rows, y, ldy, threads);
}

/* 1 where loading should rewrite this type's rows into its x8 layout (this build's tiles read
 * it at least as fast at every batch), 0 where they stay as stored (or it has no layout). */
int q_x8_at_load(int type) {
    if (!is_x8_able(type)) return 0;
    return is_kquant(type) ? twq_kx8_at_load(type) : 1;
}

/* 1 where q_gemm runs SIMD code for this type in this build (0: the scalar reference). */
int q_gemm_simd(int type) { return tile_for(type, 0) != tile_for(type, 1); }

/* Rows [first, first + nrows) of the matrix at w → float32 (an x8 matrix: any rows, each
 * from its group; the same values as the rows as stored). */
void q_dequantize_at(int type, const void *w, int64_t first, int64_t nrows, int64_t n, float *out, int threads) {
    const int64_t wb = q_row_bytes(type, n);
    if (wb < 0 || nrows <= 0 || first < 0) return;
    const uint8_t *W = w;
    const int x8 = is_x8(type), t = base_type(type);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t at = first + r;
        float *o = out + r * n;
        if (x8 && is_kquant(t)) twq_kx8_dequantize_row(t, W + at / 8 * 8 * wb, (int)(at % 8), n, o);
        else if (x8) twq_x8_dequantize_row(t, W + at / 8 * 8 * wb, (int)(at % 8), n, o);
        else if (is_legacy(t)) twq_legacy_dequantize(t, W + at * wb, n, o);
        else if (is_kquant(t)) twq_kquant_dequantize(t, W + at * wb, n, o);
        else for (int64_t i = 0; i < n; i++) o[i] = float_weight(t, W + at * wb, i);
    }
}

/* Rows [0, rows) of a 32-value type, Q4_K or Q6_K `type` (its own id) rewritten in place into the x8 layout
 * (rows: whole groups of 8); 0, or -1 for another type or shape, -2 where a group's buffer
 * could not be allocated (w then untouched or partly rewritten: the caller refuses the
 * model). */
int q_interleave(int type, void *w, int64_t rows, int64_t n, int threads) {
    const int64_t wb = q_row_bytes(type, n);
    if (!is_x8_able(type) || wb < 0 || rows < 0 || rows % 8) return -1;
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        uint8_t *tmp = malloc(8 * wb);
        if (!tmp) {
            #pragma omp atomic write
            status = -2;
        }
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < rows / 8; g++) {
            if (!tmp) continue;
            uint8_t *group = (uint8_t *)w + 8 * g * wb;
            memcpy(tmp, group, 8 * wb);
            if (is_kquant(type)) twq_kx8_interleave_group(type, tmp, n, group);
            else twq_x8_interleave_group(type, tmp, n, group);
        }
        free(tmp);
    }
    return status;
}

void q_dequantize(int type, const void *w, int64_t nrows, int64_t n, float *out, int threads) {
    q_dequantize_at(type, w, 0, nrows, n, out, threads);
}
