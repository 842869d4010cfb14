/* quantize.c: float32 blocks -> GGUF block bytes, llama.cpp's reference quantizers
 * (ggml-quants.c, quantize_row_*_ref: no importance matrix, what llama-quantize runs without
 * --imatrix) for Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K, and F16 / BF16.
 *
 * The bytes are those of twice.core.quant's torch quantizers (core/quant/legacy.py,
 * kquants.py), which document every rounding detail; this file follows them operation for
 * operation: IEEE float32 throughout, each a*b+c two roundings (fp-contract=off below: never
 * fused into a multiply-add, whatever -march the library is built for), sums one term at a
 * time in the C order, nearest_int's magic-number rounding, fp16 round to nearest even.
 * Where the C reference and the torch port could part (values the reference's int conversions
 * would not hold), this follows the torch port: inside the searches levels are rounded to
 * nearest even and clamped as floats (NaN passes through, as torch.clamp leaves it).
 *
 * One entry point: q_quantize(type, x, n_blocks, out, threads). Blocks are independent, so
 * OpenMP hands out runs of blocks (dynamic: a descheduled thread holds up nothing but its run).
 * Never build with -ffast-math. */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32
#define QK_K 256
#define GROUP_MAX_EPS 1e-15f

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> fp16 bits, round to nearest even (past 65504: inf). */
static inline uint16_t fp16_bits(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    /* the FP16 library's branch-free conversion (as ggml's software path) */
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f2u(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f2u(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

/* fp16 bits -> float32 (exact). */
static inline float fp16_value(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t result = sign | (two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized));
    return u2f(result);
#endif
}

/* GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(f)) */
static inline float fp16_round(float f) { return fp16_value(fp16_bits(f)); }

static inline void put_fp16(uint8_t *p, float f) {
    uint16_t h = fp16_bits(f);
    p[0] = (uint8_t)(h & 0xFF);
    p[1] = (uint8_t)(h >> 8);
}

static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int32_t i;
    memcpy(&i, &val, sizeof(i));
    return (i & 0x007FFFFF) - 0x00400000;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* a level inside a search: rounded to nearest even, clamped to [0, hi] as a float */
static inline float level(float v, float lo, float hi) {
    v = rintf(v);
    if (v < lo) v = lo;
    else if (v > hi) v = hi;
    return v;
}

/* float -> int32 as x86's cvttss2si gives it (truncation; INT32_MIN for NaN and values out of
 * range): torch's conversion of a float to int8/uint8 keeps that int's low byte */
static inline int32_t cvt_i32(float v) {
    return (v >= -2147483648.0f && v < 2147483648.0f) ? (int32_t)v : INT32_MIN;
}

/* roundf(v) (half away from zero), converted as cvt_i32: v minus its truncation is exact */
static inline int32_t round_away(float v) {
    const int32_t t = cvt_i32(v);
    if (t == INT32_MIN) return t;
    const float f = v - (float)t;
    return t + (f >= 0.5f) - (f <= -0.5f);
}

/* ------------------------------------------------------------------ floats */

static void q_f16(const float *x, uint8_t *y) { put_fp16(y, x[0]); }

static void q_bf16(const float *x, uint8_t *y) {
    uint32_t u = f2u(x[0]);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = (u & 0xFFFF0000u) | (64u << 16); /* quiet NaN */
    u = (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
    y[0] = (uint8_t)(u & 0xFF);
    y[1] = (uint8_t)((u >> 8) & 0xFF);
}

/* ------------------------------------------------------------------ 32-value blocks */

static void q8_0(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = fabsf(x[j]);
        amax = amax > a ? amax : a;
    }
    const float d = amax / 127;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_fp16(y, d);
    for (int j = 0; j < QK; j++) y[2 + j] = (uint8_t)(int8_t)round_away(x[j] * id);
}

/* the value of largest magnitude (the first of equal ones; +0 for a block of zeros) */
static inline float signed_absmax(const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float a = fabsf(x[j]);
        if (amax < a) { amax = a; max = x[j]; }
    }
    return max;
}

static inline void min_max(const float *x, float *mn, float *mx) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < QK; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

/* the torch port's v.trunc().to(uint8).clamp_(0, top): the low byte of the truncation, at most top */
static inline int trunc_clamp(float v, int top) {
    const int b = (int)(cvt_i32(v) & 0xFF);
    return b < top ? b : top;
}

static void q4_0(const float *x, uint8_t *y) {
    const float d = signed_absmax(x) / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_fp16(y, d);
    for (int j = 0; j < QK / 2; j++) {
        const int a = trunc_clamp(x[j] * id + 8.5f, 15);
        const int b = trunc_clamp(x[j + QK / 2] * id + 8.5f, 15);
        y[2 + j] = (uint8_t)(a | (b << 4));
    }
}

static void q4_1(const float *x, uint8_t *y) {
    float mn, mx;
    min_max(x, &mn, &mx);
    const float d = (mx - mn) / 15;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_fp16(y, d);
    put_fp16(y + 2, mn);
    for (int j = 0; j < QK / 2; j++) {
        const int a = trunc_clamp((x[j] - mn) * id + 0.5f, 15);
        const int b = trunc_clamp((x[j + QK / 2] - mn) * id + 0.5f, 15);
        y[4 + j] = (uint8_t)(a | (b << 4));
    }
}

static inline void pack5(const int *q, uint8_t *qh, uint8_t *qs) {
    uint32_t h = 0;
    for (int j = 0; j < QK; j++) h |= (uint32_t)(q[j] >> 4) << j;
    qh[0] = (uint8_t)h; qh[1] = (uint8_t)(h >> 8); qh[2] = (uint8_t)(h >> 16); qh[3] = (uint8_t)(h >> 24);
    for (int j = 0; j < QK / 2; j++) qs[j] = (uint8_t)((q[j] & 0x0F) | ((q[j + QK / 2] & 0x0F) << 4));
}

static void q5_0(const float *x, uint8_t *y) {
    const float d = signed_absmax(x) / -16;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[QK];
    put_fp16(y, d);
    for (int j = 0; j < QK; j++) q[j] = trunc_clamp(x[j] * id + 16.5f, 31);
    pack5(q, y + 2, y + 6);
}

static void q5_1(const float *x, uint8_t *y) {
    float mn, mx;
    min_max(x, &mn, &mx);
    const float d = (mx - mn) / 31;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[QK];
    put_fp16(y, d);
    put_fp16(y + 2, mn);
    for (int j = 0; j < QK; j++) q[j] = trunc_clamp((x[j] - mn) * id + 0.5f, 31);
    pack5(q, y + 4, y + 8);
}

/* ------------------------------------------------------------------ k-quants: searches */

/* make_qkx2_quants: scale and offset of the least (weighted) error fit x ~ scale*L - the_min,
 * L in 0..nmax, over nstep + 1 grids (kquants.make_qkx2_quants). */
static float make_qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min,
                       float rmin, float rdelta, int nstep, int use_mad) {
    float mn = x[0], mx = x[0];
    float sum_w = w[0];
    float sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0) mn = 0;
    if (mx == mn) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *the_min = -mn;
        return 0.0f;
    }
    const float fmax = (float)nmax;
    float iscale = fmax / (mx - mn);
    float scale = 1.0f / iscale;
    float best_iscale = iscale, best_base = mn;
    float best = 0.0f;
    for (int i = 0; i < n; i++) {
        const float l = level((x[i] - mn) * iscale, 0.0f, fmax);
        float diff = l * scale + mn - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best += diff * w[i];
    }
    float lf[32];
    for (int is = 0; is <= nstep; is++) {
        const float c = rmin + rdelta * (float)is + fmax;
        iscale = c / (mx - mn);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const float l = level((x[i] - mn) * iscale, 0.0f, fmax);
            lf[i] = l;
            const float wl = w[i] * l;
            sum_l += wl;
            sum_l2 += wl * l;
            sum_xl += wl * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (!(D > 0)) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        if (this_min > 0) {
            this_min = 0;
            this_scale = sum_xl / sum_l2;
        }
        float cur = 0.0f;
        for (int i = 0; i < n; i++) {
            float diff = lf[i] * this_scale + this_min - x[i];
            diff = use_mad ? fabsf(diff) : diff * diff;
            cur += diff * w[i];
        }
        if (cur < best) {
            best_iscale = iscale;
            best_base = mn;
            best = cur;
            scale = this_scale;
            mn = this_min;
        }
    }
    for (int i = 0; i < n; i++) L[i] = (uint8_t)clampi(nearest_int(best_iscale * (x[i] - best_base)), 0, nmax);
    *the_min = -mn;
    return scale;
}

