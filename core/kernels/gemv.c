/* y = W x for one vector x (batch-1 decode) or a few (batched decode).
 *
 * Decode reads every weight once per token, so this loop decides tokens/s: four output
 * rows at a time are streamed through W against every vector (register tiles, below), and
 * the rows are split over OpenMP threads (torch's own libgomp, so its thread pool is
 * shared with torch's kernels). bf16 uses AVX-512 BF16 dot products (32 products per
 * instruction, accumulated in float32) where the CPU has them; float32 uses AVX-512 FMAs;
 * other CPUs get the portable loops, which the compiler vectorizes as it can. Either way a
 * row's result does not depend on the number of vectors (batch invariance, see gemm).
 *
 * Built at first use by core/kernels/__init__.py with the system C compiler
 * (-O3 -march=native), cached in twice's cache folder.
 */
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "vec.h"

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

/* Several vectors at once (batched decode): a tile of 4 weight rows × NB ≤ 4 vectors
 * keeps 4·NB accumulators in registers, so every weight vector loaded feeds NB FMAs and a
 * batch reads each weight from memory once: the step turns compute-bound, and the tile
 * must then run at the FMA units' rate. Four things decide that rate (each measured on a
 * Zen 4 core, 16 vectors, weights streamed from memory):
 * - the loaded vectors are pinned in registers (the empty asm): otherwise GCC folds the
 *   loads into the FMAs and loads each weight and x vector 4 times (fp32: 1.3–1.5×);
 * - the four short interleaved row streams are too short for the hardware prefetcher, so
 *   each tile prefetches, into L2 as one sequential run, the rows PREFETCH_TILES tiles
 *   ahead: far enough to cover memory latency, into L2 so it does not evict the rows in
 *   use (1.1–1.5×; past the end is harmless);
 * - the 16 horizontal sums at the end are added in one transpose tree (store_tile, sum16)
 *   instead of reduced one by one (~130 instructions against the 288 dot products of a
 *   bf16 tile over rows of 576);
 * - the loop has no zero-trip path (do-while: the caller guarantees n ≥ one vector), so
 *   the accumulators never leave registers; with a plain for loop GCC keeps them in
 *   memory around it, 48 loads and stores per tile (1.05–1.15× at rows of 576). */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 4
#endif
#ifndef PIN /* (a build that emulates AVX-512 on narrower registers defines it away) */
#define PIN(v) __asm__("" : "+v"(v))
#endif

#ifdef __AVX512F__
/* y[b·out + r] = the lane sum of a[b][r]: sum16 leaves lane 4b + r holding it (45
 * instructions instead of 16 separate reductions of ~8). With fewer than 4 vectors the
 * missing ones are zeros: each lane's sum is a tree of its own accumulator alone, so a
 * row's result is the same in any tile and at any place in it (batch invariance). */
static inline __attribute__((always_inline)) void store_tile(const int NB, __m512 a[4][4], float *y, int64_t out) {
    for (int b = NB; b < 4; b++)
        for (int r = 0; r < 4; r++) a[b][r] = _mm512_setzero_ps();
    const __m512 s = sum16(&a[0][0]);
    _mm_storeu_ps(y, _mm512_extractf32x4_ps(s, 0));
    if (NB > 1) _mm_storeu_ps(y + out, _mm512_extractf32x4_ps(s, 1));
    if (NB > 2) _mm_storeu_ps(y + 2 * out, _mm512_extractf32x4_ps(s, 2));
    if (NB > 3) _mm_storeu_ps(y + 3 * out, _mm512_extractf32x4_ps(s, 3));
}

