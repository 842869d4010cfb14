/* Causal attention of new tokens (prefill: a prompt, a chunk of one, a chat turn, a padded
 * batch) in bfloat16 or float32, for head sizes 64 and 128 on CPUs with AVX-512 BF16.
 *
 * Prefill of a long prompt spends a third (fp32) to a half (bf16) of its time in attention
 * (SDPA's CPU flash kernel runs at a quarter of the multiply-add peak here), the rest in
 * matrix products near the peak. This computes the same thing as register tiles with no
 * horizontal sums: for each kv head the keys are first transposed so that one 32-bit lane
 * holds one key's dimension (fp32) or pair of dimensions (bf16) across 16 keys, so a tile
 * of 4 queries × 64 keys is 16 accumulators, each instruction adding one dimension (or
 * two) of one query against 16 keys; p·V is 4 queries × 64 (or 2 × 128) output
 * dimensions, one key (fp32) or two (bf16: value rows interleaved in pairs of keys) per
 * instruction.
 *
 * A KV cache of Q8_0 / Q4_0 blocks (--kv-dtype q8_0|q4_0) is read as stored: each kv head's
 * keys and values are decoded from their blocks straight into the transposed and interleaved
 * tiles above (no float copy of the cache), to the values the cache's own decode gives
 * (core/cache.py: d · q in float32, the key offset added, then the model's dtype), so the
 * result is bit for bit that of this kernel over the decoded copy.
 *
 * Numerics follow SDPA's CPU kernel: scores and softmax in float32, the 1/sum applied
 * after; in bf16 the probabilities are rounded to bf16 to meet V (accumulated in float32)
 * and the output is rounded to bf16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "kvblock.h"
#include "vec.h"

#ifdef __AVX512BF16__
/* Keys [n, ·] (rows `stride` 32-bit words apart, `units` words each: a float32 dimension
 * or a pair of bf16 ones) → kt[block][unit][16]: lane l of (block, unit) holds that unit
 * of key 16·block + l (zero past n). */
static void transpose_keys(const uint32_t *k, int64_t stride, int64_t n, int64_t units, uint32_t *kt) {
    const int64_t blocks = (n + 15) / 16;
    memset(kt, 0, (size_t)(blocks * units * 16) * sizeof(uint32_t));
    for (int64_t j = 0; j < n; j++) {
        uint32_t *dst = kt + (j / 16) * units * 16 + j % 16;
        for (int64_t u = 0; u < units; u++) dst[u * 16] = k[j * stride + u];
    }
}

/* bf16 values [n, D] → vp[pair of keys][D/16][16]: unpacking rows 2m and 2m+1 puts
 * (V[2m][i], V[2m+1][i]) in one 32-bit lane, for i in an order permuted within 128-bit
 * blocks that value_tile undoes at the end (unpacked_first16/second16; zero past n). */
static void interleave_values(const uint16_t *v, int64_t stride, int64_t n, int64_t D, __m512i *vp) {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t m = 0; 2 * m < n; m++) {
        const uint16_t *a = v + 2 * m * stride, *b = a + stride;
        for (int64_t c = 0; c < D / 32; c++) {
            const __m512i x = _mm512_loadu_si512(a + 32 * c), y = 2 * m + 1 < n ? _mm512_loadu_si512(b + 32 * c) : zero;
            vp[m * (D / 16) + 2 * c] = _mm512_unpacklo_epi16(x, y);
            vp[m * (D / 16) + 2 * c + 1] = _mm512_unpackhi_epi16(x, y);
        }
    }
}

/* Row `row` of Q8_0 (kv_type 8) or Q4_0 (2) blocks → D floats (kvblock.h: d · q exact in
 * float32), plus off[D] where given (a block cache's key offset). */
static void decode_blocks(int kv_type, const uint8_t *row, int64_t D, const float *off, float *out) {
    for (int64_t i = 0; i < D; i += 32) {
        __m512 a, c;
        row = widen_block16(kv_type == 8, row, &a, &c);
        if (off) {
            a = _mm512_add_ps(a, _mm512_loadu_ps(off + i));
            c = _mm512_add_ps(c, _mm512_loadu_ps(off + i + 16));
        }
        _mm512_storeu_ps(out + i, a);
        _mm512_storeu_ps(out + i + 16, c);
    }
}

