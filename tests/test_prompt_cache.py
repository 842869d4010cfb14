"""Prompt-cache files (core/prompt_cache.py, weights/prompt_cache_file.py, cli/prompt_cache.py)
and context shift (`twice chat --context-shift`).

- a prompt cache reused gives the same greedy tokens as a fresh prefill and prefills only
  the rest; --prompt-cache-ro never writes; chat's /save FILE writes FILE.kv, /load restores it;
- stale / foreign / truncated / tampered files (another model's fingerprint, another dtype,
  wrong shapes, a header that lies, a flipped data byte, not a prompt cache at all) are
  refused in one line and the run goes on with a normal prefill (same tokens); a file that is
  not a twice prompt cache is never replaced; a folder that cannot be written: one line, the
  run goes on, no file and no temporary file left;
- context shift: the shifted cache equals a fresh prefill of the kept tokens at their new
  positions (logits within 1e-4, float32) where that is exact, one-layer models (llama, qwen3,
  phi3's partial rotary, gemma3's local table on a sliding layer); in deeper models the kept
  tokens' keys and values above the first layer carry what they attended to (as llama.cpp's
  context shift), so there the first layer is compared; gpt2 and longrope refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from clirun import run_inprocess

GREEDY = ["--temperature", "0", "--raw", "-n", "6"]


# -- helpers -----------------------------------------------------------------------------
def _load(folder, dtype="float32"):
    from twice.weights.load import load

    return load(str(folder), device="cpu", dtype=dtype)


def _engine(loaded):
    from twice.core.engine import Engine

    return Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids)


def _generate(engine, ids, n=8):
    from twice.core.engine import Done, GenerationSettings, Request
    from twice.core.sampling import SamplingParams

    settings = GenerationSettings(max_new_tokens=n, sampling=SamplingParams(temperature=0.0))
    for event in engine.generate(Request(ids=ids), settings):
        if isinstance(event, Done):
            return event.result
    raise AssertionError("no result")


def _gen_cli(folder, prompt, capsys, *extra):
    r = run_inprocess(["generate", prompt, "--model", str(folder), *GREEDY, "--json", *extra], capsys)
    assert r.code == 0, r
    return json.loads(r.out), [line for line in r.err.splitlines() if line.strip()]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


PROMPT = "the sea and the wind and the stars over the water at night"


# -- reuse -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_reused_cache_gives_the_fresh_tokens_and_prefills_only_the_rest(model_dirs, tmp_path, family):
    from twice.weights import prompt_cache_file as pcf

    loaded = _load(model_dirs(family))
    ids = list(range(5, 45))
    first = _engine(loaded)
    r = _generate(first, ids)
    path = tmp_path / "p.kv"
    assert pcf.save_from(first, path, r.prompt_tokens) == len(ids)
    longer = ids + [7, 8, 9, 10]
    fresh = _generate(_engine(loaded), longer)
    again = _engine(loaded)
    assert pcf.load_into(again, path) == len(ids)
    reused = _generate(again, longer)
    assert reused.token_ids == fresh.token_ids
    assert reused.reused_tokens == len(ids) and reused.prompt_tokens - reused.reused_tokens == 4
    # the same prompt: only its last token runs again (it gives the first token's logits)
    same = _engine(loaded)
    pcf.load_into(same, path)
    assert _generate(same, ids).token_ids == r.token_ids


def test_generate_prompt_cache_writes_then_reuses(model_dirs, tmp_path, capsys):
    folder = model_dirs("llama")
    path = tmp_path / "prompt.kv"
    plain, _ = _gen_cli(folder, PROMPT + " and more", capsys)
    first, _ = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(path))
    assert first["reused_tokens"] == 0 and first["prompt_cache"]["saved_tokens"] == first["prompt_tokens"]
    assert path.is_file() and _leftovers(tmp_path) == []
    second, err = _gen_cli(folder, PROMPT + " and more", capsys, "--prompt-cache", str(path))
    assert second["token_ids"] == plain["token_ids"]
    assert second["reused_tokens"] == first["prompt_tokens"]
    assert any(f"{first['prompt_tokens']} tokens loaded" in line for line in err)
    # read-only: used, never written (the longer prompt is not stored)
    before = path.read_bytes()
    third, _ = _gen_cli(folder, PROMPT + " and more still", capsys, "--prompt-cache", str(path), "--prompt-cache-ro")
    assert third["reused_tokens"] == second["prompt_tokens"] and third["prompt_cache"]["saved_tokens"] == 0
    assert path.read_bytes() == before


def test_prompt_cache_ro_alone_and_a_folder_are_one_line(model_dirs, tmp_path, capsys):
    from clirun import one_error_line

    folder = model_dirs("llama")
    r = run_inprocess(["generate", "hi", "--model", str(folder), "--prompt-cache-ro"], capsys)
    assert "--prompt-cache-ro needs --prompt-cache FILE" in one_error_line(r)
    r = run_inprocess(["generate", "hi", "--model", str(folder), "--prompt-cache", str(tmp_path)], capsys)
    assert "is a folder" in one_error_line(r)
    # a name that ends as a folder's was written as a file of that name; one too long was a traceback
    for name, words in ((f"{tmp_path}/new/", "names a folder (it ends with /)"), ("x" * 300 + ".kv", "too long")):
        r = run_inprocess(["generate", "hi", "--model", str(folder), "--prompt-cache", name], capsys)
        assert words in one_error_line(r)
    assert not (tmp_path / "new").exists()
    # a read-only cache that is not there (a typo?) is said once, and nothing is written
    missing = tmp_path / "typo.kv"
    r = run_inprocess(["generate", "hi", "-n", "1", "--model", str(folder), "--prompt-cache", str(missing),
                       "--prompt-cache-ro"], capsys)
    assert r.code == 0 and r.err.count(f"prompt cache {missing}: no such file") == 1 and not missing.exists(), r.err


# -- bad files ---------------------------------------------------------------------------
def _saved(model_dirs, tmp_path, family="llama", name="p.kv") -> Path:
    from twice.weights import prompt_cache_file as pcf

    engine = _engine(_load(model_dirs(family)))
    _generate(engine, list(range(5, 30)), n=2)
    path = tmp_path / name
    pcf.save_from(engine, path, 25)
    return path


def _rewrite_header(path: Path, change) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _flip_last_byte(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[-300] ^= 0x40
    p.write_bytes(bytes(raw))


def _shape_lies(p: Path) -> None:  # one column fewer in k's shape (its offsets no longer match)
    def change(h):
        h["k"]["shape"][2] -= 1
    _rewrite_header(p, change)


def _wrong_shapes(p: Path) -> None:  # a consistent file of other shapes, with the right fingerprint
    from twice.weights import prompt_cache_file as pcf

    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    meta = {k: v for k, v in meta.items() if k not in ("tokens", "checksum")}
    t = torch.zeros(2, 3, 25, 16)
    p.write_bytes(pcf.encode({"k": t, "v": t}, list(range(25)), meta))


def _tables_swapped(p: Path) -> None:  # k's and v's byte ranges swapped in the header, the data as written
    def change(h):
        h["k"]["data_offsets"], h["v"]["data_offsets"] = h["v"]["data_offsets"], h["k"]["data_offsets"]
    _rewrite_header(p, change)


def _tokens_lie(p: Path) -> None:
    def change(h):
        h["__metadata__"]["tokens"] = "24"
    _rewrite_header(p, change)


def _version_1(p: Path) -> None:  # the version before caches stored keys minus their key bias
    def change(h):
        h["__metadata__"]["version"] = "1"
    _rewrite_header(p, change)


def _not_ours(p: Path) -> None:
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(4, 4)}, str(p))


BAD = [
    ("flipped byte", _flip_last_byte, "does not match its checksum"),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[:-1000]), "truncated"),
    ("header lies", _shape_lies, "corrupt prompt-cache entry for tensor 'k'"),
    # the checksum covers the data alone: a table pointing k at v's bytes was loaded, and the
    # model attended to values as keys (garbage text, exit 0)
    ("tables swapped", _tables_swapped, "tensor 'k' lies at bytes [6400, 12800] of the data, where twice writes "
                                         "it at [0, 6400] (the header was changed)"),
    ("token count lies", _tokens_lie, "its metadata says 24 tokens, token_ids holds 25"),
    ("wrong shapes", _wrong_shapes, "tensor 'k' is F32 [2, 3, 25, 16], this model's cache needs F32 [2, 2, 25, 16]"),
    ("version 1", _version_1, 'prompt-cache version "1", this twice reads "3"'),
    ("not a prompt cache", _not_ours, "not a twice prompt cache"),
    ("empty", lambda p: p.write_bytes(b""), "truncated prompt-cache file"),
    ("huge header", lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"), "not a twice prompt cache"),
]


@pytest.mark.parametrize("name,spoil,message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_file_is_refused_in_one_line(model_dirs, tmp_path, name, spoil, message):
    from twice.core.prompt_cache import PromptCacheError
    from twice.weights import prompt_cache_file as pcf

    path = _saved(model_dirs, tmp_path)
    spoil(path)
    engine = _engine(_load(model_dirs("llama")))
    with pytest.raises(PromptCacheError) as e:
        pcf.load_into(engine, path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert engine.cache is None and engine.cached_ids == []  # untouched: the run prefills normally


@pytest.mark.parametrize("name", ["flipped byte", "wrong shapes"])
def test_a_bad_file_and_the_run_goes_on_with_a_normal_prefill(model_dirs, tmp_path, capsys, name):
    spoil, message = next((s, m) for n, s, m in BAD if n == name)
    folder = model_dirs("llama")
    path = _saved(model_dirs, tmp_path)
    spoil(path)
    plain, _ = _gen_cli(folder, PROMPT, capsys)
    out, err = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(path), "--prompt-cache-ro")
    assert out["token_ids"] == plain["token_ids"] and out["reused_tokens"] == 0
    refused = [line for line in err if "not used" in line]
    assert len(refused) == 1 and message in refused[0], err
    assert refused[0].endswith("prefilling the whole prompt")


def test_another_models_and_another_dtypes_files_are_refused(model_dirs, tmp_path):
    from twice.core.prompt_cache import PromptCacheError
    from twice.weights import prompt_cache_file as pcf

    path = _saved(model_dirs, tmp_path, family="qwen3")
    engine = _engine(_load(model_dirs("llama")))
    with pytest.raises(PromptCacheError, match="made with another model or tokenizer: qwen3"):
        pcf.load_into(engine, path)
    assert engine.cache is None and engine.cached_ids == []  # untouched
    path = _saved(model_dirs, tmp_path)
    engine = _engine(_load(model_dirs("llama"), dtype="bfloat16"))
    with pytest.raises(PromptCacheError, match=r"holds a float32 cache, this run's is bfloat16 \(--dtype\)"):
        pcf.load_into(engine, path)
    # the same weights behind another tokenizer: another fingerprint
    from twice.core.prompt_cache import fingerprint

    loaded = _load(model_dirs("llama"))
    again = _load(model_dirs("llama"))
    assert fingerprint(loaded.model, loaded.tokenizer) == fingerprint(again.model, again.tokenizer)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(model_dirs("llama"), other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[-2:]  # two tokens trade ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    swapped = _load(other)
    assert fingerprint(swapped.model, swapped.tokenizer) != fingerprint(loaded.model, loaded.tokenizer)
    # the file is hashed when a fingerprint first asks; changed since it was read, the loaded
    # pipeline is hashed instead (never the new file's tokenizer, which this model does not run)
    assert loaded.tokenizer.digest == hashlib.sha256((model_dirs("llama") / "tokenizer.json").read_bytes()).hexdigest()
    late = _load(other).tokenizer
    (other / "tokenizer.json").write_text(json.dumps(spec) + " ")
    assert late.digest == hashlib.sha256(late.hf.to_str().encode()).hexdigest()


def test_a_foreign_file_is_never_replaced_and_a_stale_one_is(model_dirs, tmp_path, capsys):
    """Not a prompt cache, or another model's sound one: kept. Corrupt, truncated, an older
    version: replaced by this run's."""
    folder = model_dirs("llama")
    path = tmp_path / "weights.safetensors"
    _not_ours(path)
    before = path.read_bytes()
    out, err = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(path))
    assert path.read_bytes() == before
    assert any("not saved" in line and "not a twice prompt cache" in line for line in err), err
    # Another model's sound cache still serves that model: refused, kept, and said so.
    other = _saved(model_dirs, tmp_path, family="qwen3", name="other.kv")
    before = other.read_bytes()
    out, err = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(other))
    assert other.read_bytes() == before
    assert any("not saved" in line and "another model or setting (kept" in line for line in err), err
    # A corrupt one is ours to replace.
    stale = _saved(model_dirs, tmp_path, name="stale.kv")
    _flip_last_byte(stale)
    out, err = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(stale))
    again, _ = _gen_cli(folder, PROMPT + " and more", capsys, "--prompt-cache", str(stale))
    assert again["reused_tokens"] == out["prompt_tokens"]  # replaced by this model's cache
    # So is a truncated one (its header still says it is a twice prompt cache).
    cut = _saved(model_dirs, tmp_path, name="cut.kv")
    cut.write_bytes(cut.read_bytes()[: len(cut.read_bytes()) // 2])
    out, err = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(cut))
    assert not any("not saved" in line for line in err), err
    again, _ = _gen_cli(folder, PROMPT + " and more", capsys, "--prompt-cache", str(cut))
    assert again["reused_tokens"] == out["prompt_tokens"]
    # A file an older twice wrote (version 1) is ours too: refused, then replaced (it was kept
    # as "not a twice prompt cache", refused again on every run).
    old = _saved(model_dirs, tmp_path, name="old.kv")
    _version_1(old)
    out, err = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(old))
    assert any('version "1"' in line for line in err) and not any("not saved" in line for line in err), err
    again, _ = _gen_cli(folder, PROMPT + " and more", capsys, "--prompt-cache", str(old))
    assert again["reused_tokens"] == out["prompt_tokens"]


