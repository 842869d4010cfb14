"""The phi3 family (Phi-3, Phi-3.5, Phi-4-mini) against transformers' Phi3ForCausalLM (fp32, CPU).

tiny.py's "phi3" (in tiny.FAMILIES: test_models.py runs the four standard checks on it) has
longrope with original_max_position_embeddings 64, partial rotary 0.75 and GQA; "phi3-long"
the same with original_max_position_embeddings 16 (max 64) and a sliding window of 12, so
that prompts and generations land on both sides of the short/long boundary."""

import copy
import json
import shutil

import pytest
import torch

import tiny
from clirun import one_error_line, run_inprocess
from test_models import hf_model, prompt_ids
from twice.core.cache import KVCache
from twice.core.config import config_from_dict
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.errors import ConfigError, TwiceError, UnsupportedModelError
from twice.weights.load import load

torch.set_grad_enabled(False)
LONG = "phi3-long"  # original_max_position_embeddings 16


def _generate(ours, ids: list[int], n: int) -> list[int]:
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids)
    events = list(engine.generate(Request(ids=ids), GenerationSettings(max_new_tokens=n, ignore_eos=True)))
    return events[-1].result.token_ids


def _hf_generate(ref, ids: torch.Tensor, n: int) -> list[int]:
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                       eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("prompt, last", [(10, 16), (24, 40)], ids=["short", "long"])
def test_logits_on_each_side_of_original_max_position_embeddings(model_dirs, prompt, last):
    """Short factors while the sequence stays within 16 positions, long ones (every position
    of the pass) once it is longer: prefill and each decode step against transformers' forward
    of the whole sequence."""
    folder = model_dirs(LONG)
    ours, ref = load(str(folder), device="cpu", dtype="float32"), hf_model(folder)
    ids = prompt_ids(last, seed=prompt)
    expected = ref(ids).logits
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    got = ours.model(ids[:, :prompt], cache, all_logits=True)
    assert (got - expected[:, :prompt]).abs().max() < 1e-4
    for t in range(prompt, last):
        assert (ours.model(ids[:, t: t + 1], cache)[0] - expected[0, t]).abs().max() < 1e-4, t


def test_short_and_long_factors_differ(model_dirs):
    """The tiny factors bite: the same 16 tokens' logits change when the pass reaches 17."""
    folder = model_dirs(LONG)
    ref = hf_model(folder)
    ids = prompt_ids(17, seed=3)
    assert (ref(ids[:, :16]).logits - ref(ids).logits[:, :16]).abs().max() > 1e-2


def test_a_step_across_the_boundary_equals_transformers_cached_forward(model_dirs):
    """A decode crossing position 16 keeps the keys/values computed with the short factors
    and takes the long ones for the new positions: transformers' forward pass with a cache
    does the same (its generate() recomputes at the crossing: /work/notes/phi3.md)."""
    from transformers import DynamicCache

    folder = model_dirs(LONG)
    ours, ref = load(str(folder), device="cpu", dtype="float32"), hf_model(folder)
    ids = prompt_ids(24, seed=7)
    cache, hf_cache = KVCache(ours.config, 1, 64, torch.float32, "cpu"), DynamicCache(config=ref.config)
    got = ours.model(ids[:, :10], cache, all_logits=True)
    assert (got - ref(ids[:, :10], cache=hf_cache, use_cache=True).logits).abs().max() < 1e-4
    for t in range(10, 24):
        step = ref(ids[:, t: t + 1], cache=hf_cache, use_cache=True).logits[0, -1]
        assert (ours.model(ids[:, t: t + 1], cache)[0] - step).abs().max() < 1e-4, t


