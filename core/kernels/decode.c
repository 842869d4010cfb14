/* One decode step of a llama-family model on the CPU, for a batch of rows: every layer
 * and the head in one call, so a step costs one trip from Python instead of hundreds of
 * small ops.
 *
 * Decode is memory-bound: the time goes to reading each weight once (gemv.c). What this
 * file removes is everything around those reads: per-op dispatch, graph guards and
 * allocation, which for a 135M model cost as much as the reads themselves. A batch
 * reads the weights once for all its rows and turns compute-bound, and then the
 * element-wise work (norms, rotary, softmax, SiLU, roundings) shows: it runs on vectors
 * (vec.h), with scalar loops for the edges and for CPUs without AVX-512.
 *
 * Numerics follow the eager PyTorch path (core/llama.py) step for step: activations are
 * held in float32 and rounded to the model dtype (`rnd`) wherever the eager path stores a
 * tensor in that dtype, so bf16 runs round at the same points; softmax and dot products
 * accumulate in float32 as SDPA's CPU kernel does. In float32 `rnd` is the identity.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"
#include "vec.h"

void gemm(const void *w, const void *x, float *y, int64_t out, int64_t n, int64_t rows, int bf16, int threads);

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, vocab, layers;
    float eps, scale;
    int64_t bf16; /* 1: weights, cache, cos/sin in bfloat16; 0: float32 */
} Dims;

typedef struct { /* NULL where the model has no such tensor */
    const void *in_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias;
    const void *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    int64_t window; /* sliding window in tokens; 0 = none */
} Layer;

static inline float rnd(const Dims *d, float f) { return d->bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline float load(const Dims *d, const void *p, int64_t i) {
    return d->bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef __AVX512F__
static inline __m512 load16(const Dims *d, const void *p, int64_t at) {
    if (d->bf16) {  /* bf16 → f32 is a 16-bit shift */
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + at);
}

/* rnd on 16 lanes. */
static inline __m512 rnd16(const Dims *d, __m512 v) { return d->bf16 ? round_bf16(v) : v; }
#endif

/* y[i] = rnd(y[i] + t[i] + b[i]) over n elements, t (float32) and b (model dtype) each
 * optional: a residual add or a bias, rounded to the model dtype where eager stores it. */
static void add_round(const Dims *d, float *y, const float *t, const void *b, int64_t n) {
    if (!d->bf16 && !t && !b) return;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(y + i);
        if (t) v = _mm512_add_ps(v, _mm512_loadu_ps(t + i));
        if (b) v = _mm512_add_ps(v, load16(d, b, i));
        _mm512_storeu_ps(y + i, rnd16(d, v));
    }
#endif
    for (; i < n; i++) y[i] = rnd(d, y[i] + (t ? t[i] : 0.0f) + (b ? load(d, b, i) : 0.0f));
}

/* x (float32 holding bf16 values) → bf16, n elements. */
static void narrow(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(_mm512_loadu_ps(x + i))), 16);
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(u));
    }
#endif
    for (; i < n; i++) out[i] = f32_to_bf16(x[i]);
}

/* y = rnd(W x + b) for `rows` vectors x [rows, n] → y [rows, out]. x is already
 * representable in the model dtype; `xw` is scratch for it in that dtype (the bf16 kernel
 * multiplies bf16 by bf16). */
static void linear(const Dims *d, const void *w, const void *b, const float *x, int64_t n, int64_t out,
                   int64_t rows, float *y, uint16_t *xw, int threads) {
    if (d->bf16) narrow(x, xw, rows * n);
    gemm(w, d->bf16 ? (const void *)xw : (const void *)x, y, out, n, rows, (int)d->bf16, threads);
    for (int64_t r = 0; r < rows; r++) add_round(d, y + r * out, NULL, b, out);
}

/* q · one cached key, and out += p · one cached value: the dtype branch sits outside the
 * loops so the compiler vectorizes them (attention reads rows × heads × tokens of these). */
static float dot_cached(const Dims *d, const float *q, const void *cache, int64_t at, int64_t n) {
    float s = 0.0f;
    if (d->bf16) {
        const uint16_t *c = (const uint16_t *)cache + at;
        #pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) s += q[i] * bf16_to_f32(c[i]);
    } else {
        const float *c = (const float *)cache + at;
        #pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < n; i++) s += q[i] * c[i];
    }
    return s;
}

static void axpy_cached(const Dims *d, float p, const void *cache, int64_t at, int64_t n, float *out) {
    if (d->bf16) {
        const uint16_t *c = (const uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) out[i] += p * bf16_to_f32(c[i]);
    } else {
        const float *c = (const float *)cache + at;
        for (int64_t i = 0; i < n; i++) out[i] += p * c[i];
    }
}

