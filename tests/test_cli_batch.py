"""`twice batch`: input formats, per-line options, batched results equal to each prompt
alone, bad lines, --strict, crash safety and --resume, standard input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st

from clirun import one_error_line, run_inprocess
from twice.cli.batch import auto_batch_size
from twice.cli.batch_input import parse_input, sniff_format
from twice.cli.batch_output import scan_output
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.sampling import SamplingParams
from twice.weights.load import load

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. Caches trade memory for speed.",
    "Prefill runs the prompt once",
    "Café, naïve",
    "def f(x):",
    "Emoji: 😀 🚀 🎉 and symbols ∑ ∫ √ → ← and more text to make this one the longest prompt of all",
]
FIELDS = {"id", "prompt", "completion", "finish_reason", "prompt_tokens", "generated_tokens", "settings", "timings",
          "model"}


@pytest.fixture(scope="module")
def llama(model_dirs):
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def engine(llama):
    m = load(llama, device="cpu", dtype="float32")
    return Engine(m.model, m.tokenizer, m.eos_token_ids)


def alone(engine, text: str, n: int, **kw):
    events = list(engine.generate(Request(text=text), GenerationSettings(max_new_tokens=n, **kw), reuse_cache=False))
    return events[-1].result


def batch(args, capsys, llama, **kw):
    # Greedy (--temperature 0): these tests compare with greedy decoding, and the CLI's
    # default samples (llama.cpp's defaults) when the model says nothing; a line's own
    # "temperature" still replaces it.
    return run_inprocess(["batch", *args, "-m", llama, "--temperature", "0"], capsys, **kw)


def read_lines(path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def write_jsonl(path, objs) -> None:
    path.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs), encoding="utf-8")


# -- formats and fields -----------------------------------------------------------------
def test_txt_input_gives_one_line_per_prompt_with_the_documented_fields(tmp_path, capsys, llama):
    src = tmp_path / "p.txt"
    src.write_text("Hello world\n\n   \nThe quick brown fox\r\nCafé, naïve\n", encoding="utf-8")
    r = batch([str(src), "--raw", "-n", "5"], capsys, llama)
    assert r.code == 0, r.err
    out = [json.loads(line) for line in r.out.splitlines()]
    assert sorted(o["id"] for o in out) == ["1", "4", "5"]  # 1-based line numbers; blank lines skipped
    by_id = {o["id"]: o for o in out}
    assert by_id["4"]["prompt"] == "The quick brown fox"  # the \r of a CRLF line is not part of it
    for o in out:
        assert set(o) == FIELDS
        assert set(o["timings"]) == {"ttft_s", "prefill_s", "decode_s", "decode_tokens_per_s"}
        assert 1 <= o["generated_tokens"] <= 5 and o["prompt_tokens"] > 0
        assert o["finish_reason"] in ("length", "eos")
    assert "3 prompts done, 0 skipped" in r.err


@pytest.mark.parametrize("size", [2, 4])
def test_batched_results_equal_each_prompt_alone(tmp_path, capsys, llama, engine, size):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    r = batch([str(src), "--raw", "-n", "12", "--batch-size", str(size), "-o", str(dst), "--timing"], capsys, llama)
    assert r.code == 0, r.err
    out = {o["id"]: o for o in read_lines(dst)}
    assert sorted(out) == list(range(len(PROMPTS)))  # integer ids stay integers
    for i, prompt in enumerate(PROMPTS):
        want = alone(engine, prompt, 12)
        assert (out[i]["completion"], out[i]["generated_tokens"], out[i]["prompt_tokens"]) == \
            (want.text, want.generated_tokens, want.prompt_tokens), prompt
    # the --timing table: one scheduler run at the limit (every row ends at the same step, so
    # each pair joins an empty batch: no refills)
    table = {cells[0]: cells[1] for line in r.err.splitlines()
             if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) >= 2 and cells[0]}
    assert table["batches"] == "1" and table["batch size limit"] == str(size)
    assert table["refills"] == "0" and table["rows per batch"].startswith(f"{size} most")


def test_a_finished_row_is_refilled_from_the_input_and_every_result_is_its_prompts_alone(tmp_path, capsys, llama,
                                                                                         engine):
    """Mixed lengths (a line's own max_new_tokens): as a short row finishes, the next prompt takes
    its place in the running batch (--timing counts the refills), and every row still gets the
    tokens its prompt gets alone."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lengths = [2, 14, 3, 12, 2, 10]
    write_jsonl(src, [{"id": i, "prompt": PROMPTS[i], "max_new_tokens": n} for i, n in enumerate(lengths)])
    r = batch([str(src), "--raw", "--batch-size", "2", "-o", str(dst), "--timing"], capsys, llama)
    assert r.code == 0, r.err
    out = {o["id"]: o for o in read_lines(dst)}
    for i, n in enumerate(lengths):
        want = alone(engine, PROMPTS[i], n)
        assert (out[i]["completion"], out[i]["generated_tokens"]) == (want.text, want.generated_tokens), i
    table = {cells[0]: cells[1] for line in r.err.splitlines()
             if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) >= 2 and cells[0]}
    assert table["batches"] == "1" and int(table["refills"]) >= 2, table  # one run, rows joining it


