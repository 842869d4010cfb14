"""`twice generate`: every flag on the tiny models (in-process), the --json object, the
--timing report and its definitions, one-line errors, standard input, and the streams:
piped stdout holds the text alone, and on a terminal the live status line shows while
tokens stream and leaves nothing behind (checked on an emulated screen)."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import sys
import time

import pytest

from clirun import one_error_line, run_inprocess, run_subprocess

RAW_PROMPT = "Prefill runs the prompt once; decode feeds one token at a time."
CHAT_PROMPT = "Hello world"
TOP_KEYS = {"model", "model_folder", "model_type", "settings", "load_s", "text", "token_ids", "finish_reason",
            "prompt_tokens", "reused_tokens", "generated_tokens", "timings", "cache", "peak_memory_bytes",
            "weight_bytes", "device", "dtype", "bandwidth"}
SETTINGS_KEYS = {"max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop",
                 "chat", "system", "prefill_chunk", "truncate", "compile", "device", "dtype"}
TIMING_KEYS = {"load_s", "load_weights_s", "load_tokenizer_s", "tokenize_s", "prefill_s", "ttft_s", "decode_s",
               "prefill_tokens_per_s", "decode_tokens_per_s", "step_s", "step_p50_s", "step_p90_s", "step_p99_s",
               "step_max_s"}
CACHE_KEYS = {"bytes_per_token", "bytes_in_use", "bytes_allocated", "bytes_full_context", "tokens", "capacity",
              "batch", "context_length"}
# SGR parameters that set a foreground or background colour.
COLOR_SGR = re.compile(r"\x1b\[(?:[0-9;]*;)?(?:3[0-8]|4[0-8]|9[0-7]|10[0-7])(?:;[0-9;]*)?m")


@pytest.fixture(scope="module")
def llama(model_dirs):
    return str(model_dirs("llama"))


def gen(capsys, *args, monkeypatch=None, stdin: bytes | None = None):
    return run_inprocess(["generate", *args], capsys, stdin=stdin, monkeypatch=monkeypatch)


def gen_json(capsys, *args, **kw) -> dict:
    r = gen(capsys, *args, "--json", **kw)
    assert r.code == 0, r.err
    assert r.out.endswith("\n") and r.out.count("\n") == 1, r.out  # one JSON object, one line
    return json.loads(r.out)


def one_line_error(r, code: int = 2) -> str:
    assert r.out == "", r
    return one_error_line(r, code)


def no_template_copy(model_dirs, tmp_path):
    dest = tmp_path / "plain"
    shutil.copytree(model_dirs("llama"), dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dest)


# -- the JSON object -------------------------------------------------------------------------
def test_json_has_model_settings_text_counts_timings_and_cache(capsys, llama):
    d = gen_json(capsys, RAW_PROMPT, "-m", llama, "--revision", "main", "--device", "cpu", "--dtype", "float32",
                 "-n", "7", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05",
                 "--repetition-penalty", "1.1", "--seed", "3", "--stop", "never-in-output", "--stop", "nor this",
                 "--system", "Be brief.", "--chat", "--prefill-chunk", "4")
    assert TOP_KEYS <= set(d)
    assert d["model"] == llama and d["model_type"] == "llama"
    assert d["settings"] == {"max_new_tokens": 7, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
                             "repetition_penalty": 1.1, "seed": 3, "stop": ["never-in-output", "nor this"],
                             "chat": True, "system": "Be brief.", "prefill_chunk": 4, "truncate": None, "compile": False, "device": "cpu",
                             "dtype": "float32", "lookup": False, "draft_tokens": None, "draft": None}
    assert isinstance(d["text"], str)
    assert all(isinstance(i, int) for i in d["token_ids"])
    assert d["generated_tokens"] == len(d["token_ids"]) and 1 <= d["generated_tokens"] <= 7
    assert d["finish_reason"] in ("length", "eos")
    assert d["reused_tokens"] == 0 and d["prompt_tokens"] > 10
    assert d["decode_path"] in ("native", "eager")  # native where the C kernels build
    t = d["timings"]
    assert TIMING_KEYS <= set(t)  # the engine may report more (compile time)
    assert all(isinstance(t[k], float) and t[k] >= 0 for k in set(t) - {"step_s"})
    assert len(t["step_s"]) == d["generated_tokens"] - 1
    assert t["load_s"] == pytest.approx(t["load_weights_s"] + t["load_tokenizer_s"]) == d["load_s"]
    assert t["ttft_s"] >= t["prefill_s"] > 0
    assert t["step_max_s"] == max(t["step_s"]) and t["step_p50_s"] <= t["step_p90_s"] <= t["step_max_s"]
    c = d["cache"]
    assert CACHE_KEYS <= set(c)
    assert c["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # 2 · L · H_kv · d · bytes of the tiny llama
    assert c["tokens"] == d["prompt_tokens"] + d["generated_tokens"] - 1  # the last token is never fed back
    assert c["bytes_in_use"] == c["bytes_per_token"] * c["tokens"]
    assert c["bytes_allocated"] == c["bytes_per_token"] * c["capacity"] >= c["bytes_in_use"]
    assert c["context_length"] == 256 and c["bytes_full_context"] == c["bytes_per_token"] * 256
    assert c["batch"] == 1
    assert d["weight_bytes"] == 127296 * 4 and d["peak_memory_bytes"] > 0
    assert (d["device"], d["dtype"]) == ("cpu", "float32")
    bw = d["bandwidth"]
    assert set(bw) == {"bytes_read_per_token", "achieved_bytes_per_s", "device_peak_bytes_per_s", "fraction_of_peak"}
    assert bw["bytes_read_per_token"] > d["weight_bytes"]


def test_defaults_in_json_llama_cpp_sampling_and_chat_when_the_model_has_a_template(capsys, llama):
    d = gen_json(capsys, CHAT_PROMPT, "-m", llama, "-n", "3")
    assert d["settings"] == {"max_new_tokens": 3, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                             "repetition_penalty": 1.0, "seed": None, "stop": [], "chat": True, "system": None,
                             "prefill_chunk": None, "truncate": None, "compile": False, "device": "cpu", "dtype": "float32",
                             "lookup": False, "draft_tokens": None, "draft": None}
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 3


# -- finish reasons and --stop -------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_raw(llama, capsys_module):
    return capsys_module(RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "0")


@pytest.fixture(scope="module")
def capsys_module():
    """Run `generate --json` in this process outside a test's capsys (for module fixtures)."""
    from twice.cli.app import main

    def run(*args):
        out, old_out, old_argv = io.StringIO(), sys.stdout, sys.argv
        sys.stdout, sys.argv = out, ["twice", "generate", *args, "--json"]
        try:
            main()
        except SystemExit as e:
            assert not e.code
        finally:
            sys.stdout, sys.argv = old_out, old_argv
        return json.loads(out.getvalue())

    return run


