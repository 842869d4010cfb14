"""`twice quantize MODEL OUT.gguf --type TYPE`: tiny models of each architecture written as
GGUF, read back by our header checks (gguf_file.read_gguf) and the gguf package's reader,
their tensors equal to the float ones within each type's error, and (llama) converted back by
`twice convert` into the same model. llama.cpp itself loads them in a slow test."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clirun import one_error_line, run_inprocess
from llamacpp import llama_cpp_python
import tiny

ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
# Relative RMS error of a tensor's values after the round trip (measured on the tiny models:
# q8_0 ~0.004, q4_0 ~0.08, f16 ~2e-4, bf16 ~2e-3; the bounds leave room and still fail a
# wrong layout, whose error is ~1.4).
REL_RMS = {"f32": 0.0, "f16": 1e-3, "bf16": 5e-3, "q8_0": 0.01, "q5_0": 0.05, "q5_1": 0.05, "q4_0": 0.12,
           "q4_1": 0.12}


@pytest.fixture(scope="module")
def model_dirs(model_dirs, tmp_path_factory, tokenizer):
    """The shared tiny models, but mistral without its window (as Mistral 7B v0.2 on): a
    window shorter than the context has no GGUF form (llama.cpp's llama has none)."""
    root = tmp_path_factory.mktemp("quantizable")
    built = {}

    def get(family):
        if family not in ("mistral", "llama-wide"):
            return model_dirs(family)
        if family not in built:
            # llama-wide: rows of 256 and 512 values, whole super-blocks of the K types (the
            # other tiny models' rows of 64 hold none, so their K mixtures fall back to Q5_0/Q8_0)
            extra = ({"sliding_window": None} if family == "mistral" else
                     {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2})
            built[family] = tiny.make_model(root / family, family.removesuffix("-wide"), tokenizer, **extra)
        return built[family]

    return get


def _quantize(tmp_path, capsys, folder, kind, name=None, *extra):
    out = tmp_path / (name or f"{folder.name}-{kind}.gguf")
    r = run_inprocess(["quantize", str(folder), str(out), "--type", kind, *extra], capsys)
    assert r.code == 0, r
    return out, r


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k.removeprefix("transformer."): v.float() for k, v in load_file(folder / "model.safetensors").items()}


