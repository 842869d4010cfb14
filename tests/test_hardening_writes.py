"""Issue 13, items 5, 6 and 8: what twice writes is locked where two writers may meet,
whole or not at all, never through a link, with the modes a user expects.

- batch: one lock per output (and part file), taken before reading what is done; a
  one-process --resume merges the parts a killed data-parallel run left.
- the cache: a conversion is locked (a second first run waits and uses the first's
  folder), atomic, and removes the temporary folders of killed conversions.
- the chat history appends through safe_write (a planted link is refused, once).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clirun import one_error_line, run_inprocess
from test_hostile_inputs import write_small_gguf


def line(obj) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")


def ours(i, text="earlier") -> bytes:
    return line({"id": i, "completion": text, "finish_reason": "length"})


def ids_of(path: Path) -> list:
    return [json.loads(raw)["id"] for raw in path.read_bytes().splitlines()]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def llama(model_dirs):
    return str(model_dirs("llama"))


def batch(capsys, llama, *args):
    return run_inprocess(["batch", *map(str, args), "-m", llama, "--raw", "-n", "2"], capsys)


# -- batch: one lock per output --------------------------------------------------------------
@pytest.mark.slow  # a second real process
def test_two_resumes_at_once_the_second_refuses(tmp_path, capsys, llama):
    """The first --resume reads its prompts from a pipe the test holds open, so it holds the
    output's lock (it says so by its "continuing" line) until the test lets it go on."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(ours(0))
    src = tmp_path / "in.jsonl"
    records = [{"id": i, "prompt": f"prompt {i}"} for i in range(4)]
    src.write_bytes(b"".join(line(r) for r in records))
    first = subprocess.Popen([sys.executable, "-c", "from twice.cli.app import main; main()", "batch", "-",
                              "-o", str(out), "--resume", "-m", llama, "--raw", "-n", "2"],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        said = ""
        while "continuing (" not in said:  # whatever else it says first (warnings), this line comes
            said = first.stderr.readline().decode()
            assert said, "the first run ended before it said it was continuing"
        assert "continuing (1 result of an earlier run kept)" in said, said
        before = snapshot(tmp_path)
        message = one_error_line(batch(capsys, llama, src, "-o", out, "--resume"))
        assert "another twice run is writing this output now" in message and str(out) in message
        assert snapshot(tmp_path) == before  # nothing read, cut or appended
        first.stdin.write(src.read_bytes())
        first.stdin.close()
        assert first.wait(timeout=120) == 0, first.stderr.read().decode()
    finally:
        first.kill()
        first.wait()
        first.stderr.close()
    assert sorted(ids_of(out)) == [0, 1, 2, 3]  # each id once
    assert not list(tmp_path.glob(".out.jsonl.lock"))  # the lock file goes with its run


def test_a_new_output_is_locked_before_anything_is_created(tmp_path, capsys, llama):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    out = tmp_path / "new.jsonl"
    lock = tmp_path / ".new.jsonl.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # as another run holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert "another twice run is writing" in one_error_line(batch(capsys, llama, src, "-o", out))
        assert "another twice run is writing" in one_error_line(batch(capsys, llama, src, "-o", out, "--resume"))
        assert not out.exists()
    finally:
        os.close(fd)
    assert batch(capsys, llama, src, "-o", out).code == 0 and ids_of(out) == ["1"]


def test_a_file_of_data_at_the_lock_name_is_refused_and_kept(tmp_path, capsys, llama):
    # The lock file is removed after each run: a user's own file under its name would go too.
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    out = tmp_path / "new.jsonl"
    mine = tmp_path / ".new.jsonl.lock"
    mine.write_text("my notes\n")
    line = one_error_line(batch(capsys, llama, src, "-o", out))
    assert "is not a twice lock file (it holds data)" in line and str(mine) in line, line
    assert mine.read_text() == "my notes\n" and not out.exists()


def test_resume_after_a_killed_data_parallel_run_merges_its_parts(tmp_path, capsys, llama):
    """What a killed 2-rank run left (its parts, one with a torn last line, and a part of an
    earlier 3-rank run): one process with --resume skips every id they hold, merges them into
    the output in input order, removes them, and runs only the rest."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(line({"id": i, "prompt": f"prompt {i}"}) for i in range(7)))
    out = tmp_path / "out.jsonl"
    out.write_bytes(ours(0, "in the output"))
    parts = {
        "out.jsonl.part-0-of-2": ours(2, "rank 0 of 2") + ours(4, "rank 0 of 2"),
        "out.jsonl.part-1-of-2": ours(1, "rank 1 of 2") + b'{"id": 3, "completion": "torn',
        "out.jsonl.part-2-of-3": ours(5, "rank 2 of 3"),
    }
    for name, data in parts.items():
        (tmp_path / name).write_bytes(data)
    before = snapshot(tmp_path)
    assert "already exists; pass --resume" in one_error_line(batch(capsys, llama, src, "-o", out))
    moved = out.rename(tmp_path / "aside")
    message = one_error_line(batch(capsys, llama, src, "-o", out))  # the parts alone need --resume too
    assert "out.jsonl.part-0-of-2 already exists; pass --resume" in message
    moved.rename(out)
    assert snapshot(tmp_path) == before
    r = batch(capsys, llama, src, "-o", out, "--resume")
    assert r.code == 0, r.err
    assert "merged 3 part files of an interrupted data-parallel run" in r.err
    assert "2 prompts done" in r.err and "5 already in the output" in r.err  # ids 3 and 6 ran
    assert not list(tmp_path.glob("out.jsonl.part-*"))
    lines = out.read_bytes().splitlines(keepends=True)
    ids = [json.loads(raw)["id"] for raw in lines]
    assert sorted(ids) == list(range(7))  # each id exactly once
    assert ids[:5] == [0, 1, 2, 4, 5]  # the merged lines in input order, then this run's
    assert lines[:5] == [ours(0, "in the output"), ours(1, "rank 1 of 2"), ours(2, "rank 0 of 2"),
                         ours(4, "rank 0 of 2"), ours(5, "rank 2 of 3")]  # kept byte for byte


def test_a_part_that_is_not_ours_is_refused_and_nothing_changes(tmp_path, capsys, llama):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.part-0-of-2").write_bytes(b"my notes\n")
    (tmp_path / "out.jsonl.part-1-of-2").symlink_to(tmp_path / "victim")
    (tmp_path / "victim").write_bytes(ours(1))
    before = snapshot(tmp_path)
    message = one_error_line(batch(capsys, llama, src, "-o", out, "--resume"))
    assert "symbolic link" in message or "not a twice batch output" in message
    assert snapshot(tmp_path) == before and not out.exists()


def test_modes_of_one_process_and_merged_outputs_are_equal(tmp_path, capsys, llama):
    """A one-process run and rank 0's merge both give 0666 less the umask (mkstemp alone gave
    the merged output 0600); a merge into an existing output keeps its mode."""
    from twice.cli.batch_input import parse_input
    from twice.cli.distributed import merge_parts

    src = tmp_path / "in.jsonl"
    src.write_bytes(line({"id": 0, "prompt": "a"}) + line({"id": 1, "prompt": "b"}))
    records, _ = parse_input(src.read_text(), "jsonl")
    old = os.umask(0o022)
    try:
        single = tmp_path / "single.jsonl"
        assert batch(capsys, llama, src, "-o", single).code == 0
        merged = tmp_path / "merged.jsonl"
        (tmp_path / "merged.jsonl.part-0-of-2").write_bytes(ours(0))
        (tmp_path / "merged.jsonl.part-1-of-2").write_bytes(ours(1))
        assert merge_parts(merged, records) == 2
        assert ids_of(merged) == [0, 1] and not list(tmp_path.glob("merged.jsonl.part-*"))
        assert single.stat().st_mode & 0o777 == merged.stat().st_mode & 0o777 == 0o644
        os.chmod(merged, 0o600)
        (tmp_path / "merged.jsonl.part-0-of-2").write_bytes(ours(0, "again"))
        assert merge_parts(merged, records) == 2 and merged.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_a_replaced_file_keeps_its_mode(tmp_path, capsys, monkeypatch, llama):
    """/save! of a chat the user made private, its KV sidecar, a prompt cache rewritten by
    generate: each keeps 0600 (write_atomic gave every replacement 0666 less the umask)."""
    from twice.weights.safe_write import write_atomic

    old = os.umask(0o022)
    try:
        plain = tmp_path / "plain.txt"
        write_atomic(plain, "new")
        assert plain.stat().st_mode & 0o777 == 0o644
        os.chmod(plain, 0o600)
        write_atomic(plain, "newer")
        assert plain.stat().st_mode & 0o777 == 0o600 and plain.read_text() == "newer"
        chat, side = tmp_path / "c.json", tmp_path / "c.json.kv"
        run = lambda script: run_inprocess(["chat", "-m", llama, "-n", "2", "--temperature", "0"], capsys,
                                           stdin=script, monkeypatch=monkeypatch)
        assert run(f"hi\n/save {chat}\n".encode()).code == 0 and side.exists()
        os.chmod(chat, 0o600), os.chmod(side, 0o600)
        r = run(f"secret\n/save! {chat}\n".encode())
        assert r.code == 0 and "(replaced)" in r.err, r.err
        assert chat.stat().st_mode & 0o777 == side.stat().st_mode & 0o777 == 0o600
        cache = tmp_path / "p.kv"
        gen = lambda prompt: run_inprocess(["generate", prompt, "-m", llama, "-n", "1", "--prompt-cache", str(cache)],
                                           capsys)
        assert gen("one prompt").code == 0
        os.chmod(cache, 0o600)
        before = cache.read_bytes()
        assert gen("another prompt altogether").code == 0 and cache.read_bytes() != before
        assert cache.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


# -- the cache: locked, atomic, no leftovers ------------------------------------------------
def _cache_state(models: Path) -> list[str]:
    return sorted(os.listdir(models))


def test_two_first_runs_into_an_empty_cache_both_get_the_one_folder(tmp_path, monkeypatch):
    """The second run waits on the entry's lock while the first converts, then finds the
    first's folder (before: it failed with "pass overwrite=True")."""
    from twice.weights import resolve
    from twice.weights.paths import models_dir

    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "cache"))
    src = write_small_gguf(tmp_path / "m.gguf")
    first_converting, go = threading.Event(), threading.Event()
    results, said = {}, {"first": [], "second": []}

    def first_progress(message):
        said["first"].append(message)
        first_converting.set()
        assert go.wait(60)

    def run(name, progress):
        results[name] = resolve.converted_gguf(src, progress)

    a = threading.Thread(target=run, args=("first", first_progress))
    a.start()
    assert first_converting.wait(60)  # the first holds the entry's lock, about to convert
    b = threading.Thread(target=run, args=("second", said["second"].append))
    b.start()
    go.set()
    a.join(60)
    b.join(60)
    assert results["first"] == results["second"] and (results["first"] / "config.json").is_file()
    assert said["second"] == []  # it converted nothing: it waited and used the first's folder
    assert _cache_state(models_dir()) == [results["first"].name]  # one folder, no temporary, no lock


