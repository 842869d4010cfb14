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