def test_a_pass_continuing_a_row_equals_its_tokens_one_by_one(model_dirs):
    """A later prefill chunk or a speculative verify pass that crosses 16 takes, position by
    position, what one-token steps there take (short below 16, long from 16): chunking a
    prompt, or verifying drafted tokens, does not change the result across the boundary."""
    ours = load(str(model_dirs(LONG)), device="cpu", dtype="float32")
    ids = prompt_ids(22, seed=13)
    chunked, stepped = (KVCache(ours.config, 1, 64, torch.float32, "cpu") for _ in range(2))
    ours.model(ids[:, :10], chunked)
    ours.model(ids[:, :10], stepped)
    got = ours.model(ids[:, 10:], chunked, all_logits=True)
    for t in range(10, 22):
        assert (ours.model(ids[:, t: t + 1], stepped)[0] - got[0, t - 10]).abs().max() < 1e-5, t
    assert (chunked.k[:, :, :, :22] - stepped.k[:, :, :, :22]).abs().max() < 1e-5


@pytest.mark.parametrize("prompt, new", [(5, 11), (20, 32)], ids=["short", "long"])
def test_greedy_tokens_equal_generate_without_a_crossing(model_dirs, prompt, new):
    folder = model_dirs(LONG)
    ours, ref = load(str(folder), device="cpu", dtype="float32"), hf_model(folder)
    ids = prompt_ids(prompt, seed=11)
    assert _generate(ours, ids[0].tolist(), new) == _hf_generate(ref, ids, new)


@pytest.mark.parametrize("prompt, new", [(4, 11), (20, 20)], ids=["short", "long"])
def test_cached_decode_equals_naive_recomputation(model_dirs, prompt, new):
    ours = load(str(model_dirs(LONG)), device="cpu", dtype="float32")
    seq = prompt_ids(prompt, seed=5)
    cache = KVCache(ours.config, 1, 64, torch.float32, "cpu")
    logits = ours.model(seq, cache)
    for _ in range(new):
        nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        logits = ours.model(nxt, cache)
        naive = ours.model(seq, KVCache(ours.config, 1, 64, torch.float32, "cpu"))
        assert (logits - naive).abs().max() < 1e-5


def test_batch_rows_choose_their_factors_alone(model_dirs):
    """Rows of one batch on both sides of the boundary (one crossing it) each give what they
    give alone: the factors follow each row's own length, not the batch's widest row."""
    ours = load(str(model_dirs(LONG)), device="cpu", dtype="float32")
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids)
    prompts = [prompt_ids(n, seed=20 + n)[0].tolist() for n in (5, 19, 8)]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (20, 12, 6)]
    alone = [list(engine.generate(Request(ids=p), s, reuse_cache=False))[-1].result.token_ids
             for p, s in zip(prompts, settings)]
    batched = {e.row: e.result.token_ids for e in engine.generate_batch([Request(ids=p) for p in prompts], settings)
               if type(e).__name__ == "Done"}
    assert [batched[i] for i in range(3)] == alone


def _hub_forms(cfg: dict) -> dict[str, dict]:
    """The Hub's spellings of the same rope settings: rope_theta, partial_rotary_factor and
    original_max_position_embeddings at the top level, rope_scaling of type su / longrope
    (and yarn, which transformers' Phi3Config reads as longrope)."""
    rope = dict(cfg.pop("rope_parameters"))
    base = {**cfg, "rope_theta": rope.pop("rope_theta"), "partial_rotary_factor": rope.pop("partial_rotary_factor")}
    rope.pop("rope_type")
    original = rope.pop("original_max_position_embeddings")
    forms = {kind: {**base, "rope_scaling": {"type": kind, **rope}} for kind in ("su", "longrope", "yarn")}
    # transformers 5.24 wants it inside rope_scaling too (else a KeyError while it validates)
    forms["inner"] = {**base, "rope_scaling": {"type": "longrope", **rope, "original_max_position_embeddings": original}}
    return forms


