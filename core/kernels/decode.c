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
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kvblock.h"
#include "qdot.h"
#include "vec.h"

void gemm(const void *w, const void *x, float *y, int64_t out, int64_t n, int64_t rows, int bf16, int threads);
int64_t q_act_bytes(int type, int64_t n);
int q_act_family(int type);
void q_prepare(int type, const float *x, int64_t n, int64_t rows, void *xq);
void q_gemm(int type, const void *w, int64_t out, int64_t n, const void *xq, int64_t rows, float *y, int64_t ldy,
            int threads);
void q_dequantize(int type, const void *w, int64_t nrows, int64_t n, float *out, int threads);
void q_dequantize_at(int type, const void *w, int64_t first, int64_t nrows, int64_t n, float *out, int threads);
int64_t q_row_bytes(int type, int64_t n);

/* What a family needs beyond llama's block (native_decode.py reads it off the model's
 * declared features): the block kind, the RMSNorm kind, the gated MLP's activation, q/k norms
 * over the whole projection, partial rotary, a second rotary table for some layers, tanh
 * soft-caps of the attention scores and of the logits, a scale of the embeddings. Each is
 * the llama value when zero (or NULL), and then the llama code runs unchanged. */
enum { BLOCK_LLAMA = 0, BLOCK_SANDWICH = 1, BLOCK_POST_NORM = 2 };
enum { NORM_LLAMA = 0,    /* rnd(w · rnd(x · r)): LlamaRMSNorm */
       NORM_OFFSET1 = 1,  /* rnd((x · r) · (1 + w)) in float32: Gemma's RMSNorm */
       NORM_WEIGHT_F32 = 2 /* rnd(w · (x · r)) in float32: OLMo 2's RMSNorm */ };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, vocab, layers;
    float eps, scale;
    int64_t bf16; /* 1: norms, biases, float weights, cache, cos/sin in bfloat16; 0: float32 */
    const void *cos_local, *sin_local; /* the second rotary table (Layer.local), like cos/sin; NULL: none */
    int64_t block, norm, act;
    int64_t qk_full; /* q_norm / k_norm span the whole q / k projection (before the head split) */
    int64_t rot;     /* dimensions of each head that rotate (the first `rot`), the tables' width; 0: head_dim */
    float attn_cap, final_cap; /* tanh soft-caps: s → tanh(s / cap) · cap; 0: none */
    float embed_scale;         /* the embedding row times this (a model-dtype value), rounded; 0: none */
    float pad_;
    /* moe (Layer.moe layers): `experts` gated MLPs of `moe_inter` rows, `top_k` per token by the
     * router's float32 softmax, renormalized if `renorm`, the weights cast to the model dtype
     * unless `float_weights` (experts.py). */
    int64_t experts, top_k, moe_inter, renorm, float_weights;
    /* The KV cache's element type (core/cache.py): 0 the model dtype; KV_Q8_0 / KV_Q4_0 (ggml type
     * ids) blocks of 32 values along head_dim, GGUF's layout: each token's head vector is D / 32
     * blocks of fp16 d + 32 int8 (34 bytes) or fp16 d + 16 bytes of nibbles (18 bytes). */
    int64_t kv_type;
    /* 1: a block cache stores keys minus the layer's key bias (the k part of qkv_bias; cache.py's
     * offset_keys); attention is unchanged by it (softmax is shift invariant). */
    int64_t kv_unbias;
} Dims;
enum { KV_FLOAT = 0, KV_Q4_0 = 2, KV_Q8_0 = 8 };

/* A matrix as its stored parts, top to bottom (native_decode.py, qweight.BlockWeight): each
 * `rows` output rows of ggml type `type`. A float weight in the model dtype is one part of
 * type FLOAT_TYPE (multiplied by gemm, as before); blocks go through q_gemm (qdot.c). */
#define MAX_PARTS 3
#define FLOAT_TYPE -1
typedef struct { const void *data; int64_t type, rows; } Part;
typedef struct {
    Part part[MAX_PARTS];
    int64_t parts;
    /* Not NULL: the `parts` parts are there and part[] is unused. Only stacked expert matrices have
     * more than MAX_PARTS (a GGUF file's experts: each expert's gate rows and up rows are views of
     * the file's two tensors); decode.c multiplies an expert's rows of them (sub_weight: <= MAX_PARTS). */
    const Part *many;
} Weight;

static inline const Part *parts_of(const Weight *w) { return w->many ? w->many : w->part; }

typedef struct { /* NULL where the model has no such tensor */
    const void *in_norm, *qkv_bias, *q_norm, *k_norm, *o_bias, *post_norm, *gate_up_bias, *down_bias;
    Weight qkv, o, gate_up, down;
    int64_t window; /* sliding window in tokens; 0 = none */
    const void *pre_ff_norm, *post_ff_norm; /* block:sandwich's third and fourth norms; post_norm's second */
    int64_t local; /* 1: rotate with Dims.cos_local / sin_local */
    int64_t moe;   /* 1: the MLP is the router and the stacked experts below (gate_up/down unused) */
    Weight router; /* [experts, hidden] */
    Weight experts_gate_up, experts_down; /* expert e: rows [e·2·moe_inter, +2·moe_inter) / [e·hidden, +hidden) */
    /* moe:shared (qwen2_moe): besides the routed experts, a gated MLP of `shared_inter` rows whose output,
     * times sigmoid(x · shared_gate), is added (experts.SparseMoE); shared_inter 0: none. */
    Weight shared_gate, shared_gate_up, shared_down; /* [1, hidden], [2·shared_inter, hidden], [hidden, shared_inter] */
    int64_t shared_inter;
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
    for (; i < n; i++) { /* the vector lanes' operations exactly: which elements fall here depends on n */
        float v = y[i];
        if (t) v += t[i];
        if (b) v += load(d, b, i);
        y[i] = rnd(d, v);
    }
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
 * multiplies bf16 by bf16), `xq` for it prepared for a block type (int8 blocks, qdot.h). */
static void linear(const Dims *d, const Weight *w, const void *b, const float *x, int64_t n, int64_t out,
                   int64_t rows, float *y, uint16_t *xw, void *xq, int threads) {
    int64_t row = 0, prepared = -1; /* the family x is prepared for in xq (one per family: qdot.h) */
    for (int64_t p = 0; p < w->parts; p++) {
        const Part *part = &parts_of(w)[p];
        if (part->type == FLOAT_TYPE) { /* the whole matrix (a float model's weights are one part) */
            if (d->bf16) narrow(x, xw, rows * n);
            gemm(part->data, d->bf16 ? (const void *)xw : (const void *)x, y, out, n, rows, (int)d->bf16, threads);
        } else {
            const int family = q_act_family((int)part->type);
            if (family != prepared) q_prepare((int)part->type, x, n, rows, xq);
            prepared = family;
            q_gemm((int)part->type, part->data, part->rows, n, xq, rows, y + row, out, threads);
        }
        row += part->rows;
    }
    for (int64_t r = 0; r < rows; r++) add_round(d, y + r * out, NULL, b, out);
}

static int64_t act_bytes(const Weight *w, int64_t n) { /* prepared-activation bytes of one row */
    int64_t most = 0;
    for (int64_t p = 0; p < w->parts; p++)
        if (parts_of(w)[p].type != FLOAT_TYPE) {
            const int64_t b = q_act_bytes((int)parts_of(w)[p].type, n);
            if (b > most) most = b;
        }
    return most;
}

/* Rows [lo, hi) of a matrix `n` wide as a Weight of its own: the parts they fall in, from
 * those rows on (a stacked expert's rows, read and nothing else). */
static Weight sub_weight(const Dims *d, const Weight *w, int64_t lo, int64_t hi, int64_t n) {
    Weight out = {0};
    int64_t row = 0;
    for (int64_t p = 0; p < w->parts && row < hi; p++) {
        const Part *part = &parts_of(w)[p];
        const int64_t a = lo > row ? lo : row, b = hi < row + part->rows ? hi : row + part->rows;
        if (a < b && out.parts < MAX_PARTS) { /* native_decode.supported: an expert spans <= MAX_PARTS parts */
            const int64_t bytes = part->type == FLOAT_TYPE ? n * (d->bf16 ? 2 : 4) : q_row_bytes((int)part->type, n);
            out.part[out.parts].data = (const char *)part->data + (a - row) * bytes;
            out.part[out.parts].type = part->type;
            out.part[out.parts].rows = b - a;
            out.parts++;
        }
        row += part->rows;
    }
    return out;
}

/* Bytes of one token's head vector in the cache. */
static inline int64_t kv_token_bytes(const Dims *d) {
    const int64_t D = d->head_dim;
    if (d->kv_type == KV_Q8_0) return D / 32 * 34;
    if (d->kv_type == KV_Q4_0) return D / 32 * 18;
    return D * (d->bf16 ? 2 : 4);
}

/* float32 → fp16 (round to nearest even; subnormals, infinities as IEEE); the way back is qdot.h's qd_f16. */
static inline void kv_put_f16(uint8_t *p, float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    uint16_t h;
    if (ax >= 0x7f800000u) h = (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
    else if (ax >= 0x477ff000u) h = (uint16_t)(sign | 0x7c00); /* rounds past 65504 */
    else if (ax < 0x38800000u) { /* below 2^-14: a subnormal, mant = round(|f| · 2^24), exact scaling */
        float a;
        memcpy(&a, &ax, 4);
        h = (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    } else {
        uint32_t v = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
        const uint32_t rest = ax & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (v & 1))) v++;
        h = (uint16_t)(sign | v);
    }
    memcpy(p, &h, 2);
}

/* Keeps the compiler from fusing a product into the following add (the reference rounds it). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define KV_NOFUSE(v) __asm__("" : "+x"(v))
#else
#define KV_NOFUSE(v) do { volatile float nofuse_ = (v); (v) = nofuse_; } while (0)
#endif

/* n values (whole blocks of 32) → blocks, as llama.cpp's quantize_row_q8_0_ref / _q4_0_ref
 * (and core/quant/legacy.py) compute them, bit for bit. */
static void kv_quantize(const Dims *d, const float *x, uint8_t *out, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++, x += 32) {
        if (d->kv_type == KV_Q8_0) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) { const float a = fabsf(x[j]); if (a > amax) amax = a; }
            const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
            kv_put_f16(out, dd);
            for (int j = 0; j < 32; j++) ((int8_t *)out)[2 + j] = (int8_t)roundf(x[j] * id);
            out += 34;
        } else {
            float amax = 0.0f, max = 0.0f;
            for (int j = 0; j < 32; j++) if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
            const float dd = max / -8.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
            kv_put_f16(out, dd);
            for (int j = 0; j < 16; j++) {
                float x0 = x[j] * id, x1 = x[16 + j] * id;
                KV_NOFUSE(x0);
                KV_NOFUSE(x1);
                int q0 = (int8_t)(x0 + 8.5f), q1 = (int8_t)(x1 + 8.5f);
                if (q0 > 15) q0 = 15;
                if (q1 > 15) q1 = 15;
                out[2 + j] = (uint8_t)(q0 | (q1 << 4));
            }
            out += 18;
        }
    }
}

/* kv_quantize for the tests (tests/test_kv_quant.py: the C blocks = core/quant's, bit for bit). */
void kv_blocks(int64_t kv_type, const float *x, uint8_t *out, int64_t n) {
    Dims d;
    memset(&d, 0, sizeof d);
    d.kv_type = kv_type;
    kv_quantize(&d, x, out, n);
}

/* q · a key of blocks, and out += p · a value of blocks (n values, whole blocks): the int8 /
 * int4 numbers as stored, times their block's scale (d · q is exact in float32: the value
 * the reference dequantizes to), so the products are the reference's; the dot accumulates 32
 * lanes over the blocks and sums them once. No float copy of the cache. */