/* A decoded row in the kernel's element type: float32 as is, or rounded to bf16 (ties to
 * even, as torch's cast) into the first D halves of `row`. */
static void to_elements(int bf16, float *row, int64_t D) {
    if (!bf16) return;
    uint16_t *h = (uint16_t *)row;
    for (int64_t i = 0; i < D; i += 16) {
        const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(_mm512_loadu_ps(row + i))), 16);
        _mm256_storeu_si256((__m256i *)(h + i), _mm512_cvtepi32_epi16(u));
    }
}

/* transpose_keys from blocks: n keys of D values, rows `rb` bytes apart. */
static void transpose_key_blocks(int bf16, int kv_type, const uint8_t *k, int64_t rb, int64_t n, int64_t D,
                                 const float *off, uint32_t *kt) {
    const int64_t units = bf16 ? D / 2 : D;
    float row[128] __attribute__((aligned(64)));
    memset(kt, 0, (size_t)(((n + 15) / 16) * units * 16) * sizeof(uint32_t));
    for (int64_t j = 0; j < n; j++) {
        decode_blocks(kv_type, k + j * rb, D, off, row);
        to_elements(bf16, row, D);
        const uint32_t *w = (const uint32_t *)row;
        uint32_t *dst = kt + (j / 16) * units * 16 + j % 16;
        for (int64_t u = 0; u < units; u++) dst[u * 16] = w[u];
    }
}

/* interleave_values from blocks (bf16): rows `rb` bytes apart. */
static void interleave_value_blocks(int kv_type, const uint8_t *v, int64_t rb, int64_t n, int64_t D, __m512i *vp) {
    float a[128] __attribute__((aligned(64))), b[128] __attribute__((aligned(64)));
    for (int64_t m = 0; 2 * m < n; m++) {
        decode_blocks(kv_type, v + 2 * m * rb, D, NULL, a);
        to_elements(1, a, D);
        if (2 * m + 1 < n) {
            decode_blocks(kv_type, v + (2 * m + 1) * rb, D, NULL, b);
            to_elements(1, b, D);
        } else {
            memset(b, 0, sizeof b);
        }
        for (int64_t c = 0; c < D / 32; c++) { /* the pair: rows a and b */
            const __m512i x = _mm512_loadu_si512((const uint16_t *)a + 32 * c), y = _mm512_loadu_si512((const uint16_t *)b + 32 * c);
            vp[m * (D / 16) + 2 * c] = _mm512_unpacklo_epi16(x, y);
            vp[m * (D / 16) + 2 * c + 1] = _mm512_unpackhi_epi16(x, y);
        }
    }
}

/* s[i][16·b + l] = scale · q_i · key(16·b + l) for NQ queries (rows of `units` 32-bit
 * words, `qs` words apart) and NB key blocks from block b0. */
static inline __attribute__((always_inline)) void score_tile(const int BF, const int NQ, const int NB,
                                                             const uint32_t *q, int64_t qs, const uint32_t *kt,
                                                             int64_t b0, int64_t units, float scale, float *s,
                                                             int64_t ss) {
    __m512 acc[4][4];
    for (int i = 0; i < NQ; i++) for (int b = 0; b < NB; b++) acc[i][b] = _mm512_setzero_ps();
    const uint32_t *base = kt + b0 * units * 16;
    int64_t u = 0;
    do {
        __m512i kv[4];
        for (int b = 0; b < NB; b++) kv[b] = _mm512_loadu_si512(base + (b * units + u) * 16);
        for (int i = 0; i < NQ; i++) {
            const __m512i qv = _mm512_set1_epi32((int)q[i * qs + u]);
            for (int b = 0; b < NB; b++)
                acc[i][b] = BF ? _mm512_dpbf16_ps(acc[i][b], (__m512bh)kv[b], (__m512bh)qv)
                               : _mm512_fmadd_ps(_mm512_castsi512_ps(kv[b]), _mm512_castsi512_ps(qv), acc[i][b]);
        }
    } while (++u < units);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < NQ; i++)
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(s + i * ss + (b0 + b) * 16, _mm512_mul_ps(acc[i][b], sc));
}

