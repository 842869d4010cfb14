"""Native kernels for quantized weights (core/kernels/qdot*.c): the GGUF blocks read as stored.

Every type: q_dequantize is bit for bit twice.core.quant.dequantize; q_gemm is the float
product of the dequantized weight within the error that quantizing the activations to int8
blocks implies; the SIMD tiles agree with the scalar reference; a row's result is the same
bits whatever the number of rows (and threads) in the call.
"""

import platform
import shutil
import subprocess

import pytest
import torch
from test_quant import _random_blocks
from tiny import cpu_flags

from twice.core import kernels, quant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native kernels")

TYPES = list(quant.CODECS)  # F32 F16 BF16 and the ten block types
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _weights(name: str, out: int, n: int, seed: int) -> torch.Tensor:
    """out rows of n values of type `name` as stored: random valid blocks (every bit pattern
    of the quants, finite fp16 scales), or random floats for F32/F16/BF16."""
    c = quant.codec(name)
    if not c.quantized:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(out, n, generator=g) * 0.1).to(FLOAT_DTYPES[name]).contiguous().view(torch.uint8)
    return torch.from_numpy(_random_blocks(name, out, n // c.block_size, seed))


def _n(name: str, blocks: int = 2) -> int:
    size = quant.codec(name).block_size
    return blocks * (size if size > 1 else 40)  # 80 floats: the 32-wide loop, the 8-wide one and a tail


def _x(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(rows, n, generator=g) * torch.rand(rows, 1, generator=g) * 3
    if rows > 1:
        x[1, : min(n, 32)] = 0.0  # an all-zero activation block (d = 0)
    return x


def _act_error(x: torch.Tensor, block: int) -> torch.Tensor:
    """[rows, n]: the most each activation moves when quantized to int8 in blocks of `block`
    (half a step, the step being the block's max |x| / 127; 0 for float weights)."""
    if block == 1:
        return torch.zeros_like(x, dtype=torch.float64)
    rows, n = x.shape
    step = x.double().abs().reshape(rows, n // block, block).amax(-1, keepdim=True) / 127
    return (step / 2).expand(rows, n // block, block).reshape(rows, n)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_exact(name):
    c = quant.codec(name)
    n = _n(name, 3)
    data = _weights(name, 5, n, seed=TYPES.index(name))
    ours = kernels.dequantize_rows(data, c.ggml_type, n)
    assert ours.shape == (5, n) and ours.dtype == torch.float32
    assert torch.equal(ours, quant.dequantize(data, name))


@pytest.mark.parametrize("name", TYPES)
def test_product_is_the_float_product_within_the_activation_rounding(name):
    """|y - W·x| ≤ Σ|w|·(half a quantization step of x) + float rounding, the bound int8
    activations imply (computed per element from each block's scale)."""
    c = quant.codec(name)
    n = _n(name, 3)
    data = _weights(name, 7, n, seed=20 + TYPES.index(name))
    w = quant.dequantize(data, name).double()
    x = _x(5, n, seed=TYPES.index(name))
    y = kernels.quant_matmul(x, data, c.ggml_type)
    assert y.shape == (5, 7) and y.dtype == torch.float32
    exact = x.double() @ w.T
    bound = _act_error(x, c.block_size) @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()
    if c.quantized:  # and the bound is not loose: the error is of that order
        assert (y.double() - exact).abs().max() > 1e-3 * bound.max()


@pytest.mark.parametrize("name", TYPES)
def test_simd_tiles_agree_with_the_scalar_reference(name):
    c = quant.codec(name)
    lib = kernels.library()
    if not lib.q_gemm_simd(c.ggml_type):
        pytest.skip("this build runs the scalar reference for q_gemm")
    n = _n(name, 4)
    data = _weights(name, 9, n, seed=40 + TYPES.index(name))
    x = _x(6, n, seed=40 + TYPES.index(name))
    fast = kernels.quant_matmul(x, data, c.ggml_type)
    ref = kernels.quant_matmul(x, data, c.ggml_type, reference=True)
    scale = x.abs() @ quant.dequantize(data, name).abs().T
    # the same integers per block; only the float sums are added in another order
    assert ((fast - ref).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("name", TYPES)
def test_a_row_is_the_same_bits_in_any_batch(name):
    """Rows 1..17 (tiles of 4 and every leftover size), 2 threads or 1: each row's output is
    its output alone; out = 9 is not a multiple of anything."""
    c = quant.codec(name)
    n = _n(name, 2)
    data = _weights(name, 9, n, seed=60 + TYPES.index(name))
    x = _x(17, n, seed=60 + TYPES.index(name))
    alone = torch.cat([kernels.quant_matmul(x[r:r + 1], data, c.ggml_type) for r in range(17)])
    threads = torch.get_num_threads()
    try:
        for rows in range(1, 18):
            torch.set_num_threads(1 + rows % 2)
            assert torch.equal(kernels.quant_matmul(x[:rows], data, c.ggml_type), alone[:rows]), rows
        # a row moved to another place in the batch
        assert torch.equal(kernels.quant_matmul(x.flip(0), data, c.ggml_type), alone.flip(0))
    finally:
        torch.set_num_threads(threads)


def test_larger_shapes_and_the_prepared_layout():
    """Shapes like a model's (n of several super-blocks, out not a multiple of the tile):
    the SIMD product against the reference; q_act_bytes rounds to 64 bytes per row."""
    lib = kernels.library()
    for name in ("Q4_K", "Q6_K", "Q4_1", "Q8_0"):
        c = quant.codec(name)
        n = 1536
        data = _weights(name, 67, n, seed=7)
        x = _x(3, n, seed=7)
        fast = kernels.quant_matmul(x, data, c.ggml_type)
        ref = kernels.quant_matmul(x, data, c.ggml_type, reference=True)
        scale = x.abs() @ quant.dequantize(data, name).abs().T
        assert ((fast - ref).abs() <= 1e-5 * scale).all()
        assert lib.q_act_bytes(c.ggml_type, n) % 64 == 0
    assert lib.q_act_bytes(0, 10) == 40  # float weights: the float32 values as they are


def test_unknown_types_and_partial_blocks_are_refused():
    lib = kernels.library()
    for bad in (-1, 4, 5, 9, 15, 16, 29, 31, 99):  # 4/5: the removed Q4_2/Q4_3; 9 Q8_1, 15 Q8_K: activation types
        assert lib.q_row_bytes(bad, 256) == -1 and lib.q_act_bytes(bad, 256) == -1
    assert lib.q_row_bytes(12, 255) == -1 and lib.q_row_bytes(2, 48) == -1 and lib.q_row_bytes(2, 0) == -1
    assert lib.q_row_bytes(12, 512) == 288 and lib.q_row_bytes(2, 64) == 36 and lib.q_row_bytes(30, 3) == 6
    data = _weights("Q4_0", 3, 64, seed=1)
    with pytest.raises(ValueError, match="no native kernel"):
        kernels.quant_matmul(torch.zeros(1, 64), data, 99)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 18\]"):
        kernels.quant_matmul(torch.zeros(1, 32), data, 2)  # rows of 36 bytes are not rows of 32 values
    with pytest.raises(ValueError, match="contiguous"):
        kernels.dequantize_rows(data.t().contiguous().t(), 2, 64)
    assert kernels.quant_matmul(torch.zeros(0, 64), data, 2).shape == (0, 3)


def test_none_where_the_kernels_did_not_build(monkeypatch):
    monkeypatch.setitem(kernels._STATE, "lib", None)
    data = _weights("Q8_0", 2, 32, seed=2)
    assert kernels.quant_matmul(torch.zeros(1, 32), data, 8) is None
    assert kernels.dequantize_rows(data, 8, 32) is None


@pytest.mark.slow
@pytest.mark.parametrize("march,needs", [("x86-64-v2", None), ("x86-64-v3", "avx2")])
def test_builds_for_older_cpus_compute_the_same(march, needs):
    """A CPU without AVX2 runs the scalar reference (x86-64-v2), one with AVX2 but not
    this CPU's other extensions the AVX2 tiles: dequantize is the same bits, products the
    native build's within float rounding, batch invariance holds."""
    if platform.machine() != "x86_64" or (needs and needs not in cpu_flags()):
        pytest.skip(f"needs an x86-64 CPU with {needs}")
    lib = kernels._build(march=march)
    assert lib is not None
    for name in TYPES:
        c = quant.codec(name)
        assert bool(lib.q_gemm_simd(c.ggml_type)) == (march != "x86-64-v2")
        n = _n(name, 3)
        data = _weights(name, 6, n, seed=80 + TYPES.index(name))
        x = _x(6, n, seed=80 + TYPES.index(name))
        assert torch.equal(kernels.dequantize_rows(data, c.ggml_type, n, lib=lib), quant.dequantize(data, name))
        prepared = []
        for build in (lib, kernels.library()):  # the activations quantize to the same bytes
            buf = torch.empty(6 * build.q_act_bytes(c.ggml_type, n), dtype=torch.uint8)
            build.q_prepare(c.ggml_type, x.data_ptr(), n, 6, buf.data_ptr())
            prepared.append(buf)
        assert torch.equal(*prepared), name
        theirs = kernels.quant_matmul(x, data, c.ggml_type, lib=lib)
        ours = kernels.quant_matmul(x, data, c.ggml_type)
        scale = x.abs() @ quant.dequantize(data, name).abs().T
        assert ((theirs - ours).abs() <= 1e-5 * scale + 1e-30).all(), name
        alone = torch.cat([kernels.quant_matmul(x[r:r + 1], data, c.ggml_type, lib=lib) for r in range(6)])
        assert torch.equal(theirs, alone), name


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v4", "sapphirerapids", "alderlake", "znver4", "icelake-server"])
def test_avx512_and_vnni_variants_compile(march, tmp_path):
    """The AVX-512 / VNNI paths cannot run on an AVX2 machine; they must at least compile
    (where this gcc knows the CPU)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 C compiler")
    known = subprocess.run([compiler, f"-march={march}", "-E", "-x", "c", "-", "-o", "/dev/null"],
                           input=b"", capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"this compiler does not know -march={march}")
    sources = [str(kernels.Path(kernels.__file__).with_name(f)) for f in ("qdot.c", "qdot_legacy.c", "qdot_kquants.c")]
    # -O1 and no link: whether the intrinsics compile for the target does not depend on how hard
    # gcc optimizes them (-O3 tripled the test's time)
    result = subprocess.run([compiler, "-O1", f"-march={march}", "-fopenmp", "-fPIC", "-Wall", "-Werror", "-c",
                             *sources], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr



def test_a_prepared_row_serves_its_whole_family():
    """q_prepare gives the same bytes for every 32-value type, and for every K type, so
    matrices of mixed types (Q5_0 q/k and Q8_0 v; Q4_K gate/up and Q6_K down) can share it."""
    lib = kernels.library()
    x = _x(3, 512, seed=3)

    def prepared(name):
        t = quant.codec(name).ggml_type
        buf = torch.empty(3 * lib.q_act_bytes(t, 512), dtype=torch.uint8)
        lib.q_prepare(t, x.data_ptr(), 512, 3, buf.data_ptr())
        return buf

    for kind, family in ((1, ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]), (2, ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])):
        first = prepared(family[0])
        assert all(torch.equal(prepared(name), first) for name in family[1:])
        assert {lib.q_act_family(quant.codec(name).ggml_type) for name in family} == {kind}
    assert [lib.q_act_family(t) for t in (0, 1, 30, 99, 9)] == [0, 0, 0, -1, -1]


def test_results_land_at_their_stride_and_nowhere_else():
    """q_gemm writes y[r·ldy + o] for o < out only: a caller's wider buffer keeps its other
    columns (decode.c writes projections side by side)."""
    lib = kernels.library()
    for name in ("Q4_K", "Q5_0", "F16"):
        c = quant.codec(name)
        n = _n(name, 2)
        data = _weights(name, 5, n, seed=9)
        x = _x(6, n, seed=9)
        xq = torch.empty(6 * lib.q_act_bytes(c.ggml_type, n), dtype=torch.uint8)
        lib.q_prepare(c.ggml_type, x.data_ptr(), n, 6, xq.data_ptr())
        y = torch.full((6, 12), 7.0)
        lib.q_gemm(c.ggml_type, data.data_ptr(), 5, n, xq.data_ptr(), 6, y[:, 3:].data_ptr(), 12, 2)
        assert torch.equal(y[:, 3:8], kernels.quant_matmul(x, data, c.ggml_type))
        assert (y[:, :3] == 7).all() and (y[:, 8:] == 7).all()