/* One query head against n cached keys/values (rows D apart from element `base`):
 * softmax(q·K * scale) · V into out. */
static void attend_head_scalar(const Dims *d, const float *q, const void *kc, const void *vc, int64_t base,
                               int64_t n, float *s, float *out) {
    const int64_t D = d->head_dim;
    float m = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = dot_cached(d, q, kc, base + j * D, D) * d->scale;
        if (s[j] > m) m = s[j];
    }
    for (int64_t j = 0; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) axpy_cached(d, s[j] / sum, vc, base + j * D, D, out);
}

#ifdef __AVX512F__
/* Lane-wise partial products of q and the key at `at` (their lane sum is q·k). In bf16,
 * where q holds bf16 values as eager's q does, dot-product instructions take the cached
 * key as stored (32 products each, exact, accumulated in float32) instead of widening it. */
static inline __attribute__((always_inline)) __m512 key_dot(const Dims *d, const int NV, const __m512 *q,
                                                            const __m512i *qb, const void *kc, int64_t at) {
#ifdef __AVX512BF16__
    if (d->bf16) {
        const uint16_t *k = (const uint16_t *)kc + at;
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qb[0], (__m512bh)_mm512_loadu_si512(k));
        for (int v = 1; v < NV / 2; v++)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)qb[v], (__m512bh)_mm512_loadu_si512(k + 32 * v));
        return acc;
    }
#endif
    (void)qb;
    __m512 acc = _mm512_mul_ps(q[0], load16(d, kc, at));
    for (int v = 1; v < NV; v++) acc = _mm512_fmadd_ps(q[v], load16(d, kc, at + 16 * v), acc);
    return acc;
}

/* The same with the query and the output held in registers for the whole pass over the
 * cache (head_dim = 16·NV): each key and value row is loaded once and never written.
 * Scores come 16 keys at a time (their 16 partial sums folded into one vector), so the
 * max, the exponentials and the sum run on vectors. */
static inline __attribute__((always_inline)) void attend_head_vec(const Dims *d, const int NV, const float *qh,
                                                                  const void *kc, const void *vc, int64_t base,
                                                                  int64_t n, float *s, float *out) {
    const int64_t D = 16 * NV;
    __m512 q[8], o[8];
    __m512i qb[4];
    for (int v = 0; v < NV; v++) { q[v] = _mm512_loadu_ps(qh + 16 * v); o[v] = _mm512_setzero_ps(); }
#ifdef __AVX512BF16__
    for (int v = 0; v < NV / 2; v++) qb[v] = (__m512i)_mm512_cvtne2ps_pbh(q[2 * v + 1], q[2 * v]);
#endif
    const __m512 scale = _mm512_set1_ps(d->scale);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 acc[16];
        for (int k = 0; k < 16; k++) {
            acc[k] = key_dot(d, NV, q, qb, kc, base + (j + k) * D);
        }
        const __m512 sv = _mm512_mul_ps(sum16(acc), scale);
        _mm512_storeu_ps(s + j, sv);
        mv = _mm512_max_ps(mv, sv);
    }
    float m = _mm512_reduce_max_ps(mv);
    for (; j < n; j++) {
        s[j] = _mm512_reduce_add_ps(key_dot(d, NV, q, qb, kc, base + j * D)) * d->scale;
        if (s[j] > m) m = s[j];
    }
    const __m512 mb = _mm512_set1_ps(m);
    __m512 sumv = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mb));
        _mm512_storeu_ps(s + j, e);
        sumv = _mm512_add_ps(sumv, e);
    }
    if (j < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mb));
        _mm512_mask_storeu_ps(s + j, tail, e);
        sumv = _mm512_add_ps(sumv, _mm512_maskz_mov_ps(tail, e));
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(sumv);
#ifdef __AVX512BW__
    if (d->bf16) {
        /* A bf16 value widened is the top half of a float: unpacking a cached row with
         * zeros widens 32 at once, in an order permuted within 128-bit lanes, which the
         * accumulators keep until one permute at the end (exact, as load16's shift). */
        const __m512i zero = _mm512_setzero_si512();
        for (j = 0; j < n; j++) {
            const __m512 p = _mm512_set1_ps(s[j] * inv);
            const uint16_t *row = (const uint16_t *)vc + base + j * D;
            for (int v = 0; v < NV / 2; v++) {
                const __m512i raw = _mm512_loadu_si512(row + 32 * v);
                o[2 * v] = _mm512_fmadd_ps(p, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw)), o[2 * v]);
                o[2 * v + 1] = _mm512_fmadd_ps(p, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw)), o[2 * v + 1]);
            }
        }
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int v = 0; v < NV / 2; v++) {
            _mm512_storeu_ps(out + 32 * v, _mm512_permutex2var_ps(o[2 * v], first, o[2 * v + 1]));
            _mm512_storeu_ps(out + 32 * v + 16, _mm512_permutex2var_ps(o[2 * v], second, o[2 * v + 1]));
        }
        return;
    }