@pytest.mark.parametrize("fault", ["read-only", "disk full"])
def test_a_folder_that_cannot_be_written_is_one_line_and_leaves_nothing(model_dirs, tmp_path, capsys, monkeypatch,
                                                                        fault):
    import errno
    import tempfile

    from twice.weights import safe_write

    folder = model_dirs("llama")
    work = tmp_path / "work"
    work.mkdir()
    path = work / "p.kv"
    if fault == "read-only":
        def refuse(*a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    else:
        def full(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(safe_write.os, "fsync", full)
    plain, _ = _gen_cli(folder, PROMPT, capsys)
    out, err = _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(path))
    assert out["token_ids"] == plain["token_ids"]
    lines = [line for line in err if "not saved" in line]
    assert len(lines) == 1 and os.strerror(errno.EROFS if fault == "read-only" else errno.ENOSPC) in lines[0]
    assert list(work.iterdir()) == []


# -- chat: /save carries the cache, /load restores it --------------------------------------
def test_chat_save_writes_the_kv_sidecar_and_load_spares_the_prefill(model_dirs, tmp_path, capsys, monkeypatch):
    folder = model_dirs("llama")
    chat_file = tmp_path / "c.json"
    script = f"hello there\n/save {chat_file}\n".encode()
    r = run_inprocess(["chat", "--model", str(folder), "-n", "6", "--temperature", "0"], capsys, script, monkeypatch)
    assert r.code == 0, r
    assert "saved its KV cache (" in r.err and (tmp_path / "c.json.kv").is_file()
    script = f"/load {chat_file}\nand then?\n".encode()
    r = run_inprocess(["chat", "--model", str(folder), "-n", "6", "--temperature", "0"], capsys, script, monkeypatch)
    assert r.code == 0, r
    assert any(line.startswith("loaded its KV cache (") for line in r.err.splitlines()), r.err
    summary = [line for line in r.err.splitlines() if line.startswith("reused")][-1]
    reused = int(summary.split()[1])
    assert reused > 0
    # a spoiled sidecar: one note, the turn prefills the whole conversation
    _flip_last_byte(tmp_path / "c.json.kv")
    r = run_inprocess(["chat", "--model", str(folder), "-n", "6", "--temperature", "0"], capsys, script, monkeypatch)
    notes = [line for line in r.err.splitlines() if "not used" in line]
    assert r.code == 0 and len(notes) == 1 and "checksum" in notes[0]
    assert [line for line in r.err.splitlines() if line.startswith("reused")][-1].startswith("reused 0 ")


def test_chat_save_replaces_a_sidecar_only_when_asked(model_dirs, tmp_path, capsys, monkeypatch):
    """/save FILE next to an existing FILE.kv (another run's prompt cache) leaves it; /save!
    replaces it; /save! with nothing cached removes the old one, which /load would take."""
    folder = model_dirs("llama")
    chat = lambda script: run_inprocess(["chat", "--model", str(folder), "-n", "2", "--temperature", "0"], capsys,
                                        script.encode(), monkeypatch)
    doc, side = tmp_path / "doc", tmp_path / "doc.kv"
    _gen_cli(folder, PROMPT, capsys, "--prompt-cache", str(side))
    before = side.read_bytes()
    r = chat(f"hi\n/save {doc}\n")
    assert r.code == 0 and doc.is_file() and side.read_bytes() == before, r.err
    assert f"the KV cache was not saved to {side}: the file exists (/save! replaces it)" in r.err
    r = chat(f"hi\n/save! {doc}\n")
    assert r.code == 0 and "saved its KV cache (" in r.err and side.read_bytes() != before, r.err
    r = chat(f"/save! {doc}\n/load {doc}\n")
    assert r.code == 0 and not side.exists() and f"removed the earlier KV cache {side}" in r.err, r.err
    assert "loaded its KV cache" not in r.err


# -- context shift -----------------------------------------------------------------------
def _one_layer(tmp_path: Path, tokenizer, family: str) -> Path:
    """A one-layer tiny model: its keys and values depend only on the tokens and positions, so
    a shifted cache can equal a fresh prefill exactly."""
    import tiny
    from transformers import AutoModelForCausalLM

    cfg = tiny.hf_config("phi3" if family == "phi3-default" else family)
    cfg.num_hidden_layers = 1
    if family == "phi3-default":  # partial rotary without longrope
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]  # gemma3: a sliding layer (its local rope table)
    folder = tmp_path / f"{family}-1"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if family.startswith("gemma"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    tiny.save_tokenizer(folder, tokenizer)
    return folder


def _shift_vs_fresh(model, keep=9, drop=23, length=60):
    from twice.core import prompt_cache as pc
    from twice.core.cache import KVCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (1, length), generator=g)
    nxt = torch.randint(5, 400, (1, 7), generator=g)
    with torch.inference_mode():
        shifted = KVCache(model.config, 1, 128, torch.float32, "cpu", kv_heads=model.kv_heads)
        model(ids, shifted)
        pc.shift(model, shifted, keep, drop)
        assert shifted.length == length - drop
        fresh = KVCache(model.config, 1, 128, torch.float32, "cpu", kv_heads=model.kv_heads)
        model(torch.cat((ids[:, :keep], ids[:, keep + drop:]), 1), fresh)
        first = {name: (getattr(shifted, name)[0, :, :, :shifted.length] - getattr(fresh, name)[0, :, :, :fresh.length])
                 .abs().max().item() for name in ("k", "v")}
        a = model(nxt, shifted, all_logits=True)
        b = model(nxt, fresh, all_logits=True)
    return (a - b).abs().max().item(), first


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3-default", "gemma3", "llama3"])
def test_shifted_cache_equals_a_fresh_prefill_of_the_kept_tokens(tmp_path, tokenizer, family):
    loaded = _load(_one_layer(tmp_path, tokenizer, family))
    if family == "gemma3":
        assert loaded.model.layers[0].local_rope  # the sliding layer's own table is the one rotated
    logits, layer0 = _shift_vs_fresh(loaded.model)
    assert logits < 1e-4 and layer0["k"] < 1e-4 and layer0["v"] < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "gemma3", "mistral"])
