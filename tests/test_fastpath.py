"""The compiled decode path gives the same tokens as the eager path (and so as transformers)."""

import pytest
import torch

from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.fastpath import CAPACITY_BUCKET, CompiledDecoder
from twice.weights.load import load

FAMILIES = ["llama3", "qwen3", "mistral", "gpt2"]  # tied+llama3 rope, q/k norm, sliding window, learned positions


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_matches_eager(model_dirs, family):
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    ids = list(range(7, 31))  # 24 tokens: mistral's window of 12 is crossed
    settings = GenerationSettings(max_new_tokens=40, ignore_eos=True)
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids)
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    a = list(eager.generate(Request(ids=ids), settings))[-1].result
    b = list(fast.generate(Request(ids=ids), settings))[-1].result
    assert b.token_ids == a.token_ids
    assert b.compile_seconds > 0 and b.cache.capacity % CAPACITY_BUCKET == 0
    # A second turn reuses the cache and the compiled graph (no new compile).
    more = ids + b.token_ids + [9, 10, 11]
    a2 = list(eager.generate(Request(ids=more), settings))[-1].result
    b2 = list(fast.generate(Request(ids=more), settings))[-1].result
    assert b2.token_ids == a2.token_ids and b2.reused_tokens == a2.reused_tokens > 0
    assert b2.compile_seconds == 0


def test_compiled_step_logits_equal_eager_logits(model_dirs):
    m = load(str(model_dirs("qwen2")), device="cpu", dtype="float32")
    step = CompiledDecoder(m.model)
    ids = torch.tensor([list(range(3, 20))])
    a = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu")
    b = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu")
    with torch.inference_mode():
        m.model(ids, a)
        m.model(ids, b)
        tok = torch.tensor([[42]])
        for _ in range(5):
            la, lb = m.model(tok, a), step(tok, b)
            assert (la - lb).abs().max() < 1e-4
            tok = la.argmax(-1, keepdim=True)
    assert a.length == b.length
    assert torch.allclose(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 576), (37, 1536), (3, 95)])
def test_native_gemv_equals_matmul(dtype, shape):
    from twice.core import kernels

    if not kernels.available():
        pytest.skip("no C compiler here: the fast path uses inductor's reduction instead")
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(*shape, generator=g).to(dtype)
    x = torch.randn(1, shape[1], generator=g).to(dtype)
    want = x.float() @ w.float().T
    got = torch.ops.twice.gemv(x, w)
    assert got.dtype == torch.float32 and got.shape == (1, shape[0])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_compiled_decode_without_native_kernel_matches_eager(model_dirs, monkeypatch):
    from twice.core import kernels

    monkeypatch.setitem(kernels._STATE, "lib", None)  # as on a machine with no C compiler
    m = load(str(model_dirs("llama3")), device="cpu", dtype="float32")
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    ids = list(range(5, 20))
    a = list(Engine(m.model, m.tokenizer, m.eos_token_ids).generate(Request(ids=ids), settings))[-1].result
    b = list(Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False).generate(Request(ids=ids), settings))[-1].result
    assert b.token_ids == a.token_ids