/* Scores of NQ queries against `blocks` key blocks, 4 blocks at a time. */
static inline __attribute__((always_inline)) void scores(const int BF, const int NQ, const uint32_t *q, int64_t qs,
                                                         const uint32_t *kt, int64_t blocks, int64_t units,
                                                         float scale, float *s, int64_t ss) {
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) score_tile(BF, NQ, 4, q, qs, kt, b, units, scale, s, ss);
    switch (blocks - b) {
    case 3: score_tile(BF, NQ, 3, q, qs, kt, b, units, scale, s, ss); break;
    case 2: score_tile(BF, NQ, 2, q, qs, kt, b, units, scale, s, ss); break;
    case 1: score_tile(BF, NQ, 1, q, qs, kt, b, units, scale, s, ss); break;
    }
}

/* Softmax of s[lo, n) (lo < n) in place → e^(s - max), zero before lo and from n up to
 * `upto`; returns 1/sum. bf16: the probabilities rounded to bf16 and packed two to a
 * 32-bit word. */
static float softmax_row(int bf16, float *s, int64_t lo, int64_t n, int64_t upto) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = lo / 16 * 16; j < n; j += 16) {
        const __mmask16 live = lanes16(j, lo, n);
        mv = _mm512_mask_max_ps(mv, live, mv, _mm512_maskz_loadu_ps(live, s + j));
    }
    const float inv = 1.0f / exp_sum(s, lo, n, _mm512_reduce_max_ps(mv), bf16);
    uint16_t *pb = (uint16_t *)s;
    for (int64_t j = 0; j < lo; j++) {
        if (bf16) pb[j] = 0;
        else s[j] = 0.0f;
    }
    for (int64_t j = n; j < upto; j++) {
        if (bf16) pb[j] = 0;
        else s[j] = 0.0f;
    }
    return inv;
}

/* out_i = inv_i · Σ p_i · V for NQ queries (p rows `ps` 32-bit words apart) and NV = D/16
 * output vectors, over `steps` steps: bf16, pairs of keys from vp (p: bf16 pairs), written
 * as bf16; float32, single keys from the value rows `vs` floats apart, written as float. */
static inline __attribute__((always_inline)) void value_tile(const int BF, const int NQ, const int NV,
                                                             const uint32_t *p, int64_t ps, const void *vp,
                                                             int64_t vs, int64_t steps, const float *inv, void *out,
                                                             int64_t os) {
    __m512 o[4][8];
    for (int i = 0; i < NQ; i++) for (int v = 0; v < NV; v++) o[i][v] = _mm512_setzero_ps();
    for (int64_t m = 0; m < steps; m++) {
        __m512i pv[4];
        for (int i = 0; i < NQ; i++) pv[i] = _mm512_set1_epi32((int)p[i * ps + m]);
        for (int v = 0; v < NV; v++) {
            if (BF) {
                const __m512bh x = (__m512bh)_mm512_loadu_si512((const __m512i *)vp + m * NV + v);
                for (int i = 0; i < NQ; i++) o[i][v] = _mm512_dpbf16_ps(o[i][v], x, (__m512bh)pv[i]);
            } else {
                const __m512 x = _mm512_loadu_ps((const float *)vp + m * vs + 16 * v);
                for (int i = 0; i < NQ; i++) o[i][v] = _mm512_fmadd_ps(_mm512_castsi512_ps(pv[i]), x, o[i][v]);
            }
        }
    }
    for (int i = 0; i < NQ; i++) {
        const __m512 sc = _mm512_set1_ps(inv[i]);
        for (int v = 0; v < NV; v += 2) {
            if (BF) {
                uint16_t *dst = (uint16_t *)out + i * os + 16 * v;
                const __m512 lo = _mm512_mul_ps(unpacked_first16(o[i][v], o[i][v + 1]), sc);
                const __m512 hi = _mm512_mul_ps(unpacked_second16(o[i][v], o[i][v + 1]), sc);
                _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(lo));
                _mm256_storeu_si256((__m256i *)(dst + 16), (__m256i)_mm512_cvtneps_pbh(hi));
            } else {
                float *dst = (float *)out + i * os + 16 * v;
                _mm512_storeu_ps(dst, _mm512_mul_ps(o[i][v], sc));
                _mm512_storeu_ps(dst + 16, _mm512_mul_ps(o[i][v + 1], sc));
            }
        }
    }
}

/* One tile of up to 4 queries of one head, at positions first .. first + nq - 1 of a row
 * whose real tokens start at `start` (query i sees keys [start, first + i]; a padding
 * query, before start, sees only itself), with s as scratch. */