/* the first value of largest magnitude, and that magnitude */
static inline float first_absmax(int n, const float *x, float *amax_out) {
    float amax = fabsf(x[0]), max = x[0];
    for (int i = 1; i < n; i++) {
        const float a = fabsf(x[i]);
        if (a > amax) { amax = a; max = x[i]; }
    }
    *amax_out = amax;
    return max;
}

/* make_qx_quants(n, nmax, x, L, rmse_type=1, NULL): symmetric fit weighted by x^2 over 19
 * grids; L in 0..2*nmax-1 (kquants.make_qx_quants_rmse1). */
static float make_qx_rmse1(int n, int nmax, const float *x, int8_t *L) {
    float amax;
    const float mx = first_absmax(n, x, &amax);
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.0f;
    }
    const float lo = (float)-nmax, hi = (float)(nmax - 1);
    float w[16], wx[16];
    for (int i = 0; i < n; i++) {
        w[i] = x[i] * x[i];
        wx[i] = w[i] * x[i];
    }
    float iscale = (float)-nmax / mx;
    float best_iscale = iscale;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const float l = level(x[i] * iscale, lo, hi);
        sumlx += wx[i] * l;
        suml2 += (w[i] * l) * l;
    }
    float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -((float)nmax + 0.1f * (float)is) / mx;
        sumlx = 0;
        suml2 = 0;
        for (int i = 0; i < n; i++) {
            const float l = level(x[i] * iscale, lo, hi);
            sumlx += wx[i] * l;
            suml2 += (w[i] * l) * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            best_iscale = iscale;
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(clampi(nearest_int(best_iscale * x[i]), -nmax, nmax - 1) + nmax);
    return scale;
}