def _expected(folder: Path, family: str) -> dict[str, np.ndarray]:
    """The float tensors in llama.cpp's names and layout, built here independently of the writer:
    llama's q/k rows interleaved per head (convert_hf_to_gguf.py's permute), GPT-2's Conv1D
    matrices transposed."""
    cfg = json.loads((folder / "config.json").read_text())
    t = _hf_tensors(folder)
    out: dict[str, np.ndarray] = {}
    if family == "gpt2":
        out["token_embd.weight"] = t["wte.weight"]
        out["position_embd.weight"] = t["wpe.weight"]
        out["output_norm.weight"], out["output_norm.bias"] = t["ln_f.weight"], t["ln_f.bias"]
        leaves = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
                  "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
        for i in range(cfg["n_layer"]):
            for hf, g in leaves.items():
                w = t[f"h.{i}.{hf}.weight"]
                out[f"blk.{i}.{g}.weight"] = w.t() if w.dim() == 2 else w
                out[f"blk.{i}.{g}.bias"] = t[f"h.{i}.{hf}.bias"]
        return {k: v.contiguous().numpy() for k, v in out.items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def permute(w, n):
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    out["token_embd.weight"] = t["model.embed_tokens.weight"]
    out["output_norm.weight"] = t["model.norm.weight"]
    if "lm_head.weight" in t and not cfg.get("tie_word_embeddings"):
        out["output.weight"] = t["lm_head.weight"]
    leaves = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, w in t.items():
        if not name.startswith("model.layers."):
            continue
        _, _, i, *rest = name.split(".")
        leaf, kind = ".".join(rest[:-1]), rest[-1]
        g = leaves[leaf]
        if ARCHES[family] == "llama" and g in ("attn_q", "attn_k"):
            w = permute(w, heads if g == "attn_q" else kv_heads)
        out[f"blk.{i}.{g}.{kind}"] = w
    return {k: v.contiguous().numpy() for k, v in out.items()}


def _dequantized(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    import gguf

    reader = gguf.GGUFReader(path)
    result = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        result[t.name] = (t.tensor_type.name, np.asarray(values, dtype=np.float32).reshape(shape))
    return result


def _metadata(path: Path) -> dict:
    from twice.weights.gguf_file import read_gguf

    return read_gguf(path).metadata


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_0"])
def test_tensors_round_trip(tmp_path, capsys, model_dirs, family, kind):
    folder = model_dirs(family)
    out, _ = _quantize(tmp_path, capsys, folder, kind)
    expected = _expected(folder, family)
    got = _dequantized(out)
    assert set(got) == set(expected)
    for name, want in expected.items():
        type_name, values = got[name]
        assert values.shape == want.shape, name
        one_d = want.ndim == 1 or name.endswith(("_norm.weight", ".bias")) or name == "position_embd.weight"
        if one_d or kind == "f32":
            assert type_name == "F32", name
            np.testing.assert_array_equal(values, want, err_msg=name)
            continue
        # llama.cpp's rule: the output matrix (token_embd where the head is tied) gets Q6_K,
        # which rows of 64 cannot hold: Q8_0 (for any base but Q8_0 itself)
        head = name == "output.weight" or (name == "token_embd.weight" and "output.weight" not in expected)
        assert type_name == ("Q8_0" if head else kind.upper()), name
        rel = float(np.sqrt(np.mean((values - want) ** 2)) / np.sqrt(np.mean(want**2)))
        assert rel <= REL_RMS[type_name.lower()], (name, rel)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2"])
def test_metadata_is_what_llama_cpp_reads(tmp_path, capsys, model_dirs, family, tokenizer):
    folder = model_dirs(family)
    out, _ = _quantize(tmp_path, capsys, folder, "q8_0")
    md = _metadata(out)
    arch = ARCHES[family]
    cfg = json.loads((folder / "config.json").read_text())
    assert md["general.architecture"] == arch
    assert md["general.file_type"] == 7 and md["general.quantization_version"] == 2
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    assert md[f"{arch}.embedding_length"] == hidden
    assert md[f"{arch}.block_count"] == cfg.get("num_hidden_layers", cfg.get("n_layer"))
    assert md[f"{arch}.context_length"] == cfg.get("max_position_embeddings", cfg.get("n_positions"))
    assert md[f"{arch}.attention.head_count"] == cfg.get("num_attention_heads", cfg.get("n_head"))
    if family == "gpt2":
        assert md[f"{arch}.feed_forward_length"] == 4 * hidden
        assert md[f"{arch}.attention.layer_norm_epsilon"] == pytest.approx(cfg["layer_norm_epsilon"])
    else:
        assert md[f"{arch}.attention.head_count_kv"] == cfg["num_key_value_heads"]
        assert md[f"{arch}.feed_forward_length"] == cfg["intermediate_size"]
        assert md[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
        rope = cfg.get("rope_parameters") or {}
        assert md[f"{arch}.rope.freq_base"] == pytest.approx(rope.get("rope_theta", cfg.get("rope_theta", 1e4)))
    if family == "qwen3":  # head_dim 24, not hidden / heads = 16
        assert md["qwen3.attention.key_length"] == md["qwen3.attention.value_length"] == 24
    if family == "llama":
        assert md["llama.rope.dimension_count"] == hidden // cfg["num_attention_heads"]
    # the tokenizer: every token under its id, types, merges, specials, flags, template
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == tiny.VOCAB and all(tokens[i] == t for t, i in vocab.items())
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    types = md["tokenizer.ggml.token_type"]
    assert [types[vocab[s]] for s in tiny.SPECIAL] == [3, 3, 3] and types.count(1) == tiny.VOCAB - 3
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert md["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert md["tokenizer.ggml.bos_token_id"] == 0 and md["tokenizer.ggml.eos_token_id"] == 2
    assert md["tokenizer.ggml.padding_token_id"] == 0
    assert md["tokenizer.ggml.add_bos_token"] is False and md["tokenizer.ggml.add_eos_token"] is False
    assert md["tokenizer.chat_template"] == tiny.CHAT_TEMPLATE


def test_llama3_rope_and_pre_tokenizers(tmp_path, capsys, model_dirs):
    """llama3 RoPE scaling becomes rope_freqs.weight (what convert_hf_to_gguf writes), and the
    pre-tokenizer of SmolLM (digits) and of Qwen2 get their llama.cpp names."""
    from tokenizers import Regex, pre_tokenizers

    from twice.weights.gguf import _llama3_divisors

    folder = model_dirs("llama3")
    out, _ = _quantize(tmp_path, capsys, folder, "q8_0")
    got = _dequantized(out)
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    want = _llama3_divisors(rope, rope["rope_theta"], 16).astype(np.float32)
    assert got["rope_freqs.weight"][0] == "F32"
    np.testing.assert_array_equal(got["rope_freqs.weight"][1], want)
    assert "output.weight" not in got  # tied: llama.cpp uses token_embd

    from twice.weights.gguf_tokenizer import _QWEN2_SPLIT

    for pre, name in (
        (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False)]), "smollm"),
        (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), "qwen2"),
    ):
        copy = tmp_path / name
        copy.mkdir()
        for f in folder.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        tok = tiny.train_tokenizer()
        tok.pre_tokenizer = pre
        tok.save(str(copy / "tokenizer.json"))
        out, _ = _quantize(tmp_path, capsys, copy, "f16")
        assert _metadata(out)["tokenizer.ggml.pre"] == name