def test_stop_strings_end_the_text_and_are_not_printed(capsys, llama, greedy_raw):
    text = greedy_raw["text"]
    assert greedy_raw["finish_reason"] == "length" and len(text) > 12
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    d = gen_json(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "0", "--stop", stop)
    assert d["finish_reason"] == "stop"
    assert d["text"] == text[: text.find(stop)] and stop not in d["text"]
    # Repeatable: the earliest of several stop strings wins; plain output (not JSON) too.
    later = text[-3:]
    r = gen(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "0", "--stop", later, "--stop", stop)
    assert r.code == 0, r.err
    assert r.out == text[: min(text.find(stop), text.find(later))] + "\n"


def test_finish_reason_eos_when_the_model_emits_an_eos_token(capsys, model_dirs, tmp_path, greedy_raw):
    dest = tmp_path / "eos"
    shutil.copytree(model_dirs("llama"), dest)
    ids = greedy_raw["token_ids"]
    eos = ids[3]
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    d = gen_json(capsys, RAW_PROMPT, "-m", str(dest), "--raw", "-n", "24", "--temperature", "0")
    assert d["finish_reason"] == "eos"
    assert d["token_ids"] == ids[: ids.index(eos) + 1]  # the eos token is counted, its text is not shown
    assert greedy_raw["text"].startswith(d["text"])


# -- sampling, seeds, chunks ---------------------------------------------------------------------
def test_seed_reproduces_sampling_and_other_seeds_differ(capsys, llama):
    args = [RAW_PROMPT, "-m", llama, "--raw", "-n", "12", "--temperature", "1.0"]
    a = gen_json(capsys, *args, "--seed", "5")
    b = gen_json(capsys, *args, "--seed", "5")
    assert a["token_ids"] == b["token_ids"]
    others = [gen_json(capsys, *args, "--seed", str(s))["token_ids"] for s in (6, 7)]
    assert any(o != a["token_ids"] for o in others)