def test_a_dead_conversions_temporary_folder_is_removed_by_the_next(tmp_path, monkeypatch):
    from twice.weights import resolve
    from twice.weights.gguf import convert_gguf
    from twice.weights.paths import models_dir

    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "cache"))
    src = write_small_gguf(tmp_path / "m.gguf")
    dest = resolve.converted_gguf(src)
    name = dest.name
    import shutil

    shutil.rmtree(dest)
    leftover = models_dir() / f".{name}.tmp-dead1234" / name
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    stranger = models_dir() / f".{name}.tmp-link5678"
    stranger.symlink_to(tmp_path, target_is_directory=True)  # not something twice made: left alone
    assert resolve.converted_gguf(src) == dest and (dest / "config.json").is_file()
    assert _cache_state(models_dir()) == sorted([name, stranger.name]) and tmp_path.is_dir()
    # The same for a destination of twice convert's own.
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-dead9876").mkdir()
    convert_gguf(src, out)
    assert not (tmp_path / ".out.tmp-dead9876").exists() and (out / "config.json").is_file()


_KILLED_CONVERSION = """
import signal, sys
from pathlib import Path
from twice.weights import gguf, resolve

def stuck(path, jobs, dtype, src, say):
    path.write_bytes(b"half a model")
    print("WRITING", flush=True)
    signal.pause()  # killed here by the test

gguf._write_safetensors = stuck
resolve.converted_gguf(Path(sys.argv[1]))
"""


