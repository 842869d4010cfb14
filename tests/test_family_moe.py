"""The mixture-of-experts families (core/moe.py, core/experts.py): mixtral, qwen3_moe, qwen2_moe.

tiny.py's "mixtral", "qwen3_moe", "qwen3_moe-nonorm" and "qwen2_moe" run test_models.py's
standard checks (tiny.FAMILIES: logits within 1e-4 of transformers, greedy tokens equal to
generate(), batched = alone). Here: cached = naive, a batch-1 step touching only the chosen
experts, the stacked checkpoint form, --quantize, the active parameter counts, bad configs.
"""

import json
import shutil

import pytest
import torch

import tiny
from clirun import run_inprocess
from test_models import hf_model, prompt_ids
from twice.core.cache import KVCache
from twice.core.errors import ConfigError
from twice.core.experts import Experts, SparseMoE
from twice.core.models import family
from twice.weights.load import load

torch.set_grad_enabled(False)
MOE = ["mixtral", "qwen3_moe", "qwen3_moe-nonorm", "qwen2_moe"]


def sparse_blocks(model):
    return [b.mlp for b in model.layers if isinstance(b.mlp, SparseMoE)]


def test_tiny_configs_exercise_the_features(model_dirs):
    for name, want in [("mixtral", {"moe", "window"}), ("qwen3_moe", {"moe", "qk_norm"}),
                       ("qwen2_moe", {"moe", "moe:shared", "qkv_bias", "window"})]:
        ours = load(str(model_dirs(name)), device="cpu", dtype="float32")
        o = ours.config.options
        assert want <= ours.model.features() and o.experts > o.top_k
    q = load(str(model_dirs("qwen3_moe")), device="cpu").config.options
    assert q.sparse == (True, False, True) and q.renormalize  # mlp_only_layers=[1]
    q = load(str(model_dirs("qwen3_moe-nonorm")), device="cpu").config.options
    assert q.sparse == (False, True, False) and not q.renormalize  # decoder_sparse_step=2
    assert load(str(model_dirs("mixtral")), device="cpu").config.sliding_window == 12  # prompts of 40 cross it


@pytest.mark.parametrize("name", MOE)
def test_cached_decode_equals_naive_recomputation(model_dirs, name):
    ours = load(str(model_dirs(name)), device="cpu", dtype="float32")
    ids = prompt_ids(6, seed=5)
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    logits = ours.model(ids, cache)
    seq = ids
    for _ in range(16):  # past mixtral's window of 12
        nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        logits = ours.model(nxt, cache)
        naive = ours.model(seq, KVCache(ours.config, 1, 64, torch.float32, "cpu"))
        assert (logits - naive).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_a_batch1_step_reads_only_the_chosen_experts(model_dirs, monkeypatch, name):
    """Count the expert MLPs a decode step runs (top_k per sparse layer), then poison every
    other expert's rows with NaN: the step's logits do not change."""
    ours = load(str(model_dirs(name)), device="cpu", dtype="float32")
    model, o = ours.model, ours.config.options
    ids = prompt_ids(20, seed=7)
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    model(ids[:, :-1], cache)
    calls = []
    original = Experts.expert
    monkeypatch.setattr(Experts, "expert", lambda self, e, x: calls.append((id(self), e, x.shape[0])) or original(self, e, x))
    clean = model(ids[:, -1:], cache)
    monkeypatch.undo()
    blocks = sparse_blocks(model)
    chosen = {id(m.experts): set() for m in blocks}
    for who, e, tokens in calls:
        chosen[who].add(e)
        assert tokens == 1
    assert len(calls) == o.top_k * len(blocks) and all(len(c) == o.top_k for c in chosen.values())
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    model(ids[:, :-1], cache)  # the prompt with every expert intact
    for m in blocks:
        ex = m.experts
        for e in set(range(o.experts)) - chosen[id(ex)]:
            ex.gate_up_proj.weight[e * 2 * ex.intermediate:(e + 1) * 2 * ex.intermediate] = float("nan")
            ex.down_proj.weight[e * ex.hidden:(e + 1) * ex.hidden] = float("nan")
    poisoned = model(ids[:, -1:], cache)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)