#endif
    for (j = 0; j < n; j++) {
        const __m512 p = _mm512_set1_ps(s[j] * inv);
        for (int v = 0; v < NV; v++) o[v] = _mm512_fmadd_ps(p, load16(d, vc, base + j * D + 16 * v), o[v]);
    }
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + 16 * v, o[v]);
}
#endif

static void attend_head(const Dims *d, const float *q, const void *kc, const void *vc, int64_t base, int64_t n,
                        float *s, float *out) {
#ifdef __AVX512F__
    if (d->head_dim == 64) { attend_head_vec(d, 4, q, kc, vc, base, n, s, out); return; }
    if (d->head_dim == 128) { attend_head_vec(d, 8, q, kc, vc, base, n, s, out); return; }
#endif
    attend_head_scalar(d, q, kc, vc, base, n, s, out);
}

/* transformers' LlamaRMSNorm: normalize in float32, round, then scale in the model dtype. */
static void rms_norm(const Dims *d, const float *x, const void *w, int64_t n, float *y) {
    float ss = 0.0f;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i), acc);
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + d->eps);
    i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(r));
        v = _mm512_mul_ps(load16(d, w, i), rnd16(d, v));
        _mm512_storeu_ps(y + i, rnd16(d, v));
    }
#endif
    for (; i < n; i++) y[i] = rnd(d, load(d, w, i) * rnd(d, x[i] * r));
}

/* x = x*cos + rotate_half(x)*sin over one head, each product rounded as in eager. */
static void rope(const Dims *d, float *x, const void *cos, const void *sin, int64_t row) {
    const int64_t D = d->head_dim, h = D / 2;
    const int64_t at = row * D * (d->bf16 ? 2 : 4); /* this position's row of each table, in bytes */
    const void *c = (const char *)cos + at, *s = (const char *)sin + at;
    int64_t i = 0;
#ifdef __AVX512F__
    if (h % 16 == 0) { /* both halves at once: x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin */
        for (; i < h; i += 16) {
            const __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + h + i);
            __m512 a = _mm512_mul_ps(x1, load16(d, c, i)), b = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                                              load16(d, s, i));
            __m512 e = _mm512_mul_ps(x2, load16(d, c, h + i)), f = _mm512_mul_ps(x1, load16(d, s, h + i));
            a = _mm512_add_ps(rnd16(d, a), rnd16(d, b));
            e = _mm512_add_ps(rnd16(d, e), rnd16(d, f));
            _mm512_storeu_ps(x + i, rnd16(d, a));
            _mm512_storeu_ps(x + h + i, rnd16(d, e));
        }
        return;
    }
#endif
    float tmp[1024];
    for (; i < D; i++) {
        float rot = i < h ? -x[i + h] : x[i - h];
        tmp[i] = rnd(d, rnd(d, x[i] * load(d, c, i)) + rnd(d, rot * load(d, s, i)));
    }
    memcpy(x, tmp, (size_t)D * sizeof(float));
}

/* One step for `rows` rows sharing cache column `column`; row r holds padding before
 * starts[r] (NULL: no padding) and its token tokens[r] sits at position column - starts[r].
 * cos/sin: the rotary tables [positions, head_dim]. Caches: [layers, rows, kv_heads,
 * capacity, head_dim] in the model dtype. logits: [rows, vocab] float32.
 * Returns 0; -1 when a scratch allocation failed, -2 for a token id outside the
 * vocabulary (nothing was written then). */
