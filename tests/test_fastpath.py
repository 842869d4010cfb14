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
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True)
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
