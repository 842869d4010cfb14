/* y = W x for one vector x (batch-1 decode) or a few (batched decode).
 *
 * Decode reads every weight once per token, so this loop decides tokens/s: each output
 * row is one sequential stream through W with independent accumulators, and the rows are
 * split over OpenMP threads (torch's own libgomp, so its thread pool is shared with
 * torch's kernels). bf16 uses AVX-512 BF16 dot products (32 products per instruction,
 * accumulated in float32) where the CPU has them; float32 uses AVX-512 FMAs; other CPUs
 * get the portable loops, which the compiler vectorizes as it can.
 *
 * Built at first use by core/kernels/__init__.py with the system C compiler
 * (-O3 -march=native), cached in twice's cache folder.
 */
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16.h"

static float dot_f32(const float *r, const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i + 16), _mm512_loadu_ps(x + i + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i + 32), _mm512_loadu_ps(x + i + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i + 16 <= n; i += 16)
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(r + i), _mm512_loadu_ps(x + i), a0);
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    float t[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) t[j] += r[i + j] * x[i + j];
    for (; i < n; i++) s += r[i] * x[i];
    for (int j = 0; j < 8; j++) s += t[j];
    return s;
}

static float dot_bf16(const uint16_t *r, const uint16_t *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#ifdef __AVX512BF16__
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(r + i), (__m512bh)_mm512_loadu_si512(x + i));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(r + i + 32), (__m512bh)_mm512_loadu_si512(x + i + 32));
    }
    for (; i + 32 <= n; i += 32)
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(r + i), (__m512bh)_mm512_loadu_si512(x + i));
    s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
    float t[16] = {0};
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) t[j] += bf16_to_f32(r[i + j]) * bf16_to_f32(x[i + j]);
    for (; i < n; i++) s += bf16_to_f32(r[i]) * bf16_to_f32(x[i]);
    for (int j = 0; j < 16; j++) s += t[j];
    return s;
}

/* Several vectors at once (batched decode): tiles of 4 weight rows × 4 vectors keep 16 accumulators in registers: every weight
 * vector loaded feeds 4 FMAs and every x vector 4, so a batch reads each weight from
 * memory once and stays compute-bound instead of load-bound. Edges use the dot loops. */
/* Four interleaved row streams, each only a few cache lines long, are too short for the
 * hardware prefetcher: each tile prefetches, as one sequential run, the weight rows of the
 * tile PREFETCH_TILES ahead (prefetches past the end are harmless). */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 1
#endif
#ifdef __AVX512F__
static void tile_f32(const float *w, const float *x, float *y, int64_t out, int64_t n) {
    __m512 a[4][4];
    for (int r = 0; r < 4; r++) for (int b = 0; b < 4; b++) a[r][b] = _mm512_setzero_ps();
    const char *next = (const char *)(w + PREFETCH_TILES * 4 * n);
    for (int64_t i = 0; i < n; i += 16) {
        __m512 xv[4], wv;
        for (int k = 0; k < 4; k++) _mm_prefetch(next + (i * 4 + k * 16) * 4, _MM_HINT_T0);
        for (int b = 0; b < 4; b++) xv[b] = _mm512_loadu_ps(x + b * n + i);
        for (int r = 0; r < 4; r++) {
            wv = _mm512_loadu_ps(w + r * n + i);
            for (int b = 0; b < 4; b++) a[r][b] = _mm512_fmadd_ps(wv, xv[b], a[r][b]);
        }
    }
    for (int r = 0; r < 4; r++) for (int b = 0; b < 4; b++) y[b * out + r] = _mm512_reduce_add_ps(a[r][b]);
}
#endif
#ifdef __AVX512BF16__
static void tile_bf16(const uint16_t *w, const uint16_t *x, float *y, int64_t out, int64_t n) {
    __m512 a[4][4];
    for (int r = 0; r < 4; r++) for (int b = 0; b < 4; b++) a[r][b] = _mm512_setzero_ps();
    const char *next = (const char *)(w + PREFETCH_TILES * 4 * n);
    for (int64_t i = 0; i < n; i += 32) {
        __m512bh xv[4], wv;
        for (int k = 0; k < 4; k++) _mm_prefetch(next + (i * 4 + k * 32) * 2, _MM_HINT_T0);
        for (int b = 0; b < 4; b++) xv[b] = (__m512bh)_mm512_loadu_si512(x + b * n + i);
        for (int r = 0; r < 4; r++) {
            wv = (__m512bh)_mm512_loadu_si512(w + r * n + i);
            for (int b = 0; b < 4; b++) a[r][b] = _mm512_dpbf16_ps(a[r][b], wv, xv[b]);
        }
    }
    for (int r = 0; r < 4; r++) for (int b = 0; b < 4; b++) y[b * out + r] = _mm512_reduce_add_ps(a[r][b]);
}
#endif

/* The 4×4 tile's vector width in elements for this dtype, or 0 where this CPU has no
 * such instructions. */
static int tile_width(int bf16) {
#ifdef __AVX512BF16__
    if (bf16) return 32;
#endif
#ifdef __AVX512F__
    if (!bf16) return 16;
#endif
    return 0;
}

static void tile(int bf16, const void *w, const void *x, float *y, int64_t out, int64_t n) {
#ifdef __AVX512BF16__
    if (bf16) { tile_bf16(w, x, y, out, n); return; }
#endif
#ifdef __AVX512F__
    if (!bf16) { tile_f32(w, x, y, out, n); return; }
#endif
}

static float dot(int bf16, const void *w, const void *x, int64_t n) {
    return bf16 ? dot_bf16(w, x, n) : dot_f32(w, x, n);
}

/* w: [out, n] row-major; x: [rows, n]; y: [rows, out] float32. w and x are both bfloat16
 * (bf16 = 1) or both float32. Threads split the output rows, four at a time. */
void gemm(const void *w, const void *x, float *y, int64_t out, int64_t n, int64_t rows, int bf16, int threads) {
    const int64_t el = bf16 ? 2 : 4, width = tile_width(bf16);
    const char *W = w, *X = x;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o += 4) {
        int64_t b = 0;
        if (width && o + 4 <= out && n % width == 0)
            for (; b + 4 <= rows; b += 4) tile(bf16, W + o * n * el, X + b * n * el, y + b * out + o, out, n);
        for (int64_t r = o; r < o + 4 && r < out; r++)
            for (int64_t c = b; c < rows; c++) y[c * out + r] = dot(bf16, W + r * n * el, X + c * n * el, n);
    }
}
