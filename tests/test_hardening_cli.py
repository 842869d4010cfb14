"""Issue 13, a newcomer's papercuts and the default experience (items 1, 13, 14): the CLI's
dtype choice and its reason everywhere, sampling defaults, --threads, -v/--stats,
--version, shell completion, NO_COLOR without any styles, the status line and the bench
table fitted to the terminal, the --compile notice and batch --timing's batch size."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from clirun import one_error_line, run_inprocess

SGR = re.compile(r"\x1b\[[0-9;]*m")  # any style: colour, bold, dim, italic, reset
PROMPT = "Prefill runs the prompt once; decode feeds one token at a time."


@pytest.fixture(scope="module")
def llama(model_dirs):
    return str(model_dirs("llama"))


@pytest.fixture
def threads_restored():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# -- item 14: sampling defaults --------------------------------------------------------------
@pytest.mark.parametrize("config, expected", [
    ({}, (0.8, 40, 0.95, 0.05, 1.0)),  # the model says nothing: llama.cpp's defaults
    ({"repetition_penalty": 1.1}, (0.8, 40, 0.95, 0.05, 1.1)),
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, (0.0, 0, 1.0, 0.0, 1.0)),  # transformers: greedy
    ({"do_sample": False, "repetition_penalty": 1.2}, (0.0, 0, 1.0, 0.0, 1.2)),  # the penalty applies in greedy too
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, (0.6, 50, 0.9, 0.0, 1.0)),  # the rest: transformers'
    ({"do_sample": True}, (1.0, 50, 1.0, 0.0, 1.0)),
    ({"temperature": 0.7, "top_k": 20}, (0.7, 20, 0.95, 0.05, 1.0)),  # no do_sample: its values, then llama.cpp's
])
def test_sampling_defaults(config, expected):
    from twice.cli.options import sampling_params

    s = sampling_params(config, None, None, None, None, None, None)
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty) == expected


def test_flags_win_over_every_default():
    from twice.cli.options import sampling_params

    for config in ({}, {"do_sample": True, "temperature": 0.6}, {"do_sample": False}):
        s = sampling_params(config, 0.0, 3, 0.5, 0.1, 1.3, 9)
        assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.seed) == (0.0, 3, 0.5, 0.1, 1.3, 9)


def test_generation_config_do_sample_false_decodes_greedily(capsys, model_dirs, tmp_path):
    import shutil

    folder = tmp_path / "greedy"
    shutil.copytree(model_dirs("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    r = run_inprocess(["generate", PROMPT, "-m", str(folder), "--raw", "-n", "6", "--json"], capsys)
    assert r.code == 0, r.err
    settings = json.loads(r.out)["settings"]
    assert (settings["temperature"], settings["top_k"], settings["top_p"], settings["min_p"]) == (0.0, 0, 1.0, 0.0)
    greedy = run_inprocess(["generate", PROMPT, "-m", str(folder), "--raw", "-n", "6", "--temperature", "0",
                            "--json"], capsys)
    assert json.loads(greedy.out)["token_ids"] == json.loads(r.out)["token_ids"]


def test_help_names_the_sampling_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    r = run_inprocess(["generate", "--help"], capsys)
    assert r.code == 0
    text = " ".join(r.out.split())
    assert "llama.cpp's default" in text and "0.8" in text and "40" in text and "0.95" in text and "0.05" in text


# -- item 14: --threads -----------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "batch", "bench", "perplexity"])
@pytest.mark.parametrize("threads", ["0", "1025", "2147483648", "99999999999999999999"])
def test_threads_out_of_range_is_one_line_before_loading(capsys, tmp_path, command, threads):
    """Below 1, or past what torch (an int32) and libgomp (a stack per thread) take: one line."""
    args = {"generate": ["generate", "hi"], "chat": ["chat"], "batch": ["batch", str(tmp_path / "in.txt")],
            "bench": ["bench"], "perplexity": ["perplexity", str(tmp_path / "t.txt")]}[command]
    r = run_inprocess([*args, "-m", str(tmp_path / "no-such-model"), "--threads", threads], capsys)
    assert f"--threads must be between 1 and 1024, got {threads}" in one_error_line(r)


def test_threads_sets_torchs_thread_count(capsys, llama, threads_restored):
    import torch

    r = run_inprocess(["generate", PROMPT, "-m", llama, "--raw", "-n", "3", "--threads", "1", "--json"], capsys,
                      restore_threads=False)
    assert r.code == 0, r.err
    assert torch.get_num_threads() == 1


# -- item 14: -v / --stats --------------------------------------------------------------------
def test_stats_are_a_few_lines_on_stderr(capsys, llama):
    plain = run_inprocess(["generate", PROMPT, "-m", llama, "--raw", "-n", "5", "--temperature", "0"], capsys)
    for flag in ("-v", "--stats"):
        r = run_inprocess(["generate", PROMPT, "-m", llama, "--raw", "-n", "5", "--temperature", "0", flag], capsys)
        assert r.code == 0, r.err
        assert r.out == plain.out  # stdout: the text alone
        lines = r.err.strip().splitlines()
        assert 3 <= len(lines) <= 5, lines
        text = "\n".join(lines)
        for word in ("TTFT", "prefill", "tok/s", "decode", "5 tokens", "KV cache", "allocated", "/token"):
            assert word in text, word
        assert "auto: TWICE_CPU_AUTO_DTYPE=float32" in text  # the dtype and why (conftest pins it)


def test_stats_name_the_compile_time_and_no_rate_without_a_decode_step():
    from types import SimpleNamespace

    from twice.cli.report import stats_lines

    cache = SimpleNamespace(bytes_in_use=1024, bytes_allocated=2048, bytes_per_token=64, tokens=16, context_length=256)
    r = SimpleNamespace(prompt_tokens=15, reused_tokens=0, prefill_seconds=0.5, prefill_tokens_per_second=30.0,
                        ttft_seconds=0.6, generated_tokens=1, decode_seconds=0.0, decode_tokens_per_second=None,
                        decode_path="compiled", finish_reason="length", speculation=None, cache=cache,
                        compile_seconds=12.5)
    text = "\n".join(stats_lines(r))
    assert "compile   12.5" in text and "before this request" in text
    decode = next(line for line in text.splitlines() if line.startswith("decode"))
    assert "tok/s" not in decode
    r.compile_seconds = 0.0
    assert "compile   " not in "\n".join(stats_lines(r))


def test_chat_stats_per_turn_and_batch_stats(capsys, monkeypatch, llama, tmp_path):
    script = "Hello there\nHow are you?\n"
    r = run_inprocess(["chat", "-m", llama, "-n", "4", "--temperature", "0", "--stats"], capsys, script.encode(),
                      monkeypatch)
    assert r.code == 0, r.err
    assert r.err.count("KV cache ") == 2 and r.err.count("TTFT") == 2  # one summary per reply
    assert "cpu float32 (auto: TWICE_CPU_AUTO_DTYPE=float32)" in r.err  # the banner says the dtype and why
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\nthree\n")
    r = run_inprocess(["batch", str(src), "-m", llama, "--raw", "-n", "4", "-v", "-o", str(tmp_path / "o.jsonl")],
                      capsys)
    assert r.code == 0, r.err
    assert "3 done in 1 batch" in r.err and "tok/s over the batch" in r.err and "KV cache" in r.err


# -- item 1: the dtype and why, in every report ---------------------------------------------------
def test_dtype_reason_in_json_timing_and_info(capsys, monkeypatch, llama):
    from twice.core import device

    monkeypatch.setenv("COLUMNS", "220")
    r = run_inprocess(["generate", PROMPT, "-m", llama, "--raw", "-n", "3", "--json", "--timing"], capsys)
    assert r.code == 0, r.err
    d = json.loads(r.out)
    assert d["dtype"] == "float32" and d["dtype_reason"] == "auto: TWICE_CPU_AUTO_DTYPE=float32"
    assert "its weights' dtype (auto: TWICE_CPU_AUTO_DTYPE=float32)" in r.err
    r = run_inprocess(["generate", PROMPT, "-m", llama, "--raw", "-n", "3", "--json", "--dtype", "float32"], capsys)
    assert json.loads(r.out)["dtype_reason"] == "--dtype"
    # info: the flags decide when nothing pins it (info reads no weights, so bfloat16 costs nothing here).
    monkeypatch.delenv(device.CPU_AUTO_DTYPE_ENV)
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    r = run_inprocess(["info", llama, "--json"], capsys)
    facts = json.loads(r.out)
    assert (facts["dtype"], facts["dtype_reason"]) == ("bfloat16", "auto: this CPU has AVX-512 BF16")
    r = run_inprocess(["info", llama], capsys)
    assert "bfloat16 (auto: this CPU has AVX-512 BF16)" in r.out
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2"})
    r = run_inprocess(["info", llama, "--json"], capsys)
    assert json.loads(r.out)["dtype"] == "float32"


@pytest.mark.parametrize("command", ["generate", "info", "chat"])
def test_an_invalid_auto_dtype_pin_is_one_line(capsys, monkeypatch, llama, command):
    monkeypatch.setenv("TWICE_CPU_AUTO_DTYPE", "bf16")
    args = {"generate": ["generate", "hi", "-m", llama], "info": ["info", llama], "chat": ["chat", "-m", llama]}
    line = one_error_line(run_inprocess(args[command], capsys))
    assert "TWICE_CPU_AUTO_DTYPE=bf16" in line and "float32 or bfloat16" in line


# -- item 13: --version and completion ---------------------------------------------------------------
@pytest.mark.slow  # a real process / the native kernels' build
def test_version_is_the_package_version_without_importing_torch():
    from importlib.metadata import version

    code = ("import sys\nfrom twice.cli.app import main\nsys.argv = ['twice', '--version']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"twice {version('twice')}", "no torch"]


@pytest.mark.slow  # a real process / the native kernels' build
def test_completion_is_typers(capsys):
    r = run_inprocess(["--help"], capsys)
    assert "--install-completion" in r.out and "--show-completion" in r.out
    r = run_inprocess(["--show-completion", "bash"], capsys)
    assert r.code == 0 and "_twice_completion" in r.out and "_TWICE_COMPLETE" in r.out
    script = Path(sys.executable).parent / "twice"
    if not script.exists():
        pytest.skip("no twice console script beside this Python")
    env = {"_TWICE_COMPLETE": "complete_bash", "COMP_WORDS": "twice gen", "COMP_CWORD": "1", "PATH": "/usr/bin:/bin"}
    p = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout.split() == ["generate"], (p.stdout, p.stderr)


@pytest.mark.parametrize("args, message, hint", [
    (["generate", "hi", "--max-tokens", "3"], "no such option: --max-tokens", "twice generate -h"),
    (["generate", "hi", "--max-new-tokens", "abc"], "'--max-new-tokens'", "twice generate -h"),
    (["generate", "hi", "--kv-dtype"], "'--kv-dtype' requires an argument", None),  # Click gives no context
    (["batch"], "missing argument 'input'", "twice batch -h"),
    (["frobnicate"], "no such command 'frobnicate'", "twice -h"),
    # `--stop "$END"` with END unset: an empty text would match nothing (ran to the limit).
    (["generate", "hi", "--stop", "x", "--stop", ""], "'--stop': an empty text matches nothing", "twice generate -h"),
    (["chat", "--stop", ""], "'--stop': an empty text matches nothing", "twice chat -h"),
    (["batch", "in.txt", "--stop", ""], "'--stop': an empty text matches nothing", "twice batch -h"),
    # the same trap: --model "" meant the default model, --draft "" drafted with it, --system ""
    # was no system message while --json said "system": ""
    (["generate", "hi", "--model", ""], "'' names no model", "twice generate -h"),
    (["generate", "hi", "--draft", " "], "' ' names no model", "twice generate -h"),
    (["generate", "hi", "--system", ""], "'--system': an empty text is no system message", "twice generate -h"),
    (["serve", "--model", ""], "'' names no model", "twice serve -h"),
])
def test_a_command_line_click_cannot_parse_is_one_line(capsys, args, message, hint):
    """Unknown options and commands, values of the wrong type, missing arguments: the same one
    line as every other bad input (Click would draw a usage panel), saying where the options are."""
    line = one_error_line(run_inprocess(args, capsys))
    assert message in line, line
    if hint:
        assert line.endswith(f"(see '{hint}')"), line


def test_no_arguments_still_print_the_help(capsys):
    r = run_inprocess([], capsys)
    assert r.code == 2 and "Usage: twice" in r.out and "generate" in r.out and "error" not in r.err


# -- item 13: NO_COLOR means no styles at all --------------------------------------------------------
def _forced_terminal(monkeypatch):
    from twice.cli.console import COLOR

    monkeypatch.setitem(COLOR, "on", True)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich writes styles although the streams are captured
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("NO_COLOR", raising=False)


@pytest.mark.parametrize("how", ["NO_COLOR", "--no-color", "NO_COLOR=yes", None])
def test_no_color_removes_every_style(capsys, monkeypatch, llama, tmp_path, how):
    _forced_terminal(monkeypatch)
    extra = []
    if how == "--no-color":
        extra = ["--no-color"]
    elif how:
        monkeypatch.setenv("NO_COLOR", "1" if how == "NO_COLOR" else "yes")
    src = tmp_path / "in.txt"
    src.write_text("one\n")
    runs = [
        run_inprocess(["generate", PROMPT, "-m", llama, "--raw", "-n", "3", "--timing", "-v", "--system", "x",
                       *extra], capsys),
        run_inprocess(["batch", str(src), "-m", llama, "--raw", "-n", "2", "--timing", "-o",
                       str(tmp_path / "o.jsonl"), *extra], capsys),
        run_inprocess(["info", llama, *extra], capsys),
    ]
    for r in runs:
        assert r.code == 0, r.err
    err = "".join(r.err + r.out for r in runs)
    assert "twice timing report" in err and "note:" in err and "architecture" in err
    if how is None:
        assert "\x1b[1m" in err  # bold: the check below would notice styles
    else:
        assert not SGR.search(err), repr(SGR.findall(err)[:5])


def test_an_empty_no_color_leaves_colour_on(capsys, monkeypatch, llama):
    _forced_terminal(monkeypatch)
    monkeypatch.setenv("NO_COLOR", "")  # no-color.org: only a non-empty value turns colour off
    r = run_inprocess(["info", llama], capsys)
    assert SGR.search(r.out)


def test_no_color_status_line_has_no_styles(monkeypatch):
    from twice.cli.readout import Readout

    class TTY(io.StringIO):
        def isatty(self):
            return True

    _forced_terminal(monkeypatch)
    monkeypatch.setenv("NO_COLOR", "1")
    stream = TTY()
    with Readout(stream=stream) as readout:
        readout.set_phase("decode", "")
        readout.note("something")
    assert "decode" in stream.getvalue()
    assert not SGR.search(stream.getvalue())


# -- item 13: the status line fits the terminal ------------------------------------------------------
def _busy_readout(reused: int = 12_000):
    from twice.cli.readout import Readout
    from twice.core.engine import CacheStats

    r = Readout(live=False)
    r.phase, r.prompt_tokens, r.reused, r.ttft, r.prefill_tps, r.generated = "decode", 12_345, reused, 1.2345, 1234.5, 1234
    r.cache = CacheStats(9216, 9216 * 13_579, 9216 * 16_384, 13_579, 16_384, 1, 32_768)
    r.context_length = 131_072
    r._recent.extend([(0.0, 1), (10.0, 1235)])
    r.set_model("cpu bfloat16 (auto: this CPU has AVX-512 BF16)", "cpu bfloat16")
    return r


@pytest.mark.parametrize("width, shown", [
    (None, ["decode", "prompt 12,345 tok (12,000 reused)", "TTFT 1,234 ms", "prefill 1,234 tok/s",
            "decode 123.4 tok/s", "1,234 generated", "KV 119.3 MiB / 144.0 MiB", "9.0 KiB/tok", "context 10.4%",
            "cpu bfloat16 (auto: this CPU has AVX-512 BF16)"]),
    (120, ["decode", "prompt 12,345", "TTFT 1,234ms", "prefill 1,234/s", "123.4 tok/s", "1,234 generated",
           "KV 119.3M/144.0M", "ctx 10.4%"]),
    (100, ["decode", "prompt 12,345", "TTFT 1,234ms", "123.4 tok/s", "1,234 generated", "KV 119.3M", "ctx 10.4%"]),
    (80, ["decode", "TTFT 1,234ms", "123.4 tok/s", "1,234 generated", "KV 119.3M", "ctx 10.4%"]),
    (40, ["decode", "123.4 tok/s", "1,234 generated"]),
])
def test_status_line_gives_way_field_by_field(width, shown):
    text = _busy_readout().status_text(width)
    assert text.split(" · ") == shown
    assert width is None or len(text) <= width


def test_status_line_at_common_widths_never_cuts_a_field():
    from twice.cli.readout import cell_len

    for reused in (0, 12_000):
        r = _busy_readout(reused)
        full = r.status_text().split(" · ")
        for width in range(30, 200):
            text = r.status_text(width)
            assert cell_len(text) <= width, (width, text)
            assert "…" not in text and "generated" in text
            fields = text.split(" · ")
            assert len(fields) <= len(full) and fields[0] == "decode"


# -- item 13: the bench table fits the terminal ------------------------------------------------------
def _bench_results():
    def row(engine, batch=1):
        return NS(engine=engine, prompt_tokens=2048, new_tokens=256, batch=batch, ttft_s=1.2345,
                  prefill_tokens_per_s=1198.3, decode_tokens_per_s=1043.2, step_p50_s=0.0123, step_p99_s=0.0456,
                  peak_memory_bytes=123_456_789, bytes_read_per_step=lambda: 3e8, macs_per_token=1e8,
                  macs_per_step=lambda: 1.6e9)

    results = [(NS(name="decode"), row("transformers")), (NS(name="decode"), row("twice-compiled")),
               (NS(name="batch16"), row("twice-native", 16))]
    setup = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "device": "cpu", "dtype": "bfloat16", "threads": 2,
             "dtype_reason": "auto: this CPU has AVX-512 BF16"}
    return results, setup


HEADERS = ["workload", "engine", "TTFT", "p50", "p99"]
VALUES = ["twice-compiled", "1,198", "1,043.2", "12.3 ms", "45.6 ms", "117.7 MiB", "1.00×", "782%", "835%"]


@pytest.mark.parametrize("width, parts", [(80, 3), (100, 2), (120, 2), (150, 1), (180, 1), (None, 1)])
def test_bench_table_fits_the_terminal(width, parts):
    from rich.console import Console

    from twice.cli.bench_render import results_tables

    results, setup = _bench_results()
    tables = results_tables(results, setup, {"read_bytes_per_s": 4e10}, {"macs_per_s": 2e11}, width=width)
    assert len(tables) == parts
    buf = io.StringIO()
    console = Console(file=buf, width=width or 250)
    for t in tables:
        console.print(t)
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= (width or 250)
    assert "…" not in out  # no number squeezed
    for word in HEADERS + VALUES:
        assert word in out, word
    assert "auto: this CPU has AVX-512 BF16" in " ".join(out.split())
    rows = [line for line in out.splitlines() if "twice-native" in line]
    assert len(rows) == parts  # every part repeats the workload and engine


def test_bench_json_has_the_dtype_reason(tmp_path, capsys, monkeypatch):
    from twice.core import benchmark

    # The measurements are test_bench.py's; here only the setup is checked (one tiny run:
    # a bench that measured nothing is an error).
    bandwidth = {"device": "cpu", "threads": 1, "buffer_bytes": 1, "read_bytes_per_s": 1e10, "copy_bytes_per_s": 1e10}
    monkeypatch.setattr(benchmark, "measure_bandwidth", lambda *a, **k: bandwidth)
    monkeypatch.setattr(benchmark, "measure_compute_peak", lambda *a, **k: None)
    out = tmp_path / "b.json"
    r = run_inprocess(["bench", "--shape", "tiny", "--device", "cpu", "--quick", "--repeats", "1", "-w", "decode",
                       "-e", "twice", "--json", str(out)], capsys)
    assert r.code == 0, r.err
    assert json.loads(out.read_text())["setup"]["dtype_reason"] == "auto: TWICE_CPU_AUTO_DTYPE=float32"


# -- item 13: --compile where the native step runs ------------------------------------------------
def test_compile_note_names_what_runs_instead():
    from twice.cli.options import compile_note

    engine = lambda path, tp=False: NS(decode_path=path, model=NS(shard=NS(active=tp)))  # noqa: E731
    assert "native step" in compile_note(engine("native"), True)
    assert "--tp" in compile_note(engine("eager", tp=True), True)
    assert compile_note(engine("compiled"), True) is None
    assert compile_note(engine("native"), False) is None


@pytest.mark.slow  # a real process / the native kernels' build
def test_compile_with_the_native_step_says_so_once(capsys, llama):
    from twice.core import kernels

    if not kernels.available():
        pytest.skip("no C compiler here: the native step does not run")
    r = run_inprocess(["generate", PROMPT, "-m", llama, "--raw", "-n", "3", "--compile"], capsys)
    assert r.code == 0, r.err
    assert r.err.count("--compile has no effect here") == 1 and "native step" in r.err


# -- item 13: batch --timing's batch size ---------------------------------------------------------------
def test_batch_timing_batch_size_definition_matches_the_value(capsys, monkeypatch, llama, tmp_path):
    monkeypatch.setenv("COLUMNS", "220")
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\nthree\n")
    r = run_inprocess(["batch", str(src), "-m", llama, "--raw", "-n", "2", "-b", "8", "--timing", "-o",
                       str(tmp_path / "a.jsonl")], capsys)
    assert r.code == 0, r.err
    limit = next(line for line in r.err.splitlines() if "batch size limit" in line)
    assert re.search(r"│\s+8 │ most rows a batch may hold: --batch-size", limit), limit
    rows = next(line for line in r.err.splitlines() if "rows per batch" in line)
    assert "3 most, 3.0 mean" in rows
    r = run_inprocess(["batch", str(src), "-m", llama, "--raw", "-n", "2", "-b", "2", "--timing", "-o",
                       str(tmp_path / "b.jsonl")], capsys)
    assert "2 most, 1.5 mean" in next(line for line in r.err.splitlines() if "rows per batch" in line)
    # The automatic size: the value shown is the power of 2 the definition describes.
    r = run_inprocess(["batch", str(src), "-m", llama, "--raw", "-n", "2", "--timing", "-o",
                       str(tmp_path / "c.jsonl")], capsys)
    limit = next(line for line in r.err.splitlines() if "batch size limit" in line)
    value = int(re.search(r"│\s+(\d+) │", limit).group(1))
    assert value in (1, 2, 4, 8, 16, 32, 64) and ("largest power of 2 ≤ 64" in limit or "fallback" in limit)
    assert "cut to" not in limit


# -- a ~user this system does not know -------------------------------------------------------
NO_USER = "~twice-no-such-user"


@pytest.mark.parametrize("args", [
    ["generate", "hi", "-n", "1", "--prompt-cache", f"{NO_USER}/x.kv"],
    ["generate", "hi", "-m", f"{NO_USER}/model"],
    ["quantize", f"{NO_USER}/model", "out.gguf", "--type", "q8_0"],
])
def test_a_tilde_of_an_unknown_user_is_one_line(capsys, args):
    """pathlib's expanduser raises RuntimeError for ~user of no such user: it was a traceback."""
    line = one_error_line(run_inprocess(args, capsys))
    assert f"cannot expand {NO_USER}: no user 'twice-no-such-user' on this system" in line, line


def test_chat_save_and_load_to_an_unknown_users_home_keep_the_conversation(capsys, monkeypatch, llama):
    script = f"hi\n/load {NO_USER}/x.json\n/save {NO_USER}/x.json\n/save x.json/\nmore\n".encode()
    r = run_inprocess(["chat", "-m", llama, "-n", "2", "--temperature", "0"], capsys, stdin=script,
                      monkeypatch=monkeypatch)
    assert r.code == 0 and "Traceback" not in r.err, r.err
    assert r.err.count(f"cannot expand {NO_USER}") == 2 and "the turn was not kept" not in r.err, r.err
    assert "x.json/: names a folder (it ends in /)" in r.err and not Path("x.json").exists()
    assert "reused 0" not in r.err.split(f"{NO_USER}/x.json: cannot expand")[-1]  # the cache was kept