#if defined(__AVX2__) && defined(__FMA__)
/* Q8_0 on 8-lane vectors: per block the 32 int8 widened to float and multiplied with q, the
 * block's sum scaled by d once (d · Σ q·qs: the reference's products up to rounding order). */
static inline __m256 q8_widen(__m128i b8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)); }

static float dot_q8_avx2(const float *q, const uint8_t *k, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, k += 34, q += 32) {
        const __m128i lo = _mm_loadu_si128((const __m128i *)(k + 2)), hi = _mm_loadu_si128((const __m128i *)(k + 18));
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(q), q8_widen(lo));
        t = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8), q8_widen(_mm_srli_si128(lo, 8)), t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16), q8_widen(hi), t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(q + 24), q8_widen(_mm_srli_si128(hi, 8)), t);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(qd_f16(k)), t, acc);
    }
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

static void axpy_q8_avx2(float p, const uint8_t *v, int64_t nb, float *out) {
    for (int64_t b = 0; b < nb; b++, v += 34, out += 32) {
        const __m256 w = _mm256_set1_ps(p * qd_f16(v));
        const __m128i lo = _mm_loadu_si128((const __m128i *)(v + 2)), hi = _mm_loadu_si128((const __m128i *)(v + 18));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(w, q8_widen(lo), _mm256_loadu_ps(out)));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(w, q8_widen(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(out + 8)));
        _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(w, q8_widen(hi), _mm256_loadu_ps(out + 16)));
        _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(w, q8_widen(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(out + 24)));
    }
}
#endif

static float dot_blocks(const Dims *d, const float *q, const uint8_t *k, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    if (d->kv_type == KV_Q8_0) return dot_q8_avx2(q, k, n / 32);
#endif
    float acc[32] = {0};
    if (d->kv_type == KV_Q8_0) {
        for (int64_t b = 0; b < n / 32; b++, k += 34, q += 32) {
            const int8_t *qs = (const int8_t *)(k + 2);
            const float s = qd_f16(k);
            #pragma omp simd
            for (int i = 0; i < 32; i++) acc[i] += q[i] * (s * (float)qs[i]);
        }
    } else {
        for (int64_t b = 0; b < n / 32; b++, k += 18, q += 32) {
            const uint8_t *qs = k + 2;
            const float s = qd_f16(k);
            #pragma omp simd
            for (int i = 0; i < 16; i++) {
                acc[i] += q[i] * (s * (float)((int)(qs[i] & 15) - 8));
                acc[i + 16] += q[i + 16] * (s * (float)((int)(qs[i] >> 4) - 8));
            }
        }
    }
    float t = 0.0f;
    for (int i = 0; i < 32; i++) t += acc[i];
    return t;
}

static void axpy_blocks(const Dims *d, float p, const uint8_t *v, int64_t n, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (d->kv_type == KV_Q8_0) { axpy_q8_avx2(p, v, n / 32, out); return; }
#endif
    if (d->kv_type == KV_Q8_0) {
        for (int64_t b = 0; b < n / 32; b++, v += 34, out += 32) {
            const int8_t *qs = (const int8_t *)(v + 2);
            const float s = qd_f16(v);
            #pragma omp simd
            for (int i = 0; i < 32; i++) out[i] += p * (s * (float)qs[i]);
        }
    } else {
        for (int64_t b = 0; b < n / 32; b++, v += 18, out += 32) {
            const uint8_t *qs = v + 2;
            const float s = qd_f16(v);
            #pragma omp simd
            for (int i = 0; i < 16; i++) {
                out[i] += p * (s * (float)((int)(qs[i] & 15) - 8));
                out[i + 16] += p * (s * (float)((int)(qs[i] >> 4) - 8));
            }
        }
    }
}

/* q · one cached key, and out += p · one cached value: the dtype branch sits outside the
 * loops so the compiler vectorizes them (attention reads rows × heads × tokens of these).
 * `at` counts elements from the row's start (for a block cache: token at / head_dim). */
static float dot_cached(const Dims *d, const float *q, const void *cache, int64_t at, int64_t n) {
    float s = 0.0f;
    if (d->kv_type != KV_FLOAT)
        return dot_blocks(d, q, (const uint8_t *)cache + at / d->head_dim * kv_token_bytes(d), n);
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
    if (d->kv_type != KV_FLOAT) {
        axpy_blocks(d, p, (const uint8_t *)cache + at / d->head_dim * kv_token_bytes(d), n, out);
        return;
    }
    if (d->bf16) {
        const uint16_t *c = (const uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) out[i] += p * bf16_to_f32(c[i]);
    } else {
        const float *c = (const float *)cache + at;
        for (int64_t i = 0; i < n; i++) out[i] += p * c[i];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Grouped-query attention straight from Q8_0/Q4_0 blocks on AVX2: the keys (then the values)
 * of KV_TILE tokens are widened to float32 once, into a tile that stays in L1, and every
 * query head of the group reads that tile, so a block is widened once per kv head, not once
 * per query head. d·q (Q8_0) and d·(q − 8) (Q4_0) are exact in float32, so the tile holds
 * the reference's dequantized values; only the order of the sums differs from
 * attend_head_scalar's. */
#define KV_TILE 8
#define KV_TILE_MAX_D 256

static inline int64_t block_int8(const Dims *d, const uint8_t *b, float *scale, __m128i *lo, __m128i *hi) {
    return block_int8_of(d->kv_type == KV_Q8_0, b, scale, lo, hi);
}

/* t tokens' head vectors (D values, whole blocks, `tb` bytes each from p) → t rows of D floats. */
static inline void widen_tile(const Dims *d, const uint8_t *p, int64_t tb, int64_t t, int64_t D, float *buf) {
    for (int64_t i = 0; i < t; i++, p += tb) {
        const uint8_t *b = p;
        for (float *o = buf + i * D; o < buf + (i + 1) * D; o += 32) {
            float scale;
            __m128i lo, hi;
            b += block_int8(d, b, &scale, &lo, &hi);
            const __m256 s = _mm256_set1_ps(scale);
            _mm256_storeu_ps(o, _mm256_mul_ps(s, q8_widen(lo)));
            _mm256_storeu_ps(o + 8, _mm256_mul_ps(s, q8_widen(_mm_srli_si128(lo, 8))));
            _mm256_storeu_ps(o + 16, _mm256_mul_ps(s, q8_widen(hi)));
            _mm256_storeu_ps(o + 24, _mm256_mul_ps(s, q8_widen(_mm_srli_si128(hi, 8))));
        }
    }
}

/* The lane sums of a[0..7], in lanes 0..7. */
static inline __m256 sums8(const __m256 *a) {
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* softmax(q·K · scale) · V for the `group` query heads (D apart in q and out) that share the
 * n block keys/values from token `tok` of kc/vc; s: scratch, `stride` floats per head.
 * out is float32 (attend_group rounds it); ml: each head's softmax max and sum. */
static void attend_group_blocks(const Dims *d, const float *q, int64_t group, const uint8_t *kc,
                                const uint8_t *vc, int64_t tok, int64_t n, float *s, int64_t stride, float *out,
                                float *ml) {
    const int64_t D = d->head_dim, tb = kv_token_bytes(d);
    float buf[KV_TILE * KV_TILE_MAX_D] __attribute__((aligned(32)));
    const __m256 scale = _mm256_set1_ps(d->scale);
    kc += tok * tb, vc += tok * tb;
    for (int64_t j = 0; j < n; j += KV_TILE) {
        const int64_t t = n - j < KV_TILE ? n - j : KV_TILE;
        widen_tile(d, kc + j * tb, tb, t, D, buf);
        if (t < KV_TILE) memset(buf + t * D, 0, (size_t)((KV_TILE - t) * D) * sizeof(float));
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + h * D;
            __m256 acc[KV_TILE];
            for (int i = 0; i < KV_TILE; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t v = 0; v < D; v += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + v);
                for (int i = 0; i < KV_TILE; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_load_ps(buf + i * D + v), acc[i]);
            }
            float sc[KV_TILE] __attribute__((aligned(32)));
            _mm256_store_ps(sc, _mm256_mul_ps(sums8(acc), scale));
            memcpy(s + h * stride + j, sc, (size_t)t * sizeof(float));
        }
    }
    for (int64_t h = 0; h < group; h++) {  /* as attend_head_scalar: p = e^(s − max) / Σ */
        float *p = s + h * stride, m = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < n; j++) if (p[j] > m) m = p[j];
        for (int64_t j = 0; j < n; j++) { p[j] = expf(p[j] - m); sum += p[j]; }
        for (int64_t j = 0; j < n; j++) p[j] /= sum;
        memset(out + h * D, 0, (size_t)D * sizeof(float));
        ml[2 * h] = m, ml[2 * h + 1] = sum;
    }
    for (int64_t j = 0; j < n; j += KV_TILE) {
        const int64_t t = n - j < KV_TILE ? n - j : KV_TILE;
        widen_tile(d, vc + j * tb, tb, t, D, buf);
        for (int64_t h = 0; h < group; h++) {
            const float *p = s + h * stride + j;
            float *o = out + h * D;
            if (t == KV_TILE) {
                __m256 pb[KV_TILE];
                for (int i = 0; i < KV_TILE; i++) pb[i] = _mm256_set1_ps(p[i]);
                for (int64_t v = 0; v < D; v += 8) {
                    __m256 ov = _mm256_loadu_ps(o + v);
                    for (int i = 0; i < KV_TILE; i++) ov = _mm256_fmadd_ps(pb[i], _mm256_load_ps(buf + i * D + v), ov);
                    _mm256_storeu_ps(o + v, ov);
                }
            } else
                for (int64_t i = 0; i < t; i++) {
                    const __m256 pi = _mm256_set1_ps(p[i]);
                    for (int64_t v = 0; v < D; v += 8)
                        _mm256_storeu_ps(o + v, _mm256_fmadd_ps(pi, _mm256_load_ps(buf + i * D + v), _mm256_loadu_ps(o + v)));
                }
        }
    }
}
#endif

/* One query head against n cached keys/values (rows D apart from element `base`):
 * softmax(q·K * scale) · V into out; its softmax max and sum into ml[0], ml[1]. */
