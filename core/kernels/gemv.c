/* y = W x for one vector x: the matrix-vector product of batch-1 decode.
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
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

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

/* w: [out, n] row-major; x: [n]; y: [out] float32. */
void gemv_f32(const float *w, const float *x, float *y, int64_t out, int64_t n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) y[o] = dot_f32(w + o * n, x, n);
}

void gemv_bf16(const uint16_t *w, const uint16_t *x, float *y, int64_t out, int64_t n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) y[o] = dot_bf16(w + o * n, x, n);
}
