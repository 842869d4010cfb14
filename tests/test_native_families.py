"""The native CPU decode step (kernels/decode.c) runs the newer families as their eager layers do.

For each family that has landed (its tiny model in tiny.py, its module in models.FAMILIES):
the native step's logits against the eager model's, step by step from the same prefilled
cache (float32 within test_native_decode's tolerance, bfloat16 within its rounding), at batch 1
and at batch 3 with left-padded rows, over prompts that cross the sliding window; 32 greedy
tokens through the engine equal to eager, with decode_path "native". A feature decode.c does
not list in IMPLEMENTS keeps the model on the eager step.
"""

import pytest
import torch
from test_native_decode import _step_by_step
from tiny import hf_config

from twice.core import kernels, native_decode
from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.models import FAMILIES as MODEL_TYPES
from twice.core.native_decode import NativeDecoder, supported
from twice.weights.load import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")

# tiny.py name → the model_type its config builds
CANDIDATES = {"olmo2": "olmo2", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "mixtral": "mixtral",
              "qwen3_moe": "qwen3_moe"}


def _landed(name: str) -> bool:
    try:
        hf_config(name)
    except (KeyError, ImportError):
        return False
    return CANDIDATES[name] in MODEL_TYPES


LANDED = [n for n in CANDIDATES if _landed(n)]


def _perturbed(m):
    """Norm weights away from their initial ones (or zeros), so a norm computed the wrong way
    (w vs 1 + w, rounded before or after scaling) shows in the logits."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in m.model.named_parameters():
            if "norm" in name:
                p.copy_((p.float() + 0.4 * torch.randn(p.shape, generator=g)).to(p.dtype))
    return m


@pytest.fixture
def family_model(model_dirs):
    def get(name: str, dtype: str = "float32"):
        return _perturbed(load(str(model_dirs(name)), device="cpu", dtype=dtype))
    return get


def _runs_native(m) -> bool:
    return m.model.features() <= native_decode.IMPLEMENTS


@pytest.mark.parametrize("name", LANDED)
def test_native_logits_equal_eager_float32(family_model, name):
    m = family_model(name)
    if not _runs_native(m):
        pytest.skip(f"decode.c does not implement {sorted(m.model.features() - native_decode.IMPLEMENTS)} yet")
    assert supported(m.model)
    worst, gap, a, b = _step_by_step(m, torch.float32)  # 47 tokens: every tiny window is crossed
    assert worst < 1e-4 and gap == 0
    assert torch.allclose(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length], atol=1e-5)
    assert torch.allclose(a.v[:, :, :, : a.length], b.v[:, :, :, : b.length], atol=1e-5)


@pytest.mark.parametrize("name", LANDED)
def test_native_logits_track_eager_bfloat16(family_model, name):
    m = family_model(name, "bfloat16")
    if not _runs_native(m):
        pytest.skip("not native yet")
    assert supported(m.model)
    worst, gap, _, _ = _step_by_step(m, torch.bfloat16, steps=10)
    assert worst < 0.05 and gap <= worst


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 0.05)])
@pytest.mark.parametrize("name", LANDED)
def test_native_padded_batch_of_three_equals_eager(family_model, name, dtype, tolerance):
    m = family_model(name, dtype)
    if not _runs_native(m):
        pytest.skip("not native yet")
    native = NativeDecoder(m.model)
    t = getattr(torch, dtype)
    caches = []
    for _ in range(2):
        c = KVCache(m.config, 3, 64, t, "cpu")
        c.starts = torch.tensor([9, 0, 4])  # rows 0 and 2: columns of padding on the left
        caches.append(c)
    ids = torch.tensor([[0] * 9 + list(range(5, 20)), list(range(20, 44)), [0] * 4 + list(range(50, 70))])
    with torch.inference_mode():
        for c in caches:
            m.model(ids, c)
        tok = torch.tensor([[7], [9], [11]])
        for _ in range(12):
            la, lb = m.model(tok, caches[0]).float().reshape(3, -1), native(tok, caches[1])
            assert (la - lb).abs().max() < tolerance
            tok = la.argmax(-1, keepdim=True)


@pytest.mark.parametrize("name", LANDED)
def test_engine_greedy_tokens_equal_eager(family_model, name):
    m = family_model(name)
    if not _runs_native(m):
        pytest.skip("not native yet")
    settings = GenerationSettings(max_new_tokens=32, ignore_eos=True)
    ids = list(range(7, 31))
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids)
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids, native=False)
    a = list(eager.generate(Request(ids=ids), settings))[-1].result
    b = list(fast.generate(Request(ids=ids), settings))[-1].result
    assert b.decode_path == "native" and a.decode_path == "eager"
    assert b.token_ids == a.token_ids and len(b.token_ids) == 32


@pytest.mark.parametrize("name", LANDED)
def test_a_feature_decode_c_lacks_keeps_the_family_eager(family_model, name, monkeypatch):
    """Each feature the family declares, taken out of IMPLEMENTS in turn: the model is not
    supported and the engine decodes it eagerly."""
    m = family_model(name)
    features = m.model.features()
    if not features <= native_decode.IMPLEMENTS:  # today: some feature is not implemented yet
        assert not supported(m.model)
        assert Engine(m.model, m.tokenizer, m.eos_token_ids).decode_path == "eager"
        return
    assert supported(m.model)
    for feature in sorted(features):
        monkeypatch.setattr(native_decode, "IMPLEMENTS", native_decode.IMPLEMENTS - {feature})
        assert not supported(m.model), feature
    engine = Engine(m.model, m.tokenizer, m.eos_token_ids)
    assert engine.decode_path == "eager"
    done = list(engine.generate(Request(ids=list(range(7, 15))), GenerationSettings(max_new_tokens=3)))[-1]
    assert done.result.decode_path == "eager"


def test_a_norm_decode_c_does_not_compute_keeps_the_model_eager(model_dirs):
    """The norm kind is measured through the model's own modules: one that computes otherwise
    (here: llama's norm replaced by a scaled one) is refused, in float32 and bfloat16."""
    for dtype in ("float32", "bfloat16"):
        m = load(str(model_dirs("llama")), device="cpu", dtype=dtype)
        assert supported(m.model) and native_decode.norm_kind(m.model) == native_decode.NORM_LLAMA
        norm = m.model.layers[1].post_attention_layernorm
        forward = norm.forward
        norm.forward = lambda x: forward(x) * 1.5
        assert native_decode.norm_kind(m.model) is None and not supported(m.model)