static void attend_head_scalar(const Dims *d, const float *q, const void *kc, const void *vc, int64_t base,
                               int64_t n, float *s, float *out, float *ml) {
    const int64_t D = d->head_dim;
    float m = -INFINITY, sum = 0.0f;
    const float cap = d->attn_cap;
    for (int64_t j = 0; j < n; j++) {
        if (cap > 0.0f) { /* scores soft-capped as the eager path computes them: each op in the model dtype */
            const float sc = rnd(d, rnd(d, dot_cached(d, q, kc, base + j * D, D)) * d->scale);
            s[j] = rnd(d, rnd(d, tanhf(rnd(d, sc / cap))) * cap);
        } else
            s[j] = dot_cached(d, q, kc, base + j * D, D) * d->scale;
        if (s[j] > m) m = s[j];
    }
    for (int64_t j = 0; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    ml[0] = m, ml[1] = sum;
    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    if (cap > 0.0f) /* and its float32 probabilities cast to the model dtype before they meet V */
        for (int64_t j = 0; j < n; j++) axpy_cached(d, rnd(d, s[j] / sum), vc, base + j * D, D, out);
    else
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

/* Softmax(q·K · scale) of one query head over n cached keys (rows D apart from element
 * `base`) into p; returns what p still has to be multiplied by. Scores come 16 keys at a
 * time (their 16 partial sums folded into one vector), so the max, the exponentials and
 * the sum run on vectors; the max and the sum go to ml[0], ml[1]. In float32 p is
 * normalized (returns 1). In bfloat16 p holds
 * e^(s - max) as bf16 pairs, (p[j], p[j+1]) in one 32-bit word for values_vec's dot
 * products, zero-padded to an even count, and the 1/sum is returned: that is what SDPA's
 * CPU kernel does for bf16 (its probabilities meet V in bf16, the sum stays float).
 * While it reads these keys it prefetches, into L2, the keys and values the next call
 * will read (`ahead_n` keys at ahead_k/ahead_v; NULL: none): a short run of cache rows
 * far from the last one is too short a stream for the hardware prefetcher, and without
 * this each first touch waits on memory (a quarter of the attention time at batch 16). */
static inline __attribute__((always_inline)) float softmax_head_vec(const Dims *d, const int NV, const float *qh,
                                                                    const void *kc, int64_t base, int64_t n,
                                                                    const char *ahead_k, const char *ahead_v,
                                                                    int64_t ahead_n, float *p, float *ml) {
    const int64_t D = 16 * NV, row_bytes = D * (d->bf16 ? 2 : 4);
    __m512 q[8];
    __m512i qb[4];
    for (int v = 0; v < NV; v++) q[v] = _mm512_loadu_ps(qh + 16 * v);
#ifdef __AVX512BF16__
    for (int v = 0; v < NV / 2; v++) qb[v] = (__m512i)_mm512_cvtne2ps_pbh(q[2 * v + 1], q[2 * v]);
#endif
    const __m512 scale = _mm512_set1_ps(d->scale);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 acc[16];
        if (ahead_k && j < ahead_n)
            for (int64_t b = 0; b < 16 * row_bytes; b += 64) {
                _mm_prefetch(ahead_k + j * row_bytes + b, _MM_HINT_T1);
                _mm_prefetch(ahead_v + j * row_bytes + b, _MM_HINT_T1);
            }
        for (int k = 0; k < 16; k++) acc[k] = key_dot(d, NV, q, qb, kc, base + (j + k) * D);
        const __m512 sv = _mm512_mul_ps(sum16(acc), scale);
        _mm512_storeu_ps(p + j, sv);
        mv = _mm512_max_ps(mv, sv);
    }
    if (ahead_k)
        for (int64_t b = j * row_bytes; b < ahead_n * row_bytes; b += 64) {
            _mm_prefetch(ahead_k + b, _MM_HINT_T1);
            _mm_prefetch(ahead_v + b, _MM_HINT_T1);
        }
    float m = _mm512_reduce_max_ps(mv);
    for (; j < n; j++) {
        p[j] = _mm512_reduce_add_ps(key_dot(d, NV, q, qb, kc, base + j * D)) * d->scale;
        if (p[j] > m) m = p[j];
    }
    ml[0] = m;
#ifdef __AVX512BF16__
    if (d->bf16) {  /* bf16 pairs for values_vec's dot products */
        ml[1] = exp_sum(p, 0, n, m, 1);
        ((uint16_t *)p)[n] = 0;  /* the odd key's partner */
        return 1.0f / ml[1];
    }
#endif
    ml[1] = softmax16(p, n, m);
    return 1.0f;
}

/* out[h] = scale[h] · Σ_j p[h][j] · V[j] for NH query heads that share these values
 * (grouped-query attention): each value row is loaded once for all NH heads, and the
 * NH·NV accumulators are independent chains, so neither the loads nor the latency of the
 * multiply-adds bound the loop. p: NH rows `stride` floats apart, as softmax_head_vec
 * leaves them; out: NH heads D apart, in float32 (attend_group rounds it). */
static inline __attribute__((always_inline)) void values_vec(const Dims *d, const int NV, const int NH,
                                                             const float *p, int64_t stride, const float *scale,
                                                             const void *vc, int64_t base, int64_t n, float *out) {
    const int64_t D = 16 * NV;
    __m512 o[4][8];
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) o[h][v] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    if (d->bf16) {
        /* Two keys per dot product: interleaving value rows j and j+1 (unpack) puts
         * (V[j][i], V[j+1][i]) in one 32-bit lane, against the broadcast (p[j], p[j+1]).
         * The unpacks order lanes within 128-bit blocks; one permute at the end undoes it
         * (unpacked_first16/second16). */
        const __m512i zero = _mm512_setzero_si512();
        for (int64_t j = 0; j < n; j += 2) {
            const uint16_t *r0 = (const uint16_t *)vc + base + j * D, *r1 = r0 + D;
            __m512i pj[4];
            for (int h = 0; h < NH; h++) pj[h] = _mm512_set1_epi32(((const int32_t *)(p + h * stride))[j / 2]);
            for (int v = 0; v < NV / 2; v++) {
                const __m512i a = _mm512_loadu_si512(r0 + 32 * v);
                const __m512i b = j + 1 < n ? _mm512_loadu_si512(r1 + 32 * v) : zero;
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int h = 0; h < NH; h++) {
                    o[h][2 * v] = _mm512_dpbf16_ps(o[h][2 * v], lo, (__m512bh)pj[h]);
                    o[h][2 * v + 1] = _mm512_dpbf16_ps(o[h][2 * v + 1], hi, (__m512bh)pj[h]);
                }
            }
        }
        for (int h = 0; h < NH; h++) {
            const __m512 sc = _mm512_set1_ps(scale[h]);
            for (int v = 0; v < NV / 2; v++) {
                const __m512 a = o[h][2 * v], b = o[h][2 * v + 1];
                _mm512_storeu_ps(out + h * D + 32 * v, _mm512_mul_ps(unpacked_first16(a, b), sc));
                _mm512_storeu_ps(out + h * D + 32 * v + 16, _mm512_mul_ps(unpacked_second16(a, b), sc));
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++)
        for (int v = 0; v < NV; v++) {
            const __m512 vv = load16(d, vc, base + j * D + 16 * v);
            for (int h = 0; h < NH; h++) o[h][v] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * stride + j]), vv, o[h][v]);
        }
    for (int h = 0; h < NH; h++)
        for (int v = 0; v < NV; v++)
            _mm512_storeu_ps(out + h * D + 16 * v, _mm512_mul_ps(o[h][v], _mm512_set1_ps(scale[h])));
}

/* The `group` query heads (D apart in q and out) that read one cached kv head. */
static inline __attribute__((always_inline)) void attend_group_vec(const Dims *d, const int NV, const float *q,
                                                                   int64_t group, const void *kc, const void *vc,
                                                                   int64_t base, int64_t n, const char *ahead_k,
                                                                   const char *ahead_v, int64_t ahead_n, float *s,
                                                                   int64_t stride, float *out, float *ml) {
    const int64_t D = 16 * NV;
    const int most = NV == 4 ? 4 : 2;  /* 4·NV accumulators at most: with the rows and p, within 32 registers */
    for (int64_t h = 0; h < group; h += most) {
        const int nh = group - h < most ? (int)(group - h) : most;
        float scale[4];
        for (int k = 0; k < nh; k++)  /* the first head's pass prefetches; the rest find the keys in cache */
            scale[k] = softmax_head_vec(d, NV, q + (h + k) * D, kc, base, n, h + k ? NULL : ahead_k, ahead_v,
                                        ahead_n, s + k * stride, ml + 2 * (h + k));
        if (nh == 4) values_vec(d, NV, 4, s, stride, scale, vc, base, n, out + h * D);
        else if (nh == 3) values_vec(d, NV, 3, s, stride, scale, vc, base, n, out + h * D);
        else if (nh == 2) values_vec(d, NV, 2, s, stride, scale, vc, base, n, out + h * D);
        else values_vec(d, NV, 1, s, stride, scale, vc, base, n, out + h * D);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)  /* block_int8: the AVX2 section */
/* The block caches' grouped attention on 16 lanes (head_dim 16·NV), NH (≤ 4) query heads of
 * the group at a time: each token's key (then value) is widened once into registers and
 * meets all NH heads there (no float copy of a tile, no reload of it per head); each head's
 * 16 scores of a tile are summed into one vector (sum16) from partial products kept in a
 * small aligned buffer, and its output stays in registers over all the values. Only the
 * order of the float sums differs from the reference. */
#define KV_TILE16 16
static inline __attribute__((always_inline)) void attend_heads_blocks16(const Dims *d, const int Q8, const int NV,
                                                                        const int NH, const float *q,
                                                                        const uint8_t *kc, const uint8_t *vc,
                                                                        int64_t n, float *s, int64_t stride,
                                                                        float *out, float *ml) {
    const int64_t D = 16 * NV, tb = (Q8 ? 34 : 18) * (D / 32); /* kv_token_bytes, a constant here */
    const __m512 scale = _mm512_set1_ps(d->scale);
    __m512 qv[4][8];
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) qv[h][v] = _mm512_loadu_ps(q + h * D + 16 * v);
    for (int64_t j = 0; j < n; j += KV_TILE16) {
        const int64_t t = n - j < KV_TILE16 ? n - j : KV_TILE16;
        __m512 part[4][KV_TILE16];
        for (int64_t i = 0; i < KV_TILE16; i++) {
            __m512 acc[4];
            for (int h = 0; h < NH; h++) acc[h] = _mm512_setzero_ps();
            if (i < t) {
                const uint8_t *b = kc + (j + i) * tb;
#pragma GCC unroll 4
                for (int v = 0; v < NV; v += 2) {
                    __m512 k0, k1;
                    b = widen_block16(Q8, b, &k0, &k1);
                    for (int h = 0; h < NH; h++) acc[h] = _mm512_fmadd_ps(qv[h][v + 1], k1, _mm512_fmadd_ps(qv[h][v], k0, acc[h]));
                }
            }
            for (int h = 0; h < NH; h++) part[h][i] = acc[h];
        }
        for (int h = 0; h < NH; h++)
            _mm512_mask_storeu_ps(s + h * stride + j, lanes16(0, 0, t), _mm512_mul_ps(sum16(part[h]), scale));
    }
    for (int h = 0; h < NH; h++) {  /* p = e^(s − max) / Σ, 16 at a time (exp16, as the float caches') */
        float *p = s + h * stride;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, lanes16(j, 0, n), p + j));
        ml[2 * h] = _mm512_reduce_max_ps(mv);
        ml[2 * h + 1] = softmax16(p, n, ml[2 * h]);
    }
    __m512 o[4][8];
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) o[h][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *b = vc + j * tb;
        __m512 pj[4];
        for (int h = 0; h < NH; h++) pj[h] = _mm512_set1_ps(s[h * stride + j]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; v += 2) {
            __m512 v0, v1;
            b = widen_block16(Q8, b, &v0, &v1);
            for (int h = 0; h < NH; h++) {
                o[h][v] = _mm512_fmadd_ps(pj[h], v0, o[h][v]);
                o[h][v + 1] = _mm512_fmadd_ps(pj[h], v1, o[h][v + 1]);
            }
        }
    }
    for (int h = 0; h < NH; h++) for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + h * D + 16 * v, o[h][v]);
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
/* bf16 models on Q8_0/Q4_0 blocks at head_dim 64: the stored integers as bf16 (exact: a Q8_0
 * q has at most 7 significant bits, Q4_0's q − 8 four) meet the query and the probabilities in
 * dot-product instructions, two at a time, as the bf16 cache's attention does (key_dot,
 * values_vec), instead of being widened to float32, scaled and multiplied one by one
 * (attend_heads_blocks16, which the widening and scaling bound). A byte becomes bf16 by two
 * table lookups, its low and its high byte (VBMI's byte permutes: 128 entries of bf16(|q|) and
 * the sign put back for Q8_0, 16 of bf16(q − 8) for Q4_0). The block scales stay out of the
 * products: a key's two blocks sum in separate lanes and are scaled once per 16 keys
 * (sum16_halves); a value's scale goes into the probability it meets, and that product is
 * rounded to bf16. SDPA's bf16 kernel, on eager's dequantized cache, rounds e^(s − max) and
 * d·q to bf16 each; here one rounding of e^(s − max)·d stands for both, and the keys stay
 * exact (the query is bf16 already): both stay within two bf16 roundings of exact attention on
 * the dequantized blocks (tests/test_kv_bf16.py). With AVX-512 VNNI the keys skip the lookups:
 * the query, rounded to int8 per block, meets their bytes in integer dot products
 * (key_sums_int8), and the scores carry that rounding of the query, as llama.cpp's do. */
