"""Gemma 2 and Gemma 3 (core/gemma.py) against transformers on tiny random models (tiny.gemma_config):
sandwich norms with (1 + w), embeddings scaled by sqrt(hidden), soft-caps that bite, sliding and
global layers crossed by the prompts, gemma3's local RoPE table and q/k norms, the image-text
checkpoint's text part, both Hub config forms, tensor parallelism, --quantize, bad configs."""

import json
import shutil
import threading

import pytest
import torch

import test_models as standard
import tiny
from clirun import one_error_line, run_inprocess
from twice.core import attention
from twice.core.cache import KVCache
from twice.core.config import config_from_dict
from twice.core.errors import ConfigError, TwiceError, UnsupportedModelError
from twice.core.parallel import Shard
from twice.weights.load import load

torch.set_grad_enabled(False)

FAMILIES = ["gemma2", "gemma3", "gemma3-mm"]


def _logits(model, ids, capacity=64):
    cache = KVCache(model.config, ids.shape[0], capacity, torch.float32, "cpu")
    return model(ids, cache, all_logits=True)


# -- the standard checks (tests/test_models.py) for the image-text form; gemma2/gemma3 run
#    there through tiny.FAMILIES -------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gemma2", "gemma3"])  # test_models runs it for llama, mistral, gpt2 only
def test_cached_decode_equals_naive_recomputation(model_dirs, family):
    standard.test_cached_decode_equals_naive_recomputation(model_dirs, family)


def test_image_text_checkpoint_logits_and_greedy(model_dirs):
    standard.test_prefill_and_decode_logits_match(model_dirs, "gemma3-mm")
    standard.test_greedy_tokens_equal_transformers_generate(model_dirs, "gemma3-mm")
    standard.test_batch_equals_each_prompt_alone(model_dirs, "gemma3-mm")


def test_declared_features(model_dirs):
    got = {f: load(str(model_dirs(f)), device="cpu", dtype="float32").model.features() for f in FAMILIES}
    common = {"block:sandwich", "act:gelu_pytorch_tanh", "norm:offset1", "embed_scale", "window"}
    assert got["gemma2"] == common | {"attn_softcap", "final_softcap"}
    assert got["gemma3"] == common | {"qk_norm", "rope:local", "final_softcap"}
    assert got["gemma3-mm"] == common | {"qk_norm", "rope:local"}  # transformers caps nothing there


def test_parameter_count_is_transformers(model_dirs):
    for family in FAMILIES:
        folder = model_dirs(family)
        ours = load(str(folder), device="cpu", dtype="float32")
        ref = standard.hf_model(folder)
        params = {n: p for n, p in ref.named_parameters() if "vision_tower" not in n and "multi_modal" not in n}
        assert ours.config.parameter_count() == sum(p.numel() for p in params.values()), family


def test_layers_and_windows_are_transformers(model_dirs):
    for family in FAMILIES:
        folder = model_dirs(family)
        ours = load(str(folder), device="cpu", dtype="float32").config
        ref = standard.hf_model(folder).config.get_text_config()
        assert list(ours.layer_types) == list(ref.layer_types)
        assert ours.sliding_window == ref.sliding_window == 8
        assert "sliding_attention" in ours.layer_types and "full_attention" in ours.layer_types


def test_the_caps_bite(model_dirs, monkeypatch):
    """Without its caps the tiny gemma2 gives other logits: the tests above exercise them."""
    ours = load(str(model_dirs("gemma2")), device="cpu", dtype="float32").model
    ids = standard.prompt_ids(30)
    capped = _logits(ours, ids)
    assert capped.abs().max() <= 3.0
    monkeypatch.setattr(type(ours), "finish_logits", lambda self, x: x)
    raw = _logits(ours, ids)
    assert raw.abs().max() > 6.0  # far beyond the final cap of 3
    for block in ours.layers:
        block.self_attn.softcap = None
    uncapped = _logits(ours, ids)
    assert (uncapped - raw).abs().max() > 0.1  # the attention cap of 5 changed the scores


