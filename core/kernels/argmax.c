/* Greedy decoding's choice: the index of each row's largest logit, as torch.argmax picks
 * it (the first of equal maxima; the first NaN, if any, wins). torch's CPU argmax walks a
 * [16, 49152] batch of logits one element at a time (0.4 ms a step, 2% of a batch-16
 * decode step); this reads it at memory speed. */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static int64_t argmax_scalar(const float *x, int64_t from, int64_t n, int64_t best) {
    for (int64_t i = from; i < n; i++) {
        if (isnan(x[i])) return isnan(x[best]) ? best : i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

static int64_t argmax_row(const float *x, int64_t n) {
    if (n <= 0) return 0;
#ifdef __AVX512F__
    if (n >= 16) {
        /* Lane l keeps the largest of elements l, l+16, ... and the first index holding it. */
        __m512 best = _mm512_loadu_ps(x);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = at;
        __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
        const __m512i step = _mm512_set1_epi32(16);
        int64_t i = 16;
        for (; i + 16 <= n && i + 16 <= INT32_MAX; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            idx = _mm512_add_epi32(idx, step);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            at = _mm512_mask_mov_epi32(at, gt, idx);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        if (nan) return argmax_scalar(x, 0, n, 0);  /* rare: let the exact rule decide */
        float b[16];
        int32_t a[16];
        _mm512_storeu_ps(b, best);
        _mm512_storeu_si512(a, at);
        int64_t k = a[0];
        for (int l = 1; l < 16; l++)
            if (b[l] > x[k] || (b[l] == x[k] && a[l] < k)) k = a[l];
        return argmax_scalar(x, i, n, k);
    }
#endif
    return argmax_scalar(x, 1, n, 0);
}

/* out[r] = argmax of row r of x [rows, n] (float32, contiguous). */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}