def test_per_line_options_are_honoured(tmp_path, capsys, llama, engine):
    prompt = PROMPTS[1]
    greedy = alone(engine, prompt, 16).text
    stop = greedy[3:5]
    assert len(greedy) >= 5 and stop.strip()
    # A line's temperature replaces the run's; top-k, top-p and min-p stay the run's (the defaults, llama.cpp's).
    from twice.cli.options import DEFAULT_SAMPLING

    sampled = alone(engine, prompt, 10, sampling=SamplingParams(**{**DEFAULT_SAMPLING, "temperature": 1.0},
                                                                seed=7)).text
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [
        {"id": "short", "prompt": prompt, "max_new_tokens": 3},
        {"id": "seed-a", "prompt": prompt, "temperature": 1.0, "seed": 7, "max_new_tokens": 10},
        {"id": "seed-b", "prompt": prompt, "temperature": 1.0, "seed": 7, "max_new_tokens": 10, "note": "kept"},
        {"id": "stop", "prompt": prompt, "stop": [stop], "max_new_tokens": 16},
        {"id": "stop-str", "prompt": prompt, "stop": stop, "max_new_tokens": 16},
    ])
    r = batch([str(src), "--raw", "-n", "16"], capsys, llama)
    assert r.code == 0, r.err
    out = {o["id"]: o for o in map(json.loads, r.out.splitlines())}
    assert out["short"]["completion"] == alone(engine, prompt, 3).text
    assert out["short"]["generated_tokens"] <= 3
    assert out["seed-a"]["completion"] == out["seed-b"]["completion"] == sampled
    for key in ("stop", "stop-str"):
        assert out[key]["finish_reason"] == "stop"
        assert out[key]["completion"] == greedy[: greedy.find(stop)]
    assert 'key "note" is not used' in r.err  # unknown keys: noted once, not an error


def test_chat_mode_matches_generate_and_messages_lines(tmp_path, capsys, llama):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "p", "prompt": "Hello world"},
                      {"id": "m", "messages": [{"role": "user", "content": "Hello world"}]}])
    r = batch([str(src), "-n", "8"], capsys, llama)  # the tiny model has a chat template: chat by default
    assert r.code == 0, r.err
    out = {o["id"]: o for o in map(json.loads, r.out.splitlines())}
    assert out["m"]["messages"] == [{"role": "user", "content": "Hello world"}] and "prompt" not in out["m"]
    g = run_inprocess(["generate", "Hello world", "-m", llama, "-n", "8", "--temperature", "0", "--json"], capsys)
    assert g.code == 0, g.err
    assert out["p"]["completion"] == out["m"]["completion"] == json.loads(g.out)["text"]


def test_stdin_input_and_format_sniffing(capsys, monkeypatch, llama):
    lines = [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "The quick brown fox"}]
    stdin = ("\n" + "".join(json.dumps(o) + "\n" for o in lines)).encode()
    r = batch(["-", "--raw", "-n", "4"], capsys, llama, stdin=stdin, monkeypatch=monkeypatch)
    assert r.code == 0, r.err
    assert sorted(o["id"] for o in map(json.loads, r.out.splitlines())) == ["a", "b"]
    r = batch(["-", "--raw", "-n", "4"], capsys, llama, stdin=b"Hello\nworld\n", monkeypatch=monkeypatch)
    assert r.code == 0, r.err
    assert sorted(o["id"] for o in map(json.loads, r.out.splitlines())) == ["1", "2"]
    r = batch(["-", "--raw", "-n", "4", "--format", "txt"], capsys, llama, stdin=b'{"id": 1}\n',
              monkeypatch=monkeypatch)
    assert r.code == 0 and json.loads(r.out)["prompt"] == '{"id": 1}'


