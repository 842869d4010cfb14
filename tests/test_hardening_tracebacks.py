"""Issue 13, item 12: inputs that raised a traceback end in one line (`twice: error: ...`,
exit 2) or, for Ctrl-C, in exit 130 and `twice: interrupted`.

* Every JSON file twice reads goes through core/fields.py: wrong types, out-of-range
  values, 100,000-deep nesting and 400-digit numbers in config.json (RoPE/YaRN/llama3
  fields too), generation_config.json, tokenizer_config.json and the shard index are one
  line naming the file (and the key). A bool is true or false, never a truthy string.
* A tokenizer with ids past the model's vocabulary is refused at load, naming tokenizer.json.
* TWICE_CACHE pointing at a regular file (or under one) is one line, for the model cache
  and for the kernel cache.
* RANK/WORLD_SIZE without torchrun are ignored with one notice.
* Ctrl-C while Python imports (the import itself, an ImportError it turns into, or C code
  that swallows it) exits 130, sent at a readiness line, never after a sleep.
* Control characters from file contents (a tensor name, a template's raise_exception
  text) are printed escaped, never raw.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blocking_hook import hook_env, wait_until_blocked
from clirun import run_inprocess
import tiny


@pytest.fixture(scope="module")
def llama(model_dirs) -> Path:
    return model_dirs("llama")


def copy_model(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(src, dest)
    return dest


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    result = change(data)
    path.write_text(result if isinstance(result, str) else json.dumps(data))


def one_error_line(r, *words) -> str:
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert r.code == 2, (r.code, r.err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("twice: error: "), r.err[-2000:]
    assert "Traceback" not in r.err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def generate(capsys, folder, *extra):
    return run_inprocess(["generate", "Hello", "--model", str(folder), "-n", "2", *extra], capsys)


# -- config.json ---------------------------------------------------------------------------------
def _rope(kind, **fields):
    base = {"llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1},
            "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}[kind]
    return {**base, **fields}


BIG = 10**99  # within fields.loads' 100 digits, so the getter, not the parser, refuses it
CONFIG_CASES = [
    # (changes to config.json, words of the line)
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got \"no\""),
    ({"attention_bias": "yes"}, "attention_bias must be true or false, got \"yes\""),
    ({"mlp_bias": 1}, "mlp_bias must be true or false, got 1"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, got \"1e-6\""),
    ({"rms_norm_eps": [1e-6]}, "rms_norm_eps must be a positive number, got [1e-06]"),
    ({"hidden_act": ["silu"]}, "hidden_act must be a string"),
    ({"bos_token_id": "0"}, "bos_token_id must be a non-negative integer"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id must be a token id or a list of them"),
    ({"head_dim": BIG}, "head_dim must be a positive integer of at most 2,147,483,647"),
    ({"max_position_embeddings": 2**40}, "max_position_embeddings must be a positive integer of at most"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": BIG}}, "rope_parameters.rope_theta must be a number in (1, 1e+30]"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_parameters.rope_theta must be a number"),
    ({"rope_parameters": {"rope_type": ["yarn"], "rope_theta": 1e4}}, "rope type [\"yarn\"] is not supported"),
    ({"rope_parameters": _rope("linear", factor="2")}, "rope_parameters.factor must be a number in [1, 1,000,000]"),
    ({"rope_parameters": _rope("llama3", factor=BIG)}, "rope_parameters.factor must be a number in [1, 1,000,000]"),
    ({"rope_parameters": _rope("yarn", factor=0.5)}, "rope_parameters.factor must be a number in [1, 1,000,000], got 0.5"),
    ({"rope_parameters": _rope("llama3", low_freq_factor="1")}, "rope_parameters.low_freq_factor must be a number"),
    ({"rope_parameters": _rope("llama3", high_freq_factor=None)}, "rope_parameters.high_freq_factor is missing"),
    ({"rope_parameters": _rope("llama3", original_max_position_embeddings=BIG)},
     "rope_parameters.original_max_position_embeddings must be an integer in [1, 2,147,483,647]"),
    ({"rope_parameters": _rope("yarn", beta_fast="x")}, "rope_parameters.beta_fast must be a number in (0, 1,000,000]"),
    ({"rope_parameters": _rope("yarn", beta_slow=-1)}, "rope_parameters.beta_slow must be a number in (0, 1,000,000]"),
    ({"rope_parameters": _rope("yarn", mscale=BIG)}, "rope_parameters.mscale must be a number in [0, 1,000,000]"),
    ({"rope_parameters": _rope("yarn", mscale_all_dim=-1)}, "rope_parameters.mscale_all_dim must be a number in [0"),
    ({"rope_parameters": _rope("yarn", attention_factor=[1])}, "rope_parameters.attention_factor must be a number"),
    ({"rope_parameters": _rope("yarn", truncate="no")}, "rope_parameters.truncate must be true or false"),
    ({"rope_parameters": _rope("yarn", partial_rotary_factor="1")}, "rope_parameters.partial_rotary_factor must be a number"),
    ({"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": _rope("yarn", beta_fast=[1])},
     "rope_scaling.beta_fast must be a number"),
    # transformers refuses these too: yarn names its factor; layer_types is checked in every
    # config (llama reads none of it, a wrong one is still a mistake in the file)
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.factor is missing"),
    ({"layer_types": ["full_attention"]}, "layer_types must list one of full_attention/sliding_attention per layer "
                                          "(2 layers), got 1 entry"),
    ({"layer_types": ["full_attention", "bogus"]}, 'got 2 entries, layer_types[1] "bogus"'),
    ({"layer_types": "full_attention"}, "layer_types must list one of"),
    # partial rotary is phi3's: transformers ignores the field for llama, or fails on it
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5: llama models rotate the whole head"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5: llama models rotate the whole head"),
]


@pytest.mark.parametrize("changes, words", CONFIG_CASES, ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else "")
def test_wrong_types_and_ranges_in_config_json(llama, tmp_path, capsys, changes, words):
    folder = copy_model(llama, tmp_path)
    edit_json(folder / "config.json", lambda d: d.update(changes))
    before = (folder / "config.json").read_bytes()
    line = one_error_line(generate(capsys, folder), str(folder / "config.json"), words)
    assert len(line) < 400
    assert (folder / "config.json").read_bytes() == before


@pytest.mark.parametrize("key, value, words", [
    ("layer_norm_epsilon", -1, "config.json: layer_norm_epsilon must be"),
    ("n_embd", "wide", "config.json: n_embd must be"),
    ("n_layer", 10**6, "config.json: n_layer 1000000 is not a plausible layer count"),
    ("n_head", 5, "config.json: n_embd (64) is not divisible by n_head (5)"),
])
def test_a_gpt2_config_is_named_by_its_own_keys(key, value, words):
    # GPT-2 spells the common sizes its own way; a message names the key the file holds.
    from twice.core.config import config_from_dict
    from twice.core.errors import ConfigError

    raw = {"model_type": "gpt2", "vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 4, key: value}
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert words in str(e.value), str(e.value)


def test_a_gpt2_config_reads_its_own_names_only_where_transformers_does():
    # GPT2Config reads activation_function, layer_norm_epsilon and n_inner, never the shared
    # names; hidden_size (as attribute_map) wins over n_embd where both are given.
    import transformers

    from twice.core.config import config_from_dict

    raw = {"model_type": "gpt2", "vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": None,
           "activation_function": "gelu_new", "hidden_act": "relu", "layer_norm_epsilon": 1e-5, "rms_norm_eps": 0.5,
           "intermediate_size": 7}
    c, hf = config_from_dict(raw), transformers.GPT2Config.from_dict(raw)
    assert (c.hidden_act, c.rms_norm_eps, c.intermediate_size) == (hf.activation_function, hf.layer_norm_epsilon, 4 * 64)
    both = config_from_dict({**raw, "hidden_size": 32})
    assert both.hidden_size == transformers.GPT2Config.from_dict({**raw, "hidden_size": 32}).n_embd == 32


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_mlp_bias_is_llamas_alone(family):
    # transformers builds these MLPs without biases whatever the config says; a stray
    # mlp_bias must not make twice look for bias tensors the checkpoint never had
    from twice.core.config import config_from_dict

    raw = tiny.hf_config(family).to_dict()
    assert config_from_dict({**raw, "mlp_bias": True}).mlp_bias is False
    assert config_from_dict({**tiny.hf_config("llama").to_dict(), "mlp_bias": True}).mlp_bias is True


def test_400_digit_numbers_anywhere_in_a_json_file_are_one_line(llama, tmp_path, capsys):
    for name, key in (("config.json", "rope_theta"), ("config.json", "rms_norm_eps"),
                      ("generation_config.json", "temperature"), ("tokenizer_config.json", "model_max_length")):
        folder = copy_model(llama, tmp_path / name / key)
        path = folder / name
        edit_json(path, lambda d: json.dumps(d)[:-1] + f', "{key}": {"9" * 400}}}')
        one_error_line(generate(capsys, folder), str(path), "an integer of 400 digits")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_100000_deep_json_is_one_line(llama, tmp_path, capsys, name):
    folder = copy_model(llama, tmp_path)
    (folder / name).write_text("[" * 100_000 + "]" * 100_000)
    line = one_error_line(generate(capsys, folder), str(folder / name))
    assert "nested more than 64 levels deep" in line or "not a valid safetensors index" in line


def test_every_accepted_rope_field_computes(tmp_path):
    """Any value the checks accept gives finite frequencies (no ZeroDivision, overflow or
    math domain error left for the model to meet): the corners of every range."""
    import math

    from twice.core.config import config_from_dict
    from twice.core.errors import TwiceError
    from twice.core.rope import inverse_frequencies

    base = {"model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 2**31 - 1}
    corners = {"factor": (1, 1e6), "beta_fast": (1e-300, 1e6), "beta_slow": (1e-300, 1e6),
               "mscale": (0, 1e6), "mscale_all_dim": (0, 1e6), "attention_factor": (1e-300, 1e6),
               "original_max_position_embeddings": (1, 2**31 - 1), "rope_theta": (1 + 1e-15, 1e30)}
    for kind in ("linear", "llama3", "yarn"):
        for key, values in corners.items():
            for value in values:
                params = _rope(kind, **{key: value})
                config = {**base, "rope_parameters": params}
                try:
                    parsed = config_from_dict(copy.deepcopy(config))
                    inv_freq, scaling = inverse_frequencies(parsed)
                except TwiceError as e:
                    assert "\n" not in str(e)
                    continue
                assert math.isfinite(scaling), (kind, key, value)
                assert not inv_freq.isnan().any(), (kind, key, value)


# -- generation_config.json ---------------------------------------------------------------------------
GENERATION_CASES = [
    ({"temperature": "hot"}, "temperature must be a non-negative number, got \"hot\""),
    ({"temperature": [0.7]}, "temperature must be a non-negative number, got [0.7]"),
    ("1e400", "temperature must be a non-negative number, got inf"),  # JSON's 1e400 is a float overflow
    ({"top_k": "x"}, "top_k must be a non-negative integer, got \"x\""),
    ({"top_k": 2.5}, "top_k must be a non-negative integer, got 2.5"),
    ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
    ({"min_p": 1}, "min_p must be a number in [0, 1), got 1"),
    ({"repetition_penalty": {}}, "repetition_penalty must be a positive number, got {}"),
    ({"do_sample": "no"}, "do_sample must be true or false, got \"no\""),
    ({"do_sample": 0}, "do_sample must be true or false, got 0"),
    ({"eos_token_id": "2"}, "eos_token_id must be a token id or a list of them"),
]


@pytest.mark.parametrize("changes, words", GENERATION_CASES, ids=lambda v: str(v)[:30])
def test_wrong_types_in_generation_config(llama, tmp_path, capsys, changes, words):
    folder = copy_model(llama, tmp_path)
    path = folder / "generation_config.json"
    if isinstance(changes, str):
        edit_json(path, lambda d: json.dumps(d)[:-1] + f', "temperature": {changes}}}')
    else:
        edit_json(path, lambda d: d.update(changes))
    one_error_line(generate(capsys, folder), str(path), words)


def test_generation_config_values_in_range_are_used(llama, tmp_path, capsys):
    from twice.weights.files import read_config, read_generation_config

    folder = copy_model(llama, tmp_path)
    edit_json(folder / "generation_config.json", lambda d: d.update(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0, repetition_penalty=1.1, eos_token_id=[2, 1]))
    got = read_generation_config(folder, read_config(folder))
    assert got.eos_token_ids == (2, 1)
    assert got.sampling == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.0,
                            "repetition_penalty": 1.1}
    assert generate(capsys, folder, "--seed", "1").code == 0


# -- the JSON of batch input lines, resume files ------------------------------------------------------
def test_deep_and_huge_json_in_batch_lines_are_line_errors():
    from twice.cli.batch_input import parse_input

    text = "\n".join(['{"id": 1, "prompt": "a"}', '{"id": 2, "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
                      '{"id": ' + "7" * 400 + ', "prompt": "b"}', '{"id": 4, "prompt": "c", "temperature": NaN}'])
    records, errors = parse_input(text, "jsonl")
    assert [r.id for r in records] == [1]
    messages = {e.line: e.message for e in errors}
    assert "nested more than 64 levels deep" in messages[2]
    assert "an integer of 400 digits" in messages[3]
    assert "NaN is not a JSON value" in messages[4]


def test_resume_scan_of_deep_json_neither_crashes_nor_cuts(tmp_path):
    from twice.cli.batch_output import scan_output
    from twice.core.errors import TwiceError

    ours = b'{"id": "a", "completion": "x", "finish_reason": "length"}\n'
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    with pytest.raises(TwiceError, match="not a line of ours"):
        scan_output(ours + deep + ours, "out.jsonl")
    # a complete last line that is JSON beyond our bounds is not a torn write: refused, not cut
    with pytest.raises(TwiceError, match="not a"):
        scan_output(ours + b'{"id": ' + b"9" * 400 + b', "finish_reason": "stop"}\n', "out.jsonl")
    assert scan_output(ours + b'{"id": "b", "compl', "out.jsonl").done == {"a"}


# -- a tokenizer larger than the model ---------------------------------------------------------------
def _add_token(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|extra|>", special=True)])  # id 512 = the model's vocab_size
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("command", ["generate", "chat", "batch"])
def test_tokenizer_ids_past_the_vocabulary(llama, tmp_path, capsys, monkeypatch, command):
    folder = copy_model(llama, tmp_path)
    _add_token(folder)
    prompts = tmp_path / "in.txt"
    prompts.write_text("Hello <|extra|>\n")
    args = {"generate": ["generate", "Hello <|extra|>", "-n", "2"], "chat": ["chat"],
            "batch": ["batch", str(prompts), "-n", "2", "-o", str(tmp_path / "out.jsonl")]}[command]
    r = run_inprocess([*args, "--model", str(folder)], capsys, stdin=b"Hello\n", monkeypatch=monkeypatch)
    one_error_line(r, str(folder / "tokenizer.json"), "token ids up to 512", "has 512 (ids 0..511)")
    assert not (tmp_path / "out.jsonl").exists()


def _unigram_without_q(folder: Path) -> None:
    """The tokenizer as a Unigram model with no unk_id and no Q or q: tokenizers raises a
    plain Exception for a text holding either (it was a traceback)."""
    def change(j):
        vocab = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
        j["model"] = {"type": "Unigram", "unk_id": None, "byte_fallback": False,
                      "vocab": [[t, -1.0] for t, _ in vocab if t not in ("Q", "q")]}
    edit_json(folder / "tokenizer.json", change)


def test_a_text_the_tokenizer_cannot_encode_is_one_line_and_a_batch_line_error(llama, tmp_path, capsys):
    folder = copy_model(llama, tmp_path)
    _unigram_without_q(folder)
    r = run_inprocess(["generate", "Quick", "--raw", "-n", "2", "--model", str(folder)], capsys)
    one_error_line(r, "the tokenizer cannot encode this text", "unk_id")
    prompts, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    prompts.write_text("Quick\nhello\n")
    r = run_inprocess(["batch", str(prompts), "--raw", "-n", "2", "-o", str(out), "--model", str(folder)], capsys)
    assert r.code == 0 and "in.txt:1" in r.err and "cannot encode" in r.err and "Traceback" not in r.err, r.err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["2"]


def test_a_sparse_vocabulary_past_the_model_is_one_line(llama, tmp_path, capsys):
    """A tokenizer.json whose vocabulary holds an id past the model while its size does
    not say so: refused when the prompt produces that id (batch skips that line, saying why)."""
    folder = copy_model(llama, tmp_path)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    word = max(vocab, key=vocab.get)
    vocab[word] = 600
    path.write_text(json.dumps(data))
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(path)).decode([600])
    one_error_line(run_inprocess(["generate", text, "--raw", "--model", str(folder), "-n", "2"], capsys),
                   "token id 600, outside the model's vocabulary (0..511)")
    prompts = tmp_path / "in.txt"
    prompts.write_text(f"Hello\n{text}\n")
    r = run_inprocess(["batch", str(prompts), "--raw", "--model", str(folder), "-n", "2"], capsys)
    assert r.code == 0 and [json.loads(line)["id"] for line in r.out.splitlines()] == ["1"], r.err
    assert f"{prompts}:2: the tokenizer gave token id 600, outside the model's vocabulary" in r.err
    assert "Traceback" not in r.err


# -- TWICE_CACHE that is not a folder ----------------------------------------------------------------
@pytest.mark.parametrize("under", [False, True])
def test_twice_cache_on_a_regular_file(tmp_path, capsys, monkeypatch, under):
    plain = tmp_path / "plain"
    plain.write_bytes(b"mine\n")
    cache = plain / "sub" if under else plain
    monkeypatch.setenv("TWICE_CACHE", str(cache))
    r = run_inprocess(["generate", "Hello", "-n", "2"], capsys)  # the default model: converted into the cache
    line = one_error_line(r, f"the cache folder {cache} (from TWICE_CACHE)", "set TWICE_CACHE to a folder")
    assert ("is inside " + str(plain) + ", which is a file") in line if under else "is a file;" in line
    assert plain.read_bytes() == b"mine\n"


def test_kernel_cache_on_a_regular_file(tmp_path, monkeypatch):
    from twice.core import kernels
    from twice.core.errors import TwiceError

    plain = tmp_path / "plain"
    plain.write_bytes(b"mine\n")
    monkeypatch.setenv("TWICE_CACHE", str(plain))
    monkeypatch.delenv("TWICE_KERNELS_CACHE")  # the kernels' folder under TWICE_CACHE is what this is about
    monkeypatch.setattr(kernels, "_STATE", {})
    if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CC"):
        pytest.skip("no C compiler: the kernels are never built")
    with pytest.raises(TwiceError, match=r"the cache folder .*plain \(from TWICE_CACHE\) is a file"):
        kernels.library()
    assert plain.read_bytes() == b"mine\n"


def test_xdg_cache_home_on_a_regular_file_names_its_variable(tmp_path, monkeypatch):
    from twice.core.errors import TwiceError
    from twice.core.paths import cache_dir

    plain = tmp_path / "plain"
    plain.write_text("x")
    monkeypatch.delenv("TWICE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(plain))
    with pytest.raises(TwiceError, match=r"plain/twice \(from XDG_CACHE_HOME\) is inside .*plain, which is a file"):
        cache_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "new" / "deeper"))  # missing folders are fine
    assert cache_dir() == tmp_path / "new" / "deeper" / "twice"


# -- RANK/WORLD_SIZE without torchrun ---------------------------------------------------------------
@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "2"},
                                 {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
                                 {"RANK": "x", "WORLD_SIZE": "", "LOCAL_RANK": "3"}])
def test_rank_and_world_size_without_torchrun(llama, tmp_path, capsys, monkeypatch, env):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    r = generate(capsys, llama, "--raw")
    assert r.code == 0, r.err
    notes = [line for line in r.err.splitlines() if "torchrun did not start this process" in line]
    assert len(notes) == 1 and "running as one process" in notes[0] and "Traceback" not in r.err
    prompts = tmp_path / "in.txt"
    prompts.write_text("a\nb\n")
    r = run_inprocess(["batch", str(prompts), "--model", str(llama), "-n", "2", "-o", str(tmp_path / "o.jsonl")], capsys)
    assert r.code == 0 and "running as one process" in r.err, r.err
    assert [json.loads(line)["id"] for line in (tmp_path / "o.jsonl").read_text().splitlines()] == ["1", "2"]
    r = generate(capsys, llama, "--tp", "2")
    one_error_line(r, "--tp 2 needs 2 processes: launch with torchrun")


def test_torchrun_values_that_are_not_a_rank_are_one_line(monkeypatch):
    from twice.core.errors import TwiceError
    from twice.core.parallel import init_from_env

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    for rank, world in (("x", "2"), ("2", "2"), ("0", "0")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(TwiceError) as info:
            init_from_env("cpu")
        assert "\n" not in str(info.value) and "torchrun set" in str(info.value)


# -- control characters from file contents ------------------------------------------------------------
def test_printable_escapes_what_could_drive_a_terminal():
    from twice.cli.errors import printable

    assert printable("a\x1b[31mb") == "a\\x1b[31mb"
    assert printable("\x1b]0;pwned\x07") == "\\x1b]0;pwned\\x07"
    assert printable("\x9b2J \x7f \u202e \u2066 \u200f \u2028 \udcff") == "\\x9b2J \\x7f \\u202e \\u2066 \\u200f \\u2028 \\udcff"
    assert printable("plain text, é, 日本語, emoji 😀, a \\ backslash") == "plain text, é, 日本語, emoji 😀, a \\ backslash"


def test_a_tensor_name_with_an_escape_sequence_is_printed_escaped(llama, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = copy_model(llama, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.\x1b[31mred\x1b[0m.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    r = generate(capsys, folder)
    line = one_error_line(r, "\\x1b[31mred\\x1b[0m")
    assert "\x1b" not in r.err and "\x1b" not in r.out


def test_a_template_raising_an_escape_sequence_is_printed_escaped(llama, tmp_path, capsys, monkeypatch):
    folder = copy_model(llama, tmp_path)
    edit_json(folder / "tokenizer_config.json", lambda d: d.update(
        chat_template="{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('\x1b]0;pwned\x07\u202egnp.exe') }}"
                      "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    r = run_inprocess(["generate", "boom", "--model", str(folder), "-n", "2"], capsys)
    one_error_line(r, "\\x1b]0;pwned\\x07\\u202egnp.exe")
    assert "\x1b" not in r.err and "\x07" not in r.err and "\u202e" not in r.err
    # in chat the failed turn is one error line and the session goes on
    r = run_inprocess(["chat", "--model", str(folder), "-n", "2"], capsys, stdin=b"boom\nhello\n",
                      monkeypatch=monkeypatch)
    assert "\\x1b]0;pwned\\x07" in r.err and "\x1b]" not in r.err and "\x07" not in r.err, r.err


# -- Ctrl-C while importing (real processes, signalled at a readiness line) ---------------------------------
TWICE = [sys.executable, "-c", "from twice.cli.app import main; main()"]


def _interrupt_at(block: str, mode: str, args: list[str], tmp_path: Path) -> tuple[int, str, float, bytes]:
    """Run twice stopped at `block` (see blocking_hook), Ctrl-C it there: (exit code,
    stderr, seconds from the signal to the end, stdout)."""
    env = {**os.environ, "TWICE_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1",
           **hook_env(tmp_path / "hook", block, mode)}
    proc = subprocess.Popen([*TWICE, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    try:
        line, before = wait_until_blocked(proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, (before + err).decode("utf-8", "replace"), elapsed, out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["", "importerror", "swallow"])
def test_ctrl_c_while_importing_torch(llama, tmp_path, mode):
    """Ctrl-C lands while `import torch` runs inside the command: the KeyboardInterrupt
    itself, the ImportError a half-initialized C extension raises after it, and C code
    that clears it and goes on all end in 130 and one line, at once."""
    code, err, elapsed, out = _interrupt_at("import:torch", mode, ["generate", "Hello", "--model", str(llama), "-n", "2"],
                                             tmp_path)
    assert code == 130, err
    assert err.strip().endswith("twice: interrupted") and out == b""
    assert "Traceback" not in err and "Error" not in err and "Exception ignored" not in err, err
    assert elapsed < 10, elapsed  # not after the rest of the run: the whole run takes longer
