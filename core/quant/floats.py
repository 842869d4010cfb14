"""The unquantized GGUF types, as codecs of one value per "block": F32, F16, BF16.

A GGUF may store any matrix as plain floats (small models, or tensors a quantization mix
keeps exact); they go through the same seam as the quantized types, so a linear layer never
asks which kind of file its weight came from.
"""

from __future__ import annotations

import torch


def dequantize_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32).reshape(b.shape[0], 1)


def dequantize_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32).reshape(b.shape[0], 1)


def dequantize_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).to(torch.float32).reshape(b.shape[0], 1)


# The reverse direction, (n, 1) float32 -> (n, type_size) bytes, as gguf.quants.quantize writes them.

def quantize_f32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1, 1).view(torch.uint8)


def quantize_f16(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even (values past fp16's range become inf, as numpy's cast makes them)."""
    return x.contiguous().reshape(-1, 1).to(torch.float16).view(torch.uint8)


def quantize_bf16(x: torch.Tensor) -> torch.Tensor:
    """ggml_compute_fp32_to_bf16: round to nearest even on the bits; a NaN keeps its sign and top
    bits and is made quiet (torch's own cast makes every NaN 0x7FC0). In int32 arithmetic, which
    wraps as the C uint32 does; the top 16 bits are the result."""
    n = x.contiguous().reshape(-1).view(torch.int32)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(nan, (n & -65536) | (64 << 16), n)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return n.to(torch.int16).view(torch.uint8).reshape(-1, 2)
