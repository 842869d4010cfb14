"""The interleaved 8-row layout ("x8") of the 32-value block types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0)
and of Q4_K and Q6_K (their 256-value super-blocks as blocks; qdot_kquants.c).

A layout, not a type: the same bytes as the rows as stored (memory unchanged), rearranged so
that the native kernels (core/kernels/qdot_legacy.c) get one int32 lane per weight row out of
each integer dot product, and one float conversion and one fused multiply-add serve 8 weight
rows (llama.cpp's repacked block_q4_0x8 does the same). A part of R rows (R % 8 == 0) is
groups of 8 consecutive rows; a group holds 8 × row_bytes bytes, block by block: for block b
(8 × type_size bytes at b·8·type_size within the group)

    d[8] (fp16 each: rows 0..7) | m[8] (Q4_1, Q5_1) | qh[8] (Q5_0, Q5_1: uint32 each) | quants

where the quants are interleaved in runs of 4 bytes: run c (32 bytes) holds bytes 4c..4c+3 of
row 0, then of row 1, ..., row 7 (Q4: 4 runs of the 16 nibble bytes, so `& 0x0f` gives values
4c..4c+3 of every row and `>> 4` values 16+4c..; Q8_0: 8 runs of the 32 int8 quants).

The codec of an interleaved part is its type's codec with `ggml_type` + X8 and
`rows_per_group` 8 (`interleaved`), so every path that hands a part's type id to the C
kernels hands the layout with it; its `name` stays the type's ("Q4_1"). The torch reference
of the layout is `deinterleave` (back to the rows as stored) followed by the type's
dequantizer (`dequantize_part`): the tests and every non-native path use it.
"""

from __future__ import annotations

from functools import lru_cache

import torch

X8 = 256  # added to a type's ggml id for its interleaved layout (never in a file: in memory only)
GROUP = 8
# Per type: (type_size, the fields before the quants as (offset, bytes per row)), quants' offset
# (or their byte range (start, end) in a block where they do not run to its end)
_FIELDS = {
    "Q4_0": (18, ((0, 2),), 2),
    "Q4_1": (20, ((0, 2), (2, 2)), 4),
    "Q5_0": (22, ((0, 2), (2, 4)), 6),
    "Q5_1": (24, ((0, 2), (2, 2), (4, 4)), 8),
    "Q8_0": (34, ((0, 2),), 2),
    # Q4_K (per 256-value super-block): d[8] | dmin[8] | the 12 packed scale bytes byte-major
    # (byte j of rows 0..7, j = 0..11) | 32 runs of 4 quant bytes (qdot_kquants.c's x8 tile)
    "Q4_K": (144, ((0, 2), (2, 2)) + tuple((4 + j, 1) for j in range(12)), 16),
    # Q6_K: d[8] (stored last) | the 16 int8 scales byte-major | 48 runs of 4 quant bytes (ql
    # then qh: bytes 0..191 of the super-block, its quants' range)
    "Q6_K": (210, ((208, 2),) + tuple((192 + j, 1) for j in range(16)), (0, 192)),
}
TYPES = frozenset(_FIELDS)


def eligible(codec, rows: int) -> bool:
    """Whether a part of `rows` rows of `codec` can be interleaved (a type with an x8 layout,
    as stored, whole groups of 8 rows)."""
    return codec.name in _FIELDS and getattr(codec, "rows_per_group", 1) == 1 and rows > 0 and rows % GROUP == 0


def interleaved(codec):
    """The codec of `codec`'s type in the x8 layout."""
    if codec.name not in _FIELDS:
        raise ValueError(f"{codec.name} has no interleaved layout")
    if codec.rows_per_group == GROUP:
        return codec
    return codec._replace(ggml_type=codec.ggml_type + X8, rows_per_group=GROUP)


def base(codec):
    """The codec of the rows as stored (`codec` itself unless it is interleaved)."""
    if getattr(codec, "rows_per_group", 1) == 1:
        return codec
    return codec._replace(ggml_type=codec.ggml_type - X8, rows_per_group=1)