/* make_q3_quants(n, nmax, x, L, do_rmse=true): the x^2-weighted symmetric fit, improved one
 * value at a time (up to 5 passes); L in 0..2*nmax-1 (kquants.make_q3_quants_rmse). */
static float make_q3_rmse(int n, int nmax, const float *x, int8_t *L) {
    float amax;
    const float mx = first_absmax(n, x, &amax);
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; i++) L[i] = 0;
        return 0.0f;
    }
    const float iscale = (float)-nmax / mx;
    int Li[16];
    float w[16], wx[16];
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        Li[i] = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        w[i] = x[i] * x[i];
        wx[i] = w[i] * x[i];
    }
    for (int i = 0; i < n; i++) sumlx += wx[i] * (float)Li[i];
    for (int i = 0; i < n; i++) suml2 += (w[i] * (float)Li[i]) * (float)Li[i];
    for (int itry = 0; itry < 5; itry++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            const float li = (float)Li[i];
            const float slx0 = sumlx - wx[i] * li;
            if (!(slx0 > 0)) continue;
            const float sl20 = suml2 - (w[i] * li) * li;
            const int new_l = clampi(nearest_int((x[i] * sl20) / slx0), -nmax, nmax - 1);
            if (new_l == Li[i]) continue;
            const float nl = (float)new_l;
            const float slx = slx0 + wx[i] * nl;
            const float sl2 = sl20 + (w[i] * nl) * nl;
            if (sl2 > 0 && (slx * slx) * suml2 > (sumlx * sumlx) * sl2) {
                Li[i] = new_l;
                sumlx = slx;
                suml2 = sl2;
                changed = 1;
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(Li[i] + nmax);
    return suml2 > 0 ? sumlx / suml2 : 0.0f;
}

/* ------------------------------------------------------------------ k-quants: blocks */

static inline void pack_2bit(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

static void q2_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K];
    float w[16], scales[16], mins[16];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 16; l++) w[l] = fabsf(x[16 * j + l]);
        scales[j] = make_qkx2(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, 1);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    uint8_t *sc = y;
    const int has_s = max_scale > 0, has_m = max_min > 0;
    const float is = 15.0f / max_scale, im = 15.0f / max_min;
    for (int j = 0; j < 16; j++) {
        const int ls = has_s ? (nearest_int(is * scales[j]) & 0xFF) : 0;
        const int lm = has_m ? (nearest_int(im * mins[j]) << 4) : 0;
        sc[j] = (uint8_t)((ls | lm) & 0xFF);
    }
    const float d = has_s ? max_scale / 15 : 0.0f;
    const float dmin = has_m ? max_min / 15 : 0.0f;
    put_fp16(y + 80, d);
    put_fp16(y + 82, dmin);
    const float df = fp16_round(d), dmf = fp16_round(dmin);
    for (int j = 0; j < 16; j++) {
        const float dsub = df * (float)(sc[j] & 0x0F);
        if (dsub == 0) continue;
        const float dm = dmf * (float)(sc[j] >> 4);
        for (int l = 0; l < 16; l++) L[16 * j + l] = (uint8_t)clampi(nearest_int((x[16 * j + l] + dm) / dsub), 0, 3);
    }
    pack_2bit(L, y + 16);
}

