"""The quantized kernels' tiles on longer rows (core/kernels/qdot*.c): rows of many blocks, so
the AVX2 tiles' software prefetch (QD_PREFETCH bytes ahead, qdot.h) reaches into the next
weight rows and past the matrix's end; every tile size and leftover (1..qd_tile_rows and more
rows than two tiles), odd output counts, 1 and 2 threads. A row's result is the same bits in
any call, and the scalar reference's within float rounding.
"""

import pytest
import torch
from test_quant import _random_blocks

from twice.core import kernels, quant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native kernels")

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _case(name: str, out: int, blocks: int, rows: int, seed: int):
    c = quant.codec(name)
    n = blocks * c.block_size
    data = torch.from_numpy(_random_blocks(name, out, blocks, seed))
    g = torch.Generator().manual_seed(500 + seed)
    x = torch.randn(rows, n, generator=g) * torch.rand(rows, 1, generator=g) * 2
    return c, data, x


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_long_rows_are_the_same_bits_in_any_tile(name):
    """out 13 (odd), rows of 2.5–7 KB (96 blocks or 12 super-blocks: the prefetch runs ahead
    into the next rows), 1..19 activation rows per call: each row as computed alone."""
    blocks = 96 if quant.codec(name).block_size == 32 else 12
    c, data, x = _case(name, 13, blocks, 19, seed=BLOCK_TYPES.index(name))
    alone = torch.cat([kernels.quant_matmul(x[r:r + 1], data, c.ggml_type) for r in range(19)])
    threads = torch.get_num_threads()
    try:
        for rows in (2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 19):
            torch.set_num_threads(1 + rows % 2)
            assert torch.equal(kernels.quant_matmul(x[:rows], data, c.ggml_type), alone[:rows]), rows
    finally:
        torch.set_num_threads(threads)
    ref = kernels.quant_matmul(x, data, c.ggml_type, reference=True)
    scale = x.abs() @ quant.dequantize(data, name).abs().T
    assert ((alone - ref).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_a_matrix_that_is_part_of_a_larger_buffer(name):
    """The weights as rows 3..9 of a bigger tensor (what lies beyond is prefetched, never
    used): the same bits as a copy of those rows on their own, with every last row of the
    matrix (one output row at a time) too."""
    c, data, x = _case(name, 12, 16 if c_is_legacy(name) else 4, 6, seed=40)
    part = data[3:10]
    own = part.clone()
    y = kernels.quant_matmul(x, part, c.ggml_type)
    assert torch.equal(y, kernels.quant_matmul(x, own, c.ggml_type))
    for o in range(7):
        assert torch.equal(kernels.quant_matmul(x, part[o:o + 1], c.ggml_type), y[:, o:o + 1]), o


def c_is_legacy(name: str) -> bool:
    return quant.codec(name).block_size == 32
