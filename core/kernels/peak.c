/* The CPU's multiply-add peak: every thread runs 12 independent chains of vector
 * multiply-adds on registers only (AVX-512 or AVX2 FMAs for float32, AVX-512 BF16 dot
 * products for bfloat16, and for block-quantized weights the u8·s8 → int32 dot product the
 * quantized kernels use, qdot.h's qd_dot_u8s8: VNNI dpbusd, else AVX2 maddubs + madd + add),
 * so nothing but the vector units limits it. `twice bench` divides a batched decode's
 * multiply-adds per second by it: batches are compute-bound, as batch 1 is bandwidth-bound. */
#include <stdint.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "qdot.h"

#define CHAINS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define SUM(i) s += a##i[0];
/* SETUP declares each thread's own operands (shared ones would bounce between cores);
 * OPAQUE (an empty asm) makes each step's input unknown, so the loop cannot be folded away. */
#define RUN(SETUP, INIT, STEP, LANES, OPAQUE)                                            \
    {                                                                                    \
        double macs = 0;                                                                 \
        _Pragma("omp parallel num_threads(threads) reduction(+ : macs)")                 \
        {                                                                                \
            SETUP                                                                        \
            CHAINS(INIT)                                                                 \
            _Pragma("omp barrier")                                                       \
            const double t = omp_get_wtime();                                            \
            for (int64_t k = 0; k < iterations; k++) { CHAINS(STEP) OPAQUE }             \
            const double dt = omp_get_wtime() - t;                                       \
            float s = 0;                                                                 \
            CHAINS(SUM)                                                                  \
            macs = dt > 0 ? (double)iterations * 12 * (LANES) / dt + (s == 1.5e-45f) : 0; \
        }                                                                                \
        return macs;                                                                     \
    }

/* Multiply-adds per second of `threads` threads, each running `iterations` steps of 12
 * vector operations; 0 where this CPU (as compiled for) has no such instructions.
 * kind: 0 float32, 1 bfloat16, 2 int8 (u8·s8 into int32). */
double peak_macs(int kind, int threads, int64_t iterations) {
    if (kind == 2) {
#ifdef __AVX2__
/* each chain's accumulator is also its unsigned operand: one shared operand would let the
 * compiler compute the product once for all 12 chains */
#define INIT_I(i) __m256i a##i = _mm256_set1_epi32(i);
#define STEP_I(i) a##i = qd_dot_u8s8(a##i, a##i, s8);
        RUN(__m256i s8 = _mm256_set1_epi8(1);, INIT_I, STEP_I, 32, __asm__("" : "+x"(s8));)
#endif
        return 0;
    }
    if (kind == 1) {
#ifdef __AVX512BF16__
#define INIT_B(i) __m512 a##i = _mm512_set1_ps(i);
#define STEP_B(i) a##i = _mm512_dpbf16_ps(a##i, one, one);
        RUN(__m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);, INIT_B, STEP_B, 32, __asm__("" : "+v"(one));)
#endif
        return 0;
    }
#if defined(__AVX512F__)
#define INIT_F(i) __m512 a##i = _mm512_set1_ps(i);
#define STEP_F(i) a##i = _mm512_fmadd_ps(a##i, x, y);
    RUN(__m512 x = _mm512_set1_ps(1.0f); __m512 y = _mm512_set1_ps(1e-9f);, INIT_F, STEP_F, 16, __asm__("" : "+v"(x));)
#elif defined(__AVX2__) && defined(__FMA__)
#define INIT_A(i) __m256 a##i = _mm256_set1_ps(i);
#define STEP_A(i) a##i = _mm256_fmadd_ps(a##i, x, y);
    RUN(__m256 x = _mm256_set1_ps(1.0f); __m256 y = _mm256_set1_ps(1e-9f);, INIT_A, STEP_A, 8, __asm__("" : "+x"(x));)
#endif
    return 0;
}