def test_shift_in_deeper_models_moves_the_first_layer_exactly(model_dirs, family):
    _, layer0 = _shift_vs_fresh(_load(model_dirs(family)).model)
    assert layer0["k"] < 1e-4 and layer0["v"] < 1e-5


def test_plan_shift_finds_the_dropped_span():
    from twice.core.prompt_cache import plan_shift

    old = [1, 2, 3, 10, 11, 12, 20, 21, 22, 23]
    assert plan_shift(old, [1, 2, 3, 20, 21, 22, 23, 99]) == (3, 3, 4)
    assert plan_shift(old, [1, 2, 3, 20, 21, 5]) == (3, 3, 2)  # the reply re-encoded differently: kept up to there
    assert plan_shift(old, old + [5]) == (10, 0, 0)  # nothing dropped: plain reuse
    assert plan_shift(old, [7, 8]) == (0, 0, 0)


def test_context_shift_is_refused_where_keys_cannot_move(model_dirs, capsys, monkeypatch):
    from clirun import one_error_line

    r = run_inprocess(["chat", "--model", str(model_dirs("gpt2")), "--context-shift"], capsys, b"hi\n", monkeypatch)
    assert "--context-shift needs rotary position embeddings; gpt2" in one_error_line(r)
    r = run_inprocess(["chat", "--model", str(model_dirs("phi3")), "--context-shift"], capsys, b"hi\n", monkeypatch)
    assert "--context-shift does not work with longrope" in one_error_line(r)
    r = run_inprocess(["chat", "--model", str(model_dirs("llama")), "--keep", "4"], capsys, b"hi\n", monkeypatch)
    assert "--keep needs --context-shift" in one_error_line(r)
    r = run_inprocess(["chat", "--model", str(model_dirs("llama")), "--context-shift", "--keep", "256"], capsys,
                      b"hi\n", monkeypatch)  # context 256: nothing could ever be dropped
    assert "--keep 256 protects the whole context (256 tokens)" in one_error_line(r)