static inline __attribute__((always_inline)) void tile_f32(const int NB, const float *w, const float *x, float *y,
                                                           int64_t out, int64_t n) {
    __m512 a[4][4];
    for (int b = 0; b < NB; b++) for (int r = 0; r < 4; r++) a[b][r] = _mm512_setzero_ps();
    const char *next = (const char *)(w + PREFETCH_TILES * 4 * n);
    int64_t i = 0;
    do { /* n ≥ 16: no zero-trip path, which would keep the accumulators in memory */
        __m512 xv[4], wv;
        for (int k = 0; k < 4; k++) _mm_prefetch(next + (i * 4 + k * 16) * 4, _MM_HINT_T1);
        for (int b = 0; b < NB; b++) { xv[b] = _mm512_loadu_ps(x + b * n + i); PIN(xv[b]); }
        for (int r = 0; r < 4; r++) {
            wv = _mm512_loadu_ps(w + r * n + i);
            PIN(wv);
            for (int b = 0; b < NB; b++) a[b][r] = _mm512_fmadd_ps(wv, xv[b], a[b][r]);
        }
    } while ((i += 16) < n);
    store_tile(NB, a, y, out);
}
#endif
#ifdef __AVX512BF16__
static inline __attribute__((always_inline)) void tile_bf16(const int NB, const uint16_t *w, const uint16_t *x,
                                                            float *y, int64_t out, int64_t n) {
    __m512 a[4][4];
    for (int b = 0; b < NB; b++) for (int r = 0; r < 4; r++) a[b][r] = _mm512_setzero_ps();
    const char *next = (const char *)(w + PREFETCH_TILES * 4 * n);
    int64_t i = 0;
    do {
        __m512i xv[4], wv;
        for (int k = 0; k < 4; k++) _mm_prefetch(next + (i * 4 + k * 32) * 2, _MM_HINT_T1);
        for (int b = 0; b < NB; b++) { xv[b] = _mm512_loadu_si512(x + b * n + i); PIN(xv[b]); }
        for (int r = 0; r < 4; r++) {
            wv = _mm512_loadu_si512(w + r * n + i);
            PIN(wv);
            for (int b = 0; b < NB; b++) a[b][r] = _mm512_dpbf16_ps(a[b][r], (__m512bh)wv, (__m512bh)xv[b]);
        }
    } while ((i += 32) < n);
    store_tile(NB, a, y, out);
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

/* One 4-row tile against `nb` (1–4) vectors; the tile loops are instantiated per nb. */
#define BY_NB(TILE)                                            \
    switch (nb) {                                              \
    case 4: TILE(4, w, x, y, out, n); return;                  \
    case 3: TILE(3, w, x, y, out, n); return;                  \
    case 2: TILE(2, w, x, y, out, n); return;                  \
    default: TILE(1, w, x, y, out, n); return;                 \
    }
static void tile(int bf16, int nb, const void *w, const void *x, float *y, int64_t out, int64_t n) {
#ifdef __AVX512BF16__
    if (bf16) BY_NB(tile_bf16)
#endif
#ifdef __AVX512F__
    if (!bf16) BY_NB(tile_f32)
#endif
}

static float dot(int bf16, const void *w, const void *x, int64_t n) {
    return bf16 ? dot_bf16(w, x, n) : dot_f32(w, x, n);
}

/* w: [out, n] row-major; x: [rows, n]; y: [rows, out] float32. w and x are both bfloat16
 * (bf16 = 1) or both float32. Threads split the output rows, four at a time; the vectors
 * go through tiles four at a time, the last 1–3 in a smaller tile. Where the tiles do not
 * apply (no AVX-512, n not a whole number of vectors, the last 1–3 output rows) the dot
 * loops take every vector.
 *
 * Batch invariance: which code computes y[c][r], and in what order it adds, depends only
 * on r, out and n, never on how many vectors there are or where vector c sits among them:
 * a tile's accumulator for (vector, row) is one chain over n from zero, whatever the
 * tile's other vectors, and store_tile sums it by the same tree. So a batch row's output
 * is bit for bit its output alone (batch 1 takes the same tiles, tests/
 * test_batch_invariance.py). */
void gemm(const void *w, const void *x, float *y, int64_t out, int64_t n, int64_t rows, int bf16, int threads) {
    const int64_t el = bf16 ? 2 : 4, width = tile_width(bf16);
    const char *W = w, *X = x;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o += 4) {
        int64_t b = 0;
        if (width && o + 4 <= out && n > 0 && n % width == 0)
            for (; b < rows; b += 4)
                tile(bf16, rows - b < 4 ? (int)(rows - b) : 4, W + o * n * el, X + b * n * el, y + b * out + o, out, n);
        for (int64_t r = o; r < o + 4 && r < out; r++)
            for (int64_t c = b; c < rows; c++) y[c * out + r] = dot(bf16, W + r * n * el, X + c * n * el, n);
    }
}