def test_sampling_flags_change_the_output(capsys, llama, greedy_raw):
    # top-k 1 is greedy whatever the temperature; a strong repetition penalty moves off the greedy tokens.
    k1 = gen_json(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "1.5", "--top-k", "1",
                  "--seed", "1")
    assert k1["token_ids"] == greedy_raw["token_ids"]
    tiny_p = gen_json(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "1.5", "--top-p", "1e-6",
                      "--seed", "1")
    assert tiny_p["token_ids"] == greedy_raw["token_ids"]  # only the top token survives top-p
    high_min_p = gen_json(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "1.5",
                          "--min-p", "0.999", "--seed", "1")
    assert high_min_p["token_ids"] == greedy_raw["token_ids"]
    penalised = gen_json(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "0",
                         "--repetition-penalty", "5")
    assert penalised["token_ids"] != greedy_raw["token_ids"]


def test_prefill_chunks_give_the_same_greedy_text(capsys, llama, greedy_raw):
    for chunk in ("1", "5"):
        d = gen_json(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "24", "--temperature", "0", "--prefill-chunk", chunk)
        assert d["token_ids"] == greedy_raw["token_ids"] and d["text"] == greedy_raw["text"]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "nan"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--top-k", "-3"], "top-k must be a whole number >= 0"),
    (["--min-p", "1"], "min-p must be in [0, 1)"),
    (["--repetition-penalty", "0"], "repetition penalty must be a finite number > 0"),
    (["--seed", "-1"], "seed must be in [0, 2^63)"),
    (["-n", "0"], "max new tokens must be at least 1"),
    (["--prefill-chunk", "0"], "prefill chunk must be at least 1 token"),
])
def test_bad_settings_are_one_line_errors_before_the_model_loads(capsys, tmp_path, flags, message):
    # The model does not exist: the setting is refused first, without loading anything.
    r = gen(capsys, "Hello", "-m", str(tmp_path / "no-such-model"), *flags)
    assert message in one_line_error(r)


def test_missing_model_and_device_errors_are_one_line(capsys, llama, tmp_path):
    assert "no such folder" in one_line_error(gen(capsys, "Hello", "-m", str(tmp_path / "nope")))
    assert "unknown dtype" in one_line_error(gen(capsys, "Hello", "-m", llama, "--dtype", "int8"), code=2)
    message = one_line_error(gen(capsys, "Hello", "-m", llama, "--device", "tpu"), code=2)
    assert "device" in message and "tpu" in message


def test_an_unknown_model_name_lists_the_packaged_names(capsys, tmp_path):
    message = one_line_error(gen(capsys, "Hello", "-m", "smollm2"))
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m" in message and message.endswith("did you mean smollm2-135m-instruct?")
    message = one_line_error(gen(capsys, "Hello", "-m", "qwen2.5-coder-1.5"))
    assert message.endswith("did you mean qwen2.5-coder-1.5b-instruct-q4_k_m?")
    assert "did you mean" not in one_line_error(gen(capsys, "Hello", "-m", "zzz"))
    assert "did you mean" not in one_line_error(gen(capsys, "Hello", "-m", str(tmp_path / "smollm2")))


# -- chat, raw, system ---------------------------------------------------------------------------
def test_chat_raw_and_system_shape_the_prompt(capsys, llama):
    chat = gen_json(capsys, CHAT_PROMPT, "-m", llama, "-n", "2", "--chat")
    raw = gen_json(capsys, CHAT_PROMPT, "-m", llama, "-n", "2", "--raw")
    system = gen_json(capsys, CHAT_PROMPT, "-m", llama, "-n", "2", "--system", "You are terse.")
    assert (chat["settings"]["chat"], raw["settings"]["chat"]) == (True, False)
    assert raw["prompt_tokens"] < chat["prompt_tokens"] < system["prompt_tokens"]
    # The template wraps the message in <|im_start|>user ... <|im_end|> and opens the reply.
    from twice.weights.tokenizer import Tokenizer
    from pathlib import Path

    tok = Tokenizer(Path(llama))
    assert chat["prompt_tokens"] == len(tok.encode_chat([{"role": "user", "content": CHAT_PROMPT}]))
    assert system["prompt_tokens"] == len(tok.encode_chat([{"role": "system", "content": "You are terse."},
                                                           {"role": "user", "content": CHAT_PROMPT}]))
    assert raw["prompt_tokens"] == len(tok.encode(CHAT_PROMPT))
    # --system with --raw: ignored, and said so on stderr.
    r = gen(capsys, CHAT_PROMPT, "-m", llama, "-n", "2", "--raw", "--system", "You are terse.", "--json")
    assert r.code == 0 and json.loads(r.out)["prompt_tokens"] == raw["prompt_tokens"]
    assert "--system is used only in chat mode" in r.err