def test_chat_context_shift_drops_old_turns_and_prefills_only_the_new(model_dirs, capsys, monkeypatch):
    from twice.weights.tokenizer import Tokenizer

    folder = model_dirs("llama")  # context 256
    words = "the sea and the wind and the stars over the water " * 3
    script = "".join(f"{i} {words}\n" for i in range(4)).encode()
    args = ["chat", "--model", str(folder), "-n", "24", "--temperature", "0", "--system", "be brief"]
    r = run_inprocess([*args, "--context-shift"], capsys, script, monkeypatch)
    assert r.code == 0, r
    lines = r.err.splitlines()
    shifts = [line for line in lines if line.startswith("context shift: dropped")]
    assert shifts, r.err
    assert "error" not in r.err
    # after a shift the turn reuses the kept and moved tokens: it prefills less than its prompt
    after = lines[lines.index(shifts[0]) + 1:]
    summary = next(line for line in after if line.startswith("reused"))
    assert int(summary.split()[1]) > len(Tokenizer(folder).encode_chat([{"role": "system", "content": "be brief"}]))
    # without the flag: today's refusal with the smallest /drop
    r = run_inprocess(args, capsys, script, monkeypatch)
    assert "no longer fits the context" in r.err and "/drop" in r.err
    # --keep N protecting every turn: nothing may be dropped, so the same refusal; N at or past
    # the context could never let a token go: one line before the chat starts
    r = run_inprocess([*args, "--context-shift", "--keep", "255"], capsys, script, monkeypatch)
    assert "no longer fits the context" in r.err and "context shift" not in r.err
    r = run_inprocess([*args, "--context-shift", "--keep", "1000"], capsys, script, monkeypatch)
    assert r.code == 2 and "--keep 1,000 protects the whole context (256 tokens)" in r.err
    # --keep N shorter than the system message protects the system message only: the first
    # turn begins after it (it was taken to begin at 0, so it was kept and nothing could go).
    r = run_inprocess([*args[:-1], "a system message of some length " * 4, "--context-shift", "--keep", "2"],
                      capsys, script, monkeypatch)
    assert r.code == 0 and "context shift: dropped" in r.err and "no longer fits" not in r.err, r.err


