"""Arithmetic and bit packing shared by the quantizers (pure torch, float32 throughout).

The quantizers must give the bytes llama.cpp's C reference gives, so every float operation here
is one IEEE float32 operation in the C order: no fused multiply-add, sums accumulated one term
at a time in the C loop's order (torch's own reductions and ``cumsum`` reorder or widen them),
divisions written as divisions (``c / t`` on a tensor is ``t.reciprocal() * c`` in torch: one
more rounding), and square roots taken in float64 (torch's float32 ``sqrt`` on x86 is not
correctly rounded; the float64 root rounded to float32 is).
"""

from __future__ import annotations

import numpy as np
import torch

# nearest_int's magic: adding 1.5 * 2**23 rounds a float32 to an integer (ties to even) and
# leaves it in the low mantissa bits.
_MAGIC = 12582912.0


def f32(value: float) -> float:
    """`value` rounded to float32 (a C `float` literal or expression of literals), as a Python float."""
    return float(np.float32(value))


def nearest_int(f: torch.Tensor) -> torch.Tensor:
    """llama.cpp's ``nearest_int``, bit for bit (also outside its asserted range): int32."""
    v = f + _MAGIC
    return (v.view(torch.int32) & 0x007FFFFF) - 0x00400000


def div(c: float, t: torch.Tensor) -> torch.Tensor:
    """The float32 quotient ``c / t`` with one rounding (``c`` a float32 constant)."""
    return torch.full_like(t, c).div_(t)


def sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root."""
    return t.double().sqrt_().float()


def seqsum(t: torch.Tensor, start_zero: bool = True) -> torch.Tensor:
    """Sum over the first dimension, one term at a time in order (C's ``s += t[i]`` loop).

    ``start_zero``: the C accumulator starts at 0 (``float s = 0``) rather than at ``t[0]``
    (which only differs in the sign of a zero sum).
    """
    if start_zero:
        acc = torch.zeros_like(t[0])
        start = 0
    else:
        acc = t[0].clone()
        start = 1
    for i in range(start, t.shape[0]):
        acc.add_(t[i])
    return acc


def first_absmax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(|max|, the signed value) of the first element of largest magnitude along `dim`
    (C's ``if (ax > amax) { amax = ax; max = x[i]; }`` from amax = 0)."""
    ax = x.abs()
    idx = ax.argmax(dim=dim, keepdim=True)
    return ax.gather(dim, idx).squeeze(dim), x.gather(dim, idx).squeeze(dim)


def positive_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """C's ``m = 0; if (v > m) m = v;``: the largest value if positive, else +0."""
    m = x.amax(dim=dim)
    return torch.where(m > 0, m, torch.zeros_like(m))


def f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """(n,) or (n, 1) float32 -> (n, 2) little-endian fp16 bytes (round to nearest even)."""
    return t.reshape(-1, 1).to(torch.float16).view(torch.uint8)


def f16_round(t: torch.Tensor) -> torch.Tensor:
    """The float32 value of `t` stored as fp16 (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(t)))."""
    return t.to(torch.float16).to(torch.float32)


def pack_bits_le(bits: torch.Tensor) -> torch.Tensor:
    """(n, 8k) of 0/1 -> (n, k) bytes, bit j of byte i = bits[:, 8i + j]."""
    n = bits.shape[0]
    b = bits.to(torch.uint8).reshape(n, -1, 8)
    shifts = torch.arange(8, dtype=torch.uint8)
    return (b << shifts).sum(dim=-1, dtype=torch.uint8)
