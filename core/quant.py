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

QK_K = 256


class Codec(NamedTuple):
    name: str
    ggml_type: int  # the type id in GGUF files (ggml_type)
    block_size: int  # values per block
    type_size: int  # bytes per block
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]  # (n, type_size) uint8 -> (n, block_size) float32


def _u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


_NIBBLE_SHIFTS = _u8([0, 4])
_CRUMB_SHIFTS = _u8([0, 2, 4, 6])
_BIT_SHIFTS = _u8(list(range(8)))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian fp16 bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Split each run of ``run`` bytes into its low nibbles, then its high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) of its bits, bit 0 first."""
    n = qh.shape[0]
    return ((qh.reshape(n, 4, 1) >> _BIT_SHIFTS.reshape(1, 1, 8)) & 1).reshape(n, 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    x = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).to(torch.float32) - 8.0
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    m = _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).to(torch.float32)
    return (d * q) + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    qh = _bits32(b[:, 2:6])
    ql = _nibbles(b[:, 6:], 16)
    q = (ql | (qh << 4)).to(torch.float32) - 16.0
    return d * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    m = _f16(b[:, 2:4])
    qh = _bits32(b[:, 4:8])
    ql = _nibbles(b[:, 8:], 16)
    q = (ql | (qh << 4)).to(torch.float32)
    return (d * q) + m


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    qs = b[:, 16:80]
    d = _f16(b[:, 80:82])
    dmin = _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, -1, 1, 32) >> _CRUMB_SHIFTS.reshape(1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, :32]
    qs = b[:, 32:96]
    scales = b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = (scales[:, :8].reshape(n, 1, 8) >> _NIBBLE_SHIFTS.reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> _CRUMB_SHIFTS.reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).to(torch.float32) - 32.0
    dl = (d * sc).reshape(n, 16, 1)
    ql = ((qs.reshape(n, -1, 1, 32) >> _CRUMB_SHIFTS.reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, -1, 1, 32) >> _BIT_SHIFTS.reshape(1, 1, 8, 1)) & 1).reshape(n, 16, 16)
    q = ql.to(torch.float32) - ((qh ^ 1) << 2).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (get_scale_min_k4)."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]
    qs = b[:, 48:]
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = _nibbles(qs, 32).reshape(n, 8, 32)
    hb = ((qh.reshape(n, 1, 1, 32) >> _BIT_SHIFTS.reshape(1, 1, 8, 1)) & 1).reshape(n, 8, 32)
    q = (ql | (hb << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, :128]
    qh = b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    lo = _nibbles(ql, 64).reshape(n, 8, 32)
    hi = ((qh.reshape(n, -1, 1, 32) >> _CRUMB_SHIFTS.reshape(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.float32) - 32.0
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec("Q4_0", 2, 32, 18, _q4_0),
        Codec("Q4_1", 3, 32, 20, _q4_1),
        Codec("Q5_0", 6, 32, 22, _q5_0),
        Codec("Q5_1", 7, 32, 24, _q5_1),
        Codec("Q8_0", 8, 32, 34, _q8_0),
        Codec("Q2_K", 10, QK_K, 84, _q2_k),
        Codec("Q3_K", 11, QK_K, 110, _q3_k),
        Codec("Q4_K", 12, QK_K, 144, _q4_k),
        Codec("Q5_K", 13, QK_K, 176, _q5_k),
        Codec("Q6_K", 14, QK_K, 210, _q6_k),
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
