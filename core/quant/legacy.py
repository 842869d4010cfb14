"""The 32-value block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (llama.cpp's "legacy" quants).

Reference dequantizers from block bytes to float32, in the order of operations of the
`gguf` package's numpy code (bit-exact). Layouts: see the package docstring.

Quantizers from float32 blocks to block bytes, bit for bit those of llama.cpp's
``quantize_row_*_ref`` and of ``gguf.quants.quantize`` (its numpy port; the two differ only in
the sign bit of a zero d or m in a block of zeros holding a -0.0, where this follows C). The
scale comes from the block's absolute maximum (Q8_0: d = amax / 127; Q4_0, Q5_0: d = max / -8
or -16 with the sign of the value of largest magnitude, so that value lands on the end of the
range) or from its range (Q4_1, Q5_1: d = (max - min) / 15 or 31, m = min); each value is
truncated after adding the half step (Q8_0: rounded half away from zero) and clipped to the
range. The float32 d (not its fp16 rounding) divides the values, as in the reference.
"""

from __future__ import annotations

import torch

from ._bits import bits32, f16, nibbles
from ._pack import div, f16_bytes, pack_bits_le

def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    q = nibbles(b[:, 2:], 16).to(torch.float32) - 8.0
    return d * q


def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    m = f16(b[:, 2:4])
    q = nibbles(b[:, 4:], 16).to(torch.float32)
    return (d * q) + m


def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    qh = bits32(b[:, 2:6])
    ql = nibbles(b[:, 6:], 16)
    q = (ql | (qh << 4)).to(torch.float32) - 16.0
    return d * q


def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    d = f16(b[:, :2])
    m = f16(b[:, 2:4])
    qh = bits32(b[:, 4:8])
    ql = nibbles(b[:, 8:], 16)
    q = (ql | (qh << 4)).to(torch.float32)
    return (d * q) + m


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1/d, and 0 where d is 0 (an all-zero block)."""
    return torch.where(d == 0, torch.zeros_like(d), div(1.0, d))


def _signed_absmax(b: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each block (the first of equal ones), shape (n, 1);
    +0 for a block of zeros, as C's loop from max = 0 leaves it (gguf's argmax takes the first
    zero, which may be -0.0: the only place the two differ, the sign of a zero d)."""
    v = b.gather(1, b.abs().argmax(dim=1, keepdim=True))
    return torch.where(v == 0, torch.zeros_like(v), v)


def _min_max(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first smallest and first largest value of each block, shape (n, 1): C's compare loop,
    which decides the sign of a zero minimum (numpy's and torch's min/max leave it unspecified)."""
    return b.gather(1, b.argmin(dim=1, keepdim=True)), b.gather(1, b.argmax(dim=1, keepdim=True))


def _low_high(q: torch.Tensor) -> torch.Tensor:
    """32 values 0..15 (or their low nibbles) -> 16 bytes: value j low, value j + 16 high."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _trunc_u8(v: torch.Tensor, top: int) -> torch.Tensor:
    return v.trunc().to(torch.uint8).clamp_(0, top)


def quantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(dim=1, keepdim=True) / 127
    v = b * _inverse(d)
    # round half away from zero, in gguf's (and C roundf's) exact steps
    a = v.abs()
    fl = a.floor()
    q = v.sign() * (fl + (2 * (a - fl)).floor())
    return torch.cat([f16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)


def quantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(b) / -8
    q = _trunc_u8(b * _inverse(d) + 8.5, 15)
    return torch.cat([f16_bytes(d), _low_high(q)], dim=1)


def quantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    mn, mx = _min_max(b)
    d = (mx - mn) / 15
    q = _trunc_u8((b - mn) * _inverse(d) + 0.5, 15)
    return torch.cat([f16_bytes(d), f16_bytes(mn), _low_high(q)], dim=1)


def quantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(b) / -16
    q = _trunc_u8(b * _inverse(d) + 16.5, 31)
    return torch.cat([f16_bytes(d), pack_bits_le(q >> 4), _low_high(q)], dim=1)


def quantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    mn, mx = _min_max(b)
    d = (mx - mn) / 31
    q = _trunc_u8((b - mn) * _inverse(d) + 0.5, 31)
    return torch.cat([f16_bytes(d), f16_bytes(mn), pack_bits_le(q >> 4), _low_high(q)], dim=1)