def test_chat_defaults_off_without_a_template_and_chat_then_fails(capsys, model_dirs, tmp_path):
    plain = no_template_copy(model_dirs, tmp_path)
    d = gen_json(capsys, CHAT_PROMPT, "-m", plain, "-n", "2")
    raw = gen_json(capsys, CHAT_PROMPT, "-m", plain, "-n", "2", "--raw")
    assert d["settings"]["chat"] is False and d["prompt_tokens"] == raw["prompt_tokens"]
    assert "no chat template" in one_line_error(gen(capsys, CHAT_PROMPT, "-m", plain, "--chat"))


# -- standard input --------------------------------------------------------------------------------
def test_prompt_from_standard_input(capsys, monkeypatch, llama, greedy_raw):
    for args in (["-"], []):
        d = gen_json(capsys, *args, "-m", llama, "--raw", "-n", "24", "--temperature", "0", stdin=RAW_PROMPT.encode(),
                     monkeypatch=monkeypatch)
        assert (d["prompt_tokens"], d["token_ids"]) == (greedy_raw["prompt_tokens"], greedy_raw["token_ids"])
    d = gen_json(capsys, "-", "-m", llama, "--raw", "-n", "24", "--temperature", "0",
                 stdin=b"\xef\xbb\xbf" + RAW_PROMPT.encode(), monkeypatch=monkeypatch)  # an editor's BOM: not text
    assert (d["prompt_tokens"], d["token_ids"]) == (greedy_raw["prompt_tokens"], greedy_raw["token_ids"])
    for ending in (b"\n", b"\r\n"):  # `echo PROMPT |`: the line ending echo adds is no part of the prompt
        d = gen_json(capsys, "-", "-m", llama, "--raw", "-n", "24", "--temperature", "0",
                     stdin=RAW_PROMPT.encode() + ending, monkeypatch=monkeypatch)
        assert (d["prompt_tokens"], d["token_ids"]) == (greedy_raw["prompt_tokens"], greedy_raw["token_ids"])
    d = gen_json(capsys, "-", "-m", llama, "--raw", "-n", "1", stdin=RAW_PROMPT.encode() + b"\n\n",
                 monkeypatch=monkeypatch)  # only one: a blank last line is the user's
    assert d["prompt_tokens"] > greedy_raw["prompt_tokens"]
    for empty in (b"  \n", b"\xef\xbb\xbf", b"\xef\xbb\xbf \n"):
        r = gen(capsys, "-", "-m", llama, stdin=empty, monkeypatch=monkeypatch)
        assert "the prompt is empty" in one_line_error(r)
    r = gen(capsys, "-", "-m", llama, stdin=b"\xff\xfe", monkeypatch=monkeypatch)
    assert "not valid UTF-8" in one_line_error(r)


# -- --timing ---------------------------------------------------------------------------------------
DEFINITIONS = [
    "twice timing report", "read tokenizer.json", "prompt (and chat template) → token ids",
    "new prompt tokens ÷ prefill time", "request start → first token's text", "first token → last token",
    "after the first token: (generated − 1) ÷ decode time", "step latency p50", "step latency p99",
    "step latency max", "2 · L · B · N · H_kv · d · bytes", "preallocated for N =", "at full context",
    "peak process RSS", "cpu / float32", "(weight bytes + mean KV bytes read per step", "of device peak",
]