@pytest.mark.parametrize("family, changes", [
    ("mistral", {}), ("mixtral", {}), ("qwen2_moe", {}), ("qwen2", {"use_sliding_window": True, "sliding_window": 12}),
])
def test_a_window_llama_cpp_cannot_hold_is_refused(tmp_path, capsys, tokenizer, family, changes):
    # llama.cpp's llama / qwen2 have no sliding window: a file without it would be another
    # model once a prompt outgrows the window. A window of the whole context never bites.
    folder = tiny.make_model(tmp_path / family, family, tokenizer)
    tiny.set_json(folder / "config.json", **changes)
    out = tmp_path / "out.gguf"
    line = one_error_line(run_inprocess(["quantize", str(folder), str(out), "--type", "q8_0"], capsys))
    assert "with a sliding window of 12 tokens has no GGUF form" in line and "--quantize TYPE" in line, line
    assert not out.exists()
    tiny.set_json(folder / "config.json", sliding_window=256)  # = max_position_embeddings
    assert run_inprocess(["quantize", str(folder), str(out), "--type", "f16"], capsys).code == 0


def test_llama3_rope_settings_are_found_again_from_the_divisors():
    # A GGUF keeps only rope_freqs' divisors; the reader finds settings that give them again
    # (Llama 3.1's and 3.2's own; others as an equal set with low_freq_factor 1).
    from twice.weights.gguf import _llama3_divisors, llama3_rope_from_divisors

    for factor, low, high, original, theta, head_dim in ((8.0, 1, 4, 8192, 5e5, 128), (32.0, 1, 4, 8192, 5e5, 64),
                                                         (8.0, 1, 4, 64, 5e5, 16), (4.0, 2, 8, 4096, 1e4, 64),
                                                         (16.0, 1.5, 6, 32768, 1e6, 128)):
        p = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
             "original_max_position_embeddings": original}
        divisors = _llama3_divisors(p, theta, head_dim).astype(np.float32).astype(np.float64)
        found = llama3_rope_from_divisors(divisors, theta, head_dim)
        assert found is not None, p
        np.testing.assert_allclose(_llama3_divisors(found, theta, head_dim), divisors, rtol=1e-4, atol=1e-6)
        if (low, high, original) == (1, 4, 8192):
            assert found == {"rope_type": "llama3", **p}
    assert llama3_rope_from_divisors(np.array([1.0, 3.0, 1.0, 8.0]), 1e4, 8) is None  # no llama3 settings give these