def test_softcap_attention_matches_explicit_reference():
    """attend(softcap=) for every mask kind, GQA, against the scores written out."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g) * 3
    k, v = torch.randn(2, 2, 9, 8, generator=g) * 3, torch.randn(2, 2, 9, 8, generator=g)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.tanh(q @ kk.transpose(2, 3) * 0.3 / 2.0) * 2.0
    causal = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)
    expected = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ vv
    got = attention.attend(q, k, v, attention.CausalAfter(4, causal[None, None].expand(2, 1, 5, 9)), 0.3, 2.0)
    assert (got - expected.transpose(1, 2).reshape(2, 5, 32)).abs().max() < 1e-5
    full = attention.attend(q, k, v, None, 0.3, 2.0)
    assert (full - (torch.softmax(scores, -1) @ vv).transpose(1, 2).reshape(2, 5, 32)).abs().max() < 1e-5
    square = attention.attend(q, k[:, :, :5], v[:, :, :5], attention.CAUSAL, 0.3, 2.0)
    s5 = scores[..., :5].masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert (square - (torch.softmax(s5, -1) @ vv[:, :, :5]).transpose(1, 2).reshape(2, 5, 32)).abs().max() < 1e-5


def test_bfloat16_follows_transformers(model_dirs):
    """bf16: the embedding multiplier is rounded to bf16 as transformers' normalizer is; the
    logits stay close to transformers' own bf16 run."""
    folder = model_dirs("gemma3")
    ours = load(str(folder), device="cpu", dtype="bfloat16").model
    assert ours.embed_scale.dtype == torch.bfloat16
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = standard.prompt_ids(20)
    cache = KVCache(ours.config, 1, 32, torch.bfloat16, "cpu")
    got = ours(ids, cache, all_logits=True).float()
    expected = ref(ids).logits.float()
    assert (got - expected).abs().max() < 0.1


# -- config forms ---------------------------------------------------------------------------------------