#define KV_BF16_SPAN (2 * 1024) /* most keys of one call: spans are < 2·ATT_CHUNK (span_chunks) */
#define KV_KEYS_AHEAD 128       /* keys prefetched ahead of the integer key pass */
#define KV_VALUES_AHEAD 64      /* values prefetched ahead of the values' pass */
static uint8_t kv_bf16_q8[4][64] __attribute__((aligned(64)));  /* low bytes of bf16(0..127), high bytes */
static uint8_t kv_bf16_q4[2][64] __attribute__((aligned(64)));  /* low, high byte of bf16((i mod 16) − 8) */
/* byte orders of two-source byte permutes (index bit 6: the second source): value_pair_bytes' for
 * Q4_0 and Q8_0, key_bytes' for Q4_0 */
enum { PERM_VALUES_Q4 = 0, PERM_VALUES_Q8 = 1, PERM_KEYS_Q4 = 2 };
static uint8_t kv_perm[3][64] __attribute__((aligned(64)));

__attribute__((constructor)) static void kv_bf16_tables(void) {
    for (int i = 0; i < 128; i++) {
        const uint16_t h = f32_to_bf16((float)i);
        kv_bf16_q8[i / 64][i % 64] = (uint8_t)h;
        kv_bf16_q8[2 + i / 64][i % 64] = (uint8_t)(h >> 8);
    }
    for (int i = 0; i < 64; i++) { /* period 16: a nibble's byte may carry other bits above bit 3 */
        const uint16_t h = f32_to_bf16((float)(i % 16 - 8));
        kv_bf16_q4[0][i] = (uint8_t)h, kv_bf16_q4[1][i] = (uint8_t)(h >> 8);
    }
    for (int c = 0; c < 32; c++) { /* column c of two tokens → bytes 2c, 2c + 1 */
        kv_perm[PERM_VALUES_Q8][2 * c] = (uint8_t)c, kv_perm[PERM_VALUES_Q8][2 * c + 1] = (uint8_t)(64 + c);
        /* Q4_0: the sources are [r0, r1] and the same >> 4 (columns 16–31: the high nibbles) */
        kv_perm[PERM_VALUES_Q4][2 * c] = (uint8_t)(c < 16 ? c : 64 + c - 16);
        kv_perm[PERM_VALUES_Q4][2 * c + 1] = (uint8_t)(c < 16 ? 16 + c : 64 + c);
    }
    for (int c = 0; c < 64; c++) /* [block 0, block 1] and the same >> 4 → columns 0–63 */
        kv_perm[PERM_KEYS_Q4][c] = (uint8_t)((c & 16 ? 64 : 0) + (c & 32 ? 16 : 0) + (c & 15));
}

/* 64 index bytes (Q8_0's int8, Q4_0's nibbles in their low 4 bits) → their bf16 values as words,
 * in the unpack's order: *lo the bytes 0–7 of each 128-bit block, *hi bytes 8–15. t: the tables. */
static inline __attribute__((always_inline)) void bytes_bf16(const int Q8, __m512i x, const __m512i *t, __m512i *lo,
                                                             __m512i *hi) {
    __m512i l, h;
    if (Q8) {
        const __m512i a = _mm512_abs_epi8(x);
        l = _mm512_permutex2var_epi8(t[0], a, t[1]);
        h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t[2], a, t[3]), x, t[4], 0xf8); /* | the sign */
    } else {
        l = _mm512_permutexvar_epi8(x, t[0]);
        h = _mm512_permutexvar_epi8(x, t[1]);
    }
    *lo = _mm512_unpacklo_epi8(l, h);
    *hi = _mm512_unpackhi_epi8(l, h);
}

/* The two blocks of one token at b as index bytes, column c in byte c (Q4_0: its 16 bytes' low
 * nibbles are columns 0–15, the high ones 16–31; perm: kv_perm[PERM_KEYS_Q4]). */
static inline __attribute__((always_inline)) __m512i key_bytes(const int Q8, const uint8_t *b, __m512i perm) {
    if (Q8)
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                  _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
    const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 2))),
                                              _mm_loadu_si128((const __m128i *)(b + 20)), 1);
    return _mm512_permutex2var_epi8(_mm512_castsi256_si512(y), perm, _mm512_castsi256_si512(_mm256_srli_epi16(y, 4)));
}

/* The block at byte `at` of two tokens' values (r0, r1) as index bytes, column c's pair in bytes
 * 2c (r0) and 2c + 1 (r1): what a bf16 dot product of the pair against (p_j, p_j+1) needs
 * (pairs: kv_perm[PERM_VALUES_Q8 or _Q4]). */
static inline __attribute__((always_inline)) __m512i value_pair_bytes(const int Q8, const uint8_t *r0,
                                                                      const uint8_t *r1, int64_t at, __m512i pairs) {
    if (Q8)
        return _mm512_permutex2var_epi8(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r0 + at + 2))),
                                        pairs,
                                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r1 + at + 2))));
    const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(r0 + at + 2))),
                                              _mm_loadu_si128((const __m128i *)(r1 + at + 2)), 1);
    return _mm512_permutex2var_epi8(_mm512_castsi256_si512(y), pairs, _mm512_castsi256_si512(_mm256_srli_epi16(y, 4)));
}

/* The fp16 scales of t tokens' two blocks (tb bytes apart from p, the second block `second` bytes
 * into each) → 16 floats each, 0 past t (scalar loads: a gather measured no faster). */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *p, int64_t tb, int64_t second,
                                                                int64_t t, __m512 *d0, __m512 *d1) {
    uint16_t h[2][16] __attribute__((aligned(32))) = {{0}};
    for (int64_t i = 0; i < t; i++, p += tb) memcpy(&h[0][i], p, 2), memcpy(&h[1][i], p + second, 2);
    *d0 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)h[0]));
    *d1 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)h[1]));
}

#ifdef __AVX512VNNI__
/* The key scores in integers (llama.cpp's way with quantized keys: the query quantized to the
 * keys' dot-product type): each query head once per call to int8 per 32-value block, as Q8_0
 * does (d = max|q|/127, q·(1/d) rounded to nearest), then a key's bytes meet it in vpdpbusd,
 * four products a lane, with no conversion of the key at all. vpdpbusd's first factor is unsigned: a Q8_0 int8
 * k xor 0x80 is k + 128 as a byte and Q4_0's nibble n is (n − 8) + 8, so each block's sum is
 * off by 128·Σq or 8·Σq over the query's block, a constant of the head that starts its
 * accumulators. The sums are exact; the scores carry the query's int8 rounding, the only
 * difference from exact attention on the dequantized blocks that the keys add. The keys are
 * transposed to one key a lane (key_words), so the products of 16 keys need no sum across
 * lanes after: per head that sum would cost more than the transpose does once per tile. */
typedef struct {
    /* a head's int8 columns as 16 words of 4 (Q4_0: broadcast one at a time) and, for Q8_0's
     * key pairs (key_sums_int8), as the vectors the pairs meet: per block b and word l, word
     * 8b + l in 128-bit blocks 0 and 2, word 8b + 4 + l in blocks 1 and 3 */
    int32_t q[4][16] __attribute__((aligned(64)));
    int32_t pair[4][2][4][16] __attribute__((aligned(64)));
    __m512i bias[4][2]; /* −(128 or 8)·Σq of each block, halved for Q8_0 (two lanes a key) */
    __m512 d[4][2];     /* each block's d, times the softmax scale */
} QueryInt8;

static inline __attribute__((always_inline)) void query_int8(const int Q8, const int NH, const float *q, float scale,
                                                             QueryInt8 *qi) {
    for (int h = 0; h < NH; h++)
        for (int b = 0; b < 2; b++) {
            const __m512 x0 = _mm512_loadu_ps(q + h * 64 + 32 * b), x1 = _mm512_loadu_ps(q + h * 64 + 32 * b + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            const float dq = amax / 127.0f, id = dq != 0.0f ? 1.0f / dq : 0.0f;
            const __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_store_si128((__m128i *)(qi->q[h] + 8 * b), _mm512_cvtepi32_epi8(i0));
            _mm_store_si128((__m128i *)(qi->q[h] + 8 * b + 4), _mm512_cvtepi32_epi8(i1));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
            qi->bias[h][b] = _mm512_set1_epi32(Q8 ? -64 * sum : -8 * sum);
            qi->d[h][b] = _mm512_set1_ps(dq * scale);
            if (Q8)
                for (int l = 0; l < 4; l++)
                    for (int k = 0; k < 16; k++) qi->pair[h][b][l][k] = qi->q[h][8 * b + l + (k & 4)];
        }
}

/* 4 vectors of 16 words (4 bytes each) → lane k of out[l] = word l of input k's 128-bit block
 * that holds lane k: a 4×4 transpose within each 128-bit block. */
static inline __attribute__((always_inline)) void key_words(const __m512i z[4], __m512i out[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 bytes each of 4 keys `step` bytes apart, in the vector's 128-bit blocks in turn. */
static inline __attribute__((always_inline)) __m512i four_keys16(const uint8_t *p, int64_t step) {
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p + step)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p + 2 * step)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p + 3 * step)), 3);
}

/* The integer block sums of 16 keys at kt (`tb` bytes a key) with NH query heads: lane k of
 * acc[h][b] = Σ key k's block b · head h's block b (exact). */
static inline __attribute__((always_inline)) void key_sums_int8(const int Q8, const int NH, const uint8_t *kt,
                                                                int64_t tb, const QueryInt8 *qi, __m512i acc[4][2]) {
    if (Q8) {
        /* a block's 32 bytes as one load, two keys a vector ([key r | key r + 4], keys 0–3
         * with 4–7, then 8–11 with 12–15): a 128-bit block gets half a key's block, and each
         * key's sum ends in two lanes, which one shuffle pair per head adds at the end. Loading
         * 16 bytes a block instead costs three inserts a vector, more than the halves' adds. */
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int b = 0; b < 2; b++) {
            __m512i half[2][4];
            for (int set = 0; set < 2; set++) {
                __m512i z[4], w[4];
                for (int r = 0; r < 4; r++) {
                    const uint8_t *p = kt + (8 * set + r) * tb + 2 + 34 * b;
                    z[r] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                                                               _mm256_loadu_si256((const __m256i *)(p + 4 * tb)), 1), flip);
                }
                key_words(z, w); /* lanes 0–3: keys 0–3 (of the set), first half; 4–7 second; 8–15: keys 4–7 */
                for (int h = 0; h < NH; h++) {
                    __m512i a = qi->bias[h][b];
                    for (int l = 0; l < 4; l++) a = _mm512_dpbusd_epi32(a, w[l], _mm512_load_si512(qi->pair[h][b][l]));
                    half[set][h] = a;
                }
            }
            for (int h = 0; h < NH; h++)
                acc[h][b] = _mm512_add_epi32(_mm512_shuffle_i32x4(half[0][h], half[1][h], 0x88),
                                             _mm512_shuffle_i32x4(half[0][h], half[1][h], 0xdd));
        }
        return;
    }
    /* Q4_0: a block's 16 bytes hold columns 0–15 in their low nibbles, 16–31 in the high ones
     * (a key's two blocks are not one load apart: a scale lies between); four keys a vector
     * (keys r, r + 4, r + 8, r + 12), a 128-bit block one key's 16 columns */
    const __m512i low = _mm512_set1_epi8(15);
    for (int h = 0; h < NH; h++) acc[h][0] = qi->bias[h][0], acc[h][1] = qi->bias[h][1];
    for (int b = 0; b < 2; b++) {
        __m512i x[4], z[4], w[4];
        for (int r = 0; r < 4; r++) x[r] = four_keys16(kt + r * tb + 2 + 18 * b, 4 * tb);
        for (int half = 0; half < 2; half++) {
            for (int r = 0; r < 4; r++) z[r] = _mm512_and_si512(half ? _mm512_srli_epi16(x[r], 4) : x[r], low);
            key_words(z, w);
            for (int h = 0; h < NH; h++)
                for (int l = 0; l < 4; l++)
                    acc[h][b] = _mm512_dpbusd_epi32(acc[h][b], w[l], _mm512_set1_epi32(qi->q[h][8 * b + 4 * half + l]));
        }
    }
}