@pytest.mark.parametrize("family, dims", [("llama", "2 · 16 · 4"), ("qwen3", "2 · 24 · 4")])
def test_timing_report_states_definitions_and_this_models_numbers(capsys, monkeypatch, model_dirs, family, dims):
    monkeypatch.setenv("COLUMNS", "220")  # one table row per line, so the strings below are not wrapped
    r = gen(capsys, RAW_PROMPT, "-m", str(model_dirs(family)), "--raw", "-n", "6", "--timing", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)  # --timing writes nothing to stdout
    for text in DEFINITIONS:
        assert text in r.err, text
    c = d["cache"]
    assert f"2 · L · B · N · H_kv · d · bytes = 2 · 2 · 1 · {c['tokens']} · {dims} = {c['bytes_in_use']:,} B" in r.err
    assert f"2 · L · H_kv · d · bytes = 2 · 2 · {dims} = {c['bytes_per_token']:,} B" in r.err
    assert "one sequence of the model's 256 tokens" in r.err
    assert f"finish: {d['finish_reason']}" in r.err
    assert "unknown" in r.err  # no peak bandwidth known for the CPU


def test_one_token_has_no_decode_rate_or_step_latency(capsys, monkeypatch, llama):
    # -n 1 runs no decode step: its rate and step latencies are unknown (null, "n/a"), not a
    # 0.0 a script would read as measured.
    monkeypatch.setenv("COLUMNS", "220")
    r = gen(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "1", "--timing", "--json")
    assert r.code == 0, r.err
    d = json.loads(r.out)
    t = d["timings"]
    assert d["generated_tokens"] == 1 and t["step_s"] == [] and t["decode_s"] == 0.0
    assert t["decode_tokens_per_s"] is None
    assert t["step_p50_s"] is t["step_p90_s"] is t["step_p99_s"] is t["step_max_s"] is None
    assert d["bandwidth"]["achieved_bytes_per_s"] is None
    row = next(line for line in r.err.splitlines() if "(generated − 1) ÷ decode time" in line)
    assert "n/a" in row and "needs at least 2 generated tokens" in row


def test_timing_report_is_wide_off_a_terminal_and_shows_the_fraction_of_peak(capsys, monkeypatch, llama):
    import twice.core.device as core_device
    from rich.cells import cell_len

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(core_device, "device_bandwidth_bytes", lambda device: 50e9, raising=False)
    r = gen(capsys, RAW_PROMPT, "-m", llama, "--raw", "-n", "6", "--timing", "--json")
    assert r.code == 0, r.err
    table = [line for line in r.err.splitlines() if line.startswith(("│", "┃", "┏", "└"))]
    assert table and max(cell_len(line) for line in table) >= 120
    assert "after the first token: (generated − 1) ÷ decode time" in r.err  # not broken over lines
    row = next(line for line in table if "of device peak" in line)
    assert re.search(r"\d+\.\d%", row) and "50 GB/s" in row
    bw = json.loads(r.out)["bandwidth"]
    assert bw["device_peak_bytes_per_s"] == 50e9
    assert bw["fraction_of_peak"] == pytest.approx(bw["achieved_bytes_per_s"] / 50e9)


@pytest.mark.parametrize("how", ["NO_COLOR", "--no-color", None])
def test_no_color_removes_colour_codes(capsys, monkeypatch, llama, how):
    from twice.cli.console import COLOR

    monkeypatch.setitem(COLOR, "on", True)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich writes styles even though stderr is captured
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    args = [RAW_PROMPT, "-m", llama, "--raw", "-n", "4", "--timing", "--system", "x"]
    if how == "NO_COLOR":
        monkeypatch.setenv("NO_COLOR", "1")
    elif how == "--no-color":
        args.append("--no-color")
    r = gen(capsys, *args)
    assert r.code == 0, r.err
    assert "twice timing report" in r.err and "note:" in r.err
    assert "\x1b[" not in r.out  # stdout: the text only
    if how is None:
        assert COLOR_SGR.search(r.err)  # the check below would notice colours
    else:
        assert not COLOR_SGR.search(r.err), repr(r.err[:300])


# -- the status line, drawn on a (fake) terminal -------------------------------------------------------
class _TTY(io.StringIO):
    def isatty(self):
        return True


