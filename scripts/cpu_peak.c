/* The CPU's multiply-add peak, for scripts/kernel_bench.py: each OpenMP thread runs
 * independent chains of AVX-512 FMAs (float32) or BF16 dot products on registers only, so
 * nothing but the vector units limits it. Prints "fp32 <MAC/s>" and "bf16 <MAC/s>" (0 when
 * the CPU lacks the instructions). Build: cc -O2 -march=native -fopenmp cpu_peak.c */
#include <stdio.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define CHAINS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
static const long N = 50000000;

static double fp32(void) {
#ifdef __AVX512F__
    double macs = 0;
    #pragma omp parallel reduction(+ : macs)
    {
#define DECL(i) __m512 a##i = _mm512_set1_ps(i * 1e-9f);
        CHAINS(DECL)
        __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
        #pragma omp barrier
        double t = omp_get_wtime();
        for (long k = 0; k < N; k++) {
#define FMA(i) a##i = _mm512_fmadd_ps(a##i, x, y);
            CHAINS(FMA)
            __asm__ volatile("" : "+v"(x)); /* keeps the loop from being folded */
        }
        t = omp_get_wtime() - t;
        float s = 0;
#define SUM(i) s += _mm512_reduce_add_ps(a##i);
        CHAINS(SUM)
        macs = (double)N * 12 * 16 / t + (s == 12345.0f);
    }
    return macs;
#else
    return 0;
#endif
}

static double bf16(void) {
#ifdef __AVX512BF16__
    double macs = 0;
    #pragma omp parallel reduction(+ : macs)
    {
        CHAINS(DECL)
        __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);
        #pragma omp barrier
        double t = omp_get_wtime();
        for (long k = 0; k < N; k++) {
#define DOT(i) a##i = _mm512_dpbf16_ps(a##i, x, x);
            CHAINS(DOT)
            __asm__ volatile("" : "+v"(x));
        }
        t = omp_get_wtime() - t;
        float s = 0;
        CHAINS(SUM)
        macs = (double)N * 12 * 32 / t + (s == 12345.0f);
    }
    return macs;
#else
    return 0;
#endif
}

int main(void) {
    printf("fp32 %.6g\nbf16 %.6g\n", fp32(), bf16());
    return 0;
}
