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
 * would not hold, as in a block whose 1/d overflows), this follows the torch port: inside the
 * searches levels are rounded to nearest even and clamped as floats (NaN passes through, as
 * torch.clamp leaves it), and a float stored as int8/uint8 keeps the low byte of x86's
 * truncating conversion (INT32_MIN for NaN and out of range), as torch's .to(int8) does.
 *
 * One entry point: q_quantize(type, x, n_blocks, out, threads), which also refuses NaN and
 * infinity (-2). Blocks are independent, so OpenMP hands out runs of blocks (dynamic: a
 * descheduled thread holds up nothing but its run). Never build with -ffast-math. */
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32
#define QK_K 256
#define GROUP_MAX_EPS 1e-15f
#define MAXN 32 /* values per sub-block at most */

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

/* The searches run over 8 sub-blocks at once, one per lane of an 8-float vector (GCC's
 * vector extension: one AVX op here, two SSE ones in a baseline build): X[i] holds value i of
 * every sub-block, so each lane keeps the C order of its own sums (the torch port's layout) and
 * does exactly the IEEE operations a scalar loop per sub-block would: the same bytes, ~10x
 * fewer steps. Branches become selects. Q2_K, Q6_K: two runs of 8 of their 16 sub-blocks. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define NL 8
#define VINLINE static inline __attribute__((always_inline))

VINLINE vf vsplat(float f) { return (vf){0} + f; }
VINLINE vi vsplati(int32_t v) { return (vi){0} + v; }
VINLINE vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
VINLINE vi vseli(vi m, vi a, vi b) { return (a & m) | (b & ~m); }
VINLINE vf vabs(vf a) { return (vf)((vi)a & 0x7FFFFFFF); }

/* a level inside a search: rounded to nearest even, clamped to [lo, hi] as a float (NaN passes
 * through, as torch.clamp leaves it). The magic-number rounding is rint's for |v| <= 2^22; past
 * that its result lies past the same end of [lo, hi] as rint's, so the clamped level is equal. */
VINLINE vf vlevel(vf v, vf lo, vf hi) {
    v = (v + 12582912.0f) - 12582912.0f;
    v = vsel(v < lo, lo, v);
    return vsel(v > hi, hi, v);
}

/* nearest_int, clamped to [lo, hi] */
VINLINE vi vnearest(vf f, int lo, int hi) {
    const vf v = f + 12582912.0f;
    vi q = ((vi)v & 0x007FFFFF) - 0x00400000;
    q = vseli(q < lo, vsplati(lo), q);
    return vseli(q > hi, vsplati(hi), q);
}

/* make_qkx2_quants on 8 sub-blocks of n values: for each, the scale and offset of the least
 * (weighted) error fit x ~ scale*L - the_min, L in 0..nmax, over nstep + 1 grids
 * (kquants.make_qkx2_quants). L[i * 8 + j]: value i of sub-block j. */
static inline __attribute__((always_inline)) void qkx2_v(
        const int n, const int nmax, const vf *X, const vf *W, uint8_t *L, float *scale_out, float *min_out,
        const float rmin, const float rdelta, const int nstep, const int use_mad) {
    const vf zero = vsplat(0.0f), fmaxv = vsplat((float)nmax);
    vf mn = X[0], mx = X[0], sum_w = W[0], sum_x = W[0] * X[0];
    for (int i = 1; i < n; i++) {
        mn = vsel(X[i] < mn, X[i], mn);
        mx = vsel(X[i] > mx, X[i], mx);
        sum_w += W[i];
        sum_x += W[i] * X[i];
    }
    mn = vsel(mn > zero, zero, mn);
    const vf flat_mn = mn;
    const vi flat = mx == mn;
    vf iscale = fmaxv / (mx - mn);
    vf scale = vsplat(1.0f) / iscale;
    vf best_is = iscale, best_base = mn, best = zero;
    for (int i = 0; i < n; i++) {
        const vf l = vlevel((X[i] - mn) * iscale, zero, fmaxv);
        vf diff = l * scale + mn - X[i];
        diff = use_mad ? vabs(diff) : diff * diff;
        best += diff * W[i];
    }
    vf lf[MAXN];
    for (int is = 0; is <= nstep; is++) {
        const float c = rmin + rdelta * (float)is + (float)nmax;
        iscale = vsplat(c) / (mx - mn);
        vf sl = zero, sl2 = zero, sxl = zero;
        for (int i = 0; i < n; i++) {
            const vf l = vlevel((X[i] - mn) * iscale, zero, fmaxv);
            lf[i] = l;
            const vf wl = W[i] * l;
            sl += wl;
            sl2 += wl * l;
            sxl += wl * X[i];
        }
        const vf D = sum_w * sl2 - sl * sl;
        vf ts = (sum_w * sxl - sum_x * sl) / D;
        vf tm = (sl2 * sum_x - sl * sxl) / D;
        const vi pos = tm > zero;
        tm = vsel(pos, zero, tm);
        ts = vsel(pos, sxl / sl2, ts);
        vf cur = zero;
        for (int i = 0; i < n; i++) {
            vf diff = lf[i] * ts + tm - X[i];
            diff = use_mad ? vabs(diff) : diff * diff;
            cur += diff * W[i];
        }
        const vi better = (D > zero) & (cur < best);
        best_is = vsel(better, iscale, best_is);
        best_base = vsel(better, mn, best_base);
        best = vsel(better, cur, best);
        scale = vsel(better, ts, scale);
        mn = vsel(better, tm, mn);
    }
    for (int i = 0; i < n; i++) {
        const vi q = vseli(flat, vsplati(0), vnearest(best_is * (X[i] - best_base), 0, nmax));
        for (int j = 0; j < NL; j++) L[i * NL + j] = (uint8_t)q[j];
    }
    const vf so = vsel(flat, zero, scale), mo = vsel(flat, -flat_mn, -mn);
    for (int j = 0; j < NL; j++) {
        scale_out[j] = so[j];
        min_out[j] = mo[j];
    }
}