def _quants(name: str) -> tuple[int, int]:
    size, _, q = _FIELDS[name]
    return (q, size) if isinstance(q, int) else q


def _split(data: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    size = _FIELDS[name][0]
    rows, row_bytes = data.shape
    if rows % GROUP or row_bytes % size:
        raise ValueError(f"{name} x8 needs whole groups of {GROUP} rows of whole blocks, got {tuple(data.shape)}")
    return data.reshape(rows // GROUP, GROUP, row_bytes // size, size), size


def interleave(data: torch.Tensor, name: str) -> torch.Tensor:
    """Rows as stored [R, row_bytes] (R % 8 == 0) → the same bytes in the x8 layout, [R, row_bytes]."""
    blocks, size = _split(data, name)  # [G, 8 rows, nb, size]
    fields, (qoff, qend) = _FIELDS[name][1], _quants(name)
    g, _, nb, _ = blocks.shape
    blocks = blocks.permute(0, 2, 1, 3)  # [G, nb, 8, size]
    pieces = [blocks[..., o:o + w].reshape(g, nb, GROUP * w) for o, w in fields]
    q = blocks[..., qoff:qend]  # [G, nb, 8, Q]
    runs = q.shape[-1] // 4
    pieces.append(q.reshape(g, nb, GROUP, runs, 4).permute(0, 1, 3, 2, 4).reshape(g, nb, GROUP * 4 * runs))
    return torch.cat(pieces, dim=-1).reshape(data.shape).contiguous()


def deinterleave(data: torch.Tensor, name: str) -> torch.Tensor:
    """x8 bytes [R, row_bytes] → the rows as stored (interleave's inverse)."""
    size, fields, _ = _FIELDS[name]
    qoff, qend = _quants(name)
    rows, row_bytes = data.shape
    if rows % GROUP or row_bytes % size:
        raise ValueError(f"{name} x8 needs whole groups of {GROUP} rows of whole blocks, got {tuple(data.shape)}")
    g, nb = rows // GROUP, row_bytes // size
    flat = data.reshape(g, nb, GROUP * size)
    out = torch.empty(g, nb, GROUP, size, dtype=data.dtype, device=data.device)
    at = 0
    for o, w in fields:
        out[..., o:o + w] = flat[..., at:at + GROUP * w].reshape(g, nb, GROUP, w)
        at += GROUP * w
    runs = (qend - qoff) // 4
    out[..., qoff:qend] = flat[..., at:].reshape(g, nb, runs, GROUP, 4).permute(0, 1, 3, 2, 4).reshape(g, nb, GROUP,
                                                                                                  4 * runs)
    return out.permute(0, 2, 1, 3).reshape(rows, row_bytes)


@lru_cache(maxsize=None)
def _unit_positions(name: str):
    """[8, type_size] int64 (numpy): where byte k of row r's block lies among the 8 blocks'
    bytes of one x8 unit (deinterleave applied to the positions themselves)."""
    size = _FIELDS[name][0]
    return deinterleave(torch.arange(GROUP * size).reshape(GROUP, size), name).numpy()


def stored_positions(name: str, row_bytes: int, offsets):
    """The x8 byte offsets (numpy int64) of a part's bytes at `offsets` (numpy int64) of its
    rows as stored: reading a few stored bytes without deinterleaving their group."""
    size = _FIELDS[name][0]
    row, col = offsets // row_bytes, offsets % row_bytes
    block, k = col // size, col % size
    return (row - row % GROUP) * row_bytes + block * (GROUP * size) + _unit_positions(name)[row % GROUP, k]


def dequantize_part(data: torch.Tensor, codec) -> torch.Tensor:
    """Rows of blocks [R, row_bytes] in `codec`'s layout → float32 [R, n] (the torch reference)."""
    from . import dequantize

    if getattr(codec, "rows_per_group", 1) != 1:
        data = deinterleave(data, codec.name)
    return dequantize(data, codec.name)