def emulate(data: str, width: int) -> list[str]:
    """The screen (with scrollback) an xterm shows after `data`: printable text with
    autowrap (wide characters included), CR, LF (as CR LF, like a tty's onlcr), cursor
    up, erase line; colours and cursor visibility ignored. Any other escape sequence
    fails the test: the readout must not rely on more than this."""
    from rich.cells import get_character_cell_size

    rows: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(data):
        ch = data[i]
        if ch == "\x1b":
            m = re.match(r"\x1b\[(\??)([0-9;]*)([A-Za-z])", data[i:])
            assert m, repr(data[i:i + 10])
            private, params, final = m.groups()
            i += m.end()
            if final == "A":
                row, col = max(0, row - int(params or 1)), min(col, width - 1)
            elif final == "K":
                if params in ("2",):
                    rows[row] = []
                else:
                    del rows[row][col:]
            elif final in "mhl":
                pass
            else:
                raise AssertionError(f"unexpected escape sequence {m.group(0)!r}")
            continue
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
        else:
            w = get_character_cell_size(ch)
            if col + w > width:
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + w - len(line)))
            line[col] = ch
            for k in range(1, w):
                line[col + k] = ""
            col += w
        while len(rows) <= row:
            rows.append([])
    return _trim(["".join(r) for r in rows])


def _trim(rows: list[str]) -> list[str]:
    rows = [r.rstrip() for r in rows]
    while rows and not rows[-1]:
        rows.pop()
    return rows


def _events(texts: list[str], prompt_tokens: int = 5):
    from twice.core.engine import CacheStats, PrefillStart, TokenEvent

    def cache(n):
        return CacheStats(512, 512 * n, 512 * 64, n, 64, 1, 256)

    yield PrefillStart(1, prompt_tokens, 0, cache(0))
    for i, text in enumerate(texts):
        yield TokenEvent(0, 7, text, i, 0.01, 0.02 + 0.01 * i, cache(prompt_tokens + i))


def test_status_line_is_drawn_sparingly_and_leaves_only_the_text(monkeypatch):
    from twice.cli.readout import REFRESH_SECONDS, Readout

    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("TERM", "xterm")
    # Newlines, a line longer than the terminal, wide characters, an unfinished last line.
    pieces = (["Hello", " world", "\n", "second line\n", "x" * 30, "y" * 30, " 日本語のテキスト" * 4, "\n"]
              + ["tok "] * 400 + ["end"])
    stream = _TTY()
    t0 = time.perf_counter()
    with Readout(stream=stream) as readout:
        assert readout.active and readout.live_on_stdout
        readout.set_phase("loading", "tiny: config, tokenizer, weights")
        for event in _events(pieces):
            readout.on_event(event)
            if event.__class__.__name__ == "TokenEvent" and event.index == 200:
                time.sleep(REFRESH_SECONDS)  # one timed redraw mid-stream
    elapsed = time.perf_counter() - t0
    stream.write("\n")
    data = stream.getvalue()
    assert readout.draws <= 4 + elapsed / REFRESH_SECONDS  # forced (phases) + at most 4 a second, not per token
    assert "loading" in data and "prefill" in data and "decode" in data
    assert emulate(data, 40) == emulate("".join(pieces) + "\n", 40)
    assert emulate(data, 40)[-1].endswith("end")


def test_status_line_goes_to_stderr_when_only_stderr_is_a_terminal(monkeypatch):
    from twice.cli.readout import Readout

    err = _TTY()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("COLUMNS", "120")
    out = io.StringIO()
    with Readout(stream=out) as readout:
        assert readout.active and not readout.live_on_stdout
        for event in _events(["a", "b\n", "c"]):
            readout.on_event(event)
        readout.note("something to know")
    assert out.getvalue() == "ab\nc"  # the text alone, as it came
    assert "decode" in err.getvalue()
    assert emulate(err.getvalue(), 120) == ["note: something to know"]  # the status line was erased


def test_no_status_line_when_nothing_is_a_terminal():
    from twice.cli.readout import Readout

    out = io.StringIO()
    with Readout(stream=out) as readout:
        assert not readout.active
        for event in _events(["a", "b"]):
            readout.on_event(event)
    assert out.getvalue() == "ab"


# -- real processes: pipes and a pseudo-terminal ---------------------------------------------------------
N_TERM = "60"


@pytest.fixture(scope="module")
def piped(llama, capsys_module):
    """The same greedy run as --json (in this process) and as plain text in a real process
    with stdout piped."""
    args = ["Hello world", "-m", llama, "--raw", "-n", N_TERM, "--temperature", "0"]
    plain = run_subprocess(["generate", *args, "--timing"])
    assert plain.code == 0, plain.err
    return capsys_module(*args), plain


def test_piped_stdout_holds_only_the_text(piped):
    d, plain = piped
    assert plain.out == d["text"] + "\n"
    assert "twice timing report" in plain.err and "\x1b[" not in plain.err  # the report: stderr, no styles