@pytest.mark.parametrize("family", ["phi3", LONG])
def test_hub_config_forms_give_the_same_logits(model_dirs, tmp_path, family):
    src = model_dirs(family)
    ids = prompt_ids(30, seed=9)  # past phi3-long's 16 (long factors), within phi3's 64 (short)
    a = load(str(src), device="cpu").model
    expected = a(ids, KVCache(a.config, 1, 32, torch.float32, "cpu"), all_logits=True)
    for kind, cfg in _hub_forms(json.loads((src / "config.json").read_text())).items():
        hub = tmp_path / kind
        shutil.copytree(src, hub)
        (hub / "config.json").write_text(json.dumps(cfg))
        b = load(str(hub), device="cpu").model
        got = b(ids, KVCache(b.config, 1, 32, torch.float32, "cpu"), all_logits=True)
        assert torch.equal(got, expected), kind
        if kind == "inner":  # transformers reads the old form the same way
            assert (got - hf_model(hub)(ids).logits).abs().max() < 1e-4


def test_parameter_count_equals_transformers(model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    for tied in (False, True):
        hf = tiny.hf_config("phi3")
        hf.tie_word_embeddings = tied
        model = AutoModelForCausalLM.from_config(hf)
        raw = json.loads(hf.to_json_string())
        assert config_from_dict(raw).parameter_count() == sum(p.numel() for p in model.parameters()), tied


def test_features_and_fast_steps(model_dirs):
    """Partial rotary is declared; both steps implement it (rope.apply_rotary), the native one
    chosen first (the compiled one: tests/test_fastpath.py)."""
    from twice.core import fastpath, native_decode

    ours = load(str(model_dirs(LONG)), device="cpu", dtype="float32")
    assert ours.model.features() == {"block:llama", "act:silu", "rope:partial", "window"}
    assert fastpath.supported(ours.model)
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids, compile=True)
    assert engine.decode_path == ("native" if native_decode.supported(ours.model) else "compiled")