def test_invalid_utf8_input_is_a_one_line_error(tmp_path, capsys, llama):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"fine\nbad \xff byte\n")
    r = batch([str(src), "--raw"], capsys, llama)
    assert r.code == 2 and r.out == ""
    assert r.err.startswith("twice: error:") and "bad.txt:2: not valid UTF-8" in r.err
    assert r.err.count("\n") == 1


def test_a_prompt_the_engine_cannot_serve_becomes_an_error_line(tmp_path, capsys, llama):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "long", "prompt": "Hello world " * 300}, {"id": "ok", "prompt": "Hello"}])
    r = batch([str(src), "--raw", "-n", "4", "--batch-size", "2"], capsys, llama)
    assert r.code == 0, r.err
    out = {o["id"]: o for o in map(json.loads, r.out.splitlines())}
    assert set(out["long"]) == {"id", "error", "finish_reason"} and out["long"]["finish_reason"] == "error"
    assert "context" in out["long"]["error"]
    assert out["ok"]["finish_reason"] in ("length", "eos")
    assert "1 failed" in r.err


# -- bad lines and --strict -------------------------------------------------------------
BAD_INPUT = "\n".join([
    '{"id": "a", "prompt": "Hello"}',
    '{"id": "b", "prompt": ',  # 2: invalid JSON
    '{"id": "c"}',  # 3: no prompt
    '{"id": "d", "prompt": 5}',  # 4: wrong type
    '{"id": "a", "prompt": "again"}',  # 5: duplicate id
    '{"id": "e", "prompt": "x", "max_new_tokens": 0}',  # 6: out of range
    '[1, 2]',  # 7: not an object
    '{"id": "f", "prompt": "The quick brown fox"}',
]) + "\n"


def test_bad_lines_are_reported_with_line_numbers_and_the_rest_run(tmp_path, capsys, llama):
    src = tmp_path / "in.jsonl"
    src.write_text(BAD_INPUT)
    r = batch([str(src), "--raw", "-n", "4"], capsys, llama)
    assert r.code == 0, r.err
    assert sorted(o["id"] for o in map(json.loads, r.out.splitlines())) == ["a", "f"]
    for line, words in [(2, "invalid JSON"), (3, "missing"), (4, "must be a string"), (5, "duplicate id"),
                        (6, "max_new_tokens"), (7, "expected a JSON object")]:
        assert f"{src}:{line}: " in r.err and words in r.err.split(f"{src}:{line}: ")[1].splitlines()[0]
    assert "2 prompts done, 6 skipped (bad lines)" in r.err
    assert "Traceback" not in r.err


def test_an_empty_stop_text_is_a_bad_line_as_the_flag_is_refused():
    text = "".join(json.dumps(o) + "\n" for o in ({"id": 1, "prompt": "a", "stop": ""},
                                                  {"id": 2, "prompt": "b", "stop": ["x", ""]},
                                                  {"id": 3, "prompt": "c", "stop": []}))
    records, errors = parse_input(text, "jsonl")
    assert [r.id for r in records] == [3]
    assert [(e.line, "empty text, which matches nothing" in e.message) for e in errors] == [(1, True), (2, True)]


def test_a_key_given_twice_is_a_bad_line():
    # json.loads keeps the last quietly: which prompt ran would depend on the writer's order.
    records, errors = parse_input('{"id": 1, "prompt": "a", "prompt": "b"}\n{"id": 2, "prompt": "c"}\n', "jsonl")
    assert [r.id for r in records] == [2]
    assert [(e.line, e.message) for e in errors] == [(1, 'the key "prompt" appears twice in one object')]


def test_strict_stops_before_any_work(tmp_path, capsys, llama):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(BAD_INPUT)
    # A model that does not exist: --strict must stop before even loading one.
    r = run_inprocess(["batch", str(src), "--strict", "-o", str(dst), "-m", str(tmp_path / "no-model")], capsys)
    assert r.code == 2 and not dst.exists() and r.out == ""
    assert all(f"{src}:{line}: " in r.err for line in range(2, 8))
    assert "twice: error: 6 bad lines" in r.err