/* make_qx_quants(16, nmax, x, L, rmse_type=1, NULL) on 8 sub-blocks: the symmetric fit
 * weighted by x^2 over 19 grids; L in 0..2*nmax-1 (kquants.make_qx_quants_rmse1). */
VINLINE void qx_rmse1_v(const int nmax, const vf *X, int8_t *L, float *scale_out) {
    enum { n = 16 };
    const vf zero = vsplat(0.0f), lo = vsplat((float)-nmax), hi = vsplat((float)(nmax - 1));
    vf amax = vabs(X[0]), mxv = X[0];
    for (int i = 1; i < n; i++) {
        const vf a = vabs(X[i]);
        const vi up = a > amax;
        amax = vsel(up, a, amax);
        mxv = vsel(up, X[i], mxv);
    }
    vf w[n], wx[n];
    for (int i = 0; i < n; i++) {
        w[i] = X[i] * X[i];
        wx[i] = w[i] * X[i];
    }
    vf iscale = vsplat((float)-nmax) / mxv;
    vf best_is = iscale, sumlx = zero, suml2 = zero;
    for (int i = 0; i < n; i++) {
        const vf l = vlevel(X[i] * iscale, lo, hi);
        sumlx += wx[i] * l;
        suml2 += (w[i] * l) * l;
    }
    vf scale = vsel(suml2 != zero, sumlx / suml2, zero);
    vf best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = vsplat(-((float)nmax + 0.1f * (float)is)) / mxv;
        sumlx = zero;
        suml2 = zero;
        for (int i = 0; i < n; i++) {
            const vf l = vlevel(X[i] * iscale, lo, hi);
            sumlx += wx[i] * l;
            suml2 += (w[i] * l) * l;
        }
        const vi better = (suml2 > zero) & (sumlx * sumlx > best * suml2);
        const vf s = sumlx / suml2;
        best_is = vsel(better, iscale, best_is);
        scale = vsel(better, s, scale);
        best = vsel(better, s * sumlx, best);
    }
    const vi allzero = amax < GROUP_MAX_EPS;
    for (int i = 0; i < n; i++) {
        const vi q = vseli(allzero, vsplati(0), vnearest(best_is * X[i], -nmax, nmax - 1) + nmax);
        for (int j = 0; j < NL; j++) L[i * NL + j] = (int8_t)q[j];
    }
    const vf so = vsel(allzero, zero, scale);
    for (int j = 0; j < NL; j++) scale_out[j] = so[j];
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
    uint8_t L[QK_K], LT[2][16 * NL];
    float scales[16], mins[16];
    for (int h = 0; h < 2; h++) {
        vf X[16], W[16];
        for (int j = 0; j < NL; j++)
            for (int i = 0; i < 16; i++) {
                X[i][j] = x[16 * (8 * h + j) + i];
                W[i][j] = fabsf(x[16 * (8 * h + j) + i]);
            }
        qkx2_v(16, 3, X, W, LT[h], scales + 8 * h, mins + 8 * h, -0.5f, 0.1f, 15, 1);
    }
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; j++) {
        for (int i = 0; i < 16; i++) L[16 * j + i] = LT[j / 8][i * NL + j % 8];
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

/* Q4_K / Q5_K: the searches of a super-block's 8 sub-blocks (lane j: sub-block j) */
VINLINE void q45_search(const float *x, int nmax, float rmin, int nstep, uint8_t *L, float *scales, float *mins) {
    vf X[32], W[32];
    uint8_t LT[32 * NL];
    for (int j = 0; j < NL; j++)
        for (int i = 0; i < 32; i++) X[i][j] = x[32 * j + i];
    vf s2 = vsplat(0.0f);
    for (int i = 0; i < 32; i++) s2 += X[i] * X[i];
    vf q = s2 / 32.0f, av_x;
    for (int j = 0; j < NL; j++) av_x[j] = sqrtf(q[j]);
    for (int i = 0; i < 32; i++) W[i] = av_x + vabs(X[i]);
    qkx2_v(32, nmax, X, W, LT, scales, mins, rmin, 0.1f, nstep, 0);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 32; i++) L[32 * j + i] = LT[i * NL + j];
}

