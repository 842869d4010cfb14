"""`twice perplexity TEXT_FILE` (issue 14, item 5): the number agrees with transformers' own
computation of the same windows on the tiny llama, qwen2 and gpt2 models (float32), the
window arithmetic (a text shorter than one window, a last partial window, the BOS rule,
--max-tokens, the default context), the --json object, and bad input: each one line
`twice: error: ...`, exit 2, the text file untouched."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

import tiny
from clirun import one_error_line, run_inprocess

# Every kind of text the tiny tokenizer was trained on (accents, CJK, emoji, code), a few
# times over: about 750 tokens.
TEXT = "\n".join(dict.fromkeys(tiny.CORPUS)) * 4


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def bos_llama(model_dirs, tmp_path_factory) -> Path:
    """The tiny llama whose tokenizer puts a BOS (<|endoftext|>, id 0) before every text by
    default, as Llama's and TinyLlama's tokenizers do."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("bos") / "llama-bos"
    shutil.copytree(model_dirs("llama"), folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def ppl(capsys, *args, monkeypatch=None):
    return run_inprocess(["perplexity", *map(str, args)], capsys, monkeypatch=monkeypatch)


def ppl_json(capsys, *args) -> dict:
    r = ppl(capsys, *args, "--json")
    assert r.code == 0, r.err
    assert r.out.count("\n") == 1 and r.err == "", (r.out, r.err)  # one object; no bar off a terminal
    return json.loads(r.out)


def reference(folder: Path, text: str, context: int, max_tokens: int | None = None):
    """transformers' perplexity of the same windows: its fast tokenizer on the folder's
    tokenizer.json (without special tokens; its BOS where it adds one by default), its model
    in float32, log-softmax in float32 and the sum in float64. Returns (perplexity, tokens
    scored, windows, BOS id or None). (Not AutoTokenizer: for a qwen2 model transformers 5
    picks Qwen2Tokenizer, which replaces tokenizer.json's pre-tokenizer with Qwen's own
    digit-splitting pattern, so it encodes "12345" otherwise than the file says.)"""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                  **json.loads((folder / "tokenizer_config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    probe = tok("Hello world")["input_ids"]
    bos = probe[0] if probe[0] == tok.bos_token_id and probe[1:] == tok("Hello world", add_special_tokens=False)[
        "input_ids"] else None
    ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
    total, scored, windows = torch.zeros((), dtype=torch.float64), 0, 0
    with torch.no_grad():
        for a in range(0, len(ids), context):
            seq = ([bos] if bos is not None else []) + ids[a:a + context]
            if len(seq) < 2:
                continue
            logits = model(torch.tensor([seq])).logits[0].float()
            logp = logits[:-1].log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None])
            total -= logp.double().sum()
            scored += len(seq) - 1
            windows += 1
    return math.exp(float(total) / scored), scored, windows, bos


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_agrees_with_transformers(capsys, model_dirs, text_file, family):
    folder = model_dirs(family)
    got = ppl_json(capsys, text_file, "--model", folder, "--context", 64, "--max-tokens", 300)
    want, scored, windows, bos = reference(folder, TEXT, 64, 300)
    assert bos is None and got["bos_token_ids"] == []
    assert (got["tokens"], got["windows"], got["context"]) == (scored, windows, 64)
    assert (got["windows"], got["tokens"]) == (5, 4 * 63 + 43)  # 300 = 4 × 64 + a last window of 44
    # The bound is 0.5%; in float32 the two agree far closer.
    assert abs(got["perplexity"] / want - 1) < 1e-4, (got["perplexity"], want)
    assert got["mean_nll"] == pytest.approx(math.log(got["perplexity"]))


def test_bos_is_prepended_where_the_tokenizer_adds_one(capsys, bos_llama, text_file):
    got = ppl_json(capsys, text_file, "--model", bos_llama, "--context", 100, "--max-tokens", 250)
    want, scored, windows, bos = reference(bos_llama, TEXT, 100, 250)
    assert bos == 0 and got["bos_token_ids"] == [0] and got["bos_token"] == "<|endoftext|>"
    # With a BOS every text token has a token before it: all 250 are scored.
    assert (got["tokens"], got["windows"]) == (scored, windows) == (250, 3)
    assert abs(got["perplexity"] / want - 1) < 1e-4, (got["perplexity"], want)
    # The BOS takes a position: the model's 256 hold windows of 255 text tokens at most.
    line = one_error_line(ppl(capsys, text_file, "--model", bos_llama, "--context", 256))
    assert "--context 256 plus the BOS token (257 positions) is more than the model's context of 256" in line
    assert ppl_json(capsys, text_file, "--model", bos_llama, "--max-tokens", 300)["context"] == 255  # the default


def test_text_output_says_what_the_number_is(capsys, model_dirs, text_file):
    r = ppl(capsys, text_file, "--model", model_dirs("llama"), "--context", 64, "--max-tokens", 100)
    assert r.code == 0 and r.err == "", r.err
    first, definition = r.out.splitlines()
    assert first.startswith("perplexity ") and "over 98 tokens in 2 windows of 64" in first
    assert "exp(mean negative log-likelihood" in definition and "(the first 100 of its" in definition
    assert "without special tokens" in definition and "do not overlap" in definition
    assert "except each window's first" in definition and "no BOS token" in definition


def test_window_arithmetic(capsys, model_dirs, tmp_path):
    from twice.core.perplexity import windows

    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert windows(9, 4) == [(0, 4), (4, 8)]  # a last window of 1 token scores nothing without a BOS
    assert windows(9, 4, prefix=1) == [(0, 4), (4, 8), (8, 9)]  # ... and its one token with one
    assert windows(8, 4) == [(0, 4), (4, 8)] and windows(3, 512) == [(0, 3)] and windows(1, 4) == []

    folder = model_dirs("llama")
    short = tmp_path / "short.txt"
    short.write_text("Hello world! How are you today? I am fine, thank you.")
    n = len(tiny.train_tokenizer().encode(short.read_text(), add_special_tokens=False).ids)
    got = ppl_json(capsys, short, "--model", folder)
    # Shorter than one window: one window, every token but the first scored; the default
    # context is the model's 256 (512 does not fit it).
    assert (got["windows"], got["tokens"], got["text_tokens"], got["context"]) == (1, n - 1, n, 256)
    want, scored, _, _ = reference(folder, short.read_text(), 256)
    assert scored == n - 1 and abs(got["perplexity"] / want - 1) < 1e-4
    # --max-tokens cuts the text's tokens before the windows; more than the text holds is no cut.
    cut = ppl_json(capsys, short, "--model", folder, "--context", 4, "--max-tokens", 9)
    assert (cut["tokens_used"], cut["windows"], cut["tokens"], cut["max_tokens"]) == (9, 2, 6, 9)
    whole = ppl_json(capsys, short, "--model", folder, "--max-tokens", 10_000)
    assert whole["tokens_used"] == n and whole["perplexity"] == got["perplexity"]


def test_a_byte_order_mark_is_no_part_of_the_text(capsys, model_dirs, text_file, tmp_path):
    marked = tmp_path / "marked.txt"
    marked.write_bytes(b"\xef\xbb\xbf" + text_file.read_bytes())
    plain, bom = (ppl_json(capsys, path, "--model", model_dirs("llama"), "--max-tokens", 64)
                  for path in (text_file, marked))
    assert (bom["perplexity"], bom["tokens"]) == (plain["perplexity"], plain["tokens"])


def test_json_object(capsys, model_dirs, text_file, monkeypatch):
    import twice.core.perplexity as core

    got = ppl_json(capsys, text_file, "--model", model_dirs("qwen2"), "--max-tokens", 64)
    assert {"perplexity", "tokens", "windows", "context", "model"} <= got.keys()
    assert isinstance(got["perplexity"], float) and isinstance(got["tokens"], int)
    assert got["model"] == str(model_dirs("qwen2")) and got["model_type"] == "qwen2"
    assert (got["device"], got["dtype"]) == ("cpu", "float32") and got["score_s"] > 0
    # The weights' storage, as core/qweight.py describes it: a float model's matrices in F32.
    assert set(got["weights"]["types"]) == {"F32"} and got["weights"]["bits_per_weight"] == 32
    monkeypatch.setattr(core, "weight_summary", lambda model: None)  # a model that says nothing: no key
    assert "weights" not in ppl_json(capsys, text_file, "--model", model_dirs("qwen2"), "--max-tokens", 64)


def test_progress_bar_on_a_terminal(capsys, model_dirs, text_file, monkeypatch):
    """On a terminal the bar shows the windows and the perplexity so far on stderr, and is
    gone at the end (transient); stdout holds the result alone."""
    import io

    from rich.console import Console

    import twice.cli.console as console
    import twice.cli.perplexity as cli

    screen = io.StringIO()
    monkeypatch.setattr(console, "err_console", lambda: Console(file=screen, force_terminal=True, width=100))
    monkeypatch.setattr(cli, "_isatty", lambda stream: True)
    r = ppl(capsys, text_file, "--model", model_dirs("llama"), "--context", 64, "--max-tokens", 200)
    assert r.code == 0 and r.out.startswith("perplexity ") and len(r.out.splitlines()) == 2, r
    drawn = screen.getvalue()
    assert "windows" in drawn and "4/4" in drawn and "perplexity so far" in drawn, drawn
    assert drawn.endswith("\x1b[?25h\r\x1b[1A\x1b[2K")  # the cursor given back, the bar's line erased


def _unchanged(path: Path, before: bytes | None):
    if before is not None:
        assert path.read_bytes() == before


@pytest.mark.parametrize("case, content, words", [
    ("missing", None, "missing.txt: file not found"),
    ("empty", b"", "empty.txt: the file is empty; there is nothing to score"),
    ("bom_only", b"\xef\xbb\xbf", "bom_only.txt: the file is empty; there is nothing to score"),
    ("blank", b" \n\t\n", "blank.txt: the file holds only white space"),
    ("binary", b"ELF\x00\x01\x02 some text", "binary.txt: holds a NUL byte (byte 3): not a text file"),
    ("latin1", "caf\xe9 au lait".encode("latin-1"), "latin1.txt: not valid UTF-8 (byte 3: b'\\xe9')"),
    ("utf16", "text".encode("utf-16"), "utf16.txt: not valid UTF-8 (byte 0: b'\\xff')"),
    ("one_token", b"a", "the text is 1 token; scoring needs at least 2 without a BOS token"),
])
def test_bad_text_files(capsys, model_dirs, tmp_path, case, content, words):
    path = tmp_path / f"{case}.txt"
    if content is not None:
        path.write_bytes(content)
    line = one_error_line(ppl(capsys, path, "--model", model_dirs("llama")))
    assert words in line, line
    _unchanged(path, content)


def test_files_that_are_not_text(capsys, model_dirs, tmp_path, monkeypatch):
    folder = model_dirs("llama")
    assert f"{tmp_path}: not a regular file" in one_error_line(ppl(capsys, tmp_path, "--model", folder))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # refused without blocking on a writer that never comes
    assert "fifo: not a regular file" in one_error_line(ppl(capsys, fifo, "--model", folder))
    big = tmp_path / "big.txt"
    big.write_text("x" * 100)
    monkeypatch.setattr("twice.cli.perplexity.MAX_TEXT_BYTES", 64)
    assert "big.txt: 100 bytes, more than the 64 twice reads" in one_error_line(ppl(capsys, big, "--model", folder))
    _unchanged(big, b"x" * 100)
    # Unreadable (as root a mode of 000 does not stop a read, so the refusal is simulated).
    import twice.weights.files as files

    real_open = os.open

    def refuse(path, *args, **kwargs):
        if str(path) == str(big):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(files.os, "open", refuse)
    assert "big.txt: cannot read (Permission denied)" in one_error_line(ppl(capsys, big, "--model", folder))


@pytest.mark.parametrize("flags, words", [
    (["--context", "1"], "--context must be at least 2 tokens"),
    (["--context", "0"], "--context must be at least 2 tokens"),
    (["--context", "-5"], "--context must be at least 2 tokens"),
    (["--max-tokens", "1"], "--max-tokens must be at least 2"),
    (["--threads", "0"], "--threads must be between 1 and 1024"),
])
def test_bad_flags_fail_before_anything_loads(capsys, text_file, flags, words):
    # A model that does not exist: the flag is refused before the model (or the file) is read.
    line = one_error_line(ppl(capsys, text_file, "--model", "/nonexistent/model", *flags))
    assert words in line, line


def test_context_longer_than_the_model(capsys, model_dirs, text_file):
    line = one_error_line(ppl(capsys, text_file, "--model", model_dirs("gpt2"), "--context", 257))
    assert "--context 257 is more than the model's context of 256 tokens; use --context 256 or less" in line
    assert ppl_json(capsys, text_file, "--model", model_dirs("gpt2"), "--context", 256, "--max-tokens", 600)[
        "windows"] == 3


def test_dequantize_and_quantize_flags(tmp_path, capsys, model_dirs):
    """--dequantize scores a GGUF's float copy, --quantize a model quantized at load: the float
    copy of a Q8_0 file equals the file as stored (float products of the same values, to float
    rounding), and quantizing the float model in memory to Q8_0 gives the file's number."""
    import json as _json

    from clirun import run_inprocess

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    folder = model_dirs("llama")
    path = tmp_path / "m.gguf"
    assert run_inprocess(["quantize", str(folder), str(path), "--type", "q8_0"], capsys).code == 0

    def ppl(*args):
        r = run_inprocess(["perplexity", str(text), "--context", "32", "--json", *args], capsys)
        assert r.code == 0, r
        return _json.loads(r.out)["perplexity"]

    stored, floats, in_memory = ppl("-m", str(path)), ppl("-m", str(path), "--dequantize"), \
        ppl("-m", str(folder), "--quantize", "q8_0")
    assert abs(stored - floats) < 1e-3 * floats and abs(in_memory - stored) < 1e-9 * stored