static void q3_k(const float *x, uint8_t *y) {
    int8_t Ls[QK_K];
    float scales[16];
    for (int j = 0; j < 16; j++) scales[j] = make_q3_rmse(16, 4, x + 16 * j, Ls + 16 * j);
    float amax;
    const float max_scale = first_absmax(16, scales, &amax);
    const int has = max_scale != 0;
    const float iscale = -32.0f / max_scale;
    int l[16];
    for (int j = 0; j < 16; j++)
        l[j] = has ? clampi((int8_t)nearest_int(iscale * scales[j]), -32, 31) + 32 : 0;
    uint8_t *hmask = y, *qs = y + 32, *sb = y + 96;
    for (int j = 0; j < 8; j++) sb[j] = (uint8_t)((l[j] & 0x0F) | ((l[j + 8] & 0x0F) << 4));
    for (int m = 0; m < 4; m++) {
        int b = 0;
        for (int k = 0; k < 4; k++) b += (l[4 * k + m] >> 4) << (2 * k);
        sb[8 + m] = (uint8_t)(b & 0xFF);
    }
    const float d = has ? 1.0f / iscale : 0.0f;
    put_fp16(y + 108, d);
    const float df = fp16_round(d);
    uint8_t L[QK_K];
    for (int i = 0; i < QK_K; i++) L[i] = (uint8_t)Ls[i];
    for (int j = 0; j < 16; j++) {
        const float dsub = df * (float)(l[j] - 32);
        if (dsub == 0) continue;
        for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)(clampi(nearest_int(x[16 * j + i] / dsub), -4, 3) + 4);
    }
    memset(hmask, 0, 32);
    for (int j = 0; j < QK_K; j++) {
        if (L[j] > 3) {
            hmask[j % 32] |= (uint8_t)(1u << (j / 32));
            L[j] -= 4;
        }
    }
    pack_2bit(L, qs);
}

/* Q4_K / Q5_K: (d, dmin, the 12 scale bytes, L) */
static void q45_k(const float *x, int nmax, float rmin, int nstep, uint8_t *dd, uint8_t *sb, uint8_t *L) {
    float w[32], scales[8], mins[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float s2 = 0;
        for (int l = 0; l < 32; l++) s2 += xs[l] * xs[l];
        const float av_x = sqrtf(s2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        scales[j] = make_qkx2(32, nmax, xs, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    int ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = nearest_int(inv_scale * scales[j]) & 0xFF;
        lm[j] = nearest_int(inv_min * mins[j]) & 0xFF;
        if (ls[j] > 63) ls[j] = 63;
        if (lm[j] > 63) lm[j] = 63;
    }
    for (int j = 0; j < 4; j++) {
        sb[j] = (uint8_t)((ls[j] | ((ls[j + 4] >> 4) << 6)) & 0xFF);
        sb[j + 4] = (uint8_t)((lm[j] | ((lm[j + 4] >> 4) << 6)) & 0xFF);
        sb[j + 8] = (uint8_t)(((ls[j + 4] & 0x0F) | ((lm[j + 4] & 0x0F) << 4)) & 0xFF);
    }
    const float d = max_scale / 63;
    const float dmin = max_min / 63;
    put_fp16(dd, d);
    put_fp16(dd + 2, dmin);
    const float df = fp16_round(d), dmf = fp16_round(dmin);
    for (int j = 0; j < 8; j++) {
        const float dsub = df * (float)ls[j];
        if (dsub == 0) continue;
        const float dm = dmf * (float)lm[j];
        for (int l = 0; l < 32; l++) L[32 * j + l] = (uint8_t)clampi(nearest_int((x[32 * j + l] + dm) / dsub), 0, nmax);
    }
}

static void q4_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K];
    q45_k(x, 15, -1.0f, 20, y, y + 4, L);
    uint8_t *q = y + 16;
    for (int j = 0; j < QK_K; j += 64) {
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        q += 32;
    }
}