def _to_hub_form(folder):
    """gemma3's config as the Hub carries it: rope_theta, rope_scaling and rope_local_base_freq
    (no per-layer-type rope_parameters, no layer_types: sliding_window_pattern says it)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    rope = text.pop("rope_parameters")
    full, local = rope["full_attention"], rope["sliding_attention"]
    text["rope_theta"] = full.pop("rope_theta")
    text["rope_local_base_freq"] = local["rope_theta"]
    kind = full.pop("rope_type")
    text["rope_scaling"] = {"rope_type": kind, **full}
    text.pop("layer_types")
    path.write_text(json.dumps(cfg, indent=1))
    return cfg


@pytest.mark.parametrize("family", ["gemma3", "gemma3-mm"])
def test_hub_form_config_is_the_same_model(model_dirs, tmp_path, family):
    src = model_dirs(family)
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    cfg = _to_hub_form(hub)
    assert "rope_parameters" not in json.dumps(cfg)
    a, b = load(str(src), device="cpu").model, load(str(hub), device="cpu").model
    assert a.config.rope_parameters == b.config.rope_parameters == {"rope_type": "linear", "factor": 4.0,
                                                                    "rope_theta": 1e6}
    assert a.options == b.options and a.config.layer_types == b.config.layer_types
    ids = standard.prompt_ids(30)
    la = _logits(a, ids)
    assert torch.equal(la, _logits(b, ids))
    assert (la - standard.hf_model(hub)(ids).logits).abs().max() < 1e-4  # transformers reads it alike


def test_gemma3_defaults_fill_a_sparse_text_config():
    """A gemma3 config.json as the Hub's gemma-3-4b carries it: text_config names only what
    differs from Gemma3TextConfig's defaults; the top level says eos and ties the head."""
    from transformers import Gemma3TextConfig

    raw = {"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}
    c = config_from_dict(raw)
    ref = Gemma3TextConfig(**{k: v for k, v in raw["text_config"].items() if k != "model_type"})
    assert (c.vocab_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (
        ref.vocab_size, ref.head_dim, ref.num_attention_heads, ref.num_key_value_heads)
    assert list(c.layer_types) == list(ref.layer_types) and c.sliding_window == 1024
    assert c.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert c.options.local_rope == {"rope_type": "default", "rope_theta": 10000.0}
    assert c.tie_word_embeddings and c.eos_token_id == (1, 106) and c.hidden_act == "gelu_pytorch_tanh"
    assert c.options.query_pre_attn_scalar == 256 and c.qk_norm


# -- tensor parallelism, quantized weights, unused tensors ------------------------------------------------

class _TwoRanks:
    """all_reduce / all_gather between two threads, each running one rank's model."""

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.slots = [None, None]

    def exchange(self, rank, x):
        self.slots[rank] = x.clone()
        self.barrier.wait()
        both = list(self.slots)
        self.barrier.wait()
        return both


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tensor_parallel_two_ranks_equal_one(model_dirs, monkeypatch, family):
    folder = str(model_dirs(family))
    whole = load(folder, device="cpu", dtype="float32").model
    ids = standard.prompt_ids(26)
    expected = _logits(whole, ids)
    ranks = [load(folder, device="cpu", dtype="float32", shard=Shard(rank=r, world=2)).model for r in range(2)]
    assert "tp" in ranks[0].features()
    link = _TwoRanks()

    def all_reduce(self, x):
        x.copy_(sum(link.exchange(self.rank, x)))
        return x

    monkeypatch.setattr(Shard, "all_reduce", all_reduce)
    monkeypatch.setattr(Shard, "all_gather_last", lambda self, x: torch.cat(link.exchange(self.rank, x), dim=-1))
    out = [None, None]

    def run(r):
        torch.set_grad_enabled(False)
        out[r] = _logits(ranks[r], ids)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for got in out:
        assert (got - expected).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_q8_0_runs(model_dirs, monkeypatch, family):
    """--quantize q8_0 holds every matrix (the embedding and tied head too) as blocks; with float
    products it gives the float model's logits on the dequantized weights, and it decodes through
    the integer kernel. (The int8 activations move these sharp random models' capped logits by
    tenths, so the kernel path is checked for running, not for closeness.)"""
    from twice.core import qweight

    folder = str(model_dirs(family))
    floats = load(folder, device="cpu", dtype="float32").model
    quantized = load(folder, device="cpu", dtype="float32", weights="q8_0").model
    assert set(qweight.weight_formats(quantized)["types"]) == {"Q8_0"}
    params = dict(floats.named_parameters())
    for name, m in quantized.named_modules():
        if isinstance(m, (qweight.BlockLinear, qweight.BlockEmbedding)):
            params[f"{name}.weight"].copy_(m.weight.dequantize(torch.float32))
    ids = standard.prompt_ids(30)
    cache = KVCache(quantized.config, 1, 64, torch.float32, "cpu")
    step = quantized(ids[:, :1], cache)  # one row: the integer kernel
    assert torch.isfinite(step).all()
    monkeypatch.setattr(qweight, "KERNEL_ROWS", 0)  # float products of the dequantized blocks
    assert (_logits(quantized, ids) - _logits(floats, ids)).abs().max() < 1e-4


def test_vision_tensors_are_read_only_for_gemma3(model_dirs, tmp_path):
    """The image-text checkpoint's vision tower is skipped; the same tensor in a gemma2
    checkpoint is an error naming it."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "g2"
    shutil.copytree(model_dirs("gemma2"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["vision_tower.embeddings.patch_embedding.weight"] = torch.zeros(2, 2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TwiceError, match="vision_tower.embeddings.patch_embedding.weight"):
        load(str(folder), device="cpu")


# -- bad configs: one line naming the field ----------------------------------------------------------------

def _config(family, model_dirs):
    return json.loads((model_dirs(family) / "config.json").read_text())


def _text(cfg):
    return cfg.get("text_config", cfg)


BAD = [
    ("gemma2", lambda c: c.update(layer_types=["sliding_attention"] * 3), ConfigError, "layer_types"),
    ("gemma2", lambda c: c.update(attn_logit_softcapping=0), ConfigError, "attn_logit_softcapping"),
    ("gemma2", lambda c: c.update(final_logit_softcapping=-3.0), ConfigError, "final_logit_softcapping"),
    ("gemma2", lambda c: c.update(query_pre_attn_scalar=0), ConfigError, "query_pre_attn_scalar"),
    ("gemma2", lambda c: c.update(sliding_window=None), ConfigError, "sliding_window"),
    ("gemma2", lambda c: c.update(hidden_activation=7), ConfigError, "hidden_activation"),
    ("gemma2", lambda c: c.update(use_bidirectional_attention=True), UnsupportedModelError,
     "use_bidirectional_attention"),
    ("gemma3", lambda c: (c.pop("layer_types"), c.update(sliding_window_pattern=0)), ConfigError,
     "sliding_window_pattern"),
    ("gemma3", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="dynamic"), UnsupportedModelError,
     "rope type \"dynamic\""),
    ("gemma3", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="ntk"), UnsupportedModelError,
     "rope type \"ntk\""),
    ("gemma3", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_theta=-1), ConfigError,
     "rope_parameters.sliding_attention.rope_theta"),
    ("gemma3", lambda c: c["rope_parameters"]["full_attention"].update(factor=0.5), ConfigError,
     "rope_parameters.factor"),
    ("gemma3-mm", lambda c: c.update(text_config=[1]), ConfigError, "text_config"),
    ("gemma3-mm", lambda c: c["text_config"].update(model_type="gemma2"), UnsupportedModelError, "text_config"),
    ("gemma3-mm", lambda c: c["text_config"].update(layer_types=["full_attention"]), ConfigError, "layer_types"),
]


@pytest.mark.parametrize("family,change,error,words", BAD, ids=[b[3] for b in BAD])
def test_bad_config_is_one_line_naming_the_field(model_dirs, family, change, error, words):
    cfg = _config(family, model_dirs)
    change(cfg)
    with pytest.raises(error) as e:
        config_from_dict(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_config_through_the_cli(model_dirs, tmp_path, capsys):
    folder = tmp_path / "bad"
    shutil.copytree(model_dirs("gemma2"), folder)
    cfg = _config("gemma2", model_dirs)
    cfg["layer_types"] = ["full_attention"]
    (folder / "config.json").write_text(json.dumps(cfg))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    line = one_error_line(run_inprocess(["generate", "hi", "--model", str(folder), "-n", "2"], capsys))
    assert "layer_types" in line and "4 layers" in line
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_transformers_twin_kwargs(model_dirs, family):
    """hf_config_kwargs (for benchmark.hf_twin) rebuilds transformers' own view of the windows,
    layer types and per-layer-type RoPE from twice's config."""
    import transformers

    folder = model_dirs(family)
    model = load(str(folder), device="cpu", dtype="float32").model
    raw = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "sliding_window"):
        raw.pop(key)
    name = {"gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig"}[family]
    rebuilt = getattr(transformers, name)(**{**raw, **model.hf_config_kwargs()})
    saved = getattr(transformers, name).from_pretrained(folder)
    assert rebuilt.rope_parameters == saved.rope_parameters
    assert rebuilt.layer_types == saved.layer_types and rebuilt.sliding_window == saved.sliding_window


def test_a_null_softcap_is_no_cap():
    """transformers reads `attn_logit_softcapping: null` as no cap, not as Gemma2Config's default of 50."""
    from transformers import Gemma2Config

    raw = {**Gemma2Config(num_hidden_layers=2).to_dict(), "attn_logit_softcapping": None, "final_logit_softcapping": None}
    c = config_from_dict(raw)
    assert c.options.attn_logit_softcapping is None and c.options.final_logit_softcapping is None
    raw.pop("attn_logit_softcapping")  # absent: the default applies
    assert config_from_dict(raw).options.attn_logit_softcapping == 50.0