@pytest.mark.parametrize("family, kind", [("llama", "f32"), ("llama", "q8_0"), ("mistral", "f32"), ("llama3", "f32")])
def test_convert_back_gives_the_same_model(tmp_path, capsys, model_dirs, tokenizer, kind, family):
    """`twice convert` of our output (the GGUF → folder path) is the same model: transformers'
    logits within float rounding (f32) or the quantization's error (q8_0), and the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_dirs(family)
    out, _ = _quantize(tmp_path, capsys, folder, kind)
    back = tmp_path / "back"
    r = run_inprocess(["convert", str(out), str(back)], capsys)
    assert r.code == 0, r
    ids = torch.tensor([tokenizer.encode(tiny.CORPUS[0]).ids[:10]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(back).eval()(ids).logits
    tol = 1e-4 if kind == "f32" else 0.02 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol
    assert torch.equal(got.argmax(-1), want.argmax(-1)) or kind != "f32"
    hf_a, hf_b = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(back)
    for text in tiny.CORPUS[:7]:
        assert hf_b.encode(text) == hf_a.encode(text)
    assert hf_b.chat_template == hf_a.chat_template


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m"])
def test_convert_reads_a_shipped_models_name_as_model_does(tmp_path, capsys, monkeypatch, model_dirs, name):
    """`twice convert NAME OUT` of the default model's or a packaged model's name converts the
    file behind it (as --model NAME runs it), before any path of that name; it said "no such
    file". The file here is a tiny one standing in for the real one."""
    from twice.weights import packaged, resolve

    gguf, _ = _quantize(tmp_path, capsys, model_dirs("llama"), "f32")
    monkeypatch.setattr(resolve, "default_gguf", lambda: gguf)
    monkeypatch.setattr(packaged, "packaged_gguf", lambda ref, progress=None: gguf if ref == name else None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).mkdir()  # a folder of that name in the working directory: the name wins, as for --model
    r = run_inprocess(["convert", name, str(tmp_path / "out")], capsys)
    assert r.code == 0, r
    assert gguf.name in r.err and (tmp_path / "out" / "config.json").is_file()
    r = run_inprocess(["convert", "nosuch-model", str(tmp_path / "other")], capsys)
    assert r.code == 2 and one_error_line(r) == "twice: error: nosuch-model: no such file"


