"""Hardening of `twice chat` (issue 13, items 7, 13 and 14): /load checks a file whole
before anything changes, /save never replaces a file unasked, a reply cut before any text
leaves no empty message, no exception of a turn ends the REPL, /set and /retry, and the
live readout never writes a reply's lines twice when a signal lands in a terminal write."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import textwrap

import pytest

from clirun import run_inprocess
from tiny import set_json

pexpect = pytest.importorskip("pexpect")

TIMEOUT = 30


# -- the readout: a signal inside a terminal write ------------------------------------------
READOUT_CHILD = textwrap.dedent('''
    import os, sys
    from types import SimpleNamespace

    from twice.cli.readout import Readout

    # The engine's events as the readout reads them (by name), without importing torch.
    class PrefillStart(SimpleNamespace):
        pass

    class TokenEvent(SimpleNamespace):
        pass

    ready, gate = sys.argv[1], sys.argv[2]

    class SlowTerminal:
        """The terminal takes the first line of the reply slowly: the write that carries it
        waits (as a write to a busy terminal does) until the test, having sent Ctrl-C,
        opens the gate."""

        def __init__(self, real):
            self.real, self.waited = real, False

        def write(self, text):
            self.real.write(text)
            self.real.flush()
            if not self.waited and "FIRST-LINE" in text:
                self.waited = True
                fd = os.open(gate, os.O_RDWR)  # a FIFO held open: its byte cannot be lost
                try:
                    open(ready, "w").close()
                    os.read(fd, 1)  # blocks until the test writes
                finally:
                    os.close(fd)
            return len(text)

        def flush(self):
            self.real.flush()

        def isatty(self):
            return True

        def fileno(self):
            return self.real.fileno()

        @property
        def encoding(self):
            return self.real.encoding

    cache = SimpleNamespace(bytes_per_token=64, bytes_in_use=640, bytes_allocated=1280, tokens=10,
                            context_length=256)
    stream = SlowTerminal(sys.stdout)

    def token(text, index):
        return TokenEvent(text=text, index=index, step_seconds=0.01, elapsed=0.1, cache=cache)

    try:
        with Readout(stream=stream) as readout:
            readout.on_event(PrefillStart(prompt_tokens=10, reused_tokens=0, new_tokens=10, cache=cache))
            readout.on_event(token("FIRST-LINE of the reply\\n", 0))
            readout.on_event(token("second line\\n", 1))
            readout.on_event(token("third", 2))
        print("\\n[not interrupted]")
    except KeyboardInterrupt:
        print("\\n[interrupted]")
''')


@pytest.mark.slow  # a real process on a pseudo-terminal (0.5 s)
def test_ctrl_c_inside_a_terminal_write_never_repeats_the_reply(tmp_path):
    """Ctrl-C while the terminal is taking a draw of the live readout (a slow terminal, a
    slow step's draw): the reply's first line reaches the terminal once. Before, rich kept
    the interrupted write's text in its buffer and the closing draw wrote it again."""
    script, ready, gate = tmp_path / "child.py", tmp_path / "ready", tmp_path / "gate"
    script.write_text(READOUT_CHILD)
    os.mkfifo(gate)
    child = pexpect.spawn(sys.executable, [str(script), str(ready), str(gate)], timeout=TIMEOUT,
                          dimensions=(24, 80), env={**os.environ, "TERM": "xterm"})
    seen = b""
    while not ready.exists():  # the child is inside the write that carries the first line
        try:
            seen += child.read_nonblocking(65536, timeout=0.05)
        except pexpect.TIMEOUT:
            pass
    # Ctrl-C's signal, sent straight to the process: the pseudo-terminal's own ^C would
    # also discard the output it has not handed over yet, which would hide what is checked.
    child.kill(signal.SIGINT)
    fd = os.open(gate, os.O_RDWR)  # (a FIFO opened for both never waits for the other end)
    os.write(fd, b"x")
    os.close(fd)
    child.expect(pexpect.EOF)
    output = seen + child.before
    child.close()
    assert b"[interrupted]" in output  # Ctrl-C still acts: right after the draw
    assert output.count(b"FIRST-LINE") == 1, output


# -- helpers for the scripted REPL ---------------------------------------------------------
@pytest.fixture(autouse=True)
def _threads_restored():
    """`--threads 1` sets torch's thread count for the whole process: put it back."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


SUMMARY = re.compile(r"reused (\d+) · prefilled (\d+) · (\d+) tokens")


def chat(capsys, monkeypatch, folder, lines: list[str], *flags: str):
    """`twice chat` in this process, its standard input the given lines (greedy, 4 tokens;
    one thread: on a busy 2-core machine two threads made each sampled step 100x slower)."""
    script = "\n".join(lines) + "\n"
    return run_inprocess(["chat", "--model", str(folder), "-n", "4", "--temperature", "0", "--threads", "1", *flags],
                         capsys, script.encode(), monkeypatch)


def errors(r) -> list[str]:
    return [line for line in r.err.splitlines() if line.startswith("error:")]


def saved(path) -> list[dict]:
    return json.loads(path.read_text())["messages"]


def turns(r) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m.groups())) for m in SUMMARY.finditer(r.err)]


def copy_model(model_dirs, tmp_path, **tokenizer_config):
    folder = tmp_path / "model"
    shutil.copytree(model_dirs("llama"), folder)
    if tokenizer_config:
        set_json(folder / "tokenizer_config.json", **tokenizer_config)
    return folder


# -- /load: checked whole, the conversation untouched on any problem ---------------------------
def _deep(path):
    path.write_text('{"version": 1, "messages": [{"role": "user", "content": "hi", "x": ' + "[" * 100_000
                    + "]" * 100_000 + "}]}")
    return "nested more than 64 levels deep"


def _surrogate_in_content(path):
    path.write_text('{"version": 1, "messages": [{"role": "user", "content": "hi \\ud800 there"}]}')
    return r"messages[0].content holds a lone surrogate (\ud800 at character 3)"


def _surrogate_in_system(path):
    path.write_text('{"version": 1, "system": "\\udfff", "messages": []}')
    return "'system' holds a lone surrogate"


def _surrogate_in_model(path):
    path.write_text('{"version": 1, "model": "m\\ud83d", "messages": []}')
    return "'model' holds a lone surrogate"


def _fifo(path):
    os.mkfifo(path)
    return "not a regular file"


def _folder(path):
    path.mkdir()
    return "it is a folder"


def _too_big(path):
    from twice.cli.conversation_file import MAX_FILE_BYTES

    with open(path, "wb") as f:  # sparse: its size is refused before anything is read
        f.truncate(MAX_FILE_BYTES + 1)
    return "more than the 16,777,216 twice reads"


def _too_many_messages(path):
    from twice.cli.conversation_file import MAX_MESSAGES

    path.write_text(json.dumps({"version": 1, "messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)}))
    return "100,001 messages, more than the 100,000 /load takes"


def _huge_integer(path):
    path.write_text('{"version": 1' + "0" * 400 + ', "messages": []}')
    return "an integer of 401 digits"


def _nan(path):
    path.write_text('{"version": NaN, "messages": []}')
    return "NaN is not a JSON value"


def _version_true(path):
    path.write_text('{"version": true, "messages": []}')
    return "unsupported version true"


def _role_not_text(path):
    path.write_text('{"version": 1, "messages": [{"role": ["user"], "content": "x"}]}')
    return "messages[0].role must be 'user' or 'assistant', got [\"user\"]"


BAD_FILES = [_deep, _surrogate_in_content, _surrogate_in_system, _surrogate_in_model, _fifo, _folder, _too_big,
             _too_many_messages, _huge_integer, _nan, _version_true, _role_not_text]


def test_load_refuses_what_would_crash_a_later_turn(model_dirs, tmp_path, capsys, monkeypatch):
    """Each of these used to pass /load (or crash it) and end the session on the next
    turn, losing the conversation; now: one line each, the conversation untouched, the
    chat going on (one session loads them all in turn)."""
    bad = {make.__name__.strip("_"): tmp_path / f"bad-{make.__name__.strip('_')}.json" for make in BAD_FILES}
    problems = {name: make(bad[name]) for name, make in zip(bad, BAD_FILES)}
    before = {name: path.read_bytes() for name, path in bad.items() if path.is_file()}
    out = tmp_path / "out.json"
    r = chat(capsys, monkeypatch, model_dirs("llama"),
             ["Hello there", *(f"/load {path}" for path in bad.values()), "How are you?", f"/save {out}"])
    assert r.code == 0 and "Traceback" not in r.err, r.err
    lines = errors(r)
    assert len(lines) == len(bad), lines
    for (name, path), line in zip(bad.items(), lines):
        assert line.startswith(f"error: cannot load {path}: ") and problems[name] in line, (name, line)
        assert line.endswith("(the current conversation is unchanged)"), (name, line)
    assert len(turns(r)) == 2  # the next turn ran, on the old conversation
    assert [m["content"] for m in saved(out)][::2] == ["Hello there", "How are you?"]
    assert {name: bad[name].read_bytes() for name in before} == before


def test_load_refuses_a_conversation_the_template_cannot_go_on_with(model_dirs, tmp_path, capsys, monkeypatch):
    """A template that insists on alternating roles (as Llama 2's and Mistral's do): a file
    with two user messages in a row is refused at /load, not at every later turn."""
    template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    folder = copy_model(model_dirs, tmp_path, chat_template=template)
    bad, good, out = tmp_path / "bad.json", tmp_path / "good.json", tmp_path / "out.json"
    bad.write_text(json.dumps({"version": 1, "messages": [{"role": "user", "content": "a"},
                                                          {"role": "user", "content": "b"}]}))
    good.write_text(json.dumps({"version": 1, "messages": [{"role": "user", "content": "a"}]}))
    r = chat(capsys, monkeypatch, folder, ["Hello there", f"/load {bad}", f"/save {out}", f"/load {good}", "/retry"])
    assert r.code == 0 and "Traceback" not in r.err, r.err
    [line] = errors(r)
    assert "the model's chat template cannot go on with it" in line and "roles must alternate" in line
    assert len(saved(out)) == 2
    assert "loaded 1 message " in r.err and len(turns(r)) == 2  # a file ending with the user's message: /retry answers it


# -- /save: never over a file unasked -------------------------------------------------------
def test_save_replaces_only_when_asked_and_only_a_chat_file(model_dirs, tmp_path, capsys, monkeypatch):
    chat_file, other, fifo, folder = (tmp_path / name for name in ("chat.json", "notes.txt", "fifo", "folder"))
    other.write_text("my notes\n")
    os.mkfifo(fifo)
    folder.mkdir()
    r = chat(capsys, monkeypatch, model_dirs("llama"),
             ["Hello there", f"/save {chat_file}", "How are you?", f"/save {chat_file}", f"/save! {other}",
              f"/save {fifo}", f"/save! {folder}", f"/save! {chat_file}", "/save!"])
    assert r.code == 0 and "Traceback" not in r.err, r.err
    problems = errors(r)
    assert problems == [
        f"error: cannot save to {chat_file}: the file exists (an earlier chat); /save! {chat_file} replaces it",
        f"error: cannot save to {other}: the file exists and is not a twice chat file; choose another name",
        f"error: cannot save to {fifo}: it exists and is not a regular file; choose another name",
        f"error: cannot save to {folder}: it is a folder",
        "error: usage: /save! FILE",
    ]
    assert f"saved 2 messages to {chat_file}\n" in r.err and f"saved 4 messages to {chat_file} (replaced)" in r.err
    assert len(saved(chat_file)) == 4 and other.read_text() == "my notes\n"
    assert "/save! FILE" in chat(capsys, monkeypatch, model_dirs("llama"), ["/help"]).err  # said in /help


# -- a reply cut by Ctrl-C ------------------------------------------------------------------------
def test_a_system_message_too_long_for_the_context_is_named_not_the_users(model_dirs, capsys, monkeypatch):
    big = "system words here " * 60  # ~800 tokens against the tiny model's 256
    r = chat(capsys, monkeypatch, model_dirs("llama"), [f"/system {big}", "hi"])
    (line,) = errors(r)
    assert "the system message alone is" in line and "/system - removes it" in line and "your message" not in line
    r = chat(capsys, monkeypatch, model_dirs("llama"), ["hi"], "--system", big)
    (line,) = errors(r)
    assert "the system message alone is" in line, r.err


def test_system_dash_says_when_there_is_nothing_to_remove(model_dirs, capsys, monkeypatch):
    r = chat(capsys, monkeypatch, model_dirs("llama"), ["/system -", "/system Be brief.", "/system -"])
    assert r.code == 0, r.err
    said = [line for line in r.err.splitlines() if "system message" in line]
    assert said[-3:] == ["no system message to remove", "system message set", "system message removed"], said


def test_a_command_that_takes_no_words_refuses_them_and_does_nothing(model_dirs, capsys, monkeypatch):
    """"/reset the system message" cleared the whole conversation and "/exit now" left: the
    words after a command that takes none were dropped without a word."""
    r = chat(capsys, monkeypatch, model_dirs("llama"), ["Hello", "/reset the system message", "/exit now",
                                                       "/retry please", "/stats x", "/help me", "again"])
    assert r.code == 0, r.err
    assert errors(r) == [f"error: {c} takes nothing after it, got {w!r}; nothing was done"
                         for c, w in (("/reset", "the system message"), ("/exit", "now"), ("/retry", "please"),
                                      ("/stats", "x"), ("/help", "me"))], errors(r)
    assert "conversation cleared" not in r.err
    assert len(turns(r)) == 2  # "again" was answered: /exit now did not leave
    assert turns(r)[1][0] > turns(r)[0][0]  # and its prompt held the first turn: /reset did not clear it


def test_crlf_lines_on_standard_input_are_lines_without_the_cr(model_dirs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "c.json"
    script = f"hi\r\n/save {out}\r\n".encode()
    r = run_inprocess(["chat", "--model", str(model_dirs("llama")), "-n", "2", "--temperature", "0"], capsys,
                      script, monkeypatch)
    assert r.code == 0 and out.is_file(), r.err  # the file name has no "\r" either
    assert saved(out)[0] == {"role": "user", "content": "hi"}


def test_a_reply_cut_before_any_text_keeps_no_empty_message(model_dirs, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the prefill: the turn goes (no empty assistant message, no user message
    left without a reply), and the next turn's prompt is the saved conversation plus its
    message. Ctrl-C after some text: the text is kept, marked cut, and is what the next
    prompt holds."""
    from twice.core.engine import Engine
    from twice.weights.tokenizer import Tokenizer

    folder = model_dirs("llama")
    real_prefill, real_step = Engine._prefill, Engine._step
    cut = {"prefill": "Cut in the prefill", "decode": "Cut in the decode"}
    state = {"steps": 0}

    def prefill(self, tokens, cache, chunk):
        if state["message"] == cut["prefill"]:
            raise KeyboardInterrupt
        return real_prefill(self, tokens, cache, chunk)

    def step(self, tokens, cache, sampler, masks=None):
        state["steps"] += 1
        if state["message"] == cut["decode"] and state["steps"] == 3:
            raise KeyboardInterrupt
        return real_step(self, tokens, cache, sampler, masks)

    real_render = Tokenizer.render_chat

    def render_chat(self, messages, *args, **kwargs):  # each turn renders its prompt first
        state["message"], state["steps"] = messages[-1]["content"], 0
        return real_render(self, messages, *args, **kwargs)

    monkeypatch.setattr(Engine, "_prefill", prefill)
    monkeypatch.setattr(Engine, "_step", step)
    monkeypatch.setattr(Tokenizer, "render_chat", render_chat)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    r = chat(capsys, monkeypatch, folder, ["Hello there", cut["prefill"], f"/save {first}", "Next", cut["decode"],
                                           "Last", f"/save {second}"], "-n", "8")
    assert r.code == 0 and "Traceback" not in r.err, r.err
    assert "[reply cut] before any text; the message was not kept" in r.err
    assert [m["content"] for m in saved(first)][::2] == ["Hello there"] and len(saved(first)) == 2
    messages = saved(second)
    assert [m["content"] for m in messages][::2] == ["Hello there", "Next", cut["decode"], "Last"]
    partial = messages[5]
    assert partial["role"] == "assistant" and partial["cut"] is True and partial["content"]
    assert all(m["content"] or m["role"] == "user" for m in messages)  # no empty reply anywhere
    # Each turn's prompt was the conversation as saved, plus its message.
    tok = Tokenizer(folder)
    whole = [line for line in r.err.splitlines() if "[reply cut]" not in line]
    sizes = [int(m[1]) + int(m[2]) for m in map(SUMMARY.search, whole) if m]
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert sizes[0] == len(tok.encode_chat(plain[:1]))
    assert sizes[1] == len(tok.encode_chat(plain[:3]))  # "Next" right after the first reply
    assert sizes[2] == len(tok.encode_chat(plain[:7]))  # "Last" after the cut reply, as saved


# -- no exception of a turn ends the REPL ---------------------------------------------------------
def _tokenizer_fails(monkeypatch, folder, word):
    from twice.weights.tokenizer import Tokenizer

    real = Tokenizer.encode

    def encode(self, text, *args, **kwargs):  # as `tokenizers` fails on a lone surrogate
        if word in text:
            raise TypeError("TextInputSequence must be str")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", encode)
    return word, "TypeError: TextInputSequence must be str"


def _template_fails(monkeypatch, folder, word):
    from tiny import CHAT_TEMPLATE

    set_json(folder / "tokenizer_config.json", chat_template=(
        "{% for m in messages %}{% if '" + word + "' in m['content'] %}{{ raise_exception('no crashing here') }}"
        "{% endif %}{% endfor %}" + CHAT_TEMPLATE))
    return word, "chat template failed to render: no crashing here"


def _engine_fails(monkeypatch, folder, word):
    from twice.core.engine import Engine
    from twice.weights.tokenizer import Tokenizer

    real_step, real_render = Engine._step, Tokenizer.render_chat
    state = {}

    def render_chat(self, messages, *args, **kwargs):
        state["crash"] = word in messages[-1]["content"]
        return real_render(self, messages, *args, **kwargs)

    def step(self, tokens, cache, sampler, masks=None):
        if state["crash"]:
            raise RuntimeError("boom in the middle of the reply")
        return real_step(self, tokens, cache, sampler, masks)

    monkeypatch.setattr(Engine, "_step", step)
    monkeypatch.setattr(Tokenizer, "render_chat", render_chat)
    return word, "RuntimeError: boom in the middle of the reply"


def test_no_exception_of_a_turn_ends_the_chat(model_dirs, tmp_path, capsys, monkeypatch):
    """A tokenizer that raises a TypeError (as `tokenizers` does on a lone surrogate), a
    template that raises, an engine error in the middle of a reply: one line each, the
    conversation as it was before that turn, the KV cache forgotten, the chat going on."""
    folder = copy_model(model_dirs, tmp_path)
    expected = [f(monkeypatch, folder, f"CRASH-{f.__name__.strip('_').upper()}")
                for f in (_tokenizer_fails, _template_fails, _engine_fails)]
    out = tmp_path / "out.json"
    r = chat(capsys, monkeypatch, folder, ["Hello there", *(f"Please {word}" for word, _ in expected), "How are you?",
                                           f"/save {out}"])
    assert r.code == 0 and "Traceback" not in r.err, r.err
    lines = errors(r)
    assert len(lines) == 3 and all(problem in line for (_, problem), line in zip(expected, lines)), lines
    assert [m["content"] for m in saved(out)][::2] == ["Hello there", "How are you?"]  # as before those turns
    assert len(saved(out)) == 4 and len(turns(r)) == 2
    assert turns(r)[1][0] == 0  # the cache was forgotten after the engine failed mid-reply


def test_a_failed_device_ends_the_chat_and_rescues_the_conversation(model_dirs, tmp_path, capsys, monkeypatch):
    """A CUDA error is sticky (every later call fails): the chat ends with exit 3 and one
    line saying where the conversation so far was saved."""
    from twice.core.engine import Engine
    from twice.weights.tokenizer import Tokenizer

    real_step, real_render = Engine._step, Tokenizer.render_chat
    state = {}

    def render_chat(self, messages, *args, **kwargs):
        state["crash"] = "CRASH" in messages[-1]["content"]
        return real_render(self, messages, *args, **kwargs)

    def step(self, tokens, cache, sampler, masks=None):
        if state["crash"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")
        return real_step(self, tokens, cache, sampler, masks)

    monkeypatch.setattr(Engine, "_step", step)
    monkeypatch.setattr(Tokenizer, "render_chat", render_chat)
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "cache"))
    r = chat(capsys, monkeypatch, model_dirs("llama"), ["Hello there", "Please CRASH now", "Never read"])
    assert r.code == 3 and "Traceback" not in r.err, r.err
    last = r.err.strip().splitlines()[-1]
    assert last.startswith("twice: error: the device failed during the chat (CUDA error: an illegal memory access "
                           "was encountered); the chat cannot go on; the conversation is saved in ")
    [rescued] = (tmp_path / "cache").glob("chat-rescued-*.json")
    assert last.endswith(str(rescued))
    assert [m["content"] for m in saved(rescued)][::2] == ["Hello there"] and len(turns(r)) == 1