def test_prefill_runs_each_hit_expert_once_over_its_tokens(model_dirs, monkeypatch):
    ours = load(str(model_dirs("qwen3_moe")), device="cpu", dtype="float32")
    calls = []
    original = Experts.expert
    monkeypatch.setattr(Experts, "expert", lambda self, e, x: calls.append((id(self), e, x.shape[0])) or original(self, e, x))
    ours.model(prompt_ids(30, seed=8), KVCache(ours.config, 1, 32, torch.float32, "cpu"))
    per_layer: dict = {}
    for who, e, tokens in calls:
        assert e not in per_layer.setdefault(who, {})
        per_layer[who][e] = tokens
    top_k = ours.config.options.top_k
    assert all(sum(layer.values()) == 30 * top_k for layer in per_layer.values())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_stacked_checkpoint_form_loads_the_same(model_dirs, tmp_path, name):
    """transformers 5's in-memory form (experts.gate_up_proj [experts, 2·inter, hidden], mixtral's
    block_sparse_moe named mlp) loads into the same model as the per-expert tensors."""
    from safetensors.torch import save_file

    src = model_dirs(name)
    stacked = tmp_path / "stacked"
    shutil.copytree(src, stacked)
    (stacked / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf_model(src).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(stacked / "model.safetensors"))
    a = load(str(src), device="cpu", dtype="float32").model
    b = load(str(stacked), device="cpu", dtype="float32").model
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_stacked_checkpoint_missing_an_expert_tensor_is_named(model_dirs, tmp_path, capsys):
    from safetensors.torch import save_file

    src = model_dirs("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    state = {k: v.contiguous() for k, v in hf_model(src).state_dict().items() if k != "model.layers.2.mlp.experts.down_proj"}
    save_file(state, str(bad / "model.safetensors"))
    before = (bad / "model.safetensors").read_bytes()
    r = run_inprocess(["generate", "hi", "--model", str(bad), "-n", "2"], capsys)
    assert r.code == 2 and r.err.count("\n") == 1 and r.err.startswith("twice: error: ")
    assert "checkpoint is missing tensors: model.layers.2.mlp.experts." in r.err and "down_proj" in r.err
    assert (bad / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_quantized_experts_match_the_dequantized_weights(model_dirs, name):
    """--quantize q8_0: every expert's rows become blocks of one stacked buffer; the eager
    step's products use only the chosen experts' rows of it."""
    q = load(str(model_dirs(name)), device="cpu", dtype="float32", weights="q8_0")
    ex = sparse_blocks(q.model)[0].experts
    assert hasattr(ex.gate_up_proj, "store_rows") and hasattr(ex.down_proj, "store_rows")
    assert len(ex.gate_up_proj.weight.parts) == len(ex.down_proj.weight.parts) == 1  # one buffer, expert e at a row offset
    ref = load(str(model_dirs(name)), device="cpu", dtype="float32")
    ids = prompt_ids(24, seed=3)
    a = q.model(ids, KVCache(q.config, 1, 32, torch.float32, "cpu"), all_logits=True)
    b = ref.model(ids, KVCache(ref.config, 1, 32, torch.float32, "cpu"), all_logits=True)
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert q.model.active_weight_bytes() < q.model.weight_bytes() < ref.model.weight_bytes()


@pytest.mark.parametrize("name", MOE)
def test_parameter_counts_total_and_active(model_dirs, name):
    ours = load(str(model_dirs(name)), device="cpu", dtype="float32")
    c, o, fam = ours.config, ours.config.options, family(ours.config.model_type)
    stored = {p.data_ptr(): p.numel() for p in ours.model.parameters()}
    assert c.parameter_count() == sum(stored.values())
    unread = o.sparse_layers * (o.experts - o.top_k) * 3 * c.hidden_size * o.expert_intermediate
    assert fam.active_parameter_count(c) == c.parameter_count() - unread
    assert ours.model.active_weight_bytes() == 4 * fam.active_parameter_count(c)


def test_info_and_timing_report_active_parameters(model_dirs, capsys):
    folder = model_dirs("mixtral")
    ours = load(str(folder), device="cpu", dtype="float32")
    active = family("mixtral").active_parameter_count(ours.config)
    r = run_inprocess(["info", str(folder), "--json", "--dtype", "float32"], capsys)
    assert r.code == 0, r.err
    facts = json.loads(r.out)
    assert facts["active_parameters"] == active < facts["parameters"]
    assert facts["active_weight_bytes"] == 4 * active
    r = run_inprocess(["info", str(folder), "--dtype", "float32"], capsys)
    assert "active parameters" in r.out and f"{active:,}" in r.out
    r = run_inprocess(["generate", "hello", "-m", str(folder), "-n", "4", "--json", "--dtype", "float32"], capsys)
    assert r.code == 0, r.err
    out = json.loads(r.out.strip().splitlines()[-1])
    assert out["active_weight_bytes"] == 4 * active < out["weight_bytes"]
    if out["generated_tokens"] > 1:  # the achieved bandwidth counts the active bytes
        kv = out["bandwidth"]["bytes_read_per_token"] - out["active_weight_bytes"]
        assert 0 < kv < out["weight_bytes"] - out["active_weight_bytes"]


def _config(name, model_dirs, **changes):
    cfg = json.loads((model_dirs(name) / "config.json").read_text())
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("name, changes, words", [
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok (9) must not exceed num_local_experts (8)"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts must be"),
    ("qwen2_moe", {"num_experts": 0}, "num_experts must be"),
    ("qwen3_moe", {"num_experts": 5, "num_local_experts": 8}, "num_experts (5) and num_local_experts (8)"),
    ("qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers must list layer indices 0..2, got 3"),
    ("qwen3_moe", {"mlp_only_layers": "1"}, "mlp_only_layers must be a list"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be"),
    # a window of 0 tokens (transformers fails inside its first step): refused, not read as none
    ("qwen2_moe", {"sliding_window": 0}, "sliding_window must be a positive integer"),
])
def test_bad_configs_are_one_line_naming_the_field(model_dirs, tmp_path, capsys, name, changes, words):
    folder = tmp_path / "m"
    shutil.copytree(model_dirs(name), folder)
    (folder / "config.json").write_text(json.dumps(_config(name, model_dirs, **changes)))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    r = run_inprocess(["info", str(folder)], capsys)
    assert r.code == 2 and r.err.count("\n") == 1 and r.err.startswith("twice: error: "), r.err
    assert words in r.err and "config.json" in r.err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    from twice.core.config import config_from_dict

    with pytest.raises(ConfigError):
        config_from_dict(_config(name, model_dirs, **changes))


def test_hub_form_qwen3_moe_config_names_num_experts(model_dirs, tmp_path):
    """The Hub's Qwen3-MoE configs say num_experts (save_pretrained writes num_local_experts)."""
    hub = tmp_path / "hub"
    shutil.copytree(model_dirs("qwen3_moe"), hub)
    cfg = json.loads((hub / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (hub / "config.json").write_text(json.dumps(cfg))
    tiny.to_hub_form(hub)
    assert load(str(hub), device="cpu").config.options.experts == 8


def test_tp_ranks_hold_their_rows_of_every_expert(model_dirs):
    """--tp 2 splits every expert by rows (core/moe.py): rank r keeps rows [r·I/2, (r+1)·I/2)
    of each expert's gate and up and those columns of its down; the router is replicated."""
    from twice.core.parallel import Shard

    folder = model_dirs("qwen2_moe")
    full = sparse_blocks(load(str(folder), device="cpu", dtype="float32").model)[0]
    inter, hidden, experts = full.experts.intermediate, full.experts.hidden, full.experts.experts
    for r in range(2):
        ours = load(str(folder), device="cpu", dtype="float32", shard=Shard(rank=r, world=2))
        assert "tp" in ours.model.features()
        part = sparse_blocks(ours.model)[0]
        n = inter // 2
        assert part.experts.intermediate == n and torch.equal(part.gate.weight, full.gate.weight)
        whole = full.experts.gate_up_proj.weight.view(experts, 2, inter, hidden)
        mine = part.experts.gate_up_proj.weight.view(experts, 2, n, hidden)
        assert torch.equal(mine, whole[:, :, r * n:(r + 1) * n])
        down = full.experts.down_proj.weight.view(experts, hidden, inter)[:, :, r * n:(r + 1) * n]
        assert torch.equal(part.experts.down_proj.weight.view(experts, hidden, n), down)