def test_quantize_never_overwrites_the_file_behind_a_shipped_name(tmp_path, capsys, monkeypatch, model_dirs):
    """OUT = the GGUF file a packaged model's name stands for, with --overwrite: refused in one
    line, the file kept (only a model given as a path was compared with OUT: the installed
    default model's file could be replaced by its own quantization); an empty MODEL is one line."""
    from twice.weights import packaged

    name = "qwen2.5-coder-0.5b-instruct-q4_k_m"
    gguf, _ = _quantize(tmp_path, capsys, model_dirs("llama"), "q8_0")
    before = gguf.read_bytes()
    monkeypatch.setattr(packaged, "packaged_gguf", lambda ref, progress=None: gguf if ref == name else None)
    r = run_inprocess(["quantize", name, str(gguf), "--type", "q4_0", "--overwrite"], capsys)
    assert one_error_line(r) == f"twice: error: {gguf}: is the model being quantized; --overwrite would replace it " \
                                "(choose another name)"
    assert gguf.read_bytes() == before
    for args in (["quantize", "", str(tmp_path / "x.gguf"), "--type", "q8_0"], ["info", ""], ["convert", "", "x"]):
        assert "'' names no model" in one_error_line(run_inprocess(args, capsys))
    # an empty OUT_DIR was the working folder (".: folder exists and is not empty")
    assert one_error_line(run_inprocess(["convert", str(gguf), ""], capsys)) == \
        "twice: error: '' names no folder (OUT_DIR: the folder to create)"
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("family, kind", [
    ("llama", "f32"), ("qwen2", "f32"), ("qwen3", "f32"), ("llama3", "f32"),
    pytest.param("qwen2", "q8_0", marks=pytest.mark.slow),  # builds the quantized-weight kernels (~40 s)
])
def test_twice_runs_the_output_as_stored(tmp_path, capsys, model_dirs, tokenizer, family, kind):
    """twice's own GGUF loader (weights as stored) reads our file as the same model:
    transformers' logits on the float folder exactly for f32 (so the layout is right:
    llama's q/k permuted, qwen2/qwen3's not), within Q8_0's error for q8_0 (measured:
    0.041-0.048 of logits up to 2.3 for llama/qwen2/qwen3)."""
    from transformers import AutoModelForCausalLM

    from twice.core.cache import KVCache
    from twice.weights.load import load

    folder = model_dirs(family)
    out, _ = _quantize(tmp_path, capsys, folder, kind)
    ids = torch.tensor([tokenizer.encode(tiny.CORPUS[1]).ids[:12]])
    loaded = load(str(out), device="cpu", dtype="float32")
    with torch.inference_mode():
        got = loaded.model(ids, KVCache(loaded.config, 1, 16, torch.float32, "cpu"), all_logits=True)
        want = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    tol = 1e-4 if kind == "f32" else 0.05 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol


def test_a_gguf_input_is_quantized_from_its_float_values(tmp_path, capsys, model_dirs):
    folder = model_dirs("llama")
    f32, _ = _quantize(tmp_path, capsys, folder, "f32")
    q8, _ = _quantize(tmp_path, capsys, f32, "q8_0", "from-gguf.gguf")
    direct, _ = _quantize(tmp_path, capsys, folder, "q8_0", "direct.gguf")
    a, b = _dequantized(q8), _dequantized(direct)
    assert set(a) == set(b)
    for name in a:
        assert a[name][0] == b[name][0]
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=name)


def test_summary_json(tmp_path, capsys, model_dirs):
    folder = model_dirs("qwen2")
    out, r = _quantize(tmp_path, capsys, folder, "q4_0", None, "--json")
    s = json.loads(r.out)
    assert s["type"] == "q4_0" and s["architecture"] == "qwen2" and s["path"] == str(out)
    # 14 matrices in Q4_0, the tied embedding (the head) in Q8_0, 11 norms and biases in F32
    assert s["tensor_types"] == {"Q4_0": 14, "Q8_0": 1, "F32": 11} and s["tensors"] == 26
    assert s["file_bytes"] == out.stat().st_size > s["tensor_bytes"] == sum(s["tensor_type_bytes"].values())
    params = sum(v.numel() for v in _hf_tensors(folder).values())
    assert s["parameters"] == params
    assert s["bits_per_weight"] == pytest.approx(8 * s["tensor_bytes"] / params, abs=1e-3)
    assert 4.5 < s["bits_per_weight"] < 6.5  # Q4_0 is 4.5 bits, Q8_0 8.5; the norms and biases are F32
    r = run_inprocess(["quantize", str(folder), str(tmp_path / "plain.gguf"), "--type", "q4_0"], capsys)
    assert r.code == 0 and "Q4_0" in r.out and "bits per weight" in r.out