# -- /set and /retry ------------------------------------------------------------------------------
def test_set_changes_sampling_as_the_flags_would(model_dirs, tmp_path, capsys, monkeypatch):
    from twice.cli.options import check_flags
    from twice.core.errors import PromptError

    out = tmp_path / "out.json"
    bad = [("temperature", "-1"), ("temperature", "nan"), ("top_k", "-1"), ("top_p", "0"), ("top_p", "1.5"),
           ("min_p", "1"), ("repetition_penalty", "0"), ("seed", "-1"), ("max_new_tokens", "0")]
    r = chat(capsys, monkeypatch, model_dirs("llama"),
             ["/set", "/set max_new_tokens 3", "/set top-k 5", "/set temperature 0.5", "/set seed 3", "/set seed none",
              *(f"/set {k} {v}" for k, v in bad), "/set top_k 1.5", "/set temperature 1_0", "/set nonsense 1",
              "/set top_k", "Hello there", "/set"])
    assert r.code == 0 and "Traceback" not in r.err, r.err
    lines = r.err.splitlines()
    shown = [line for line in lines if line.startswith("temperature ") and "·" in line]
    assert shown[0] == ("temperature 0.0 · top_k 40 · top_p 0.95 · min_p 0.05 · repetition_penalty 1.0 · seed none · "
                        "max_new_tokens 4 (greedy)")
    assert shown[1] == ("temperature 0.5 · top_k 5 · top_p 0.95 · min_p 0.05 · repetition_penalty 1.0 · seed none · "
                        "max_new_tokens 3")
    assert "max_new_tokens 3 (was 4)" in lines and "top_k 5 (was 40)" in lines and "seed none (was 3)" in lines
    assert "note: top_k has no effect with greedy decoding (temperature 0)" in lines  # before temperature 0.5
    problems = errors(r)
    for (key, value), line in zip(bad, problems):
        kind = float if key in ("temperature", "top_p", "min_p", "repetition_penalty") else int
        with pytest.raises(PromptError) as flag:
            check_flags(**{key: kind(value)})
        assert line == f"error: /set {key}: {flag.value}"  # word for word the flag's message
    assert problems[len(bad):] == ["error: /set top_k: a whole number is needed, got '1.5'",
                                   "error: /set temperature: a number is needed, got '1_0'",  # not 10.0
                                   *["error: usage: /set NAME VALUE, NAME one of temperature, top_k, top_p, min_p, "
                                     "repetition_penalty, seed, max_new_tokens (/set alone shows them)"] * 2]
    assert turns(r)[0][2] == 3  # the reply took the new max_new_tokens


