"""CPU weights placed in one huge-page-advised mapping (core/hugepages.py)."""

import ctypes
import sys

import pytest
import torch

from twice.core import benchmark
from twice.core.cache import KVCache
from twice.core.config import config_from_dict

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")

# ~4.6 MB of float32 weights: above the 2 MiB below which placing is skipped.
CONFIG = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def _model(monkeypatch, enabled: bool, config=CONFIG):
    monkeypatch.setenv("TWICE_HUGE_PAGES", "1" if enabled else "0")
    return benchmark.random_model(config_from_dict(dict(config)), "cpu", torch.float32, seed=3)


def test_parameters_live_in_one_advised_region_and_compute_the_same(monkeypatch):
    placed, plain = _model(monkeypatch, True), _model(monkeypatch, False)
    region = placed._huge_page_region
    assert not hasattr(plain, "_huge_page_region")
    begin = ctypes.addressof(ctypes.c_char.from_buffer(region))
    pointers = sorted(p.data_ptr() for p in placed.parameters())
    assert all(begin <= ptr and ptr % 4096 == 0 for ptr in pointers)
    assert pointers[0] % (2 << 20) == 0 and pointers[-1] < begin + len(region)
    assert placed.embed_tokens.weight.data_ptr() == placed.lm_head_weight.data_ptr()  # still tied
    for a, b in zip(placed.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    ids = torch.tensor([[5, 17, 300, 4000, 42]])
    with torch.inference_mode():
        out = [m(ids, KVCache(m.config, 1, 16, torch.float32, "cpu")) for m in (placed, plain)]
    assert torch.equal(out[0], out[1])


def test_small_models_stay_where_they_are(monkeypatch):
    m = _model(monkeypatch, True, {**CONFIG, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64})
    assert not hasattr(m, "_huge_page_region")


def test_a_large_kv_cache_is_zeroed_huge_page_memory_and_grows_keeping_its_columns(monkeypatch):
    config = config_from_dict(dict(CONFIG))  # 2 layers × 2 kv heads × 64 dims × 4 B = 2 KiB per token
    monkeypatch.setenv("TWICE_HUGE_PAGES", "1")
    cache = KVCache(config, 2, 1024, torch.float32, "cpu")  # 4 MiB each for K and V
    for t in (cache.k, cache.v):
        assert t.data_ptr() % (2 << 20) == 0 and t.shape == (2, 2, 2, 1024, 64) and not t.any()
    cache.k[:, :, :, :3] = 1.5
    cache.length = 3
    cache.grow(2048)
    assert cache.k.data_ptr() % (2 << 20) == 0 and cache.k.shape[3] == 2048
    assert (cache.k[:, :, :, :3] == 1.5).all() and not cache.k[:, :, :, 3:].any()
    monkeypatch.setenv("TWICE_HUGE_PAGES", "0")
    assert KVCache(config, 2, 1024, torch.float32, "cpu").k.data_ptr() % (2 << 20) != 0
