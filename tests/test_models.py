"""Our models against transformers on the same tiny random weights (fp32, CPU)."""

import json

import pytest
import torch

import tiny
from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.load import load

torch.set_grad_enabled(False)


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompt_ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, tiny.VOCAB, (1, n), generator=g)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_prefill_and_decode_logits_match(model_dirs, family):
    folder = model_dirs(family)
    ours = load(str(folder), device="cpu", dtype="float32")
    ref = hf_model(folder)
    ids = prompt_ids(40)
    expected = ref(ids).logits
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    with torch.inference_mode():
        got = ours.model(ids[:, :24], cache, all_logits=True)
        assert (got - expected[:, :24]).abs().max() < 1e-4
        for t in range(24, 40):  # one token per step against the cache (crosses mistral's window)
            step = ours.model(ids[:, t : t + 1], cache)
            assert (step[0] - expected[0, t]).abs().max() < 1e-4, t


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_greedy_tokens_equal_transformers_generate(model_dirs, family):
    folder = model_dirs(family)
    ours = load(str(folder), device="cpu", dtype="float32")
    ref = hf_model(folder)
    ids = prompt_ids(7, seed=1)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                       min_new_tokens=32, eos_token_id=None, pad_token_id=0)
    expected = out[0, 7:].tolist()
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids)
    events = list(engine.generate(Request(ids=ids[0].tolist()), GenerationSettings(max_new_tokens=32, ignore_eos=True)))
    result = events[-1].result
    assert result.token_ids == expected
    assert result.finish_reason == "length"


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_batch_equals_each_prompt_alone(model_dirs, family):
    folder = model_dirs(family)
    ours = load(str(folder), device="cpu", dtype="float32")
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids)
    prompts = [prompt_ids(5, seed=2)[0].tolist(), prompt_ids(19, seed=3)[0].tolist(), prompt_ids(11, seed=4)[0].tolist()]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (20, 12, 16)]
    alone = []
    for p, s in zip(prompts, settings):
        alone.append(list(engine.generate(Request(ids=p), s, reuse_cache=False))[-1].result.token_ids)
    batched = {e.row: e.result.token_ids for e in engine.generate_batch([Request(ids=p) for p in prompts], settings)
               if type(e).__name__ == "Done"}
    assert [batched[i] for i in range(3)] == alone


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_cached_decode_equals_naive_recomputation(model_dirs, family):
    ours = load(str(model_dirs(family)), device="cpu", dtype="float32")
    ids = prompt_ids(6, seed=5)
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    with torch.inference_mode():
        logits = ours.model(ids, cache)
        seq = ids
        for _ in range(20):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            logits = ours.model(nxt, cache)
            fresh = KVCache(ours.config, 1, 64, torch.float32, "cpu")
            naive = ours.model(seq, fresh)  # the whole sequence again, no reuse
            assert (logits - naive).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hub_form_config_loads_the_same(model_dirs, family, tmp_path):
    import shutil

    src = model_dirs(family)
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    tiny.to_hub_form(hub)
    cfg = json.loads((hub / "config.json").read_text())
    assert "rope_parameters" not in cfg and "rope_theta" in cfg
    a = load(str(src), device="cpu").model
    b = load(str(hub), device="cpu").model
    ids = prompt_ids(9)
    with torch.inference_mode():
        la = a(ids, KVCache(a.config, 1, 16, torch.float32, "cpu"), all_logits=True)
        lb = b(ids, KVCache(b.config, 1, 16, torch.float32, "cpu"), all_logits=True)
    assert torch.equal(la, lb)


def test_hub_form_llama3_scaling_matches_transformers(model_dirs, tmp_path):
    import shutil

    hub = tmp_path / "hub"
    shutil.copytree(model_dirs("llama3"), hub)
    tiny.to_hub_form(hub)
    cfg = json.loads((hub / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    ours = load(str(hub), device="cpu").model
    ref = hf_model(hub)  # transformers reads the Hub form too
    ids = prompt_ids(100, seed=9)  # beyond original_max_position_embeddings=64
    with torch.inference_mode():
        got = ours(ids, KVCache(ours.config, 1, 128, torch.float32, "cpu"), all_logits=True)
    assert (got - ref(ids).logits).abs().max() < 1e-4