static inline __attribute__((always_inline)) void query_tile(const int BF, const uint32_t *q, int64_t qs, int nq,
                                                             int64_t first, int64_t start, const uint32_t *kt,
                                                             const void *vp,
                                                             int64_t vs, int64_t D, float scale, float *s,
                                                             int64_t ss, void *out, int64_t os) {
    const int64_t units = BF ? D / 2 : D, n = first + nq, nb = (n + 15) / 16;
    if (nq == 4) scores(BF, 4, q, qs, kt, nb, units, scale, s, ss);
    else if (nq == 3) scores(BF, 3, q, qs, kt, nb, units, scale, s, ss);
    else if (nq == 2) scores(BF, 2, q, qs, kt, nb, units, scale, s, ss);
    else scores(BF, 1, q, qs, kt, nb, units, scale, s, ss);
    const int64_t upto = BF ? (n + 1) / 2 * 2 : n, steps = BF ? upto / 2 : n;
    float inv[4];
    for (int i = 0; i < nq; i++) {
        const int64_t at = first + i;
        inv[i] = softmax_row(BF, s + i * ss, at < start ? at : start, at + 1, upto);
    }
    const uint32_t *p = (const uint32_t *)s; /* rows ss floats apart: ss 32-bit words */
    const int64_t el = BF ? 2 : 4;
    if (D == 64) {
        if (nq == 4) value_tile(BF, 4, 4, p, ss, vp, vs, steps, inv, out, os);
        else if (nq == 3) value_tile(BF, 3, 4, p, ss, vp, vs, steps, inv, out, os);
        else if (nq == 2) value_tile(BF, 2, 4, p, ss, vp, vs, steps, inv, out, os);
        else value_tile(BF, 1, 4, p, ss, vp, vs, steps, inv, out, os);
    } else {
        for (int i = 0; i < nq; i += 2) {
            char *o = (char *)out + i * os * el;
            if (nq - i >= 2) value_tile(BF, 2, 8, p + i * ss, ss, vp, vs, steps, inv + i, o, os);
            else value_tile(BF, 1, 8, p + i * ss, ss, vp, vs, steps, inv + i, o, os);
        }
    }
}
#endif

/* The attention below over float rows (kv_type 0: k, v strides kb, kh in elements, rows D
 * apart) or Q8_0 / Q4_0 blocks (kv_type 8 / 2: strides in bytes, rows rb bytes apart, off
 * [KV][D] the key offset to add or NULL). */
