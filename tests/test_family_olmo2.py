"""The olmo2 family (core/olmo2.py) against transformers' Olmo2ForCausalLM on tiny random weights.

tiny.py's "olmo2" runs the standard checks of test_models.py (tiny.FAMILIES). transformers
initializes every norm weight to one, which would not tell q_norm from k_norm nor a norm from
another; here the norms are random (1 + 0.5·N(0, 1)), in the plain model and in one with
attention biases (q, k, v and o)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tiny
from clirun import one_error_line, run_inprocess
from test_models import hf_model, prompt_ids
from twice.core.cache import KVCache
from twice.core.config import config_from_dict
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.errors import ConfigError
from twice.weights.load import load

torch.set_grad_enabled(False)


def _make(folder: Path, tokenizer, **changes) -> Path:
    from transformers import AutoModelForCausalLM, Olmo2Config

    config = tiny.hf_config("olmo2").to_dict()
    config.update(changes)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(Olmo2Config(**config)).eval()
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.5 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    tiny.save_tokenizer(folder, tokenizer)
    return folder


@pytest.fixture(scope="module")
def olmo2_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("olmo2")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            extra = {"attention_bias": True} if kind == "bias" else {}
            made[kind] = _make(root / kind, tokenizer, **extra)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["norms", "bias"])
def test_logits_match_transformers(olmo2_dirs, kind):
    folder = olmo2_dirs(kind)
    ours = load(str(folder), device="cpu", dtype="float32")
    assert ours.model.features() == ({"block:post_norm", "qk_norm:full", "act:silu"}
                                     | ({"qkv_bias", "o_bias"} if kind == "bias" else set()))
    ids = prompt_ids(40)
    expected = hf_model(folder)(ids).logits
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    with torch.inference_mode():
        got = ours.model(ids[:, :24], cache, all_logits=True)
        assert (got - expected[:, :24]).abs().max() < 1e-4
        for t in range(24, 40):
            step = ours.model(ids[:, t: t + 1], cache)
            assert (step[0] - expected[0, t]).abs().max() < 1e-4, t


@pytest.mark.parametrize("kind", ["norms", "bias"])
def test_greedy_tokens_equal_generate(olmo2_dirs, kind):
    folder = olmo2_dirs(kind)
    ours = load(str(folder), device="cpu", dtype="float32")
    ids = prompt_ids(7, seed=1)
    out = hf_model(folder).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                    min_new_tokens=32, eos_token_id=None, pad_token_id=0)
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids)
    events = list(engine.generate(Request(ids=ids[0].tolist()), GenerationSettings(max_new_tokens=32, ignore_eos=True)))
    assert events[-1].result.token_ids == out[0, 7:].tolist()


def test_cached_decode_equals_naive_recomputation(olmo2_dirs):
    ours = load(str(olmo2_dirs("norms")), device="cpu", dtype="float32")
    ids = prompt_ids(6, seed=5)
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    with torch.inference_mode():
        logits = ours.model(ids, cache)
        seq = ids
        for _ in range(12):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            logits = ours.model(nxt, cache)
            naive = ours.model(seq, KVCache(ours.config, 1, 64, torch.float32, "cpu"))
            assert (logits - naive).abs().max() < 1e-5


def test_bfloat16_matches_transformers_closely(olmo2_dirs):
    """In bf16 the norms scale in float32 before the cast, as Olmo2RMSNorm does: the logits
    stay within bf16's rounding of transformers' bf16 model."""
    from transformers import AutoModelForCausalLM

    folder = olmo2_dirs("norms")
    ours = load(str(folder), device="cpu", dtype="bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = prompt_ids(16, seed=3)
    with torch.inference_mode():
        got = ours.model(ids, KVCache(ours.config, 1, 32, torch.bfloat16, "cpu"), all_logits=True).float()
    want = ref(ids).logits.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("kind", ["norms", "bias"])
def test_parameter_count_is_exact(olmo2_dirs, kind):
    folder = olmo2_dirs(kind)
    ours = load(str(folder), device="cpu", dtype="float32")
    stored = {p.data_ptr(): p.numel() for p in ours.model.parameters()}
    assert ours.config.parameter_count() == sum(stored.values())
    assert ours.config.parameter_count() == sum(p.numel() for p in hf_model(folder).parameters())


def test_tied_head(tmp_path, tokenizer):
    folder = _make(tmp_path / "tied", tokenizer, tie_word_embeddings=True)
    ours = load(str(folder), device="cpu", dtype="float32")
    assert not hasattr(ours.model, "lm_head")
    ids = prompt_ids(12)
    with torch.inference_mode():
        got = ours.model(ids, KVCache(ours.config, 1, 16, torch.float32, "cpu"), all_logits=True)
    assert (got - hf_model(folder)(ids).logits).abs().max() < 1e-4
    assert ours.config.parameter_count() == sum(p.numel() for p in hf_model(folder).parameters())


def test_quantize_q8_0_runs(olmo2_dirs, capsys):
    """--quantize q8_0: every matrix in Q8_0 blocks, logits near the float model's, and the
    CLI generates from it."""
    from twice.core.qweight import weight_formats

    folder = olmo2_dirs("norms")
    floats = load(str(folder), device="cpu", dtype="float32")
    q8 = load(str(folder), weights="q8_0", device="cpu", dtype="float32")
    assert "Q8_0" in weight_formats(q8.model)["types"]
    ids = prompt_ids(20, seed=2)
    with torch.inference_mode():
        a = floats.model(ids, KVCache(floats.config, 1, 32, torch.float32, "cpu"), all_logits=True)
        b = q8.model(ids, KVCache(q8.config, 1, 32, torch.float32, "cpu"), all_logits=True)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    r = run_inprocess(["generate", "hello", "--model", str(folder), "-n", "4", "--temperature", "0",
                       "--quantize", "q8_0", "--json"], capsys)
    assert r.code == 0, r
    assert json.loads(r.out)["generated_tokens"] == 4


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_holds_its_heads_of_the_qk_norms(olmo2_dirs, rank):
    """Each rank's q/k norm weights are its heads' slice of the checkpoint's (the squares are
    all-reduced at run time: tests/test_parallel.py runs two ranks), its projections its heads'
    rows and MLP rows; the post-norms whole."""
    from twice.core.parallel import Shard

    folder = olmo2_dirs("bias")
    whole = load(str(folder), device="cpu", dtype="float32").model
    part = load(str(folder), device="cpu", dtype="float32", shard=Shard(rank=rank, world=2)).model
    assert "tp" in part.features()
    a, b = whole.layers[1], part.layers[1]
    for name in ("q_norm", "k_norm"):
        full = getattr(a.self_attn, name).weight
        half = full.numel() // 2
        assert torch.equal(getattr(b.self_attn, name).weight, full[rank * half:(rank + 1) * half])
    assert torch.equal(b.post_feedforward_layernorm.weight, a.post_feedforward_layernorm.weight)
    q = a.self_attn.q_size // 2
    assert torch.equal(b.self_attn.qkv_proj.weight[:q], a.self_attn.qkv_proj.weight[rank * q:(rank + 1) * q])
    assert torch.equal(b.self_attn.qkv_proj.bias[:q], a.self_attn.qkv_proj.bias[rank * q:(rank + 1) * q])
    assert b.mlp.gate_up_proj.weight.shape[0] * 2 == a.mlp.gate_up_proj.weight.shape[0]


def test_bad_attention_bias_is_one_line(olmo2_dirs, capsys, tmp_path):
    raw = json.loads((olmo2_dirs("norms") / "config.json").read_text())
    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_dict({**raw, "attention_bias": "yes"})
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(olmo2_dirs("norms"), folder)
    tiny.set_json(folder / "config.json", attention_bias=3)
    before = (folder / "config.json").read_bytes()
    r = run_inprocess(["generate", "hi", "--model", str(folder), "-n", "1"], capsys)
    assert r.code == 2 and "attention_bias" in one_error_line(r)
    assert (folder / "config.json").read_bytes() == before