def _k_model(tmp_path, tokenizer) -> Path:
    """A llama whose rows are whole 256-value blocks (the tiny models' 64 are not)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path / "k-model"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.08, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tiny.save_tokenizer(folder, tokenizer)
    return folder


K_REL_RMS = {"q2_k": 0.45, "q3_k": 0.25, "q4_k": 0.12, "q5_k": 0.06, "q6_k": 0.03, "q8_0": 0.01}


@pytest.mark.slow  # the K-type quantizers take seconds for this model's 0.6 M values
@pytest.mark.parametrize("kind, types", [
    ("q4_k_m", {"Q4_K", "Q6_K"}), ("q6_k", {"Q6_K"}), ("q2_k", {"Q2_K", "Q3_K", "Q6_K"}),
])
def test_k_mixtures_round_trip(tmp_path, capsys, tokenizer, kind, types):
    folder = _k_model(tmp_path, tokenizer)
    out, _ = _quantize(tmp_path, capsys, folder, kind)
    expected = _expected(folder, "llama")
    got = _dequantized(out)
    assert got["output.weight"][0] == "Q6_K"  # llama.cpp's rule for the head
    assert {t for n, (t, _) in got.items() if t != "F32"} == types
    for name, want in expected.items():
        type_name, values = got[name]
        if type_name == "F32":
            np.testing.assert_array_equal(values, want, err_msg=name)
            continue
        rel = float(np.sqrt(np.mean((values - want) ** 2)) / np.sqrt(np.mean(want**2)))
        assert rel <= K_REL_RMS[type_name.lower()], (name, type_name, rel)


# -- bad input ------------------------------------------------------------------------------


def test_existing_output_is_kept_without_overwrite(tmp_path, capsys, model_dirs):
    folder = model_dirs("llama")
    out = tmp_path / "out.gguf"
    out.write_bytes(b"precious")
    r = run_inprocess(["quantize", str(folder), str(out), "--type", "q8_0"], capsys)
    assert "exists (pass --overwrite to replace it)" in one_error_line(r)
    assert out.read_bytes() == b"precious"
    _quantize(tmp_path, capsys, folder, "q8_0", "out.gguf", "--overwrite")
    assert out.read_bytes()[:4] == b"GGUF"


def test_an_output_that_is_the_input_or_inside_its_folder_is_refused(tmp_path, capsys, model_dirs):
    """--overwrite made the source's config.json (or safetensors, or the GGUF itself) GGUF bytes."""
    import shutil

    folder = tmp_path / "victim"
    shutil.copytree(model_dirs("llama"), folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for name in ("config.json", "model.safetensors", "new.gguf"):
        r = run_inprocess(["quantize", str(folder), str(folder / name), "--type", "q8_0", "--overwrite"], capsys)
        assert "the model folder being read; choose a name outside it" in one_error_line(r)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    src, _ = _quantize(tmp_path, capsys, folder, "q8_0", "src.gguf")
    kept = src.read_bytes()
    r = run_inprocess(["quantize", str(src), str(src), "--type", "q4_0", "--overwrite"], capsys)
    assert "is the model being quantized" in one_error_line(r) and src.read_bytes() == kept


@pytest.mark.parametrize("bad", ["q9_0", "iq4_xs", ""])
def test_unknown_type_is_one_line(tmp_path, capsys, model_dirs, bad):
    r = run_inprocess(["quantize", str(model_dirs("llama")), str(tmp_path / "o.gguf"), "--type", bad], capsys)
    assert "is not a quantization type; choose one of" in one_error_line(r)
    assert not (tmp_path / "o.gguf").exists()


def test_output_that_is_a_folder_or_a_link_is_refused(tmp_path, capsys, model_dirs):
    folder = model_dirs("llama")
    (tmp_path / "dir.gguf").mkdir()
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "link.gguf").symlink_to(target)
    for name, words in (("dir.gguf", "is a folder"), ("link.gguf", "symbolic link")):
        r = run_inprocess(["quantize", str(folder), str(tmp_path / name), "--type", "q8_0", "--overwrite"], capsys)
        assert words in one_error_line(r)
    assert target.read_bytes() == b"keep" and (tmp_path / "link.gguf").is_symlink()
    r = run_inprocess(["quantize", str(folder), str(tmp_path / "no" / "o.gguf"), "--type", "q8_0"], capsys)
    assert "does not exist" in one_error_line(r)


