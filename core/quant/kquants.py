"""The 256-value super-block types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (llama.cpp's k-quants).

Reference dequantizers from block bytes to float32, in the order of operations of the
`gguf` package's numpy code (bit-exact). Layouts: see the package docstring.
"""

from __future__ import annotations

import numpy as np
import torch

from ._bits import BIT_SHIFTS, CRUMB_SHIFTS, NIBBLE_SHIFTS, f16, nibbles
from ._pack import div as _div
from ._pack import f16_bytes, f16_round, f32, first_absmax, nearest_int, positive_max, seqsum, sqrt

QK_K = 256

def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    qs = b[:, 16:80]
    d = f16(b[:, 80:82])
    dmin = f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> CRUMB_SHIFTS.to(b.device).reshape(1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, :32]
    qs = b[:, 32:96]
    scales = b[:, 96:108]
    d = f16(b[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> NIBBLE_SHIFTS.to(b.device).reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> CRUMB_SHIFTS.to(b.device).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).to(torch.float32) - 32.0
    dl = (d * sc).reshape(n, 16, 1)
    ql = ((qs.reshape(n, -1, 1, 32) >> CRUMB_SHIFTS.to(b.device).reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, -1, 1, 32) >> BIT_SHIFTS.to(b.device).reshape(1, 1, 8, 1)) & 1).reshape(n, 16, 16)
    q = ql.to(torch.float32) - ((qh ^ 1) << 2).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = f16(b[:, :2])
    dmin = f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = nibbles(b[:, 16:], 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = f16(b[:, :2])
    dmin = f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]
    qs = b[:, 48:]
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = nibbles(qs, 32).reshape(n, 8, 32)
    hb = ((qh.reshape(n, 1, 1, 32) >> BIT_SHIFTS.to(b.device).reshape(1, 1, 8, 1)) & 1).reshape(n, 8, 32)
    q = (ql | (hb << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128]
    qh = b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = f16(b[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    lo = nibbles(ql, 64).reshape(n, 8, 32)
    hi = ((qh.reshape(n, -1, 1, 32) >> CRUMB_SHIFTS.to(b.device).reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.float32) - 32.0
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------
# Quantizers: float32 super-blocks -> block bytes, ports of llama.cpp's quantize_row_q*_K_ref
# (ggml-quants.c, the versions without an importance matrix, which is what `llama-quantize`
# runs without --imatrix). Each searches per sub-block for a scale (and a minimum), quantizes
# the sub-block scales to 4, 6 or 8 bits against one fp16 super-block scale, then rounds every
# value against its sub-block's quantized scale.
#
# Vectorized over sub-blocks: a sub-block's values lie along the first dimension (n, M), so the
# C loops over the 16 or 32 values of a sub-block become n steps over M sub-blocks at once, and
# the sums are taken in the C order (see _pack). The bytes equal the C reference's compiled
# without contraction of a*b+c into fused multiply-adds (-ffp-contract=off); a build that fuses
# them rounds some sums differently, and may choose another scale for a few sub-blocks.
# ---------------------------------------------------------------------------------------------


GROUP_MAX_EPS = f32(1e-15)
# super-blocks per pass: keeps each (n, M) temporary within the caches
_CHUNK = 2048


def _columns(x: torch.Tensor, n: int) -> torch.Tensor:
    """(N, 256) -> (n, N * 256 / n): column m holds sub-block m's n values."""
    return x.reshape(-1, n).t().contiguous()


def _rows(c: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """The inverse of _columns: (n, M) -> (N, 256)."""
    return c.t().reshape(n_blocks, QK_K)


def _u8(v: torch.Tensor) -> torch.Tensor:
    """A C store of an int into a uint8_t: the low 8 bits."""
    return (v & 0xFF).to(torch.uint8)


def _i8(v: torch.Tensor) -> torch.Tensor:
    """A C store of an int into an int8_t, as an int32 value."""
    return ((v + 128) & 0xFF) - 128


def make_qkx2_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                     nstep: int, use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, w: (n, M). Returns (scale (M,), the_min (M,), L (n, M) int32): the scale and offset of
    the least-(weighted)-error fit x ~ scale * L - the_min, L in 0..nmax, trying nstep + 1 grids.

    Within the search the levels are rounded with torch.round (nearest_int's ties-to-even; the
    values are at most nmax + 1 here, far inside its range) and kept as floats; the levels of
    the winning grid are recomputed once at the end from its (iscale, min)."""
    n = x.shape[0]
    zero = torch.zeros_like(x[0])
    mn = x.amin(dim=0)
    mx = x.amax(dim=0)
    sum_w = seqsum(w, start_zero=False)
    sum_x = seqsum(w * x, start_zero=False)
    mn = torch.where(mn > 0, zero, mn)
    flat = mx == mn
    the_flat_min = -mn
    sums = torch.empty((n, 3) + x.shape[1:], dtype=x.dtype)
    diff = torch.empty_like(x)
    lf = torch.empty_like(x)

    def levels(iscale, base):
        v = torch.sub(x, base, out=lf).mul_(iscale)
        return v.round_().clamp_(0, nmax)

    def error(scale, lf, m):
        d = torch.mul(lf, scale, out=diff).add_(m).sub_(x)
        d = d.abs_() if use_mad else d.mul_(d)
        return seqsum(d.mul_(w))

    iscale = _div(f32(nmax), mx - mn)
    scale = _div(1.0, iscale)
    best_iscale, best_base = iscale, mn
    best = error(scale, levels(iscale, mn), mn)
    for step in range(nstep + 1):
        c = f32(np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax))
        iscale = _div(c, mx - mn)
        levels(iscale, mn)
        wl = torch.mul(w, lf, out=sums[:, 0])
        torch.mul(wl, lf, out=sums[:, 1])
        torch.mul(wl, x, out=sums[:, 2])
        sum_l, sum_l2, sum_xl = seqsum(sums)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = torch.where(pos, zero, this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        cur = error(this_scale, lf, this_min)
        better = (D > 0) & (cur < best)
        best_iscale = torch.where(better, iscale, best_iscale)
        best_base = torch.where(better, mn, best_base)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    L = nearest_int(best_iscale * (x - best_base)).clamp_(0, nmax)
    L = torch.where(flat, torch.zeros_like(L), L)
    scale = torch.where(flat, zero, scale)
    the_min = torch.where(flat, the_flat_min, -mn)
    return scale, the_min, L


def make_qx_quants_rmse1(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) on x (n, M): (scale (M,), L (n, M) in
    0..2*nmax-1). The symmetric fit x ~ scale * (L - nmax) weighted by x^2, over 19 grids
    (levels rounded as in make_qkx2_quants, those of the winning grid recomputed at the end)."""
    n = x.shape[0]
    zero = torch.zeros_like(x[0])
    amax, mx = first_absmax(x, 0)
    w = x * x
    wx = w * x
    lf = torch.empty_like(x)
    sums = torch.empty((n, 2) + x.shape[1:], dtype=x.dtype)

    def fit(iscale):
        torch.mul(x, iscale, out=lf).round_().clamp_(-nmax, nmax - 1)
        torch.mul(wx, lf, out=sums[:, 0])
        torch.mul(w, lf, out=sums[:, 1]).mul_(lf)
        return seqsum(sums)

    iscale = _div(f32(-nmax), mx)
    best_iscale = iscale
    sumlx, suml2 = fit(iscale)
    scale = torch.where(suml2 != 0, sumlx / suml2, zero)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = _div(f32(-(np.float32(nmax) + np.float32(0.1) * np.float32(step))), mx)
        sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_iscale = torch.where(better, iscale, best_iscale)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    L = nearest_int(best_iscale * x).clamp_(-nmax, nmax - 1) + nmax
    allzero = amax < GROUP_MAX_EPS
    return torch.where(allzero, zero, scale), torch.where(allzero, torch.zeros_like(L), L)


def make_q3_quants_rmse(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants(n, nmax, x, L, do_rmse=true) on x (n, M): (scale (M,), L (n, M) in
    0..2*nmax-1). The x^2-weighted symmetric fit, improved one value at a time (5 passes)."""
    zero = torch.zeros_like(x[0])
    amax, mx = first_absmax(x, 0)
    iscale = _div(f32(-nmax), mx)
    L = nearest_int(iscale * x).clamp_(-nmax, nmax - 1)
    Lf = L.float()
    w = x * x
    wx = w * x
    sumlx = seqsum(wx * Lf)
    suml2 = seqsum((w * Lf) * Lf)
    n = x.shape[0]
    for _ in range(5):
        changed = torch.zeros_like(sumlx, dtype=torch.bool)
        for i in range(n):
            li = Lf[i]
            slx0 = sumlx - wx[i] * li
            sl20 = suml2 - (w[i] * li) * li
            new_l = nearest_int((x[i] * sl20) / slx0).clamp_(-nmax, nmax - 1)
            nl = new_l.float()
            slx = slx0 + wx[i] * nl
            sl2 = sl20 + (w[i] * nl) * nl
            take = (slx0 > 0) & (new_l != L[i]) & (sl2 > 0) & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
            L[i] = torch.where(take, new_l, L[i])
            Lf[i] = torch.where(take, nl, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
            changed |= take
        # a pass that changes nothing in a sub-block leaves it as the next pass found it, so
        # running the remaining passes on it is what C's early break does for it
        if not bool(changed.any()):
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, zero)
    allzero = amax < GROUP_MAX_EPS
    return torch.where(allzero, zero, scale), torch.where(allzero, torch.zeros_like(L), L + nmax)


def _chunked(fn):
    """Run a (N, 256) -> (N, type_size) quantizer over slices of _CHUNK super-blocks."""
    def run(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        if x.shape[0] <= _CHUNK:
            return fn(x.contiguous())
        return torch.cat([fn(x[i:i + _CHUNK].contiguous()) for i in range(0, x.shape[0], _CHUNK)])
    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """(N, 256) values 0..3 -> 64 bytes: each 32-byte half holds 128 values at shifts 0, 2, 4, 6."""
    q = L.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _pack_k_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins (N, 8) -> 12 bytes (the inverse of k_scale_min)."""
    return _u8(torch.cat([
        ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
        (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4),
    ], dim=1))


def _q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int):
    """The shared part of quantize_row_q4_K_ref / q5_K_ref: (d, dmin, 12 scale bytes, L (N, 256))."""
    N = x.shape[0]
    xc = _columns(x, 32)
    av_x = sqrt(seqsum(xc * xc) / 32)
    w = av_x + xc.abs()
    scales, mins, L = make_qkx2_quants(xc, w, nmax, rmin, 0.1, nstep, False)
    scales = scales.reshape(N, 8)
    mins = mins.reshape(N, 8)
    max_scale = positive_max(scales, 1)
    max_min = positive_max(mins, 1)
    zero = torch.zeros_like(max_scale)
    inv_scale = torch.where(max_scale > 0, _div(63.0, max_scale), zero)
    inv_min = torch.where(max_min > 0, _div(63.0, max_min), zero)
    ls = (nearest_int(inv_scale[:, None] * scales) & 0xFF).clamp_(max=63)
    lm = (nearest_int(inv_min[:, None] * mins) & 0xFF).clamp_(max=63)
    d = max_scale / 63
    dmin = max_min / 63
    dsub = (f16_round(d)[:, None] * ls.float()).reshape(1, -1)
    dm = (f16_round(dmin)[:, None] * lm.float()).reshape(1, -1)
    lq = nearest_int((xc + dm) / dsub).clamp_(0, nmax)
    L = _rows(torch.where(dsub != 0, lq, L), N)
    return d, dmin, _pack_k_scales(ls, lm), L


@_chunked
def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q4_K_ref: 8 sub-blocks of 32, asymmetric 4-bit, 6-bit scales and mins."""
    d, dmin, scales, L = _q45_k(x, 15, -1.0, 20)
    q = L.reshape(-1, 4, 2, 32)
    qs = _u8(q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), scales, qs], dim=1)


@_chunked
def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q5_K_ref: as Q4_K with 5-bit values (the 5th bits in qh)."""
    d, dmin, scales, L = _q45_k(x, 31, -0.5, 15)
    hi = (L >> 4).reshape(-1, 8, 32)  # bit i of qh[j]: the 5th bit of value 32*i + j
    qh = _u8((hi << torch.arange(8, dtype=hi.dtype).reshape(1, 8, 1)).sum(dim=1))
    q = (L & 0x0F).reshape(-1, 4, 2, 32)
    qs = _u8(q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), scales, qh, qs], dim=1)


@_chunked
def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q2_K_ref: 16 sub-blocks of 16, asymmetric 2-bit, 4-bit scales and mins."""
    N = x.shape[0]
    xc = _columns(x, 16)
    scales, mins, L = make_qkx2_quants(xc, xc.abs(), 3, -0.5, 0.1, 15, True)
    scales = scales.reshape(N, 16)
    mins = mins.reshape(N, 16)
    max_scale = positive_max(scales, 1)
    max_min = positive_max(mins, 1)
    zero = torch.zeros_like(max_scale)
    has_s = (max_scale > 0)[:, None]
    has_m = (max_min > 0)[:, None]
    ls = nearest_int(_div(15.0, max_scale)[:, None] * scales) & 0xFF
    lm = nearest_int(_div(15.0, max_min)[:, None] * mins) << 4
    sc = (torch.where(has_s, ls, 0) | torch.where(has_m, lm, 0)) & 0xFF
    d = torch.where(has_s[:, 0], max_scale / 15, zero)
    dmin = torch.where(has_m[:, 0], max_min / 15, zero)
    dsub = (f16_round(d)[:, None] * (sc & 0x0F).float()).reshape(1, -1)
    dm = (f16_round(dmin)[:, None] * (sc >> 4).float()).reshape(1, -1)
    lq = nearest_int((xc + dm) / dsub).clamp_(0, 3)
    L = _rows(torch.where(dsub != 0, lq, L), N)
    return torch.cat([_u8(sc), _u8(_pack_2bit(L)), f16_bytes(d), f16_bytes(dmin)], dim=1)


def _pack_q3_scales(l: torch.Tensor) -> torch.Tensor:
    """Q3_K: 16 six-bit scales (N, 16), offset by 32 -> 12 bytes: low nibbles of 0..7 and, above
    them, of 8..15 in bytes 0..7; the top 2 bits of scale j in byte 8 + j % 4 at shift 2 * (j // 4)."""
    high = (l >> 4).reshape(-1, 4, 4)
    high = (high << (2 * torch.arange(4, dtype=high.dtype)).reshape(1, 4, 1)).sum(dim=1)
    return _u8(torch.cat([(l[:, :8] & 0x0F) | ((l[:, 8:] & 0x0F) << 4), high], dim=1))


@_chunked
def quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q3_K_ref: 16 sub-blocks of 16, symmetric 3-bit, 6-bit signed scales."""
    N = x.shape[0]
    xc = _columns(x, 16)
    scales, L = make_q3_quants_rmse(xc, 4)
    scales = scales.reshape(N, 16)
    _, max_scale = first_absmax(scales, 1)
    has = (max_scale != 0)[:, None]
    iscale = _div(-32.0, max_scale)
    l = _i8(nearest_int(iscale[:, None] * scales)).clamp_(-32, 31) + 32
    l = torch.where(has, l, 0)
    sc_bytes = _pack_q3_scales(l)
    d = torch.where(has[:, 0], _div(1.0, iscale), torch.zeros_like(iscale))
    dsub = (f16_round(d)[:, None] * (l - 32).float()).reshape(1, -1)
    lq = nearest_int(xc / dsub).clamp_(-4, 3) + 4
    L = _rows(torch.where(dsub != 0, lq, L), N)
    hb = (L > 3).to(L.dtype)
    L = L - 4 * hb
    hmask = (hb.reshape(N, 8, 32) << torch.arange(8, dtype=hb.dtype).reshape(1, 8, 1)).sum(dim=1)
    return torch.cat([_u8(hmask), _u8(_pack_2bit(L)), _u8(sc_bytes), f16_bytes(d)], dim=1)


@_chunked
def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q6_K_ref: 16 sub-blocks of 16, symmetric 6-bit, 8-bit signed scales."""
    N = x.shape[0]
    xc = _columns(x, 16)
    scales, L = make_qx_quants_rmse1(xc, 32)
    scales = scales.reshape(N, 16)
    amax, max_scale = first_absmax(scales, 1)
    iscale = _div(-128.0, max_scale)
    d = _div(1.0, iscale)
    sc = _i8(nearest_int(iscale[:, None] * scales).clamp_(max=127))
    dsub = (f16_round(d)[:, None] * sc.float()).reshape(1, -1)
    lq = nearest_int(xc / dsub).clamp_(-32, 31) + 32
    L = _rows(torch.where(dsub != 0, lq, L), N)
    q = L.reshape(N, 2, 4, 32)
    lo = q & 0x0F
    ql = torch.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=2).reshape(N, 128)
    hi = q >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(N, 64)
    out = torch.cat([_u8(ql), _u8(qh), _u8(sc), f16_bytes(d)], dim=1)
    return torch.where((amax < GROUP_MAX_EPS)[:, None], torch.zeros_like(out), out)
