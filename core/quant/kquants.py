"""The 256-value super-block types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (llama.cpp's k-quants).

Reference dequantizers from block bytes to float32, in the order of operations of the
`gguf` package's numpy code (bit-exact). Layouts: see the package docstring.
"""

from __future__ import annotations

import torch

from ._bits import BIT_SHIFTS, CRUMB_SHIFTS, NIBBLE_SHIFTS, f16, nibbles

QK_K = 256

def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    qs = b[:, 16:80]
    d = f16(b[:, 80:82])
    dmin = f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> CRUMB_SHIFTS.reshape(1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, :32]
    qs = b[:, 32:96]
    scales = b[:, 96:108]
    d = f16(b[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> NIBBLE_SHIFTS.reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> CRUMB_SHIFTS.reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).to(torch.float32) - 32.0
    dl = (d * sc).reshape(n, 16, 1)
    ql = ((qs.reshape(n, -1, 1, 32) >> CRUMB_SHIFTS.reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, -1, 1, 32) >> BIT_SHIFTS.reshape(1, 1, 8, 1)) & 1).reshape(n, 16, 16)
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
    hb = ((qh.reshape(n, 1, 1, 32) >> BIT_SHIFTS.reshape(1, 1, 8, 1)) & 1).reshape(n, 8, 32)
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
    hi = ((qh.reshape(n, -1, 1, 32) >> CRUMB_SHIFTS.reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.float32) - 32.0
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)
