"""GGUF block codecs: reference dequantizers from raw block bytes to float32.

Each type stores a row of values as whole blocks of ``block_size`` values in
``type_size`` bytes (all multi-byte fields little-endian; "d" is a per-block
fp16 scale, "m"/"dmin" an fp16 minimum/offset).  The layouts, as in llama.cpp's
ggml-common.h and ``dequantize_row_*`` in ggml-quants.c:

- Q8_0 (32 values, 34 bytes): fp16 d, 32 int8 quants; x = d*q.
- Q4_0 (32, 18): fp16 d, 16 bytes of 4-bit quants, low nibbles first (values 0..15 are the low nibbles, 16..31 the high ones); x = d*(q-8).
- Q4_1 (32, 20): fp16 d, fp16 m, 16 bytes of 4-bit quants, low nibbles first; x = d*q + m.
- Q5_0 (32, 22): fp16 d, 4 bytes qh (bit j = 5th bit of value j), 16 bytes of low nibbles as Q4_0; x = d*(q-16).
- Q5_1 (32, 24): fp16 d, fp16 m, 4 bytes qh, 16 bytes of low nibbles; x = d*q + m.
- Q2_K (256, 84): 16 bytes of scales (low nibble: scale, high nibble: min, one per 16 values), 64 bytes of 2-bit quants (each 32-byte half holds 128 values at shifts 0,2,4,6), fp16 d, fp16 dmin; x = d*sc*q - dmin*mn.
- Q3_K (256, 110): 32 bytes hmask (3rd bit, inverted: bit clear = subtract 4), 64 bytes of 2-bit quants as Q2_K, 12 bytes of 6-bit scales (16 of them, offset by 32), fp16 d; x = d*(sc-32)*q.
- Q4_K (256, 144): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 of each, one per 32 values), 128 bytes of 4-bit quants (each 32-byte run: low nibbles = 32 values, high nibbles = the next 32); x = d*sc*q - dmin*mn.
- Q5_K (256, 176): fp16 d, fp16 dmin, 12 bytes of scales/mins as Q4_K, 32 bytes qh (bit i of byte l = 5th bit of value 32*i+l), 128 bytes of low nibbles as Q4_K; x = d*sc*q - dmin*mn.
- Q6_K (256, 210): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16 values), fp16 d; x = d*sc*(q-32).

The arithmetic follows the order of operations of the ``gguf`` package's
numpy dequantizers (float32 throughout, no fused multiply-add), so results are
equal to theirs bit for bit.  Pure torch; nothing here prints.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import floats, kquants, legacy
from .kquants import QK_K


class Codec(NamedTuple):
    name: str
    ggml_type: int  # the type id in GGUF files (ggml_type)
    block_size: int  # values per block
    type_size: int  # bytes per block
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]  # (n, type_size) uint8 -> (n, block_size) float32
    quantize_blocks: Callable[[torch.Tensor], torch.Tensor] | None = None  # (n, block_size) float32 -> (n, type_size) uint8

    @property
    def quantized(self) -> bool:
        """False for the plain float types (F32, F16, BF16)."""
        return self.block_size > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of `n` values; ValueError where `n` is not whole blocks."""
        if n % self.block_size:
            raise ValueError(f"a row of {n} values is not a whole number of {self.name} blocks of {self.block_size}")
        return n // self.block_size * self.type_size


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec("F32", 0, 1, 4, floats.dequantize_f32),
        Codec("F16", 1, 1, 2, floats.dequantize_f16),
        Codec("BF16", 30, 1, 2, floats.dequantize_bf16),
        Codec("Q4_0", 2, 32, 18, legacy.dequantize_q4_0),
        Codec("Q4_1", 3, 32, 20, legacy.dequantize_q4_1),
        Codec("Q5_0", 6, 32, 22, legacy.dequantize_q5_0),
        Codec("Q5_1", 7, 32, 24, legacy.dequantize_q5_1),
        Codec("Q8_0", 8, 32, 34, legacy.dequantize_q8_0),
        Codec("Q2_K", 10, QK_K, 84, kquants.dequantize_q2_k),
        Codec("Q3_K", 11, QK_K, 110, kquants.dequantize_q3_k),
        Codec("Q4_K", 12, QK_K, 144, kquants.dequantize_q4_k),
        Codec("Q5_K", 13, QK_K, 176, kquants.dequantize_q5_k),
        Codec("Q6_K", 14, QK_K, 210, kquants.dequantize_q6_k),
    )
}

BY_GGML_TYPE: dict[int, Codec] = {c.ggml_type: c for c in CODECS.values()}


def codec(type_name: str) -> Codec:
    """The codec for a type name such as ``"Q4_K"`` (case-insensitive)."""
    c = CODECS.get(str(type_name).upper())
    if c is None:
        raise ValueError(f"unsupported quantization type {type_name!r} (known: {', '.join(CODECS)})")
    return c


def dequantize(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """Dequantize raw block bytes to float32.

    ``data`` is a uint8 tensor whose last dimension holds whole blocks of one
    row (rows may be stacked in leading dimensions); the result has the same
    leading shape and ``n_blocks * block_size`` values in its last dimension.
    """
    c = codec(type_name)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{c.name} data must be a uint8 tensor, got {got}")
    if data.dim() == 0:
        raise ValueError(f"{c.name} data must have at least one dimension")
    row_bytes = data.shape[-1]
    if row_bytes % c.type_size:
        raise ValueError(
            f"{c.name} row of {row_bytes} bytes is not a whole number of {c.type_size}-byte blocks"
        )
    lead = tuple(data.shape[:-1])
    n_blocks = row_bytes // c.type_size
    blocks = data.reshape(-1, c.type_size)
    out = c.dequantize_blocks(blocks)
    return out.reshape(*lead, n_blocks * c.block_size)