static int attention(int bf16, int kv_type, const void *q, int64_t qb, int64_t qh, int64_t qt, const void *k,
                     const void *v, int64_t kb, int64_t kh, int64_t rb, const float *off, void *out, int64_t B,
                     int64_t H, int64_t KV, int64_t T, int64_t D, int64_t column, const int64_t *starts, float scale,
                     int threads) {
#ifdef __AVX512BF16__
    if ((D != 64 && D != 128) || T < 1 || KV < 1 || H % KV || column < 0) return -1;
    if (kv_type != 0 && kv_type != 8 && kv_type != 2) return -1;
    const int64_t el = bf16 ? 2 : 4, units = bf16 ? D / 2 : D, group = H / KV, N = column + T;
    const int64_t blocks = (N + 15) / 16, padded = blocks * 16, tiles = (T + 3) / 4;
    uint32_t *kt = aligned_alloc(64, (size_t)(blocks * units * 16) * sizeof(uint32_t));
    __m512i *vp = bf16 ? aligned_alloc(64, (size_t)((padded / 2) * (D / 16)) * sizeof(__m512i)) : NULL;
    float *vf = !bf16 && kv_type ? aligned_alloc(64, (size_t)(N * D) * sizeof(float)) : NULL;
    if (!kt || (bf16 && !vp) || (!bf16 && kv_type && !vf)) { free(kt); free(vp); free(vf); return -2; }
    int failed = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < KV; g++) {
            const int64_t start = starts ? starts[b] : 0;
            const void *vg;
            if (kv_type) {
                const uint8_t *kg = (const uint8_t *)k + b * kb + g * kh, *vb = (const uint8_t *)v + b * kb + g * kh;
                transpose_key_blocks(bf16, kv_type, kg, rb, N, D, off ? off + g * D : NULL, kt);
                if (bf16) interleave_value_blocks(kv_type, vb, rb, N, D, vp);
                else for (int64_t j = 0; j < N; j++) decode_blocks(kv_type, vb + j * rb, D, NULL, vf + j * D);
                vg = vf;
            } else {
                const char *kg = (const char *)k + (b * kb + g * kh) * el;
                vg = (const char *)v + (b * kb + g * kh) * el;
                transpose_keys((const uint32_t *)kg, units, N, units, kt);
                if (bf16) interleave_values((const uint16_t *)vg, D, N, D, vp);
            }
            #pragma omp parallel num_threads(threads) reduction(| : failed)
            {
                const int64_t ss = padded + 16;
                float *s = aligned_alloc(64, (size_t)(4 * ss) * sizeof(float));
                if (!s) failed = 1;
                /* later tiles see more keys: hand them out largest first, one at a time */
                #pragma omp for schedule(dynamic, 1)
                for (int64_t w = 0; w < group * tiles; w++) {
                    if (!s) continue; /* every thread must still take part in the loop */
                    const int64_t h = g * group + w / tiles, t0 = (tiles - 1 - w % tiles) * 4;
                    const int nq = T - t0 < 4 ? (int)(T - t0) : 4;
                    const uint32_t *qp = (const uint32_t *)((const char *)q + (b * qb + h * qh + t0 * qt) * el);
                    char *o = (char *)out + ((b * T + t0) * H + h) * D * el;
                    if (bf16) query_tile(1, qp, qt / 2, nq, column + t0, start, kt, vp, D, D, scale, s, ss, o, H * D);
                    else query_tile(0, qp, qt, nq, column + t0, start, kt, vg, D, D, scale, s, ss, o, H * D);
                }
                free(s);
            }
            if (failed) { free(kt); free(vp); free(vf); return -2; }
        }
    free(kt);
    free(vp);
    free(vf);
    return 0;
#else
    (void)bf16, (void)kv_type, (void)q, (void)qb, (void)qh, (void)qt, (void)k, (void)v, (void)kb, (void)kh, (void)rb;
    (void)off, (void)out, (void)B, (void)H, (void)KV, (void)T, (void)D, (void)column, (void)starts, (void)scale;
    (void)threads;
    return -1;
#endif
}

/* out [B, T, H, D] (q's dtype, contiguous) = causal attention of T new tokens q [B, H, T, D]
 * (element strides qb, qh, qt; dimensions contiguous), after `column` cached ones, over
 * k, v [B, KV, ≥column + T, D] (strides kb, kh; rows D apart): token t sees keys
 * [starts[b], column + t] (starts NULL: from 0; a padding token, before its row's start,
 * sees only itself), query head h reads kv head h / (H / KV); bf16 = 1: bfloat16, 0:
 * float32. Returns 0, or -1 where this build or shape is not supported (the caller then
 * uses SDPA), -2 when out of memory. */
int causal_attention(int bf16, const void *q, int64_t qb, int64_t qh, int64_t qt, const void *k, const void *v,
                     int64_t kb, int64_t kh, void *out, int64_t B, int64_t H, int64_t KV, int64_t T, int64_t D,
                     int64_t column, const int64_t *starts, float scale, int threads) {
    return attention(bf16, 0, q, qb, qh, qt, k, v, kb, kh, 0, NULL, out, B, H, KV, T, D, column, starts, scale,
                     threads);
}

/* causal_attention over a block cache's keys and values as stored: k, v [B, KV, ≥column + T,
 * rb bytes] of Q8_0 (kv_type 8) or Q4_0 (2) blocks, strides kb, kh in bytes; off [KV][D]
 * float32: the layer's key offset (added to the decoded keys) or NULL. */
int causal_attention_blocks(int bf16, int kv_type, const void *q, int64_t qb, int64_t qh, int64_t qt,
                            const void *k, const void *v, int64_t kb, int64_t kh, int64_t rb, const float *off,
                            void *out, int64_t B, int64_t H, int64_t KV, int64_t T, int64_t D, int64_t column,
                            const int64_t *starts, float scale, int threads) {
    return attention(bf16, kv_type, q, qb, qh, qt, k, v, kb, kh, rb, off, out, B, H, KV, T, D, column, starts, scale,
                     threads);
}