def _spawn(command: str, args: list[str], tmp_path):
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "TERM": "xterm", "TWICE_CACHE": str(tmp_path / "cache")}
    env.pop("NO_COLOR", None)
    env.pop("COLUMNS", None)
    child = pexpect.spawn(command, args, env=env, dimensions=(30, 120), encoding="utf-8", timeout=90)
    child.expect(pexpect.EOF)
    data = child.before
    child.close()
    assert child.exitstatus == 0, data
    return data


STATUS_WORDS = ("tok/s", "t/s", "generated", "prompt ", "KV ", "loading", "decode")


def _check_clean(data: str, text: str) -> None:
    assert "decode" in data and ("tok/s" in data or "t/s" in data)  # the status line was shown
    screen = emulate(data, 120)
    for word in STATUS_WORDS:
        assert not any(word in row for row in screen), (word, screen)
    # Raw stream: the last erase of the live region is followed by no status text.
    tail = data[data.rfind("\x1b[2K") + len("\x1b[2K"):]
    assert not any(word in tail for word in STATUS_WORDS), tail

    def visible(s: str) -> str:
        return "".join(ch for ch in s if not ch.isspace() and ch.isprintable())

    assert visible("".join(screen)) == visible(text)


@pytest.mark.slow
def test_on_a_terminal_the_status_line_shows_then_disappears(llama, piped, tmp_path):
    d, _ = piped
    data = _spawn(sys.executable, ["-c", "from twice.cli.app import main; main()", "generate", "Hello world",
                                   "-m", llama, "--raw", "-n", N_TERM, "--temperature", "0"], tmp_path)
    _check_clean(data, d["text"])
    assert data.endswith("\r\n")


@pytest.mark.slow
def test_stdout_piped_stderr_terminal_status_on_stderr_then_gone(llama, piped, tmp_path):
    d, _ = piped
    out = tmp_path / "out.txt"
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-c", "from twice.cli.app import main; main()",
                                             "generate", "Hello world", "-m", llama, "--raw", "-n", N_TERM,
                                             "--temperature", "0"])
    data = _spawn("/bin/bash", ["-c", f"exec {cmd} > {shlex.quote(str(out))}"], tmp_path)
    assert out.read_text(encoding="utf-8") == d["text"] + "\n"
    assert "decode" in data
    assert emulate(data, 120) == []  # the terminal (stderr) is left empty


def test_truncate_left_keeps_the_end_of_a_long_prompt(capsys, llama):
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 60  # far beyond the 256-token context
    r = gen(capsys, long_prompt, "-m", llama, "--raw", "-n", "8")
    assert r.code == 2 and "too many" in r.err
    r = gen(capsys, long_prompt, "-m", llama, "--raw", "-n", "8", "--truncate", "left", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["prompt_tokens"] == 256 - 8 and data["generated_tokens"] == 8
    assert "dropped the first" in r.err and "--truncate left" in r.err
    r = gen(capsys, "Hi", "-m", llama, "--truncate", "right")
    assert r.code == 2 and "truncate must be 'left'" in r.err


def test_sampling_flags_with_greedy_get_a_note(capsys, llama):
    r = gen(capsys, "Hi", "-m", llama, "--raw", "-n", "2", "--temperature", "0", "--top-k", "5")
    assert r.code == 0 and "--top-k has no effect with greedy decoding" in r.err


def test_the_loaded_model_is_frozen_out_of_the_cyclic_collector_before_decoding(capsys, llama, monkeypatch):
    """generate calls options.settle_loaded once the engine is built, before the first token
    (then the model's objects are frozen: gc.freeze), and the tokens are unchanged by it."""
    from twice.cli import options
    from twice.core.engine import Engine

    seen = []
    monkeypatch.setattr(options, "settle_loaded", lambda: seen.append("settled"))
    step = Engine.generate

    def generate(self, *a, **kw):
        seen.append("generate")
        yield from step(self, *a, **kw)

    monkeypatch.setattr(Engine, "generate", generate)
    out = gen_json(capsys, "Hello", "--model", llama, "--max-new-tokens", "4", "--temperature", "0")
    assert seen == ["settled", "generate"], seen
    monkeypatch.undo()
    again = gen_json(capsys, "Hello", "--model", llama, "--max-new-tokens", "4", "--temperature", "0")
    assert again["text"] == out["text"]