def test_nothing_runnable_exits_2(tmp_path, capsys, llama):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1}\n')
    r = batch([str(src)], capsys, llama)
    assert r.code == 2 and "no prompt could run" in r.err


# -- output files and --resume ----------------------------------------------------------
def test_resume_after_a_complete_run_repeats_nothing(tmp_path, capsys, llama):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("\n".join(PROMPTS[:4]) + "\n")
    assert batch([str(src), "--raw", "-n", "4", "-o", str(dst)], capsys, llama).code == 0
    before = dst.read_bytes()
    assert len(read_lines(dst)) == 4
    r = batch([str(src), "--raw", "-n", "4", "-o", str(dst), "--resume"], capsys, llama)
    assert r.code == 0, r.err
    assert "nothing to do" in r.err and dst.read_bytes() == before


@pytest.mark.slow
def test_resume_after_sigkill_and_torn_write(tmp_path, capsys, llama):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    n_prompts = 40
    src.write_text("".join(f"{PROMPTS[i % len(PROMPTS)]} {i}\n" for i in range(n_prompts)))
    args = ["batch", str(src), "-m", llama, "--raw", "-n", "200", "--temperature", "0", "--batch-size", "1", "-o", str(dst)]
    proc = subprocess.Popen([sys.executable, "-c", "from twice.cli.app import main; main()", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (dst.exists() and dst.read_bytes().count(b"\n") >= 3):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "no output lines after 60 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    done = read_lines(dst)
    assert 3 <= len(done) < n_prompts  # killed mid-file
    with open(dst, "ab") as f:
        f.write(b'{"id": "39", "completion": "torn mid-wr')  # a torn last write: no newline
    # the killed run's settings (--resume refuses others), another batch size
    r = batch([str(src), "--raw", "-n", "200", "--batch-size", "8", "-o", str(dst), "--resume"], capsys, llama)
    assert r.code == 0, r.err
    assert "dropped an incomplete last line" in r.err
    out = read_lines(dst)  # every line complete, valid JSON
    ids = [o["id"] for o in out]
    assert sorted(ids, key=int) == [str(i) for i in range(1, n_prompts + 1)]  # each id exactly once
    assert out[: len(done)] == done  # what the killed run wrote is kept as it was
    assert f"{n_prompts - len(done)} prompts done" in r.err and f"{len(done)} already in the output" in r.err


def test_resume_drops_a_last_line_that_is_not_json(tmp_path, capsys, llama):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("Hello\nworld\n")
    dst.write_bytes(b'{"id": "1", "completion": "x", "finish_reason": "length"}\n{"id": "2", "compl\x00\x00\n')
    r = batch([str(src), "--raw", "-n", "3", "-o", str(dst), "--resume"], capsys, llama)
    assert r.code == 0, r.err
    out = read_lines(dst)
    assert [o["id"] for o in out] == ["1", "2"] and out[0]["completion"] == "x"


@pytest.mark.parametrize("content", [
    b"my notes\nplease keep\n",
    b"hello",  # one line, no newline: not a torn line of ours
    b'{"id": 1, "prompt": "an input file, not an output"}\n',
    b'{"id": 1, "prompt": "no newline"}',
])
def test_resume_refuses_a_file_that_is_not_ours(tmp_path, capsys, llama, content):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("Hello\n")
    dst.write_bytes(content)
    r = batch([str(src), "--raw", "-o", str(dst), "--resume"], capsys, llama)
    assert r.code == 2 and "is not a twice batch output" in r.err and r.err.count("\n") == 1
    assert dst.read_bytes() == content


def test_resume_refuses_an_output_written_for_another_input(tmp_path, capsys, llama):
    # Text inputs number their prompts 1, 2, ...: another file's output holds the same ids,
    # and continuing it would skip prompts whose lines answer something else.
    first, second, dst = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "out.jsonl"
    first.write_text("Hello\nworld\n")
    second.write_text("Hello\nsomething else\nthird\n")
    assert batch([str(first), "--raw", "-n", "2", "-o", str(dst)], capsys, llama).code == 0
    before = dst.read_bytes()
    r = batch([str(second), "--raw", "-n", "2", "-o", str(dst), "--resume"], capsys, llama)
    last = r.err.strip().splitlines()[-1]  # after the "continuing" note (said before stdin is read)
    assert r.code == 2 and last.startswith("twice: error: ") and "Traceback" not in r.err, r.err
    assert f"{dst}:2: the result for id \"2\" answers another prompt than {second}:2" in last
    assert dst.read_bytes() == before
    # The same input, one prompt added at its end: continued.
    first.write_text("Hello\nworld\nthird\n")
    r = batch([str(first), "--raw", "-n", "2", "-o", str(dst), "--resume"], capsys, llama)
    assert r.code == 0, r.err
    assert [o["id"] for o in read_lines(dst)] == ["1", "2", "3"]


def test_resume_refuses_an_output_another_model_wrote(tmp_path, capsys, llama, model_dirs, monkeypatch):
    # Result lines name their model; continuing with another would mix two models' answers.
    src, dst = tmp_path / "a.txt", tmp_path / "out.jsonl"
    src.write_text("Hello\nworld\n")
    assert batch([str(src), "--raw", "-n", "2", "-o", str(dst)], capsys, llama).code == 0
    assert {o["model"] for o in read_lines(dst)} == {llama}
    src.write_text("Hello\nworld\nthird\n")
    before = dst.read_bytes()
    other = str(model_dirs("qwen3"))
    r = run_inprocess(["batch", str(src), "--raw", "-n", "2", "-o", str(dst), "--resume", "-m", other,
                       "--temperature", "0"], capsys)
    last = r.err.strip().splitlines()[-1]
    assert r.code == 2 and last.startswith("twice: error: ") and "Traceback" not in r.err, r.err
    assert f"{dst}:1: its results are from the model \"{llama}\", this run loads \"{other}\"" in last, last
    assert dst.read_bytes() == before
    # The same model spelled as another path to the same folder: continued.
    relative = os.path.relpath(llama)
    r = batch([str(src), "--raw", "-n", "2", "-o", str(dst), "--resume"], capsys, relative)
    assert r.code == 0, r.err
    assert [o["id"] for o in read_lines(dst)] == ["1", "2", "3"]
    # A folder named relative to where the first run was is recorded as the folder itself, so a
    # run from elsewhere continues it (the line said "llama", which from there named nothing).
    monkeypatch.chdir(os.path.dirname(llama))
    dst2 = tmp_path / "out2.jsonl"
    assert batch([str(src), "--raw", "-n", "2", "-o", str(dst2)], capsys, os.path.basename(llama)).code == 0
    assert {o["model"] for o in read_lines(dst2)} == {os.path.realpath(llama)}
    dst2.write_bytes(b"".join(dst2.read_bytes().splitlines(keepends=True)[:1]))
    monkeypatch.chdir(tmp_path)
    r = batch([str(src), "--raw", "-n", "2", "-o", str(dst2), "--resume"], capsys, llama)
    assert r.code == 0, r.err
    assert [o["id"] for o in read_lines(dst2)] == ["1", "2", "3"]


def test_resume_refuses_an_output_drawn_with_other_settings(tmp_path, capsys, llama):
    # Result lines record the settings that chose their tokens, after the line's own values;
    # continuing with others would mix two ways of answering in one file.
    src, dst = tmp_path / "a.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"id": 1, "prompt": "Hello"}, {"id": 2, "prompt": "world", "temperature": 0.7, "seed": 3}])
    assert batch([str(src), "-n", "2", "-o", str(dst), "--system", "Be brief."], capsys, llama).code == 0
    lines = read_lines(dst)
    numerics = {k: lines[0]["settings"].pop(k) for k in ("dtype", "kv_dtype", "weights")}
    assert lines[0]["settings"] == {"max_new_tokens": 2, "temperature": 0.0, "top_k": 40, "top_p": 0.95,
                                    "min_p": 0.05, "repetition_penalty": 1.0, "seed": None, "stop": [], "chat": True,
                                    "system": "Be brief."}
    assert numerics == {"dtype": "float32", "kv_dtype": "float32", "weights": "F32"}, numerics
    assert (lines[1]["settings"]["temperature"], lines[1]["settings"]["seed"]) == (0.7, 3)  # the line's own
    dst.write_bytes(b"".join(dst.read_bytes().splitlines(keepends=True)[:1]))  # as if killed after one line
    before = dst.read_bytes()
    same = [str(src), "-n", "2", "-o", str(dst), "--system", "Be brief.", "--resume"]
    for changed, words in ((["-n", "3"], "max_new_tokens 2, this run gives 3"),
                           (["--top-k", "5"], "top_k 40, this run gives 5"),
                           (["--stop", "x"], 'stop [], this run gives ["x"]'),
                           (["--raw"], "chat true, this run gives false"),
                           (["--system", "Be long."], 'system "Be brief.", this run gives "Be long."'),
                           # what the numbers are computed in chooses tokens too
                           (["--dtype", "bfloat16"], 'dtype "float32", this run gives "bfloat16"'),
                           (["--kv-dtype", "float16"], 'kv_dtype "float32", this run gives "float16"'),
                           (["--quantize", "q8_0"], 'weights "F32", this run gives "Q8_0"')):
        r = batch([*same, *changed], capsys, llama)
        last = r.err.strip().splitlines()[-1]
        assert r.code == 2 and last.startswith(f"twice: error: {dst}:1: its result was generated with {words}"), r.err
        assert dst.read_bytes() == before
    # a line's own values changed since: refused too
    write_jsonl(src, [{"id": 1, "prompt": "Hello", "max_new_tokens": 1}, {"id": 2, "prompt": "world"}])
    assert batch(same, capsys, llama).code == 2 and dst.read_bytes() == before
    write_jsonl(src, [{"id": 1, "prompt": "Hello"}, {"id": 2, "prompt": "world", "temperature": 0.7, "seed": 3}])
    r = batch(same, capsys, llama)
    assert r.code == 0, r.err
    assert [o["id"] for o in read_lines(dst)] == [1, 2]
    # a complete output is checked too: "nothing to do" told a run with other settings it was done
    done = dst.read_bytes()
    r = batch([*same, "-n", "3"], capsys, llama)
    assert r.code == 2 and "its result was generated with max_new_tokens 2, this run gives 3" in r.err, r.err
    assert "nothing to do" not in r.err and dst.read_bytes() == done
    r = batch(same, capsys, llama)
    assert r.code == 0 and "nothing to do" in r.err and dst.read_bytes() == done
    # lines of a twice that recorded no dtype/kv_dtype/weights are continued, the rest compared
    older = dict(read_lines(dst)[0], settings=dict(read_lines(dst)[0]["settings"]))
    for k in numerics:
        del older["settings"][k]
    dst.write_text(json.dumps(older) + "\n")
    assert batch([*same, "--dtype", "bfloat16"], capsys, llama).code == 0
    assert read_lines(dst)[1]["settings"]["dtype"] == "bfloat16"
    # settings or a model of another kind than ours write: not a line of ours (it was passed over)
    good = read_lines(dst)[0]
    for field, value in (("settings", "x"), ("settings", None), ("model", 7)):
        dst.write_text(json.dumps({**good, field: value}) + "\n")
        r = batch([*same, "--dtype", "bfloat16"], capsys, llama)
        assert r.code == 2 and f"{dst}:1: not a line of ours" in r.err, r.err
    dst.write_text(json.dumps(good) + "\n")
    assert batch([*same, "--dtype", "bfloat16"], capsys, llama).code == 0
    # an output whose lines record no settings (an older twice's) is continued as before
    dst.write_bytes(b'{"id": "1", "completion": "x", "finish_reason": "length"}\n')
    assert batch([*same, "-n", "5"], capsys, llama).code == 0


def test_the_input_as_its_own_output_is_one_line(tmp_path, capsys, llama):
    """-o naming the input file said "already exists; pass --resume", and --resume then said
    its lines were not ours: it is the input, said once, and the file is kept."""
    src = tmp_path / "p.txt"
    src.write_text("Hello\nworld\n")
    for extra in ([], ["--resume"]):
        r = batch([str(src), "-o", str(tmp_path / "." / "p.txt"), "-n", "2", *extra], capsys, llama)
        assert one_error_line(r) == f"twice: error: {tmp_path}/p.txt: is the input file; results go to another " \
                                    "file (--output OUT.jsonl)"
        assert src.read_text() == "Hello\nworld\n"


def test_batch_notes_that_raw_ignores_system(tmp_path, capsys, llama):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": 1, "prompt": "Hello"}, {"id": 2, "messages": [{"role": "user", "content": "Hi"}]}])
    r = batch([str(src), "--raw", "-n", "2", "--system", "Be brief."], capsys, llama)
    assert r.code == 0, r.err
    assert "note: --system is used only in chat mode; ignored with --raw for prompt lines (messages lines keep it)" in r.err
    r = batch([str(src), "-n", "2", "--system", "Be brief."], capsys, llama)  # the tiny model has a template
    assert r.code == 0 and "--system" not in r.err, r.err


def test_output_errors_never_clobber(tmp_path, capsys, llama):
    src, dst = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("Hello\n")
    dst.write_bytes(b"precious\n")
    r = batch([str(src), "--raw", "-o", str(dst)], capsys, llama)
    assert r.code == 2 and "--resume" in r.err and dst.read_bytes() == b"precious\n"
    r = batch([str(src), "--raw", "-o", str(tmp_path / "no-such-dir" / "out.jsonl")], capsys, llama)
    assert r.code == 2 and "does not exist" in r.err and r.err.count("\n") == 1
    r = batch([str(src), "--raw", "--resume"], capsys, llama)
    assert r.code == 2 and "--resume needs --output" in r.err


# -- pure parts -------------------------------------------------------------------------
def test_parse_input_edge_cases():
    records, errors = parse_input('\ufeff{"id": "a", "prompt": "x\u2028y"}\r\n\n{"id": 1, "prompt": "\\ud800"}\n'
                                  + "[" * 100000 + "\n" + '{"id": "a", "prompt": "same id as line 1"}\n', "jsonl")
    assert [(r.id, r.prompt) for r in records] == [("a", "x\u2028y")]
    assert [e.line for e in errors] == [3, 4, 5] and "surrogate" in errors[0].message
    assert "duplicate id \"a\" (first on line 1)" in errors[2].message
    records, errors = parse_input('{"id": "q", "prompt": "p", "seed": -1, "top_p": 0}\n{"id": true, "prompt": "p"}\n'
                                  '{"id": "z", "prompt": "p", "temperature": 1e999}', "jsonl")
    assert not records and [e.line for e in errors] == [1, 2, 3]
    assert sniff_format("\n  {\"id\": 1}") == "jsonl" and sniff_format("hello {") == "txt"


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('{}[]":,\n\r 0123456789abidpromptseqnull\\u') + ["\ud800", "é"])),
       st.sampled_from(["txt", "jsonl"]))