# -- quantized KV caches (--kv-dtype, core/cache.py) --------------------------------------
def _needs_kv_dtype():
    import inspect

    from twice.core.cache import KVCache

    if "kv_dtype" not in inspect.signature(KVCache).parameters:
        pytest.skip("core/cache.py has no kv_dtype yet")


def test_a_q8_0_cache_is_stored_as_blocks_and_refused_by_a_float_run(model_dirs, tmp_path):
    _needs_kv_dtype()
    from twice.core.engine import Engine
    from twice.core.prompt_cache import PromptCacheError
    from twice.weights import prompt_cache_file as pcf

    loaded = _load(model_dirs("llama-hd64"))

    def q8():
        return Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids, kv_dtype="q8_0")

    ids = list(range(5, 45))
    first = q8()
    _generate(first, ids)
    path = tmp_path / "q8.kv"
    pcf.save_from(first, path, len(ids))
    from twice.weights.checkpoint import validate_header

    header = validate_header(path)
    assert header["k"]["dtype"] == "U8" and header["__metadata__"]["kv_dtype"] == "q8_0"
    assert header["k"]["shape"][-1] == 34 * 64 // 32  # the blocks as stored
    longer = ids + [7, 8, 9]
    again = q8()
    pcf.load_into(again, path)
    assert torch.equal(again.cache.k[:, 0, :, :len(ids)], first.cache.k[:, 0, :, :len(ids)])
    assert _generate(again, longer).token_ids == _generate(q8(), longer).token_ids
    with pytest.raises(PromptCacheError, match=r"holds a q8_0 cache, this run's is float32 \(--kv-dtype\)"):
        pcf.load_into(_engine(loaded), path)