def test_row_length_no_block_fits_is_one_line(tmp_path, capsys, tokenizer):
    """Rows of 40 values: no 32-value block type holds them (llama.cpp refuses them too)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path / "odd"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=40, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tiny.save_tokenizer(folder, tokenizer)
    for kind in ("q8_0", "q4_k_m"):
        r = run_inprocess(["quantize", str(folder), str(tmp_path / "o.gguf"), "--type", kind], capsys)
        line = one_error_line(r)
        assert "token_embd.weight (rows of 40 values) cannot be stored as" in line, line
        assert not (tmp_path / "o.gguf").exists()
    _quantize(tmp_path, capsys, folder, "f16")  # a float type holds any row


@pytest.mark.parametrize("change, words", [
    ({"byte_fallback": True}, "a SentencePiece-style tokenizer with normalizer"),  # byte fallback with ByteLevel splits
    ("wordlevel", "a WordLevel tokenizer cannot be written as GGUF"),
    ("pre", "its pre-tokenizer matches none llama.cpp knows by name"),
])
def test_tokenizers_gguf_cannot_hold_are_one_line(tmp_path, capsys, model_dirs, change, words):
    src = model_dirs("llama")
    folder = tmp_path / "tok"
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    if change == "wordlevel":
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    data = json.loads((folder / "tokenizer.json").read_text())
    if change == "wordlevel":
        pass
    elif change == "pre":
        data["pre_tokenizer"] = {"type": "Whitespace"}
    else:
        data["model"].update(change)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    out = tmp_path / "o.gguf"
    r = run_inprocess(["quantize", str(folder), str(out), "--type", "q8_0"], capsys)
    assert words in one_error_line(r)
    assert not out.exists()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_midway_leaves_nothing_behind(tmp_path, capsys, model_dirs, monkeypatch, existing):
    """The disk fills after 3 tensors: one line, no OUT (or the old OUT unchanged), no temporary file."""
    import errno

    import gguf

    folder = model_dirs("qwen3")
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out.gguf"
    if existing:
        out.write_bytes(b"old model")
    calls = {"n": 0}
    real = gguf.GGUFWriter.write_tensor_data

    def failing(self, tensor, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    r = run_inprocess(["quantize", str(folder), str(out), "--type", "q8_0", "--overwrite"], capsys)
    assert "cannot write the GGUF file (No space left on device)" in one_error_line(r)
    assert calls["n"] == 4
    assert (out.read_bytes() == b"old model") if existing else not out.exists()
    assert _leftovers(work) == []


def test_a_bad_tensor_midway_leaves_nothing_behind(tmp_path, capsys, model_dirs, monkeypatch):
    """A quantizer that fails on the 5th tensor (here: NaN in the checkpoint) ends the same way."""
    from safetensors.torch import save_file

    src = model_dirs("llama")
    folder = tmp_path / "nan"
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out.gguf"
    r = run_inprocess(["quantize", str(folder), str(out), "--type", "q4_0"], capsys)
    assert "'model.layers.1.mlp.up_proj.weight' contains NaN or infinite values" in one_error_line(r)
    assert not out.exists() and _leftovers(tmp_path) == []


# -- llama.cpp itself (outside CI: needs llama-cpp-python) ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q4_k_m", "q5_k_m", "q6_k", "q3_k_m", "q2_k", "q8_0", "f32"])
def test_llama_cpp_reads_the_k_mixtures_as_twice_runs_them(tmp_path, capsys, model_dirs, tokenizer, kind):
    """The K types on rows that hold them (256 and 512 values): llama.cpp loads the file and its
    logits are twice's own on the same file as stored: the same blocks, read alike. What
    differs is how each engine rounds the activations and llama.cpp's f16 KV cache: measured
    0.022-0.029 of the logits' scale for every K mixture, 0.023 for a Q8_0 file (whose layout
    test_llama_cpp_loads_the_output checks against transformers), under 0.001 for f32; a
    misread block would move them by the logits' whole size."""
    from twice.core.cache import KVCache
    from twice.weights.load import load

    python = llama_cpp_python()
    if python is None:
        pytest.skip("llama_cpp is not importable (set TWICE_LLAMA_CPP_PYTHON to a Python that has it)")
    out, r = _quantize(tmp_path, capsys, model_dirs("llama-wide"), kind, None, "--json")
    types = json.loads(r.out)["tensor_types"]
    assert kind in ("q8_0", "f32") or any(t.endswith("_K") for t in types), types  # it really holds K blocks
    texts = tiny.CORPUS[:3]
    p = subprocess.run([python, "-c", _LOAD_AND_TOKENIZE, str(out), json.dumps(texts)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["ids"] == [tokenizer.encode(t).ids for t in texts] and result["finite"]
    ids = torch.tensor([tokenizer.encode(texts[0]).ids[:8]])
    loaded = load(str(out), device="cpu", dtype="float32")
    with torch.inference_mode():
        want = loaded.model(ids, KVCache(loaded.config, 1, 16, torch.float32, "cpu"), all_logits=True)[0]
    got = torch.tensor(result["logits"])
    tol = (0.002 if kind == "f32" else 0.04) * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol, kind


_LOAD_AND_TOKENIZE = """
import json, sys
import numpy as np
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], verbose=False, n_ctx=64, n_threads=1, logits_all=True)
texts = json.loads(sys.argv[2])
ids = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
llm.eval(ids[0][:8])
logits = np.asarray(llm.scores[:8])
print(json.dumps({"ids": ids, "n_vocab": llm.n_vocab(), "finite": bool(np.isfinite(logits).all()),
                  "logits": logits.tolist()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3", "gpt2"])
@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_0"])
def test_llama_cpp_loads_the_output(tmp_path, capsys, model_dirs, tokenizer, family, kind):
    """llama.cpp loads the file, tokenizes every text as the original tokenizer does, and its
    logits are transformers' on the float folder (f32: within its f16 KV cache's rounding, so
    llama.cpp reads the layout as meant: llama's permuted q/k under its RoPE, llama3's
    rope_freqs, GPT-2's fused qkv). Measured, of logits up to 2.1-2.6: f32 7e-4..1.2e-3,
    q8_0 0.04-0.06, q4_0 0.38-0.68."""
    from transformers import AutoModelForCausalLM

    python = llama_cpp_python()
    if python is None:
        pytest.skip("llama_cpp is not importable (set TWICE_LLAMA_CPP_PYTHON to a Python that has it)")
    folder = model_dirs(family)
    out, _ = _quantize(tmp_path, capsys, folder, kind)
    texts = tiny.CORPUS[:7] + ["<|im_start|>user\nHi<|im_end|>\n"]
    p = subprocess.run([python, "-c", _LOAD_AND_TOKENIZE, str(out), json.dumps(texts)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["n_vocab"] == tiny.VOCAB
    assert result["ids"] == [tokenizer.encode(t).ids for t in texts]
    assert result["finite"]
    ids = torch.tensor([tokenizer.encode(texts[0]).ids[:8]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits[0]
    got = torch.tensor(result["logits"])
    scale = float(want.abs().max())
    tol = {"f32": 1e-3, "q8_0": 0.05, "q4_0": 0.5}[kind] * scale
    assert float((got - want).abs().max()) <= tol