/* The weights of the 16 values from j (of n): e^(s − max) of each head's scores (s, `stride`
 * apart; m: the maxima) times each block's value scale, in bf16: word i of w[h][b] pairs values
 * j + 2i, j + 2i + 1 for the dot products (past n: 0). The exponentials add to sum. */
static inline __attribute__((always_inline)) void value_weights(const int NH, const uint8_t *vc, int64_t tb,
                                                                const float *s, int64_t stride, int64_t j, int64_t n,
                                                                const __m512 m[4], __m512 sum[4],
                                                                uint32_t w[4][2][8]) {
    const __mmask16 live = lanes16(j, 0, n);
    __m512 d0, d1;
    block_scales(vc + j * tb, tb, tb / 2, n - j < 16 ? n - j : 16, &d0, &d1);
    for (int h = 0; h < NH; h++) {
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + h * stride + j), m[h])));
        sum[h] = _mm512_add_ps(sum[h], e);
        _mm256_store_si256((__m256i *)w[h][0], (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, d0)));
        _mm256_store_si256((__m256i *)w[h][1], (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, d1)));
    }
}
#endif

static inline __attribute__((always_inline)) void attend_heads_blocks_bf16(const Dims *d, const int Q8, const int NH,
                                                                           const float *q, const uint8_t *kc,
                                                                           const uint8_t *vc, int64_t n, float *s,
                                                                           int64_t stride, float *out, float *ml,
                                                                           const uint8_t *ahead, int64_t ahead_n) {
    const int64_t tb = Q8 ? 68 : 36, second = tb / 2; /* a token's bytes, its second block's */
    __m512i t[5];
    for (int i = 0; i < (Q8 ? 4 : 2); i++) t[i] = _mm512_load_si512(Q8 ? kv_bf16_q8[i] : kv_bf16_q4[i]);
    t[4] = _mm512_set1_epi8((char)0x80);
    __m512 mv[4];
    for (int h = 0; h < NH; h++) mv[h] = _mm512_set1_ps(-INFINITY);
#ifdef __AVX512VNNI__
    QueryInt8 qi;
    query_int8(Q8, NH, q, d->scale, &qi);
    for (int64_t j = 0; j < n; j += 16) {
        const int64_t tt = n - j < 16 ? n - j : 16;
        const __mmask16 live = lanes16(j, 0, n);
        const uint8_t *kt = kc + j * tb;
        uint8_t tail[16 * 68] __attribute__((aligned(64)));
        if (tt < 16) { /* the last, partial tile: zero keys past n (their lanes are masked) */
            memcpy(tail, kt, (size_t)(tt * tb));
            memset(tail + tt * tb, 0, (size_t)((16 - tt) * tb));
            kt = tail;
        }
        /* the keys KV_KEYS_AHEAD on into L2, and past n the first of the next call's (`ahead`,
         * ahead_n of them): at this pass's pace the hardware prefetcher alone leaves its loads
         * waiting on memory, most of all at a call's start */
        const int64_t at = j + KV_KEYS_AHEAD;
        const uint8_t *pf = at < n ? kc + at * tb : ahead && at - n < ahead_n ? ahead + (at - n) * tb : NULL;
        if (pf)
            for (int64_t b = 0; b < 16 * tb; b += 64) _mm_prefetch((const char *)pf + b, _MM_HINT_T1);
        __m512i acc[4][2];
        key_sums_int8(Q8, NH, kt, tb, &qi, acc);
        __m512 d0, d1;
        block_scales(kc + j * tb, tb, second, tt, &d0, &d1);
        for (int h = 0; h < NH; h++) {
            const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[h][0]), qi.d[h][0]);
            const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[h][1]), qi.d[h][1]);
            const __m512 sv = _mm512_fmadd_ps(a, d0, _mm512_mul_ps(b, d1));
            _mm512_mask_storeu_ps(s + h * stride + j, live, sv);
            mv[h] = _mm512_mask_max_ps(mv[h], live, mv[h], sv);
        }
    }
#else
    (void)ahead, (void)ahead_n;
    /* the query in bf16 (exact: a bf16 model's q holds bf16 values), column c where bytes_bf16
     * leaves a key's: *lo's word 8k + m is column 16k + m, *hi's column 16k + 8 + m */
    __m512i qw[4][2];
    for (int h = 0; h < NH; h++) {
        uint16_t w[64] __attribute__((aligned(64)));
        for (int c = 0; c < 64; c++) w[(c & 8) * 4 + (c >> 4) * 8 + (c & 7)] = f32_to_bf16(q[h * 64 + c]);
        qw[h][0] = _mm512_load_si512(w), qw[h][1] = _mm512_load_si512(w + 32);
    }
    const __m512 scale = _mm512_set1_ps(d->scale);
    const __m512i key_perm = _mm512_load_si512(kv_perm[PERM_KEYS_Q4]);
    for (int64_t j = 0; j < n; j += 16) {
        const int64_t tt = n - j < 16 ? n - j : 16;
        const __mmask16 live = lanes16(j, 0, n);
        __m512 part[4][16];
        for (int64_t i = 0; i < 16; i++) {
            __m512 acc[4];
            for (int h = 0; h < NH; h++) acc[h] = _mm512_setzero_ps();
            if (i < tt) { /* lanes 0–7: the first block's products, 8–15 the second's */
                __m512i w0, w1;
                bytes_bf16(Q8, key_bytes(Q8, kc + (j + i) * tb, key_perm), t, &w0, &w1);
                for (int h = 0; h < NH; h++)
                    acc[h] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[h], (__m512bh)w0, (__m512bh)qw[h][0]),
                                              (__m512bh)w1, (__m512bh)qw[h][1]);
            }
            for (int h = 0; h < NH; h++) part[h][i] = acc[h];
        }
        /* these tokens' values into L2 while the keys are read: the next pass reads their scales,
         * 16 lines apart, each of which would otherwise wait on memory (measured: ~5% of a call
         * whose cache is not in L2) */
        for (int64_t b = 0; b < tt * tb; b += 64) _mm_prefetch((const char *)vc + j * tb + b, _MM_HINT_T1);
        __m512 d0, d1;
        block_scales(kc + j * tb, tb, second, tt, &d0, &d1);
        for (int h = 0; h < NH; h++) {
            __m512 a, b;
            sum16_halves(part[h], &a, &b);
            const __m512 sv = _mm512_mul_ps(_mm512_fmadd_ps(a, d0, _mm512_mul_ps(b, d1)), scale);
            _mm512_mask_storeu_ps(s + h * stride + j, live, sv);
            mv[h] = _mm512_mask_max_ps(mv[h], live, mv[h], sv);
        }
    }
#endif
    __m512 m[4], sum[4];
    for (int h = 0; h < NH; h++) m[h] = _mm512_set1_ps(ml[2 * h] = _mm512_reduce_max_ps(mv[h])), sum[h] = _mm512_setzero_ps();
    const __m512i pairs = _mm512_load_si512(kv_perm[Q8 ? PERM_VALUES_Q8 : PERM_VALUES_Q4]);
    __m512 o[4][4];
    for (int h = 0; h < NH; h++) for (int v = 0; v < 4; v++) o[h][v] = _mm512_setzero_ps();
#ifdef __AVX512VNNI__
    /* The values, 16 at a time, each tile's weights made while the tile before meets its values:
     * the weights' exponentials, and the loads of their value scales that first touch a tile's
     * lines, then overlap the dot products instead of holding them up. One pass over the values
     * reads them from memory at the pace of the dot products (a pass for the weights alone,
     * little work per line, would wait on memory), and prefetches them KV_VALUES_AHEAD on. */
    uint32_t w[2][4][2][8] __attribute__((aligned(64)));
    value_weights(NH, vc, tb, s, stride, 0, n, m, sum, w[0]);
    for (int64_t j = 0; j < n; j += 16) {
        const int cur = (int)(j / 16) & 1;
        if (j + KV_VALUES_AHEAD < n)
            for (int64_t b = 0; b < 16 * tb; b += 64) _mm_prefetch((const char *)vc + (j + KV_VALUES_AHEAD) * tb + b, _MM_HINT_T1);
        if (j + 16 < n) value_weights(NH, vc, tb, s, stride, j + 16, n, m, sum, w[cur ^ 1]);
        for (int64_t i = j; i < n && i < j + 16; i += 2) {
            /* an odd last value's partner: its own bytes again (finite), against a weight of 0 */
            const uint8_t *r0 = vc + i * tb, *r1 = i + 1 < n ? r0 + tb : r0;
            for (int b = 0; b < 2; b++) {
                __m512i v0, v1;
                bytes_bf16(Q8, value_pair_bytes(Q8, r0, r1, b * second, pairs), t, &v0, &v1);
                for (int h = 0; h < NH; h++) {
                    const __m512bh p = (__m512bh)_mm512_set1_epi32((int)w[cur][h][b][(i - j) / 2]);
                    o[h][2 * b] = _mm512_dpbf16_ps(o[h][2 * b], (__m512bh)v0, p);
                    o[h][2 * b + 1] = _mm512_dpbf16_ps(o[h][2 * b + 1], (__m512bh)v1, p);
                }
            }
        }
    }
#else
    /* e^(s − max) times each block's value scale, in bf16, per head and block: word j of w[h][b]
     * (pairs j, j + 1 one 32-bit word for the dot products; past n: 0) */
    uint32_t w[4][2][KV_BF16_SPAN / 2] __attribute__((aligned(64)));
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = lanes16(j, 0, n);
        __m512 d0, d1;
        block_scales(vc + j * tb, tb, second, n - j < 16 ? n - j : 16, &d0, &d1);
        for (int h = 0; h < NH; h++) {
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + h * stride + j), m[h])));
            sum[h] = _mm512_add_ps(sum[h], e);
            _mm256_store_si256((__m256i *)(w[h][0] + j / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, d0)));
            _mm256_store_si256((__m256i *)(w[h][1] + j / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, d1)));
        }
    }
    for (int64_t j = 0; j < n; j += 2) {
        /* an odd last value's partner: its own bytes again (finite), against a weight of 0 */
        const uint8_t *r0 = vc + j * tb, *r1 = j + 1 < n ? r0 + tb : r0;
        for (int b = 0; b < 2; b++) {
            __m512i v0, v1;
            bytes_bf16(Q8, value_pair_bytes(Q8, r0, r1, b * second, pairs), t, &v0, &v1);
            for (int h = 0; h < NH; h++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)w[h][b][j / 2]);
                o[h][2 * b] = _mm512_dpbf16_ps(o[h][2 * b], (__m512bh)v0, p);
                o[h][2 * b + 1] = _mm512_dpbf16_ps(o[h][2 * b + 1], (__m512bh)v1, p);
            }
        }
    }