int decode_step(const Dims *d, const Layer *layers, const void *final_norm, const void *head,
                const void *embed, const int64_t *tokens, int64_t rows, const void *cos, const void *sin,
                void *k_cache, void *v_cache, int64_t capacity, int64_t column, const int64_t *starts,
                float *logits, int threads) {
    const int64_t H = d->hidden, D = d->head_dim, q_size = d->heads * D, kv_size = d->kv_heads * D;
    const int64_t qkv = q_size + 2 * kv_size;
    const int64_t widest = 2 * d->inter > qkv ? 2 * d->inter : qkv;
    const int64_t wide_in = d->inter > H ? (d->inter > q_size ? d->inter : q_size) : (H > q_size ? H : q_size);
    const int64_t el = d->bf16 ? 2 : 4;
    if (D > 1024 || rows < 1) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= d->vocab) return -2; /* its embedding row would be out of bounds */
    float *x = malloc(sizeof(float) * rows * H), *xn = malloc(sizeof(float) * rows * H);
    float *t = malloc(sizeof(float) * rows * H), *big = malloc(sizeof(float) * rows * widest);
    float *att = malloc(sizeof(float) * rows * (q_size > d->inter ? q_size : d->inter));
    uint16_t *xw = malloc(sizeof(uint16_t) * rows * wide_in);
    float *scores = malloc(sizeof(float) * rows * d->heads * capacity);
    if (!x || !xn || !t || !big || !att || !xw || !scores) {
        free(x); free(xn); free(t); free(big); free(att); free(xw); free(scores);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < H; i++) x[r * H + i] = load(d, embed, tokens[r] * H + i);
    const int64_t row_elems = d->kv_heads * capacity * D; /* one row of one layer's cache */
    const int64_t group = d->heads / d->kv_heads;

    for (int64_t l = 0; l < d->layers; l++) {
        const Layer *L = &layers[l];
        char *kl = (char *)k_cache + l * rows * row_elems * el, *vl = (char *)v_cache + l * rows * row_elems * el;

        #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
        for (int64_t r = 0; r < rows; r++) rms_norm(d, x + r * H, L->in_norm, H, xn + r * H);
        linear(d, L->qkv, L->qkv_bias, xn, H, qkv, rows, big, xw, threads);
        #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float nt[1024];
            float *q = big + r * qkv, *k = q + q_size, *v = q + q_size + kv_size;
            const int64_t position = column - (starts ? starts[r] : 0);
            char *kc = kl + r * row_elems * el, *vc = vl + r * row_elems * el;
            for (int64_t h = 0; h < d->heads; h++) {
                if (L->q_norm) { rms_norm(d, q + h * D, L->q_norm, D, nt); memcpy(q + h * D, nt, D * sizeof(float)); }
                rope(d, q + h * D, cos, sin, position);
            }
            for (int64_t h = 0; h < d->kv_heads; h++) {
                if (L->k_norm) { rms_norm(d, k + h * D, L->k_norm, D, nt); memcpy(k + h * D, nt, D * sizeof(float)); }
                rope(d, k + h * D, cos, sin, position);
                const int64_t at = (h * capacity + column) * D;
                if (d->bf16) { /* k and v hold bf16 values already: narrow() only repacks them */
                    narrow(k + h * D, (uint16_t *)kc + at, D);
                    narrow(v + h * D, (uint16_t *)vc + at, D);
                } else {
                    memcpy((float *)kc + at, k + h * D, D * sizeof(float));
                    memcpy((float *)vc + at, v + h * D, D * sizeof(float));
                }
            }
        }
        /* Row r sees columns [lo, column]: from its first real token, inside the window. */
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t rh = 0; rh < rows * d->heads; rh++) {
            const int64_t r = rh / d->heads, h = rh % d->heads, g = h / group;
            int64_t lo = starts ? starts[r] : 0;
            if (L->window > 0 && column - L->window + 1 > lo) lo = column - L->window + 1;
            const int64_t n = column - lo + 1;
            const char *kc = kl + r * row_elems * el, *vc = vl + r * row_elems * el;
            const float *qh = big + r * qkv + h * D;
            float *oh = att + r * q_size + h * D;
            attend_head(d, qh, kc, vc, (g * capacity + lo) * D, n, scores + rh * capacity, oh);
            for (int64_t i = 0; i < D; i++) oh[i] = rnd(d, oh[i]);
        }
        linear(d, L->o, L->o_bias, att, q_size, H, rows, t, xw, threads);
        add_round(d, x, t, NULL, rows * H);

        #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
        for (int64_t r = 0; r < rows; r++) rms_norm(d, x + r * H, L->post_norm, H, xn + r * H);
        linear(d, L->gate_up, L->gate_up_bias, xn, H, 2 * d->inter, rows, big, xw, threads);
        #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *gu = big + r * 2 * d->inter;
            float *h = att + r * d->inter;
            int64_t i = 0;
#ifdef __AVX512F__
            for (; i + 16 <= d->inter; i += 16) {
                const __m512 g = _mm512_loadu_ps(gu + i), up = _mm512_loadu_ps(gu + d->inter + i);
                __m512 a = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                a = _mm512_mul_ps(rnd16(d, a), up);
                _mm512_storeu_ps(h + i, rnd16(d, a));
            }
#endif
            for (; i < d->inter; i++) {
                const float g = gu[i];
                h[i] = rnd(d, rnd(d, g / (1.0f + expf(-g))) * gu[d->inter + i]);
            }
        }
        linear(d, L->down, L->down_bias, att, d->inter, H, rows, t, xw, threads);
        add_round(d, x, t, NULL, rows * H);
    }
    for (int64_t r = 0; r < rows; r++) rms_norm(d, x + r * H, final_norm, H, xn + r * H);
    linear(d, head, NULL, xn, H, d->vocab, rows, logits, xw, threads);
    free(x); free(xn); free(t); free(big); free(att); free(xw); free(scores);
    return 0;
}