def test_retry_regenerates_the_last_reply(model_dirs, tmp_path, capsys, monkeypatch):
    """/retry replaces the last reply (the conversation keeps one); with a seed and the same
    settings it is the same reply, with another seed another one."""
    out = tmp_path / "out.json"
    r = chat(capsys, monkeypatch, model_dirs("llama"),
             ["/retry", "/set temperature 1", "/set seed 7", "Hello there", "Tell me more", "/retry", "/set seed 8",
              "/retry", f"/save {out}", "/set seed 7", "/retry"], "-n", "6")
    assert r.code == 0 and "Traceback" not in r.err, r.err
    assert errors(r) == ["error: nothing to retry: there is no reply yet"]
    replies = r.out.splitlines()
    assert len(replies) == 5 and len(turns(r)) == 5
    assert replies[2] == replies[1]  # same seed, same settings: the same reply
    assert replies[3] != replies[1]  # another seed
    assert replies[4] == replies[1]  # the first seed again
    messages = saved(out)
    assert [m["content"] for m in messages] == ["Hello there", replies[0], "Tell me more", replies[3]]
    # The retried turns prefilled what the replaced reply's turn did.
    assert turns(r)[2][:2] == turns(r)[1][:2] == turns(r)[4][:2]


# -- the terminal: bytes that are not UTF-8 -------------------------------------------------------
@pytest.mark.slow  # a real process on a pseudo-terminal
def test_invalid_utf8_typed_at_the_terminal_is_not_sent(model_dirs, tmp_path):
    """prompt-toolkit hands invalid UTF-8 on, as lone surrogates, which crashed the
    tokenizer (and the session): now one line, nothing sent, the chat going on."""
    out = tmp_path / "out.json"
    env = {**os.environ, "TWICE_CACHE": str(tmp_path / "cache"), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    child = pexpect.spawn(sys.executable, ["-c", "from twice.cli.app import main; main()", "chat", "--model",
                                           str(model_dirs("llama")), "-n", "4", "--temperature", "0", "--threads", "1"],
                          env=env, dimensions=(40, 120), timeout=TIMEOUT)
    child.expect_exact(b">>>")
    child.send(b"caf\xe9 au lait\r")
    child.expect_exact(b"error: the message is not valid UTF-8 (byte 0xe9 at character 3); not sent")
    child.expect_exact(b">>>")
    child.send(b"Hello there\r")
    child.expect(rb"reused \d+ \xc2\xb7 prefilled")
    child.expect_exact(b">>>")
    child.send(f"/save {out}\r".encode())
    child.expect_exact(b"saved 2 messages")
    child.expect_exact(b">>>")
    child.send(b"/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert [m["content"] for m in saved(out)][0] == "Hello there"


def test_history_empty_keeps_none_and_a_folder_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """--history '' said "file '' is a directory" (the current folder); it keeps no history
    file now, as bash's HISTFILE=. A folder is one line before the model loads."""
    from twice.cli import chat_input
    from twice.cli.chat import _history_file

    opened = []
    monkeypatch.setattr(chat_input.sys, "stdin", type("Tty", (), {"isatty": lambda self: True})())
    monkeypatch.setattr(chat_input, "TerminalReader", lambda path: opened.append(path))
    chat_input.make_reader(_history_file(""))
    chat_input.make_reader(_history_file(str(tmp_path / "h")))
    assert opened == [None, tmp_path / "h"]  # None: prompt-toolkit's in-memory history (open_history)
    r = run_inprocess(["chat", "--history", str(tmp_path), "--model", str(tmp_path / "nowhere")], capsys)
    assert r.code == 2 and r.err.strip() == (f"twice: error: --history {tmp_path}: is a folder; name a file "
                                             "(or --history '' to keep none)"), r.err