#endif
    for (int h = 0; h < NH; h++) {
        const float total = _mm512_reduce_add_ps(sum[h]);
        const __m512 inv = _mm512_set1_ps(1.0f / total);
        ml[2 * h + 1] = total;
        for (int b = 0; b < 2; b++) {
            _mm512_storeu_ps(out + h * 64 + 32 * b, _mm512_mul_ps(unpacked_first16(o[h][2 * b], o[h][2 * b + 1]), inv));
            _mm512_storeu_ps(out + h * 64 + 32 * b + 16, _mm512_mul_ps(unpacked_second16(o[h][2 * b], o[h][2 * b + 1]), inv));
        }
    }
}
#endif

/* The `group` query heads (D apart in q and out) that share the n block keys/values from
 * token `tok` of kc/vc, in runs of up to 4 heads (D = 64) or 2 (D = 128: their 2·8 outputs
 * and queries fill the registers). out is float32 (attend_group rounds it). */
static inline __attribute__((always_inline)) void attend_group_blocks16(const Dims *d, const int NV, const float *q,
                                                                        int64_t group, const uint8_t *kc,
                                                                        const uint8_t *vc, int64_t tok, int64_t n,
                                                                        const uint8_t *ahead, int64_t ahead_n,
                                                                        float *s, int64_t stride, float *out,
                                                                        float *ml) {
    const int64_t D = 16 * NV, tb = kv_token_bytes(d);
    const int most = NV == 4 ? 4 : 2;
    kc += tok * tb, vc += tok * tb;
    for (int64_t h = 0; h < group; h += most) {
        const int nh = group - h < most ? (int)(group - h) : most;
        const float *qh = q + h * D;
        float *sh = s + h * stride, *oh = out + h * D, *mh = ml + 2 * h;
        /* block type and head count as compile-time constants of the kernel */
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
        if (d->bf16 && NV == 4 && n <= KV_BF16_SPAN) {
            /* the next call's keys: prefetched by the last run of heads, the one that precedes it */
            const uint8_t *ah = h + nh == group ? ahead : NULL;
#define HEADS_BF16(Q8)                                                                                            \
            if (nh == 4) attend_heads_blocks_bf16(d, Q8, 4, qh, kc, vc, n, sh, stride, oh, mh, ah, ahead_n);       \
            else if (nh == 3) attend_heads_blocks_bf16(d, Q8, 3, qh, kc, vc, n, sh, stride, oh, mh, ah, ahead_n);  \
            else if (nh == 2) attend_heads_blocks_bf16(d, Q8, 2, qh, kc, vc, n, sh, stride, oh, mh, ah, ahead_n);  \
            else attend_heads_blocks_bf16(d, Q8, 1, qh, kc, vc, n, sh, stride, oh, mh, ah, ahead_n);
            if (d->kv_type == KV_Q8_0) { HEADS_BF16(1) }
            else { HEADS_BF16(0) }
#undef HEADS_BF16
            continue;
        }
#endif
#define HEADS_BLOCKS16(Q8)                                                                            \
        if (nh == 4) attend_heads_blocks16(d, Q8, NV, 4, qh, kc, vc, n, sh, stride, oh, mh);          \
        else if (nh == 3) attend_heads_blocks16(d, Q8, NV, 3, qh, kc, vc, n, sh, stride, oh, mh);     \
        else if (nh == 2) attend_heads_blocks16(d, Q8, NV, 2, qh, kc, vc, n, sh, stride, oh, mh);     \
        else attend_heads_blocks16(d, Q8, NV, 1, qh, kc, vc, n, sh, stride, oh, mh);
        if (d->kv_type == KV_Q8_0) { HEADS_BLOCKS16(1) }
        else { HEADS_BLOCKS16(0) }
#undef HEADS_BLOCKS16
    }
    (void)ahead, (void)ahead_n;
}
#endif

/* x[0, n) rounded to the model dtype, as rnd() each. */
static void round_to_dtype(const Dims *d, float *x, int64_t n) {
    if (!d->bf16) return;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, round_bf16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) x[i] = rnd(d, x[i]);
}

/* softmax(q·K · scale) · V for the `group` query heads that share one cached kv head,
 * into out, with s as scratch (`stride` floats per head) and each head's softmax max and
 * sum into m (2 · group floats). out is rounded to the model dtype, unless it is a chunk of
 * a longer span (`chunk`): merge_chunks rounds the merged result. */
static void attend_group(const Dims *d, const float *q, int64_t group, const void *kc, const void *vc, int64_t base,
                         int64_t n, const char *ahead_k, const char *ahead_v, int64_t ahead_n, float *s,
                         int64_t stride, float *out, float *m, int chunk) {
    const int64_t D = d->head_dim;
#ifdef __AVX512F__
    if (d->attn_cap > 0.0f || d->kv_type != KV_FLOAT) {} /* soft-capped scores, block caches: below */
    else if (D == 64) { attend_group_vec(d, 4, q, group, kc, vc, base, n, ahead_k, ahead_v, ahead_n, s, stride, out, m); goto done; }
    else if (D == 128) { attend_group_vec(d, 8, q, group, kc, vc, base, n, ahead_k, ahead_v, ahead_n, s, stride, out, m); goto done; }
#endif
    (void)ahead_k, (void)ahead_v, (void)ahead_n;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (d->kv_type != KV_FLOAT && d->attn_cap <= 0.0f && (D == 64 || D == 128)) {  /* blocks on 16 lanes */
        const uint8_t *k8 = (const uint8_t *)kc, *v8 = (const uint8_t *)vc, *a8 = (const uint8_t *)ahead_k;
        if (D == 64) attend_group_blocks16(d, 4, q, group, k8, v8, base / D, n, a8, ahead_n, s, stride, out, m);
        else attend_group_blocks16(d, 8, q, group, k8, v8, base / D, n, a8, ahead_n, s, stride, out, m);
        goto done;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (d->kv_type != KV_FLOAT && d->attn_cap <= 0.0f && D <= KV_TILE_MAX_D) {  /* blocks: each widened once per group */
        attend_group_blocks(d, q, group, (const uint8_t *)kc, (const uint8_t *)vc, base / D, n, s, stride, out, m);
        goto done;
    }
#endif
    for (int64_t h = 0; h < group; h++)
        attend_head_scalar(d, q + h * D, kc, vc, base, n, s + h * stride, out + h * D, m + 2 * h);
done: __attribute__((unused)); /* a build without AVX2 has no goto */
    if (!chunk) round_to_dtype(d, out, group * D);
}

/* attend_group for the tests (tests/test_kv_bf16.py): the `group` query heads at q (float32; in
 * bf16 holding bf16 values, as a bf16 model's are) against n tokens of one kv head's keys and
 * values as the cache stores them (kv_type: KV_FLOAT in the model dtype, or blocks), scores
 * scaled by `scale`; out: group · head_dim floats, rounded to the model dtype. 0, or -1 when
 * out of memory. */
int kv_attend(int64_t kv_type, int64_t bf16, int64_t group, int64_t head_dim, int64_t n, float scale, const float *q,
              const void *kc, const void *vc, float *out) {
    Dims d;
    memset(&d, 0, sizeof d);
    d.kv_type = kv_type, d.bf16 = bf16, d.head_dim = head_dim, d.scale = scale;
    float *s = malloc(sizeof(float) * (size_t)(group * n + 1)), *ml = malloc(sizeof(float) * (size_t)(2 * group));
    if (!s || !ml) { free(s); free(ml); return -1; }
    attend_group(&d, q, group, kc, vc, 0, n, NULL, NULL, 0, s, n, out, ml, 0);
    free(s), free(ml);
    return 0;
}

/* 1 where kv_attend (and the decode step) scores a bfloat16 model's keys on Q8_0/Q4_0 blocks at
 * head_dim 64 against the query rounded to int8 per 32-value block (attend_heads_blocks_bf16's
 * integer key pass), 0 where the query meets them as it is (tests/test_kv_bf16.py). */
int kv_attend_int8_query(void) {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__AVX512BF16__) && \
    defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* Attention over a span of 2·ATT_CHUNK keys or more runs as chunks of ATT_CHUNK keys (the
 * last one takes the rest: fewer than 2·ATT_CHUNK), each its own unit of work, merged after
 * by their softmax maxima and sums (flash-decoding's split of the keys): with few kv heads
 * and rows (batch 1 of a model with 2 or 3 kv heads) the units would otherwise be fewer
 * than the threads, which then idle through a long context. Where a row splits depends on
 * its own span only, so a row computes the same alone as in a batch. */
#define ATT_CHUNK 1024
static inline int64_t span_chunks(int64_t n) { return n >= 2 * ATT_CHUNK ? n / ATT_CHUNK : 1; }

typedef struct {
    int64_t unit, chunk, cache_row; /* unit: row · kv_heads + kv head */
    int64_t base, n;                /* the chunk's keys: from element `base` of the cache row, n of them */
} AttUnit;

/* The output of `chunks` chunks (group · D floats each, `each` floats apart) of one kv head's
 * query heads and their maxima and sums (ml, 2 · group floats a chunk), merged into out,
 * rounded to the model dtype: out = Σ_c w_c·o_c / Σ_c w_c, w_c = sum_c · e^(max_c − max). */
static void merge_chunks(const Dims *d, int64_t group, int64_t chunks, const float *parts, int64_t each,
                         const float *ml, float *out) {
    const int64_t D = d->head_dim;
    for (int64_t h = 0; h < group; h++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < chunks; c++) if (ml[c * 2 * group + 2 * h] > top) top = ml[c * 2 * group + 2 * h];
        float *o = out + h * D;
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            const float w = ml[c * 2 * group + 2 * h + 1] * expf(ml[c * 2 * group + 2 * h] - top);
            const float *p = parts + c * each + h * D;
            total += w;
            for (int64_t i = 0; i < D; i++) o[i] += w * p[i];
        }
        for (int64_t i = 0; i < D; i++) o[i] /= total;
    }
    round_to_dtype(d, out, group * D);
}

/* transformers' LlamaRMSNorm: normalize in float32, round, then scale in the model dtype
 * (Dims.norm: Gemma's and OLMo 2's scale in float32 and round once). y may be x. */
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
    if (d->norm == NORM_OFFSET1) {
        for (i = 0; i < n; i++) y[i] = rnd(d, (x[i] * r) * (1.0f + load(d, w, i)));
        return;
    }
    if (d->norm == NORM_WEIGHT_F32) {
        for (i = 0; i < n; i++) y[i] = rnd(d, load(d, w, i) * (x[i] * r));
        return;
    }
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

/* x = x*cos + rotate_half(x)*sin over one head, each product rounded as in eager. Only
 * the first Dims.rot dimensions rotate (rope:partial; the tables are that wide); the rest
 * pass through. */
