"""Q6_K in the interleaved 8-row layout (core/quant/interleave.py, the x8 tile of
core/kernels/qdot_kquants.c): the same values as the rows as stored through every reader, the
AVX2 tile the scalar x8 reference's bits (with FMA in the build), within float rounding of the
rows as stored, batch invariant, and rows not a multiple of 8 stay as stored."""

import pytest
import torch
from test_quant import _random_blocks
from tiny import cpu_flags

from twice.core import kernels, quant
from twice.core.qweight import BlockWeight, Part
from twice.core.quant import interleave as x8

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native kernels, no interleaving")

Q6_K = quant.codec("Q6_K")
X8_TYPE = Q6_K.ggml_type + x8.X8


def _case(out, blocks, rows, seed):
    data = torch.from_numpy(_random_blocks("Q6_K", out, blocks, seed))
    g = torch.Generator().manual_seed(900 + seed)
    x = torch.randn(rows, blocks * 256, generator=g) * torch.rand(rows, 1, generator=g) * 2
    return data, x


@pytest.mark.parametrize("out,blocks", [(8, 1), (16, 3), (40, 2)])
def test_layout_round_trip_and_dequantize(out, blocks):
    """interleave → deinterleave gives the bytes back; q_interleave (in place) writes the torch
    layout; the torch reference and the native dequantizer (whole, any row range) equal the
    rows as stored bit for bit."""
    data, _ = _case(out, blocks, 1, seed=out + blocks)
    il = x8.interleave(data, "Q6_K")
    assert il.shape == data.shape and not torch.equal(il, data)
    assert torch.equal(x8.deinterleave(il, "Q6_K"), data)
    mine = data.clone()
    assert kernels.interleave_rows(mine, Q6_K.ggml_type, blocks * 256) and torch.equal(mine, il)
    cx = x8.interleaved(Q6_K)
    assert (cx.name, cx.ggml_type, cx.rows_per_group) == ("Q6_K", X8_TYPE, 8) and x8.base(cx) == Q6_K
    ref = quant.dequantize(data, "Q6_K")
    assert torch.equal(x8.dequantize_part(il, cx), ref)
    n = blocks * 256
    assert torch.equal(kernels.dequantize_rows(il, X8_TYPE, n), ref)
    for lo, hi in [(0, 1), (3, 5), (5, 13 if out > 8 else 8), (out - 1, out)]:
        assert torch.equal(kernels.dequantize_rows(il, X8_TYPE, n, start=lo, stop=hi), ref[lo:hi]), (lo, hi)


def test_x8_tile_against_reference_and_rows_as_stored():
    """The SIMD x8 tile gives the scalar x8 reference's bits (the same integers, the same fused
    multiply-adds), and is within 1e-5·Σ|w||x| of the rows as stored (their AVX2 tile sums 8
    lanes a row) and of the float product."""
    data, x = _case(48, 5, 19, seed=20)
    il = x8.interleave(data, "Q6_K")
    got = kernels.quant_matmul(x, il, X8_TYPE)
    ref = kernels.quant_matmul(x, il, X8_TYPE, reference=True)
    if "fma" in cpu_flags():
        assert torch.equal(got, ref)
    stored = kernels.quant_matmul(x, data, Q6_K.ggml_type)
    scale = x.abs() @ quant.dequantize(data, "Q6_K").abs().T
    assert ((got - ref).abs() <= 1e-5 * scale + 1e-30).all()
    assert ((got - stored).abs() <= 1e-5 * scale + 1e-30).all()
    assert ((got - x @ quant.dequantize(data, "Q6_K").T).abs() <= 2e-2 * scale + 1e-6).all()


def test_x8_is_batch_invariant():
    """Every activation row's result is the same bits alone as in any batch of 2..19 rows, on
    1 and 2 threads."""
    data, x = _case(40, 3, 19, seed=40)
    il = x8.interleave(data, "Q6_K")
    alone = torch.cat([kernels.quant_matmul(x[r:r + 1], il, X8_TYPE) for r in range(19)])
    threads = torch.get_num_threads()
    try:
        for rows in range(2, 20):
            torch.set_num_threads(1 + rows % 2)
            assert torch.equal(kernels.quant_matmul(x[:rows], il, X8_TYPE), alone[:rows]), rows
    finally:
        torch.set_num_threads(threads)


def test_rows_not_a_multiple_of_8_stay_as_stored():
    """12 rows are not eligible (a group is whole; Q6_K is not applied at load at all); the kernel refuses them in the x8 layout;
    a BlockWeight of an x8 part and a part as stored multiplies and dequantizes as stored."""
    assert not x8.eligible(Q6_K, 12) and not x8.eligible(Q6_K, 16)  # never at load (interleave.NOT_AT_LOAD)
    data, x = _case(12, 2, 3, seed=3)
    with pytest.raises(ValueError, match="whole groups of 8"):
        kernels.quant_matmul(x, data, X8_TYPE)
    with pytest.raises(ValueError, match="whole groups"):
        x8.interleave(data, "Q6_K")
    d16, _ = _case(16, 2, 1, seed=4)
    stored = BlockWeight([Part(Q6_K, 16, d16), Part(Q6_K, 12, data)], 512)
    mixed = BlockWeight([Part(x8.interleaved(Q6_K), 16, x8.interleave(d16, "Q6_K")), Part(Q6_K, 12, data)], 512)
    assert torch.equal(mixed.dequantize(), stored.dequantize())
    assert torch.equal(mixed.dequantize(start=10, stop=20), stored.dequantize(start=10, stop=20))
    scale = x.abs() @ stored.dequantize().abs().T
    assert ((mixed.matmul(x) - stored.matmul(x)).abs() <= 1e-5 * scale + 1e-30).all()