static void q5_k(const float *x, uint8_t *y) {
    uint8_t L[QK_K];
    q45_k(x, 31, -0.5f, 15, y, y + 4, L);
    uint8_t *qh = y + 16, *ql = y + 48;
    memset(qh, 0, 32);
    for (int i = 0; i < QK_K; i++)
        if (L[i] > 15) qh[i % 32] |= (uint8_t)(1u << (i / 32));
    for (int j = 0; j < QK_K; j += 64) {
        for (int l = 0; l < 32; l++) ql[l] = (uint8_t)((L[j + l] & 0x0F) | ((L[j + l + 32] & 0x0F) << 4));
        ql += 32;
    }
}

static void q6_k(const float *x, uint8_t *y) {
    int8_t Ls[QK_K];
    float scales[16];
    for (int j = 0; j < 16; j++) scales[j] = make_qx_rmse1(16, 32, x + 16 * j, Ls + 16 * j);
    float amax;
    const float max_scale = first_absmax(16, scales, &amax);
    if (amax < GROUP_MAX_EPS) {
        memset(y, 0, 210);
        return;
    }
    const float iscale = -128.0f / max_scale;
    const float d = 1.0f / iscale;
    int8_t sc[16];
    for (int j = 0; j < 16; j++) {
        int v = nearest_int(iscale * scales[j]);
        sc[j] = (int8_t)(v > 127 ? 127 : v);
    }
    const float df = fp16_round(d);
    uint8_t L[QK_K];
    for (int i = 0; i < QK_K; i++) L[i] = (uint8_t)Ls[i];
    for (int j = 0; j < 16; j++) {
        const float dsub = df * (float)sc[j];
        if (dsub == 0) continue;
        for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)(clampi(nearest_int(x[16 * j + i] / dsub), -32, 31) + 32);
    }
    uint8_t *ql = y, *qh = y + 128;
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; l++) {
            const uint8_t q1 = L[j + l] & 0x0F, q2 = L[j + l + 32] & 0x0F;
            const uint8_t q3 = L[j + l + 64] & 0x0F, q4 = L[j + l + 96] & 0x0F;
            ql[l] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4)
                              | ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
    memcpy(y + 192, sc, 16);
    put_fp16(y + 208, d);
}

/* ------------------------------------------------------------------ entry point */

typedef void (*block_fn)(const float *, uint8_t *);

static int pick(int type, block_fn *fn, int *values, int *bytes) {
    switch (type) {
    case 1: *fn = q_f16; *values = 1; *bytes = 2; return 0;
    case 30: *fn = q_bf16; *values = 1; *bytes = 2; return 0;
    case 2: *fn = q4_0; *values = QK; *bytes = 18; return 0;
    case 3: *fn = q4_1; *values = QK; *bytes = 20; return 0;
    case 6: *fn = q5_0; *values = QK; *bytes = 22; return 0;
    case 7: *fn = q5_1; *values = QK; *bytes = 24; return 0;
    case 8: *fn = q8_0; *values = QK; *bytes = 34; return 0;
    case 10: *fn = q2_k; *values = QK_K; *bytes = 84; return 0;
    case 11: *fn = q3_k; *values = QK_K; *bytes = 110; return 0;
    case 12: *fn = q4_k; *values = QK_K; *bytes = 144; return 0;
    case 13: *fn = q5_k; *values = QK_K; *bytes = 176; return 0;
    case 14: *fn = q6_k; *values = QK_K; *bytes = 210; return 0;
    default: return -1;
    }
}

/* Bytes per block of a ggml type this file quantizes (-1: not one). */
int q_quantize_block_bytes(int type) {
    block_fn fn;
    int values, bytes;
    return pick(type, &fn, &values, &bytes) ? -1 : bytes;
}

/* x: n_blocks blocks of the type's values (float32, contiguous) -> out: n_blocks * type_size
 * bytes. 0, or -1 for a type this file does not quantize. */
int q_quantize(int type, const float *x, int64_t n_blocks, uint8_t *out, int threads) {
    block_fn fn;
    int values, bytes;
    if (pick(type, &fn, &values, &bytes)) return -1;
    const int64_t run = values == QK_K ? 16 : (values == QK ? 512 : 16384);
    const int64_t n_runs = (n_blocks + run - 1) / run;
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n_runs > 1)
    for (int64_t r = 0; r < n_runs; r++) {
        const int64_t end = (r + 1) * run < n_blocks ? (r + 1) * run : n_blocks;
        for (int64_t b = r * run; b < end; b++) fn(x + b * values, out + b * bytes);
    }
    return 0;
}