static void rope(const Dims *d, float *x, const void *cos, const void *sin, int64_t row) {
    const int64_t D = d->rot ? d->rot : d->head_dim, h = D / 2;
    const int64_t at = row * D * (d->bf16 ? 2 : 4); /* this position's row of each table, in bytes */
    const void *c = (const char *)cos + at, *s = (const char *)sin + at;
    int64_t i = 0;
#ifdef __AVX512F__
    if (h % 16 == 0 && D == d->head_dim) { /* both halves at once: x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin */
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

#ifndef AHEAD_MAX_BYTES
#define AHEAD_MAX_BYTES (32 << 10) /* of keys (as much again of values) */
#endif

/* Kv head g of a cache row whose first real token is at `start` attends to n cached
 * positions from element `base` of that row: from its first real token, inside the
 * sliding window, up to `column`. */
static void span(const Dims *d, int64_t start, int64_t window, int64_t column, int64_t capacity, int64_t g,
                 int64_t *base, int64_t *n) {
    int64_t lo = start;
    if (window > 0 && column - window + 1 > lo) lo = column - window + 1;
    *n = column - lo + 1;
    *base = (g * capacity + lo) * d->head_dim;
}

/* h = rnd(rnd(act(gate)) · up) over `inter` elements of one row's gate|up product gu. */
static void gated_act(const Dims *d, const float *gu, int64_t inter, float *h) {
    int64_t i = 0;
    if (d->act == ACT_GELU_TANH) { /* torch's gelu(approximate="tanh"), in its order */
        const float beta = (float)(1.41421356237309504880 * 1.12837916709551257390 * 0.5), kappa = 0.044715f;
        for (; i < inter; i++) {
            const float g = gu[i], inner = beta * (g + kappa * (g * g * g));
            h[i] = rnd(d, rnd(d, 0.5f * g * (1.0f + tanhf(inner))) * gu[inter + i]);
        }
    }
#ifdef __AVX512F__
    for (; i + 16 <= inter; i += 16) {
        const __m512 g = _mm512_loadu_ps(gu + i), up = _mm512_loadu_ps(gu + inter + i);
        __m512 a = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        a = _mm512_mul_ps(rnd16(d, a), up);
        _mm512_storeu_ps(h + i, rnd16(d, a));
    }
#endif
    for (; i < inter; i++) {
        const float g = gu[i];
        h[i] = rnd(d, rnd(d, g / (1.0f + expf(-g))) * gu[inter + i]);
    }
}

/* out = rnd(down(h) + down_bias), h = rnd(rnd(act(gate)) · up), [gate | up] = rnd(gate_up(x) + gate_up_bias),
 * for `rows` rows x [rows, hidden] → out [rows, hidden]: the gated MLP of a dense layer, of a routed
 * expert (its rows of the stacked matrices, sub_weight) and of qwen2_moe's shared expert. gu [rows,
 * 2·inter] and h [rows, inter] are scratch. */
static void gated_mlp(const Dims *d, const Weight *gate_up, const void *gate_up_bias, const Weight *down,
                      const void *down_bias, int64_t inter, const float *x, int64_t rows, float *out, float *gu,
                      float *h, uint16_t *xw, void *xq, int threads) {
    const int64_t H = d->hidden;
    linear(d, gate_up, gate_up_bias, x, H, 2 * inter, rows, gu, xw, xq, threads);
    #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) gated_act(d, gu + r * 2 * inter, inter, h + r * inter);
    linear(d, down, down_bias, h, inter, H, rows, out, xw, xq, threads);
}

/* Scratch of the moe MLP: router logits (then the shared expert's gate), per row its chosen
 * experts and weights, the rows one expert serves, gathered, and the gated MLP's (gu, h: wide
 * enough for the routed and the shared experts). */
typedef struct {
    float *logits, *weight, *gx, *gu, *h, *y;
    int64_t *chosen, *slot;
} MoeScratch;

/* t = Σ over each row's top_k experts, in increasing expert order, of rnd(rnd(expert(x)) · w),
 * rounded after every add, as experts.py's eager loop does. An expert runs once over the rows
 * that chose it, reading only its own rows of the stacked matrices. With a shared expert
 * (Layer.shared_inter), then t = rnd(t + rnd(rnd(sigmoid(rnd(x · shared_gate))) · shared(x))),
 * as SparseMoE.forward's `y + sigmoid(g(x)) * shared(x)` rounds in the model dtype. */
static void moe_mlp(const Dims *d, const Layer *L, const float *x, int64_t rows, float *t, const MoeScratch *m,
                    uint16_t *xw, void *xq, int threads) {
    const int64_t H = d->hidden, E = d->experts, K = d->top_k, I = d->moe_inter;
    linear(d, &L->router, NULL, x, H, E, rows, m->logits, xw, xq, threads);
    for (int64_t r = 0; r < rows; r++) {
        float *l = m->logits + r * E, mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) if (l[e] > mx) mx = l[e];
        for (int64_t e = 0; e < E; e++) { l[e] = expf(l[e] - mx); sum += l[e]; }
        for (int64_t e = 0; e < E; e++) l[e] /= sum;
        float picked = 0.0f;
        for (int64_t k = 0; k < K; k++) { /* the largest left; the lower index on a tie */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < k; j++) taken |= m->chosen[r * K + j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            m->chosen[r * K + k] = best;
            m->weight[r * K + k] = l[best];
            picked += l[best];
        }
        for (int64_t k = 0; k < K; k++) {
            float w = m->weight[r * K + k];
            if (d->renorm) w = w / picked;
            m->weight[r * K + k] = d->float_weights ? w : rnd(d, w);
        }
    }
    memset(t, 0, sizeof(float) * rows * H);
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < K; k++)
                if (m->chosen[r * K + k] == e) {
                    m->slot[n] = r * K + k;
                    memcpy(m->gx + n * H, x + r * H, sizeof(float) * H);
                    n++;
                }
        if (!n) continue;
        const Weight gu = sub_weight(d, &L->experts_gate_up, e * 2 * I, (e + 1) * 2 * I, H);
        const Weight dn = sub_weight(d, &L->experts_down, e * H, (e + 1) * H, I);
        gated_mlp(d, &gu, NULL, &dn, NULL, I, m->gx, n, m->y, m->gu, m->h, xw, xq, threads);
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = m->slot[j] / K;
            const float w = m->weight[m->slot[j]];
            for (int64_t i = 0; i < H; i++) t[r * H + i] = rnd(d, t[r * H + i] + rnd(d, m->y[j * H + i] * w));
        }
    }
    if (L->shared_inter > 0) {
        gated_mlp(d, &L->shared_gate_up, NULL, &L->shared_down, NULL, L->shared_inter, x, rows, m->y, m->gu, m->h,
                  xw, xq, threads);
        linear(d, &L->shared_gate, NULL, x, H, 1, rows, m->logits, xw, xq, threads); /* [rows, 1] */
        for (int64_t r = 0; r < rows; r++) {
            const float s = rnd(d, 1.0f / (1.0f + expf(-m->logits[r])));
            for (int64_t i = 0; i < H; i++) t[r * H + i] = rnd(d, t[r * H + i] + rnd(d, s * m->y[r * H + i]));
        }
    }
}

/* One step for `rows` input rows. By default (cache_rows and columns NULL) input row r is
 * cache row r, the cache holds `rows` rows, and every row sits at cache column `column`.
 * Otherwise input row r reads and writes cache row cache_rows[r] (of `cache_batch` rows) at
 * its own column columns[r] ("virtual rows": speculative.py's verify pass gives one cache row
 * K + 1 input rows at columns c .. c + K; every row's k/v of a layer is written before any
 * row attends, and each row attends only up to its own column, so row t sees rows < t as
 * sequential steps would, and with batch-invariant matrix kernels its logits are theirs bit
 * for bit). Two input rows must not share a cache row and a column. A cache row holds
 * padding before starts[cache row] (NULL: no padding); the token sits at position
 * column - start. cos/sin: the rotary tables [positions, head_dim]. Caches: [layers,
 * cache rows, kv_heads, capacity, head_dim] in the model dtype, or [..., capacity,
 * head_dim / 32 · block bytes] of Dims.kv_type blocks (written quantized, read as stored).
 * logits: [rows - first_logit, vocab] float32, the head's rows first_logit .. rows - 1 only
 * (0: every row's; rows: none, as a prompt's chunks before its last want; the final norm and
 * the head, the largest matrix, are skipped for the rest, and since the matrix kernels are
 * batch invariant the rows computed are bit for bit what they are among all). Returns 0; -1 when a scratch allocation failed, -2 for a
 * token id outside the vocabulary, -3 for a cache row or column outside the cache (nothing
 * was written then). */
