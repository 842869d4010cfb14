"""The native CPU decode step (kernels/decode.c) computes what the eager layers compute."""

import pytest
import torch
from tiny import cpu_flags

from twice.core import kernels
from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.native_decode import NativeDecoder, supported
from twice.weights.load import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")

# MHA + llama3 rope + tied head; GQA; sliding window; q/k/v bias; q/k norm with explicit head_dim
FAMILIES = ["llama3", "llama", "mistral", "qwen2", "qwen3", "llama-hd64", "qwen3-hd128"]


def _step_by_step(m, dtype, steps=30, capacity=64):
    """Logits of eager and native decode from the same prefilled cache, token by token."""
    native = NativeDecoder(m.model)
    a = KVCache(m.config, 1, capacity, dtype, "cpu")
    b = KVCache(m.config, 1, capacity, dtype, "cpu")
    ids = torch.tensor([list(range(3, 20))])
    worst, gap = 0.0, 0.0
    with torch.inference_mode():
        m.model(ids, a)
        m.model(ids, b)
        tok = torch.tensor([[42]])
        for _ in range(steps):
            la, lb = m.model(tok, a).float(), native(tok, b)
            worst = max(worst, (la - lb).abs().max().item())
            # How much worse, by eager's logits, native's greedy choice is (0 = the same token).
            gap = max(gap, (la.max() - la[0, lb.argmax()]).item())
            tok = la.argmax(-1, keepdim=True)
    assert a.length == b.length == 17 + steps
    return worst, gap, a, b


@pytest.mark.parametrize("family", FAMILIES)
def test_native_logits_equal_eager_float32(model_dirs, family):
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    assert supported(m.model)
    worst, gap, a, b = _step_by_step(m, torch.float32)  # 47 tokens: mistral's window of 12 is crossed
    assert worst < 1e-4 and gap == 0
    assert torch.allclose(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length], atol=1e-5)
    assert torch.allclose(a.v[:, :, :, : a.length], b.v[:, :, :, : b.length], atol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "llama-hd64", "qwen3-hd128"])
def test_native_logits_track_eager_bfloat16(model_dirs, family):
    m = load(str(model_dirs(family)), device="cpu", dtype="bfloat16")
    worst, gap, _, _ = _step_by_step(m, torch.bfloat16, steps=10)
    # Both round to bf16 at the same points; only summation order differs, so greedy
    # choices differ at most between near-tied tokens (random tiny models have many).
    assert worst < 0.05 and gap <= worst


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_engine_native_decode_matches_eager_engine(model_dirs, family, monkeypatch):
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    settings = GenerationSettings(max_new_tokens=40, ignore_eos=True)
    ids = list(range(7, 31))
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids)
    assert isinstance(fast.fast, NativeDecoder)  # the default on the CPU
    monkeypatch.setitem(kernels._STATE, "lib", None)
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids)
    assert eager.fast is None
    a = list(eager.generate(Request(ids=ids), settings))[-1].result
    b = list(fast.generate(Request(ids=ids), settings))[-1].result
    assert b.token_ids == a.token_ids
    more = ids + b.token_ids + [9, 10, 11]  # a second turn reuses the cache
    a2 = list(eager.generate(Request(ids=more), settings))[-1].result
    b2 = list(fast.generate(Request(ids=more), settings))[-1].result
    assert b2.token_ids == a2.token_ids and b2.reused_tokens == a2.reused_tokens > 0


def test_gpt2_and_float16_stay_in_pytorch(model_dirs):
    assert not supported(load(str(model_dirs("gpt2")), device="cpu", dtype="float32").model)
    assert not supported(load(str(model_dirs("llama")), device="cpu", dtype="float16").model)
    m = load(str(model_dirs("llama")), device="cpu", dtype="float32")
    w = m.model.layers[0].mlp.down_proj.weight
    w.data = w.data.t().contiguous().t()  # same values, strided: the C code could not read it
    assert not supported(m.model)
    assert Engine(m.model, m.tokenizer, m.eos_token_ids).fast is None


@pytest.mark.parametrize("family", ["mistral", "qwen3", "llama", "llama-hd64"])
def test_native_batch_equals_eager_batch(model_dirs, family):
    """Left-padded rows of different lengths, rows finishing at different steps."""
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    prompts = [list(range(3, 8)), list(range(10, 33)), list(range(40, 51))]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (20, 12, 16)]

    def run(native: bool) -> dict:
        engine = Engine(m.model, m.tokenizer, m.eos_token_ids, native=native)
        return {e.row: e.result for e in engine.generate_batch([Request(ids=p) for p in prompts], settings)
                if type(e).__name__ == "Done"}

    fast, eager = run(True), run(False)
    assert [fast[i].token_ids for i in range(3)] == [eager[i].token_ids for i in range(3)]
    assert {fast[i].decode_path for i in range(3)} == {"native"}
    assert {eager[i].decode_path for i in range(3)} == {"eager"}


def test_native_step_logits_for_a_padded_batch(model_dirs):
    m = load(str(model_dirs("qwen2")), device="cpu", dtype="float32")
    native = NativeDecoder(m.model)
    caches = []
    for _ in range(2):
        c = KVCache(m.config, 2, 64, torch.float32, "cpu")
        c.starts = torch.tensor([4, 0])  # row 0: 4 columns of padding
        caches.append(c)
    ids = torch.tensor([[0, 0, 0, 0] + list(range(5, 15)), list(range(20, 34))])
    with torch.inference_mode():
        for c in caches:
            m.model(ids, c)
        tok = torch.tensor([[7], [9]])
        for _ in range(6):
            la, lb = m.model(tok, caches[0]).float(), native(tok, caches[1])
            assert (la - lb).abs().max() < 1e-4
            tok = la.argmax(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out,n", [(1, 7, 33), (2, 12, 64), (4, 8, 64), (5, 13, 64), (6, 8, 64), (7, 20, 128),
                                        (9, 64, 576), (16, 6, 96), (3, 4, 32), (2, 4, 16), (2, 8, 0)])