def test_context_shift_on_a_q8_0_cache(tmp_path, tokenizer):
    _needs_kv_dtype()
    from twice.core import prompt_cache as pc
    from twice.core.cache import KVCache

    model = _load(_one_layer(tmp_path, tokenizer, "llama-hd64")).model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (1, 60), generator=g)
    nxt = torch.randint(5, 400, (1, 7), generator=g)
    keep, drop = 9, 23
    caches = {}
    with torch.inference_mode():
        for name, kv in (("q8_0", "q8_0"), ("float", None)):
            shifted = KVCache(model.config, 1, 128, torch.float32, "cpu", kv_heads=model.kv_heads, kv_dtype=kv)
            model(ids, shifted)
            pc.shift(model, shifted, keep, drop)
            fresh = KVCache(model.config, 1, 128, torch.float32, "cpu", kv_heads=model.kv_heads, kv_dtype=kv)
            model(torch.cat((ids[:, :keep], ids[:, keep + drop:]), 1), fresh)
            caches[name] = (shifted, fresh)
            a, b = model(nxt, shifted, all_logits=True), model(nxt, fresh, all_logits=True)
            caches[name] += ((a - b).abs().max().item(),)
    shifted, fresh, q8_gap = caches["q8_0"]
    assert torch.equal(shifted.v[:, :, :, :37], fresh.v[:, :, :, :37])  # values move as stored
    assert torch.equal(shifted.k[:, :, :, :keep], fresh.k[:, :, :, :keep])
    assert caches["float"][2] < 1e-4
    assert q8_gap < 0.05  # one more rounding of the moved keys (their blocks quantized twice)
