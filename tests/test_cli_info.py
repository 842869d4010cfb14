"""`twice info`: the facts of tiny llama / qwen3 / gpt2 folders, as text and as JSON, equal
to their config.json and to the tensors in model.safetensors."""

from __future__ import annotations

import json
import math
import shutil
import struct

import pytest

from clirun import run_inprocess

FAMILIES = ["llama", "qwen3", "gpt2"]
JSON_KEYS = {"name", "folder", "model_type", "parameters", "stored_dtype", "dtype", "weight_bytes", "context_length",
             "layers", "heads", "kv_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size", "rope",
             "sliding_window", "kv_bytes_per_token", "kv_bytes_full_context", "chat_template", "eos_token_ids",
             "dtype_reason", "weight_format", "source", "active_parameters", "active_weight_bytes", "kv_dtype",
             "decode_steps"}


def tensor_elements(path) -> int:
    """Sum of the tensor sizes in a safetensors file, read from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def expected(folder) -> dict:
    """What info must say, from config.json (either naming scheme) and the weights."""
    cfg = json.loads((folder / "config.json").read_text())
    g = lambda *names: next(cfg[n] for n in names if cfg.get(n) is not None)  # noqa: E731
    layers, heads = g("num_hidden_layers", "n_layer"), g("num_attention_heads", "n_head")
    hidden = g("hidden_size", "n_embd")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    return {"model_type": cfg["model_type"], "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "hidden_size": hidden, "vocab_size": cfg["vocab_size"],
            "context_length": g("max_position_embeddings", "n_positions"),
            "parameters": tensor_elements(folder / "model.safetensors")}


def info(capsys, *args):
    return run_inprocess(["info", *args], capsys)


@pytest.mark.parametrize("family", FAMILIES)
def test_info_json_equals_the_config_and_the_weights(capsys, model_dirs, family):
    folder = model_dirs(family)
    want = expected(folder)
    r = info(capsys, str(folder), "--json")
    assert r.code == 0, r.err
    facts = json.loads(r.out)
    assert set(facts) == JSON_KEYS
    for key, value in want.items():
        assert facts[key] == value, key
    L, H, d, n = want["layers"], want["kv_heads"], want["head_dim"], want["context_length"]
    assert facts["dtype"] == "float32" and facts["stored_dtype"] == "float32"
    assert facts["weight_bytes"] == want["parameters"] * 4
    assert facts["kv_bytes_per_token"] == 2 * L * H * d * 4
    assert facts["kv_bytes_full_context"] == 2 * L * H * d * 4 * n
    assert facts["chat_template"] is True and facts["eos_token_ids"] == [2]
    assert (facts["rope"] is None) == (family == "gpt2")
    # which steps run it: the native one all but GPT-2, the compiled one every family here
    steps = facts["decode_steps"]
    assert steps == {"native": family != "gpt2", "compiled": True, "features": steps["features"]}
    assert ("block:gpt2" in steps["features"]) == (family == "gpt2") and "act:" in " ".join(steps["features"])
    # In bfloat16 the weights and the cache take half as much.
    half = json.loads(info(capsys, str(folder), "--json", "--dtype", "bfloat16").out)
    assert half["dtype"] == "bfloat16"
    assert (half["weight_bytes"], half["kv_bytes_per_token"]) == (want["parameters"] * 2, 2 * L * H * d * 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_info_text_shows_the_same_numbers(capsys, monkeypatch, model_dirs, family):
    monkeypatch.delenv("COLUMNS", raising=False)
    folder = model_dirs(family)
    want = expected(folder)
    r = info(capsys, str(folder))
    assert r.code == 0, r.err
    L, H, d = want["layers"], want["kv_heads"], want["head_dim"]
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in r.out.splitlines() if line.count("│") == 3}
    assert rows["architecture"].startswith(want["model_type"])
    assert rows["parameters"].startswith(f"{want['parameters']:,} (")
    assert rows["layers / heads / kv heads / head dim"] == f"{L} / {want['heads']} / {H} / {d}"
    assert rows["context length"] == f"{want['context_length']:,} tokens"
    per_token = 2 * L * H * d * 4
    assert rows["KV cache per token"].endswith(f"2 · L · H_kv · d · bytes = 2 · {L} · {H} · {d} · 4 = {per_token:,} B")
    assert f"({want['parameters'] * 4:,} B)" in rows["weights"] and "float32" in rows["weights"]
    assert rows["KV cache at full context"].endswith(f"(per token × {want['context_length']:,})")
    assert rows["chat template"] == "yes"
    assert rows["decode steps"].startswith(f"native CPU step {'no: eager' if family == 'gpt2' else 'yes'}; "
                                           "compiled (--compile, a GPU) yes;")
    assert rows["position encoding"] == ("learned absolute positions" if family == "gpt2" else
                                         "RoPE default (rope_theta 10000)")
    assert "\x1b[" not in r.out


def test_info_without_a_chat_template_and_bad_input(capsys, model_dirs, tmp_path):
    dest = tmp_path / "plain"
    shutil.copytree(model_dirs("llama"), dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert json.loads(info(capsys, str(dest), "--json").out)["chat_template"] is False
    assert "│ chat template" in info(capsys, str(dest)).out and "│ no " in info(capsys, str(dest)).out
    for args, code, message in [([str(tmp_path / "missing")], 2, "no such folder"),
                                ([str(dest), "--dtype", "int8"], 2, "unknown dtype 'int8'")]:
        r = info(capsys, *args)
        assert r.code == code and r.out == ""
        assert r.err.startswith("twice: error: ") and r.err.count("\n") == 1 and message in r.err


@pytest.mark.parametrize("changes, words", [
    ({"intermediate_size": 128}, "has shape [64, 96], the config implies [64, 128]"),  # was reported as 128, exit 0
    ({"num_hidden_layers": 3}, "checkpoint is missing tensors: model.layers.2."),
    ({"num_hidden_layers": 1}, "tensors not used by a llama model: model.layers.1."),
    ({"vocab_size": 100}, "the tokenizer has token ids up to"),
])
def test_info_refuses_what_generate_would(capsys, model_dirs, tmp_path, changes, words):
    # info reads no weights, but the headers' names and shapes and the tokenizer must agree
    # with the config it reports.
    dest = tmp_path / "m"
    shutil.copytree(model_dirs("llama"), dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, **changes}))
    r = info(capsys, str(dest), "--json")
    assert r.code == 2 and r.out == "" and r.err.count("\n") == 1 and words in r.err, r.err
    gen = run_inprocess(["generate", "hi", "-m", str(dest), "-n", "1"], capsys)
    assert gen.code == 2 and words in gen.err, gen.err  # the same line


def test_info_of_a_gguf_run_as_stored(capsys, model_dirs, tmp_path):
    """A GGUF is described from its header: the stored types, their bytes and bits per
    weight; --dequantize describes its float copy instead."""
    from clirun import run_inprocess
    from twice.weights.gguf_file import read_gguf

    path = tmp_path / "m.gguf"
    assert run_inprocess(["quantize", str(model_dirs("llama")), str(path), "--type", "q8_0"], capsys).code == 0
    facts = json.loads(info(capsys, str(path), "--json").out)
    assert facts["source"] == str(path.resolve())
    assert facts["weight_bytes"] == sum(t.n_bytes for t in read_gguf(path).tensors)
    assert set(facts["weight_format"]["types"]) == {"Q8_0", "F32"}
    assert 8.0 < facts["weight_format"]["bits_per_weight"] < 9.0
    text = info(capsys, str(path)).out
    assert "bits per weight" in text and "Q8_0" in text
    floats = json.loads(info(capsys, str(path), "--dequantize", "--json").out)
    assert floats["source"] is None and floats["weight_bytes"] == 4 * floats["parameters"]