def test_parse_input_never_raises_and_keeps_one_line_messages(text, fmt):
    records, errors = parse_input(text, fmt)
    assert all("\n" not in e.message for e in errors)
    assert len({r.key for r in records}) == len(records)


def test_scan_output_and_auto_batch_size():
    ours = b'{"id": "1", "completion": "", "finish_reason": "eos"}\n'
    assert scan_output(ours, "o").done == {"1"} and scan_output(ours, "o").keep_bytes is None
    state = scan_output(ours + b'{"id": "2", "comp', "o")
    assert state.keep_bytes == len(ours) and state.done == {"1"}
    assert scan_output(b'{"i', "o").keep_bytes == 0  # a first line torn before its end
    assert auto_batch_size(100, 1000, 64 * 100 * 1000 * 4) == 64
    assert auto_batch_size(100, 1000, 5 * 100 * 1000 * 4) == 4
    assert auto_batch_size(100, 1000, 10) == 1
    assert auto_batch_size(100, 1000, None) == 8


def test_help_documents_the_batch_size_rule(capsys):
    r = run_inprocess(["batch", "--help"], capsys)
    assert r.code == 0
    text = " ".join(r.out.split())
    assert "25%" in text and "64" in text and "completion order" in text


@pytest.mark.slow
def test_compile_gives_the_same_lines(tmp_path, capsys, model_dirs):
    """--compile: the same completions as the eager layers (GPT-2: no native step), rows
    of different lengths finishing at different steps."""
    gpt2 = str(model_dirs("gpt2"))
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": i, "prompt": p, "max_new_tokens": 4 + 3 * i} for i, p in enumerate(PROMPTS[:4])])
    outs = []
    for extra in ([], ["--compile"]):
        dst = tmp_path / f"out{len(extra)}.jsonl"
        r = run_inprocess(["batch", str(src), "-m", gpt2, "--raw", "--temperature", "0", "-o", str(dst), *extra], capsys)
        assert r.code == 0, r.err
        outs.append({o["id"]: (o["completion"], o["generated_tokens"]) for o in read_lines(dst)})
    assert outs[0] == outs[1] and len(outs[0]) == 4
