"""The 32-value block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (llama.cpp's "legacy" quants).

Reference dequantizers from block bytes to float32, in the order of operations of the
`gguf` package's numpy code (bit-exact). Layouts: see the package docstring.
"""

from __future__ import annotations

import torch

from ._bits import bits32, f16, nibbles

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