int decode_step(const Dims *d, const Layer *layers, const void *final_norm, const Weight *head,
                const Weight *embed, const int64_t *tokens, int64_t rows, const void *cos, const void *sin,
                void *k_cache, void *v_cache, int64_t capacity, int64_t column, const int64_t *starts,
                int64_t cache_batch, const int64_t *cache_rows, const int64_t *columns,
                float *logits, int64_t first_logit, int threads) {
    const int64_t H = d->hidden, D = d->head_dim, q_size = d->heads * D, kv_size = d->kv_heads * D;
    const int64_t qkv = q_size + 2 * kv_size;
    const int64_t widest = 2 * d->inter > qkv ? 2 * d->inter : qkv;
    int64_t wide_in = d->inter > H ? (d->inter > q_size ? d->inter : q_size) : (H > q_size ? H : q_size);
    if (d->moe_inter > wide_in) wide_in = d->moe_inter;
    int64_t SI = 0; /* the widest shared expert (moe:shared) */
    for (int64_t l = 0; l < d->layers; l++)
        if (layers[l].moe && layers[l].shared_inter > SI) SI = layers[l].shared_inter;
    if (SI > wide_in) wide_in = SI;
    const int64_t el = d->bf16 ? 2 : 4;
    if (D > 1024 || rows < 1 || first_logit < 0 || first_logit > rows) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= d->vocab) return -2; /* its embedding row would be out of bounds */
    if (!cache_rows) cache_batch = rows;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t cr = cache_rows ? cache_rows[r] : r, col = columns ? columns[r] : column;
        if (cr < 0 || cr >= cache_batch || col < 0 || col >= capacity) return -3;
    }
    float *x = malloc(sizeof(float) * rows * H), *xn = malloc(sizeof(float) * rows * H);
    float *t = malloc(sizeof(float) * rows * H), *big = malloc(sizeof(float) * rows * widest);
    float *att = malloc(sizeof(float) * rows * (q_size > d->inter ? q_size : d->inter));
    uint16_t *xw = malloc(sizeof(uint16_t) * rows * wide_in);
    float *scores = malloc(sizeof(float) * rows * d->heads * capacity);
    /* attention's units of work: (row, kv head, chunk of ATT_CHUNK keys), their chunks'
     * outputs and each head's softmax max and sum (merge_chunks) */
    const int64_t max_chunks = span_chunks(capacity);  /* no span is longer than the cache */
    const int64_t units = rows * d->kv_heads * max_chunks;
    AttUnit *work = malloc(sizeof(AttUnit) * units);
    int64_t *chunks = malloc(sizeof(int64_t) * rows * d->kv_heads);
    float *parts = max_chunks > 1 ? malloc(sizeof(float) * units * (q_size / d->kv_heads)) : NULL;
    float *ml = malloc(sizeof(float) * units * 2 * (d->heads / d->kv_heads));
    int64_t most = act_bytes(head, H);
    for (int64_t l = 0; l < d->layers; l++) {
        const int64_t b[4] = {act_bytes(&layers[l].qkv, H), act_bytes(&layers[l].o, q_size),
                              act_bytes(&layers[l].gate_up, H), act_bytes(&layers[l].down, d->inter)};
        for (int i = 0; i < 4; i++) if (b[i] > most) most = b[i];
        if (layers[l].moe) {
            const int64_t c[3] = {act_bytes(&layers[l].router, H), act_bytes(&layers[l].experts_gate_up, H),
                                  act_bytes(&layers[l].experts_down, d->moe_inter)};
            for (int i = 0; i < 3; i++) if (c[i] > most) most = c[i];
            if (layers[l].shared_inter > 0) {
                const int64_t s[3] = {act_bytes(&layers[l].shared_gate, H), act_bytes(&layers[l].shared_gate_up, H),
                                      act_bytes(&layers[l].shared_down, layers[l].shared_inter)};
                for (int i = 0; i < 3; i++) if (s[i] > most) most = s[i];
            }
        }
    }
    void *xq = malloc(rows * most + 64);
    MoeScratch moe = {0};
    const int64_t E = d->experts > 0 ? d->experts : 1, K = d->top_k > 0 ? d->top_k : 1;
    const int64_t MI = d->moe_inter > SI ? d->moe_inter : SI; /* gu / h serve the routed and the shared experts */
    if (d->experts > 0) {
        moe.logits = malloc(sizeof(float) * rows * E);
        moe.weight = malloc(sizeof(float) * rows * K);
        moe.gx = malloc(sizeof(float) * rows * H);
        moe.gu = malloc(sizeof(float) * rows * 2 * MI);
        moe.h = malloc(sizeof(float) * rows * MI);
        moe.y = malloc(sizeof(float) * rows * H);
        moe.chosen = malloc(sizeof(int64_t) * rows * K);
        moe.slot = malloc(sizeof(int64_t) * rows * K);
    }
    const int moe_ok = d->experts <= 0 || (moe.logits && moe.weight && moe.gx && moe.gu && moe.h && moe.y && moe.chosen
                                          && moe.slot);
    if (!x || !xn || !t || !big || !att || !xw || !scores || !xq || !moe_ok || !work || !chunks || !ml
        || (max_chunks > 1 && !parts)) {
        free(x); free(xn); free(t); free(big); free(att); free(xw); free(scores); free(xq);
        free(work); free(chunks); free(parts); free(ml);
        free(moe.logits); free(moe.weight); free(moe.gx); free(moe.gu); free(moe.h); free(moe.y); free(moe.chosen);
        free(moe.slot);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        const Part *e = &embed->part[0]; /* the embedding is one part */
        if (e->type == FLOAT_TYPE)
            for (int64_t i = 0; i < H; i++) x[r * H + i] = load(d, e->data, tokens[r] * H + i);
        else { /* one stored row, dequantized; rounded to the model dtype as the eager lookup is */
            q_dequantize_at((int)e->type, e->data, tokens[r], 1, H, x + r * H, 1); /* (an x8 row: from its group) */
            add_round(d, x + r * H, NULL, NULL, H);
        }
        if (d->embed_scale != 0.0f) /* embed_scale: times √hidden in the model dtype, rounded */
            for (int64_t i = 0; i < H; i++) x[r * H + i] = rnd(d, x[r * H + i] * d->embed_scale);
    }
    const int64_t row_elems = d->kv_heads * capacity * D; /* one row of one layer's cache */
    const int64_t tok_bytes = kv_token_bytes(d), row_bytes = d->kv_heads * capacity * tok_bytes;
    const int64_t group = d->heads / d->kv_heads;

    for (int64_t l = 0; l < d->layers; l++) {
        const Layer *L = &layers[l];
        char *kl = (char *)k_cache + l * cache_batch * row_bytes, *vl = (char *)v_cache + l * cache_batch * row_bytes;

        const void *cos_l = L->local ? d->cos_local : cos, *sin_l = L->local ? d->sin_local : sin;
        const float *attn_in = xn; /* block:post_norm attends to x itself */
        if (d->block == BLOCK_POST_NORM) attn_in = x;
        else {
            #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
            for (int64_t r = 0; r < rows; r++) rms_norm(d, x + r * H, L->in_norm, H, xn + r * H);
        }
        linear(d, &L->qkv, L->qkv_bias, attn_in, H, qkv, rows, big, xw, xq, threads);
        #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float nt[1024];
            float *q = big + r * qkv, *k = q + q_size, *v = q + q_size + kv_size;
            const int64_t cr = cache_rows ? cache_rows[r] : r, col = columns ? columns[r] : column;
            const int64_t position = col - (starts ? starts[cr] : 0);
            char *kc = kl + cr * row_bytes, *vc = vl + cr * row_bytes;
            const int per_head = !d->qk_full;
            if (!per_head) { /* qk_norm:full: one norm over each whole projection */
                if (L->q_norm) rms_norm(d, q, L->q_norm, q_size, q);
                if (L->k_norm) rms_norm(d, k, L->k_norm, kv_size, k);
            }
            for (int64_t h = 0; h < d->heads; h++) {
                if (L->q_norm && per_head) { rms_norm(d, q + h * D, L->q_norm, D, nt); memcpy(q + h * D, nt, D * sizeof(float)); }
                rope(d, q + h * D, cos_l, sin_l, position);
            }
            for (int64_t h = 0; h < d->kv_heads; h++) {
                if (L->k_norm && per_head) { rms_norm(d, k + h * D, L->k_norm, D, nt); memcpy(k + h * D, nt, D * sizeof(float)); }
                rope(d, k + h * D, cos_l, sin_l, position);
                const int64_t at = (h * capacity + col) * D;
                if (d->kv_type != KV_FLOAT) { /* quantized once, here, as cache.py's write does */
                    if (d->kv_unbias && L->qkv_bias) /* minus the key bias (offset_keys), in float32 as cache.py */
                        for (int64_t i = 0; i < D; i++) k[h * D + i] -= load(d, L->qkv_bias, q_size + h * D + i);
                    kv_quantize(d, k + h * D, (uint8_t *)kc + (h * capacity + col) * tok_bytes, D);
                    kv_quantize(d, v + h * D, (uint8_t *)vc + (h * capacity + col) * tok_bytes, D);
                } else if (d->bf16) { /* k and v hold bf16 values already: narrow() only repacks them */
                    narrow(k + h * D, (uint16_t *)kc + at, D);
                    narrow(v + h * D, (uint16_t *)vc + at, D);
                } else {
                    memcpy((float *)kc + at, k + h * D, D * sizeof(float));
                    memcpy((float *)vc + at, v + h * D, D * sizeof(float));
                }
            }
        }
        /* Row r sees columns [lo, its column]: from its first real token, inside the window.
         * One unit of work is one row's kv head with the query heads that read it, or a
         * chunk of its keys where they are 2·ATT_CHUNK or more. */
        int64_t n_units = 0;
        for (int64_t u = 0; u < rows * d->kv_heads; u++) {
            int64_t base, n;
            const int64_t r = u / d->kv_heads, g = u % d->kv_heads;
            const int64_t cr = cache_rows ? cache_rows[r] : r, col = columns ? columns[r] : column;
            span(d, starts ? starts[cr] : 0, L->window, col, capacity, g, &base, &n);
            chunks[u] = span_chunks(n);  /* the last one takes the rest */
            for (int64_t c = 0; c < chunks[u]; c++)
                work[n_units++] = (AttUnit){u, c, cr, base + c * ATT_CHUNK * D,
                                            c + 1 < chunks[u] ? ATT_CHUNK : n - c * ATT_CHUNK};
        }
        const int64_t each = group * D; /* a chunk's output */
        #pragma omp parallel num_threads(threads)
        {
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < n_units; i++) {
                const AttUnit *w = &work[i];
                const int64_t r = w->unit / d->kv_heads, g = w->unit % d->kv_heads;
                const char *kc = kl + w->cache_row * row_bytes, *vc = vl + w->cache_row * row_bytes;
                const char *ahead_k = NULL, *ahead_v = NULL;
                int64_t next_n = 0;
                if (i + 1 < n_units && d->kv_type == KV_FLOAT) {  /* the next unit's keys, prefetched while this one runs */
                    const AttUnit *next = &work[i + 1];
                    next_n = next->n;
                    ahead_k = kl + (next->cache_row * row_elems + next->base) * el;
                    ahead_v = vl + (next->cache_row * row_elems + next->base) * el;
                    /* Past a few hundred keys the stream is long enough for the hardware prefetcher,
                     * and prefetching a whole next unit would only crowd this one out of L2. */
                    if (next_n * D * el > AHEAD_MAX_BYTES) ahead_k = ahead_v = NULL, next_n = 0;
                } else if (i + 1 < n_units) { /* blocks: where the next unit's keys start (its first few are prefetched) */
                    const AttUnit *next = &work[i + 1];
                    next_n = next->n;
                    ahead_k = kl + next->cache_row * row_bytes + next->base / D * tok_bytes;
                }
                const int chunked = chunks[w->unit] > 1;
                float *out = chunked ? parts + (w->unit * max_chunks + w->chunk) * each : att + r * q_size + g * each;
                attend_group(d, big + r * qkv + g * each, group, kc, vc, w->base, w->n, ahead_k, ahead_v, next_n,
                             scores + w->unit * group * capacity + w->chunk * ATT_CHUNK, capacity, out,
                             ml + (w->unit * max_chunks + w->chunk) * 2 * group, chunked);
            }
            if (n_units > rows * d->kv_heads) {  /* some spans were split: merge their chunks */
                #pragma omp for schedule(static)
                for (int64_t u = 0; u < rows * d->kv_heads; u++)
                    if (chunks[u] > 1)
                        merge_chunks(d, group, chunks[u], parts + u * max_chunks * each, each,
                                     ml + u * max_chunks * 2 * group,
                                     att + (u / d->kv_heads) * q_size + (u % d->kv_heads) * each);
            }
        }
        linear(d, &L->o, L->o_bias, att, q_size, H, rows, t, xw, xq, threads);
        if (d->block != BLOCK_LLAMA) { /* sandwich / post_norm: the norm of attention's output */
            #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
            for (int64_t r = 0; r < rows; r++) rms_norm(d, t + r * H, L->post_norm, H, t + r * H);
        }
        add_round(d, x, t, NULL, rows * H);

        const float *mlp_in = xn;
        if (d->block == BLOCK_POST_NORM) mlp_in = x;
        else {
            const void *w = d->block == BLOCK_SANDWICH ? L->pre_ff_norm : L->post_norm;
            #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
            for (int64_t r = 0; r < rows; r++) rms_norm(d, x + r * H, w, H, xn + r * H);
        }
        if (L->moe) {
            moe_mlp(d, L, mlp_in, rows, t, &moe, xw, xq, threads);
        } else {
            gated_mlp(d, &L->gate_up, L->gate_up_bias, &L->down, L->down_bias, d->inter, mlp_in, rows, t, big, att, xw,
                      xq, threads);
        }
        if (d->block != BLOCK_LLAMA) {
            #pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
            for (int64_t r = 0; r < rows; r++) rms_norm(d, t + r * H, L->post_ff_norm, H, t + r * H);
        }
        add_round(d, x, t, NULL, rows * H);
    }
    const int64_t wanted = rows - first_logit;
    for (int64_t r = first_logit; r < rows; r++) rms_norm(d, x + r * H, final_norm, H, xn + r * H);
    if (wanted > 0) linear(d, head, NULL, xn + first_logit * H, H, d->vocab, wanted, logits, xw, xq, threads);
    if (d->final_cap > 0.0f)
        for (int64_t i = 0; i < wanted * d->vocab; i++) logits[i] = tanhf(logits[i] / d->final_cap) * d->final_cap;
    free(x); free(xn); free(t); free(big); free(att); free(xw); free(scores); free(xq);
    free(work); free(chunks); free(parts); free(ml);
    free(moe.logits); free(moe.weight); free(moe.gx); free(moe.gu); free(moe.h); free(moe.y); free(moe.chosen);
    free(moe.slot);
    return 0;
}
