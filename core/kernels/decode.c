/* One decode token of a llama-family model, batch 1, on the CPU: every layer and the head
 * in one call, so a token costs one trip from Python instead of hundreds of small ops.
 *
 * Decode is memory-bound: the time goes to reading each weight once (gemv.c). What this
 * file removes is everything around those reads: per-op dispatch, graph guards and
 * allocation, which for a 135M model cost as much as the reads themselves.
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

void gemv_f32(const float *w, const float *x, float *y, int64_t out, int64_t n, int threads);
void gemv_bf16(const uint16_t *w, const uint16_t *x, float *y, int64_t out, int64_t n, int threads);

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

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float rnd(const Dims *d, float f) { return d->bf16 ? from_bf16(to_bf16(f)) : f; }

static inline float load(const Dims *d, const void *p, int64_t i) {
    return d->bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(const Dims *d, void *p, int64_t i, float f) {
    if (d->bf16) ((uint16_t *)p)[i] = to_bf16(f);
    else ((float *)p)[i] = f;
}

/* y = rnd(W x + b): x is already representable in the model dtype; `xw` is scratch for it
 * in that dtype (the bf16 kernel multiplies bf16 by bf16). */
static void linear(const Dims *d, const void *w, const void *b, const float *x, int64_t n, int64_t out,
                   float *y, uint16_t *xw, int threads) {
    if (d->bf16) {
        for (int64_t i = 0; i < n; i++) xw[i] = to_bf16(x[i]);
        gemv_bf16((const uint16_t *)w, xw, y, out, n, threads);
    } else {
        gemv_f32((const float *)w, x, y, out, n, threads);
    }
    for (int64_t i = 0; i < out; i++) y[i] = rnd(d, b ? y[i] + load(d, b, i) : y[i]);
}

/* transformers' LlamaRMSNorm: normalize in float32, round, then scale in the model dtype. */
static void rms_norm(const Dims *d, const float *x, const void *w, int64_t n, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + d->eps);
    for (int64_t i = 0; i < n; i++) y[i] = rnd(d, load(d, w, i) * rnd(d, x[i] * r));
}

/* x = x*cos + rotate_half(x)*sin over one head, each product rounded as in eager. */
static void rope(const Dims *d, float *x, const void *cos, const void *sin) {
    int64_t h = d->head_dim / 2;
    float tmp[1024];
    for (int64_t i = 0; i < d->head_dim; i++) {
        float rot = i < h ? -x[i + h] : x[i - h];
        tmp[i] = rnd(d, rnd(d, x[i] * load(d, cos, i)) + rnd(d, rot * load(d, sin, i)));
    }
    memcpy(x, tmp, (size_t)d->head_dim * sizeof(float));
}

/* Returns 0, or -1 when a scratch allocation failed (nothing was written then). */
int decode_token(const Dims *d, const Layer *layers, const void *final_norm, const void *head,
                 const void *embed_row, const void *cos, const void *sin, void *k_cache, void *v_cache,
                 int64_t capacity, int64_t column, int64_t start, float *logits, int threads) {
    const int64_t H = d->hidden, D = d->head_dim, q_size = d->heads * D, kv_size = d->kv_heads * D;
    const int64_t widest = (2 * d->inter > q_size + 2 * kv_size ? 2 * d->inter : q_size + 2 * kv_size);
    const int64_t wide_in = (d->inter > H ? d->inter : (q_size > H ? q_size : H));
    const int64_t el = d->bf16 ? 2 : 4;
    if (D > 1024) return -1;
    float *x = malloc(sizeof(float) * H), *xn = malloc(sizeof(float) * H), *t = malloc(sizeof(float) * H);
    float *big = malloc(sizeof(float) * widest), *att = malloc(sizeof(float) * (q_size + d->inter));
    uint16_t *xw = malloc(sizeof(uint16_t) * wide_in);
    float *scores = malloc(sizeof(float) * d->heads * capacity);
    if (!x || !xn || !t || !big || !att || !xw || !scores) {
        free(x); free(xn); free(t); free(big); free(att); free(xw); free(scores);
        return -1;
    }
    for (int64_t i = 0; i < H; i++) x[i] = load(d, embed_row, i);
    const int64_t layer_elems = d->kv_heads * capacity * D;
    const int64_t group = d->heads / d->kv_heads;

    for (int64_t l = 0; l < d->layers; l++) {
        const Layer *L = &layers[l];
        char *kc = (char *)k_cache + l * layer_elems * el, *vc = (char *)v_cache + l * layer_elems * el;

        rms_norm(d, x, L->in_norm, H, xn);
        linear(d, L->qkv, L->qkv_bias, xn, H, q_size + 2 * kv_size, big, xw, threads);
        float *q = big, *k = big + q_size, *v = big + q_size + kv_size;
        for (int64_t h = 0; h < d->heads; h++) {
            if (L->q_norm) { rms_norm(d, q + h * D, L->q_norm, D, t); memcpy(q + h * D, t, D * sizeof(float)); }
            rope(d, q + h * D, cos, sin);
        }
        for (int64_t h = 0; h < d->kv_heads; h++) {
            if (L->k_norm) { rms_norm(d, k + h * D, L->k_norm, D, t); memcpy(k + h * D, t, D * sizeof(float)); }
            rope(d, k + h * D, cos, sin);
            for (int64_t i = 0; i < D; i++) {
                store(d, kc, (h * capacity + column) * D + i, k[h * D + i]);
                store(d, vc, (h * capacity + column) * D + i, v[h * D + i]);
            }
        }
        /* Columns [lo, column] are visible: from the row's first real token, inside the window. */
        int64_t lo = start;
        if (L->window > 0 && column - L->window + 1 > lo) lo = column - L->window + 1;
        const int64_t n = column - lo + 1;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t h = 0; h < d->heads; h++) {
            const int64_t g = h / group;
            const float *qh = q + h * D;
            float *s = scores + h * capacity, m = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                float dot = 0.0f;
                for (int64_t i = 0; i < D; i++) dot += qh[i] * load(d, kc, (g * capacity + lo + j) * D + i);
                s[j] = dot * d->scale;
                if (s[j] > m) m = s[j];
            }
            for (int64_t j = 0; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
            float *oh = att + h * D;
            for (int64_t i = 0; i < D; i++) oh[i] = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const float p = s[j] / sum;
                for (int64_t i = 0; i < D; i++) oh[i] += p * load(d, vc, (g * capacity + lo + j) * D + i);
            }
            for (int64_t i = 0; i < D; i++) oh[i] = rnd(d, oh[i]);
        }
        linear(d, L->o, L->o_bias, att, q_size, H, t, xw, threads);
        for (int64_t i = 0; i < H; i++) x[i] = rnd(d, x[i] + t[i]);

        rms_norm(d, x, L->post_norm, H, xn);
        linear(d, L->gate_up, L->gate_up_bias, xn, H, 2 * d->inter, big, xw, threads);
        for (int64_t i = 0; i < d->inter; i++) {
            const float g = big[i];
            att[i] = rnd(d, rnd(d, g / (1.0f + expf(-g))) * big[d->inter + i]);
        }
        linear(d, L->down, L->down_bias, att, d->inter, H, t, xw, threads);
        for (int64_t i = 0; i < H; i++) x[i] = rnd(d, x[i] + t[i]);
    }
    rms_norm(d, x, final_norm, H, xn);
    linear(d, head, NULL, xn, H, d->vocab, logits, xw, threads);
    free(x); free(xn); free(t); free(big); free(att); free(xw); free(scores);
    return 0;
}