@pytest.mark.slow  # a second real process
def test_sigkill_during_a_conversion_then_the_next_run_converts_and_cleans_up(tmp_path, monkeypatch):
    from twice.weights import resolve
    from twice.weights.paths import models_dir

    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "cache"))
    src = write_small_gguf(tmp_path / "m.gguf")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CONVERSION, str(src)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"WRITING\n", child.stderr.read().decode()
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    left = _cache_state(models_dir())
    assert any(".tmp-" in n for n in left) and not any(n.endswith(".gguf") or "config" in n for n in left)
    dest = resolve.converted_gguf(src)  # the killed run's lock went with it
    assert (dest / "config.json").is_file() and (dest / "model.safetensors").stat().st_size > 100
    assert _cache_state(models_dir()) == [dest.name]  # no temporary folder, no lock file


def test_twice_convert_names_its_flag_for_an_existing_folder(tmp_path, capsys):
    src = write_small_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    message = one_error_line(run_inprocess(["convert", str(src), str(out)], capsys))
    assert "pass --overwrite to replace it" in message and "overwrite=True" not in message
    assert os.listdir(out) == ["keep.txt"]
    # --overwrite replaces a model folder only: not a folder of other files, nor one holding the source
    message = one_error_line(run_inprocess(["convert", str(src), str(out), "--overwrite"], capsys))
    assert "not a model folder (no config.json)" in message and os.listdir(out) == ["keep.txt"]
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "config.json").write_text("{}")
    nested = write_small_gguf(inside / "m.gguf")
    message = one_error_line(run_inprocess(["convert", str(nested), str(inside), "--overwrite"], capsys))
    assert "holds m.gguf, the file being converted" in message and nested.stat().st_size > 0
    model = tmp_path / "model"
    assert run_inprocess(["convert", str(src), str(model)], capsys).code == 0
    (model / "stale.txt").write_text("from before")
    assert run_inprocess(["convert", str(src), str(model), "--overwrite"], capsys).code == 0
    assert (model / "config.json").is_file() and not (model / "stale.txt").exists()