/* Q4_K / Q5_K from a block's fits: d, dmin, the 12 scale bytes, and L re-rounded */
static void q45_finish(const float *x, int nmax, const float *scales, const float *mins, uint8_t *dd, uint8_t *sb,
                       uint8_t *L) {
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
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

/* nb (1 or 2) Q4_K blocks */
static void q4_k(const float *x, uint8_t *y, int nb) {
    uint8_t L[2][QK_K];
    float scales[NL], mins[NL];
    for (int b = 0; b < nb; b++) {
        uint8_t *yb = y + 144 * b;
        q45_search(x + QK_K * b, 15, -1.0f, 20, L[b], scales, mins);
        q45_finish(x + QK_K * b, 15, scales, mins, yb, yb + 4, L[b]);
        uint8_t *q = yb + 16;
        for (int j = 0; j < QK_K; j += 64) {
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[b][j + l] | (L[b][j + l + 32] << 4));
            q += 32;
        }
    }
}

/* nb (1 or 2) Q5_K blocks */
static void q5_k(const float *x, uint8_t *y, int nb) {
    uint8_t L[2][QK_K];
    float scales[NL], mins[NL];
    for (int b = 0; b < nb; b++) {
        uint8_t *yb = y + 176 * b;
        q45_search(x + QK_K * b, 31, -0.5f, 15, L[b], scales, mins);
        q45_finish(x + QK_K * b, 31, scales, mins, yb, yb + 4, L[b]);
        uint8_t *qh = yb + 16, *ql = yb + 48;
        memset(qh, 0, 32);
        for (int i = 0; i < QK_K; i++)
            if (L[b][i] > 15) qh[i % 32] |= (uint8_t)(1u << (i / 32));
        for (int j = 0; j < QK_K; j += 64) {
            for (int l = 0; l < 32; l++) ql[l] = (uint8_t)((L[b][j + l] & 0x0F) | ((L[b][j + l + 32] & 0x0F) << 4));
            ql += 32;
        }
    }
}

static void q6_k(const float *x, uint8_t *y) {
    int8_t Ls[QK_K], LT[2][16 * NL];
    float scales[16];
    for (int h = 0; h < 2; h++) {
        vf X[16];
        for (int j = 0; j < NL; j++)
            for (int i = 0; i < 16; i++) X[i][j] = x[16 * (8 * h + j) + i];
        qx_rmse1_v(32, X, LT[h], scales + 8 * h);
    }
    for (int j = 0; j < 16; j++)
        for (int i = 0; i < 16; i++) Ls[16 * j + i] = LT[j / 8][i * NL + j % 8];
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
    case 12: *fn = NULL; *values = QK_K; *bytes = 144; return 0; /* q4_k: two blocks a call */
    case 13: *fn = NULL; *values = QK_K; *bytes = 176; return 0; /* q5_k */
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
 * bytes. 0; -1 for a type this file does not quantize; -2 where a value is NaN or infinite
 * (out is then partly written: the caller refuses the values). */
int q_quantize(int type, const float *x, int64_t n_blocks, uint8_t *out, int threads) {
    block_fn fn;
    int values, bytes;
    if (pick(type, &fn, &values, &bytes)) return -1;
    const int64_t run = values == QK_K ? 16 : (values == QK ? 512 : 16384);
    const int64_t n_runs = (n_blocks + run - 1) / run;
    if (threads < 1) threads = 1;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n_runs > 1)
    for (int64_t r = 0; r < n_runs; r++) {
        const int64_t end = (r + 1) * run < n_blocks ? (r + 1) * run : n_blocks;
        /* NaN and inf first (all exponent bits set), the run's values in one pass */
        const uint32_t *bits = (const uint32_t *)(x + r * run * values);
        uint32_t any = 0;
        for (int64_t i = 0; i < (end - r * run) * values; i++) any |= (bits[i] & 0x7F800000u) == 0x7F800000u;
        if (any) {
#pragma omp atomic write
            bad = 1;
            continue;
        }
        if (type == 30) { /* one value a "block": a direct loop the compiler vectorizes */
            for (int64_t b = r * run; b < end; b++) q_bf16(x + b, out + 2 * b);
        } else if (type == 1) {
            int64_t b = r * run;
#if defined(__F16C__)
            for (; b + 8 <= end; b += 8) /* vcvtps2ph, round to nearest even: as fp16_bits */
                _mm_storeu_si128((__m128i *)(out + 2 * b), _mm256_cvtps_ph(_mm256_loadu_ps(x + b), 0));
#endif
            for (; b < end; b++) q_f16(x + b, out + 2 * b);
        } else if (fn) {
            for (int64_t b = r * run; b < end; b++) fn(x + b * values, out + b * bytes);
        } else {
            for (int64_t b = r * run; b < end; b += 2) {
                const int nb = b + 1 < end ? 2 : 1;
                if (type == 12) q4_k(x + b * values, out + b * bytes, nb);
                else q5_k(x + b * values, out + b * bytes, nb);
            }
        }
    }
    return bad ? -2 : 0;
}