@pytest.fixture(scope="module")
def full_rotary(tmp_path_factory, tokenizer):
    """phi3-long with every dimension rotating (Phi-3-mini / Phi-3.5-mini: longrope, full rotary)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("phi3-full")
    hf = tiny.hf_config(LONG)
    hf.rope_parameters = {**hf.rope_parameters, "partial_rotary_factor": 1.0,
                          "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0, 2.4, 3.0],
                          "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf).eval().save_pretrained(folder)
    tiny.save_tokenizer(folder, tokenizer)
    return folder


def test_full_rotary_longrope_greedy_and_native_step(full_rotary):
    """Without partial rotary a phi3 model declares only llama features: a decode step that
    indexes rope.cos by position takes the short rows below 16 and the long rows from 16 on,
    what a one-token pass there uses. Greedy tokens equal transformers' generate (prompt past
    the boundary); the native step, where it runs, equals the eager layers."""
    from twice.core import native_decode

    ours, ref = load(str(full_rotary), device="cpu", dtype="float32"), hf_model(full_rotary)
    assert ours.model.features() == {"block:llama", "act:silu", "window"}
    ids = prompt_ids(18, seed=4)
    assert _generate(ours, ids[0].tolist(), 24) == _hf_generate(ref, ids, 24)
    if native_decode.supported(ours.model):
        eager = Engine(ours.model, ours.tokenizer, native=False)
        native = Engine(ours.model, ours.tokenizer)
        assert native.decode_path == "native"
        for prompt in (prompt_ids(5, seed=1)[0].tolist(), ids[0].tolist()):  # crosses 16 while decoding; past it
            s = GenerationSettings(max_new_tokens=20, ignore_eos=True)
            assert (list(native.generate(Request(ids=prompt), s))[-1].result.token_ids
                    == list(eager.generate(Request(ids=prompt), s))[-1].result.token_ids)


def test_quantize_q8_0_runs_phi3(model_dirs):
    q = load(str(model_dirs("phi3")), device="cpu", dtype="float32", weights="q8_0")
    f = load(str(model_dirs("phi3")), device="cpu", dtype="float32")
    ids = prompt_ids(12, seed=2)
    a = q.model(ids, KVCache(q.config, 1, 16, torch.float32, "cpu"))
    b = f.model(ids, KVCache(f.config, 1, 16, torch.float32, "cpu"))
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def _float_rows(linear) -> torch.Tensor:
    from twice.core.qweight import BlockLinear

    return linear.weight.dequantize(torch.float32) if isinstance(linear, BlockLinear) else linear.weight


@pytest.mark.parametrize("stored", ["safetensors", "q8_0", "--quantize q8_0"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_keep_their_slices_of_the_fused_tensors(model_dirs, tokenizer, tmp_path, capsys, stored,
                                                                     rank):
    """Each rank's qkv_proj is three slices of the checkpoint's one fused tensor (its q heads,
    its k heads, its v heads), its gate_up_proj two (its gate rows, its up rows), its o_proj
    and down_proj their columns; from safetensors, from a GGUF as stored (blocks copied) and
    quantized at load (tests/test_parallel.py runs two ranks)."""
    from twice.core.parallel import Shard

    src, weights = model_dirs("phi3"), None
    if stored != "safetensors":  # a rank's 48 of 96 MLP columns would cut a q8_0 block: 128 wide
        from transformers import AutoModelForCausalLM

        config = tiny.hf_config("phi3")
        config.intermediate_size = 128
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "wide")
        tiny.save_tokenizer(tmp_path / "wide", tokenizer)
        src, path = tmp_path / "wide", tmp_path / "phi3-q8_0.gguf"
        if stored == "q8_0":  # a GGUF as stored
            assert run_inprocess(["quantize", str(src), str(path), "--type", stored], capsys).code == 0
            src = path
        else:  # quantized in memory at load
            weights = "q8_0"
    whole = load(str(src), device="cpu", dtype="float32", weights=weights).model
    part = load(str(src), device="cpu", dtype="float32", weights=weights, shard=Shard(rank=rank, world=2)).model
    c = whole.config
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size

    def mine(w: torch.Tensor, start: int, size: int, dim: int = 0) -> torch.Tensor:
        return w.narrow(dim, start + rank * size // 2, size // 2)

    for i in range(c.num_hidden_layers):
        a, b = whole.layers[i], part.layers[i]
        qkv = _float_rows(a.self_attn.qkv_proj)
        assert torch.equal(_float_rows(b.self_attn.qkv_proj),
                           torch.cat([mine(qkv, 0, q), mine(qkv, q, kv), mine(qkv, q + kv, kv)]))
        gate_up = _float_rows(a.mlp.gate_up_proj)
        assert torch.equal(_float_rows(b.mlp.gate_up_proj), torch.cat([mine(gate_up, 0, inter),
                                                                       mine(gate_up, inter, inter)]))
        assert torch.equal(_float_rows(b.self_attn.o_proj), mine(_float_rows(a.self_attn.o_proj), 0, q, dim=1))
        assert torch.equal(_float_rows(b.mlp.down_proj), mine(_float_rows(a.mlp.down_proj), 0, inter, dim=1))


# -- bad configs: one line naming the field ---------------------------------------------------------------
def _phi3_config() -> dict:
    return json.loads(tiny.hf_config(LONG).to_json_string())


def _rope(**changes):
    def edit(cfg):
        cfg["rope_parameters"].update(changes)
    return edit


def _hub(**changes):
    def edit(cfg):
        cfg.update(_hub_forms(cfg)["su"])
        cfg["rope_scaling"].update(changes)
    return edit


BAD = [
    (_rope(short_factor=[1.0] * 5), ConfigError,
     "rope_parameters.short_factor must be a list of 6 numbers (one per pair of the 12 rotary dimensions), "
     "got 5 entries"),
    (_rope(long_factor=[1.0] * 8), ConfigError, "rope_parameters.long_factor must be a list of 6 numbers"),
    (_rope(long_factor=[1.0, 2.0, 0.0, 1.0, 1.0, 1.0]), ConfigError,
     "rope_parameters.long_factor[2] must be a number in [1e-06, 1,000,000], got 0.0"),
    (_rope(short_factor=[1.0, "2", 1.0, 1.0, 1.0, 1.0]), ConfigError, "rope_parameters.short_factor[1] must be a number"),
    (_rope(short_factor=None), ConfigError, "rope_parameters.short_factor is missing"),
    (_rope(long_factor=2.0), ConfigError, "rope_parameters.long_factor must be a list, got 2.0"),
    (_rope(partial_rotary_factor=1.5), ConfigError, "rope_parameters.partial_rotary_factor must be a number in (0, 1]"),
    (_rope(partial_rotary_factor=0), ConfigError, "rope_parameters.partial_rotary_factor must be a number in (0, 1]"),
    (_rope(partial_rotary_factor=0.5625), ConfigError,  # 16 · 0.5625 = 9 dimensions
     "partial_rotary_factor 0.5625 of head_dim 16 gives a rotary dimension of 9; it must be even and at least 2"),
    (_rope(factor=0.5), ConfigError, "rope_parameters.factor must be a number in [1, 1,000,000], got 0.5"),
    (_rope(attention_factor=-1), ConfigError, "rope_parameters.attention_factor must be a number in (0"),
    (_rope(rope_type="linear", factor=2.0), UnsupportedModelError, "phi3 rope type \"linear\" is not supported"),
    (_hub(short_factor=[1.0] * 7), ConfigError, "rope_scaling.short_factor must be a list of 6 numbers"),
    (_hub(long_factor=[1.0, 1.0, 1.0, 1.0, 1.0, float("nan")]), ConfigError, "rope_scaling.long_factor[5] must be a number"),
    (lambda cfg: cfg.update(original_max_position_embeddings=0), ConfigError,
     "original_max_position_embeddings must be an integer in [2, 2,147,483,647], got 0"),
]


@pytest.mark.parametrize("edit, error, words", BAD, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_rope_fields_are_one_line_naming_the_field(edit, error, words):
    cfg = _phi3_config()
    edit(cfg)
    with pytest.raises(error) as e:
        config_from_dict(copy.deepcopy(cfg), "config.json")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("config.json: ") and words in str(e.value), str(e.value)


def test_bad_factor_list_through_the_cli_loses_nothing(model_dirs, tmp_path, capsys):
    folder = tmp_path / "bad"
    shutil.copytree(model_dirs(LONG), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"]["long_factor"] = [1.0, 2.0]
    (folder / "config.json").write_text(json.dumps(cfg))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    line = one_error_line(run_inprocess(["generate", "hi", "--model", str(folder), "-n", "2"], capsys))
    assert "rope_parameters.long_factor must be a list of 6 numbers" in line and "got 2 entries" in line
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_every_accepted_longrope_field_computes():
    """The corners of each accepted range give finite frequencies and scaling."""
    import math

    from twice.core.rope import inverse_frequencies

    for key, value in (("factor", 1), ("factor", 1e6), ("attention_factor", 1e-300), ("attention_factor", 1e6),
                       ("short_factor", [1e-6] * 6), ("long_factor", [1e6] * 6)):
        cfg = _phi3_config()
        cfg["rope_parameters"][key] = value
        for orig in (1, 2, 2**31 - 1):
            cfg["original_max_position_embeddings"] = orig
            try:
                parsed = config_from_dict(copy.deepcopy(cfg))
            except TwiceError as e:
                assert "\n" not in str(e)
                continue
            for long in (False, True):
                inv, scaling = inverse_frequencies(parsed, long=long)
                assert math.isfinite(scaling) and not inv.isnan().any(), (key, value, orig)


def test_quantize_at_load_refuses_a_rank_split_that_cuts_a_block(model_dirs):
    """--quantize q8_0 --tp 2 on 96 MLP columns: each rank's 48 would cut a block of 32 (the
    type chosen per checkpoint tensor, its columns per rank: weights/load._mixture_layouts)."""
    from twice.core.parallel import Shard

    with pytest.raises(UnsupportedModelError) as e:
        load(str(model_dirs("phi3")), device="cpu", shard=Shard(rank=0, world=2), weights="q8_0")
    assert str(e.value) == ("--quantize q8_0: model.layers.0.mlp.down_proj.weight would be Q8_0 (blocks of 32 values), "
                            "but each of the 2 ranks holds 48 of its columns; use fewer ranks, or no --quantize")