def test_native_gemm_equals_matmul(dtype, rows, out, n):
    """The batched kernel's register tiles and its edges (rows, outputs or width not a
    multiple of the tile)."""
    import ctypes

    lib = kernels.library()
    g = torch.Generator().manual_seed(rows * 100 + out + n)
    w = torch.randn(out, n, generator=g).to(dtype)
    x = torch.randn(rows, n, generator=g).to(dtype)
    y = torch.empty(rows, out)
    lib.gemm(w.data_ptr(), x.data_ptr(), y.data_ptr(), out, n, rows, int(dtype == torch.bfloat16), ctypes.c_int(2))
    assert torch.allclose(y, x.float() @ w.float().T, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_kernels_never_load_from_a_folder_others_can_write(tmp_path, monkeypatch):
    """A shared, group/world-writable cache: the library is built in a private temporary
    folder instead, and still works; the planted file is never loaded."""
    import os

    # The compiler: a copy of the library this session built (the test is about where a build
    # goes and what is loaded from there; compiling twice more would cost it ~30 s).
    session_lib = kernels._build()._name
    fake_cc = tmp_path / "cc"
    fake_cc.write_text(f'#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\ncp "{session_lib}" "$2"\n')
    fake_cc.chmod(0o755)
    monkeypatch.setenv("CC", str(fake_cc))
    monkeypatch.delenv("TWICE_KERNELS_CACHE")  # this test is about the kernels' folder in TWICE_CACHE
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    os.chmod(shared / "kernels", 0o777)
    monkeypatch.setenv("TWICE_CACHE", str(shared))
    built = kernels._build()
    assert built is not None and not built._name.startswith(str(shared))
    assert built.decode_step  # loaded and usable though its temporary file is gone
    assert list((shared / "kernels").iterdir()) == []
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "mine"))
    own = kernels._build()
    assert own is not None and own._name.startswith(str(tmp_path / "mine" / "kernels"))
    assert kernels._private(tmp_path / "mine" / "kernels") and kernels._private(__import__("pathlib").Path(own._name))


def test_a_token_outside_the_vocabulary_is_refused_before_anything_is_written(model_dirs):
    m = load(str(model_dirs("llama")), device="cpu", dtype="float32")
    native = NativeDecoder(m.model)
    cache = KVCache(m.config, 2, 32, torch.float32, "cpu")
    with torch.inference_mode():
        m.model(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache)
        before = cache.k.clone()
        for bad in (m.config.vocab_size, -1):
            with pytest.raises(ValueError, match="outside the vocabulary"):
                native(torch.tensor([[3], [bad]]), cache)
            assert cache.length == 3 and torch.equal(cache.k, before)


@pytest.mark.parametrize("march,needs", [("x86-64-v3", "avx2"), ("skylake-avx512", "avx512f")])
@pytest.mark.slow
def test_builds_for_older_cpus_compute_the_same(model_dirs, march, needs):
    """The paths a CPU without AVX-512 BF16 (or without AVX-512) runs: a library built for
    that instruction set, on this machine, against eager — batched, both dtypes."""
    import platform

    if platform.machine() != "x86_64" or needs not in cpu_flags():
        pytest.skip(f"needs an x86-64 CPU with {needs}")
    lib = kernels._build(march=march)
    assert lib is not None
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        m = load(str(model_dirs("llama-hd64")), device="cpu", dtype=str(dtype).removeprefix("torch."))
        native = NativeDecoder(m.model)
        native.lib = lib
        rows = 5
        a, b = (KVCache(m.config, rows, 64, dtype, "cpu") for _ in range(2))
        ids = torch.tensor([list(range(3, 22))] * rows)
        with torch.inference_mode():
            m.model(ids, a)
            m.model(ids, b)
            tok = torch.arange(40, 40 + rows).reshape(rows, 1)
            for _ in range(20):
                la, lb = m.model(tok, a).float().reshape(rows, -1), native(tok, b)
                assert (la - lb).abs().max() < tolerance
                tok = la.argmax(-1, keepdim=True)


def _argmax_cases():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(16, 49152, generator=g)
    for rows, n in ((1, 1), (3, 7), (2, 16), (2, 33), (5, 1000)):
        yield torch.randn(rows, n, generator=g)
    yield torch.randint(0, 3, (8, 1000), generator=g).float()  # many ties: the first index wins
    x = torch.zeros(4, 100)
    x[0, 17] = x[0, 83] = 5  # a tie across vector lanes
    x[1, 50] = x[1, 70] = float("nan")  # the first NaN wins, as in torch
    x[2] = float("-inf")
    x[2, 99] = float("-inf")
    x[3, 98] = float("inf")
    x[3, 3] = float("nan")
    yield x


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_argmax_picks_what_torch_picks(march):
    import platform

    if march != "native" and (platform.machine() != "x86_64" or "avx2" not in cpu_flags()):
        pytest.skip("needs an x86-64 CPU with avx2")
    lib = kernels.library() if march == "native" else kernels._build(march=march)
    for x in _argmax_cases():
        out = torch.empty(x.shape[0], dtype=torch.int64)
        lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        assert torch.equal(out, x.argmax(-1)), x.shape
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    assert kernels.argmax(x.t()) is None and kernels.argmax(x.double()) is None  # torch decides those