def test_a_second_twice_convert_into_the_same_folder_is_refused_while_the_first_writes(tmp_path, monkeypatch):
    from twice.core.errors import WeightsError
    from twice.weights import gguf

    src = write_small_gguf(tmp_path / "m.gguf")
    out = tmp_path / "out"
    writing, go, errors = threading.Event(), threading.Event(), []
    real = gguf._write_safetensors

    def slow(path, jobs, dtype, source, say):
        if threading.current_thread().name == "first":
            writing.set()
            assert go.wait(60)
        return real(path, jobs, dtype, source, say)

    monkeypatch.setattr(gguf, "_write_safetensors", slow)
    first = threading.Thread(target=gguf.convert_gguf, args=(src, out), name="first")
    first.start()
    try:
        assert writing.wait(60)
        with pytest.raises(WeightsError, match="another twice run is writing the converted model now"):
            gguf.convert_gguf(src, out)
    finally:
        go.set()
        first.join(60)
    assert (out / "config.json").is_file() and sorted(os.listdir(tmp_path)) == ["m.gguf", "out"]


# -- the chat history -----------------------------------------------------------------------
def test_the_history_file_is_never_written_through_a_link(tmp_path, capsys):
    from prompt_toolkit.history import InMemoryHistory

    from twice.cli.chat_input import _history_notice, open_history

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    planted = tmp_path / "history"
    planted.symlink_to(victim)
    capsys.readouterr()
    history = open_history(planted)
    err = capsys.readouterr().err
    assert isinstance(history, InMemoryHistory)
    assert err.count("\n") == 1 and "input history not kept" in err and "symbolic link" in err
    history.append_string("typed text")  # the chat goes on, without a file
    assert victim.read_bytes() == b"precious\n"
    # A link put in place of a good history file while the chat runs: refused, said once.
    own = tmp_path / "own_history"
    history = open_history(own)
    history.append_string("first message")
    assert oct(own.stat().st_mode & 0o777) == oct(0o600) and b"+first message\n" in own.read_bytes()
    own.unlink()
    own.symlink_to(victim)
    capsys.readouterr()
    history.append_string("second message")
    history.append_string("third message")
    _history_notice(history)
    _history_notice(history)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "symbolic link" in err
    assert victim.read_bytes() == b"precious\n"


def test_the_history_file_reads_back_what_prompt_toolkit_wrote(tmp_path):
    from prompt_toolkit.history import FileHistory

    from twice.cli.chat_input import open_history

    path = tmp_path / "history"
    theirs = FileHistory(str(path))
    for text in ["one", "two\nlines", "with \u2028 separator", ""]:
        theirs.store_string(text)
    ours_ = open_history(path)
    assert list(ours_.load_history_strings()) == list(FileHistory(str(path)).load_history_strings())
    ours_.store_string("three")
    assert list(FileHistory(str(path)).load_history_strings())[0] == "three"
