"""`twice chat`: the REPL driven through a pseudo-terminal (pexpect), scripted standard
input, the KV cache kept across turns (checked to the token), Ctrl-C, /save and /load,
and chat templates that cannot be used."""

import json
import os
import re
import shutil
import sys

import pytest

from clirun import run_inprocess
from tiny import set_json

pexpect = pytest.importorskip("pexpect")

PROMPT = ">>>"  # prompt-toolkit draws the trailing space as a cursor move, not a character
SUMMARY = re.compile(r"reused (\d+) · prefilled (\d+) · (\d+) tokens")
TIMEOUT = 30  # importing torch in the child takes a few seconds on a busy machine


# -- helpers -------------------------------------------------------------------------------
def spawn(folder, tmp_path, *args):
    env = {**os.environ, "TWICE_CACHE": str(tmp_path / "cache"), "TERM": "xterm",
           # pexpect does not answer cursor-position requests; without this prompt-toolkit
           # waits for the answer and then prints a warning.
           "PROMPT_TOOLKIT_NO_CPR": "1"}
    child = pexpect.spawn(sys.executable, ["-c", "from twice.cli.app import main; main()", "chat",
                                           "--model", str(folder), *args],
                          env=env, dimensions=(40, 120), encoding="utf-8", timeout=TIMEOUT)
    child.expect_exact(PROMPT)
    return child


def ask(child, text: str) -> tuple[int, int]:
    """Send one message (\\r is the Enter key in raw mode); return (reused, prefilled)."""
    child.send(text + "\r")
    child.expect(SUMMARY)
    reused, prefilled = int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact(PROMPT)
    return reused, prefilled


def command(child, text: str, expect: str) -> str:
    """Run a slash command; return what it printed up to the next prompt."""
    child.send(text + "\r")
    child.expect_exact(expect)
    printed = child.before + expect
    child.expect_exact(PROMPT)
    return printed + child.before


def leave(child) -> None:
    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def load_reference(folder):
    from twice.core.engine import Engine
    from twice.weights.load import load

    loaded = load(str(folder), device="cpu")
    return loaded.tokenizer, Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids)


def replay(folder, user_messages: list[str], max_new: int):
    """Run the same greedy conversation in this process and work out, from the token ids
    alone, what each turn must reuse: the cache holds the previous prompt and all reply
    tokens but the last (the last is sampled, never fed back), and the engine may reuse
    the longest common prefix of that with the new prompt."""
    from twice.core.engine import Done, GenerationSettings, Request

    tok, engine = load_reference(folder)
    settings = GenerationSettings(max_new_tokens=max_new)
    messages, fed, expected = [], [], []
    for text in user_messages:
        messages.append({"role": "user", "content": text})
        prompt = tok.encode_chat(messages)
        reused = common_prefix(fed, prompt)
        expected.append((reused, len(prompt) - reused))
        result = next(e.result for e in engine.generate(Request(messages=list(messages)), settings)
                      if isinstance(e, Done))
        fed = prompt + result.token_ids[:-1]
        messages.append({"role": "assistant", "content": result.text})
    return messages, expected, tok


def copy_model(model_dirs, tmp_path, name="model"):
    dest = tmp_path / name
    shutil.copytree(model_dirs("llama"), dest)
    return dest


# -- the terminal REPL -----------------------------------------------------------------------
USER = ["Hello there", "How are you today?", "Tell me about caches."]


@pytest.mark.slow
def test_turns_reuse_the_cache_and_save_load_restores(model_dirs, tmp_path):
    folder = model_dirs("llama")
    child = spawn(folder, tmp_path, "-n", "8", "--temperature", "0")
    seen = [ask(child, text) for text in USER]
    saved = tmp_path / "conversation.json"
    command(child, f"/save {saved}", "saved 6 messages")

    messages, expected, tok = replay(folder, USER, 8)
    data = json.loads(saved.read_text())
    assert data["version"] == 1 and data["system"] is None and data["model"] == str(folder)
    assert data["messages"] == messages  # the replay produced the same replies
    assert seen == expected  # each turn reused exactly the common prefix with the cache
    assert seen[0][0] == 0
    for reused, prefilled in seen[1:]:
        assert reused > 0 and prefilled > 0  # turns 2 and 3 prefilled only what they added

    # A broken file: one line, and the conversation is still there.
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": 1, "messages": [{"role": "user"}]}')
    out = command(child, f"/load {broken}", "cannot load")
    assert "messages[0].content must be a string" in out and "Traceback" not in out

    # /reset forgets the cache too; /load brings the conversation back, and its KV cache
    # (/save wrote conversation.json.kv beside it): the next prompt is the loaded
    # conversation plus the new message, only what the cache does not hold prefilled.
    command(child, "/reset", "conversation cleared")
    command(child, f"/load {saved}", "loaded 6 messages")
    reused, prefilled = ask(child, "And then?")
    assert reused > 0
    assert reused + prefilled == len(tok.encode_chat(messages + [{"role": "user", "content": "And then?"}]))

    command(child, "/drop 3", "dropped 3 turns; 1 left")
    command(child, f"/save! {saved}", "saved 2 messages")  # /save! replaces the earlier file
    data = json.loads(saved.read_text())
    assert [m["content"] for m in data["messages"]][0] == "And then?"
    assert not list(tmp_path.glob(".conversation.json.*"))  # the atomic write left no temp file
    # The KV sidecar holds only this conversation's own start: the dropped turns stayed in the
    # engine's cache and were written to FILE.kv (a dropped secret travelled with the file).
    from safetensors.torch import load_file

    kept = load_file(str(saved) + ".kv")["token_ids"].tolist()
    now = tok.encode_chat([{"role": m["role"], "content": m["content"]} for m in data["messages"]])
    assert kept == now[:len(kept)] and all(text not in tok.decode(kept) for text in USER)
    leave(child)


@pytest.mark.slow
def test_multiline_input_system_and_commands(model_dirs, tmp_path):
    folder = model_dirs("llama")
    child = spawn(folder, tmp_path, "-n", "4", "--temperature", "0")
    child.send("/help\r")
    child.expect_exact("Esc-Enter")
    child.expect_exact(PROMPT)
    command(child, "/nonsense", "unknown command /nonsense")
    ask(child, "first line\\\rsecond line")  # a trailing backslash continues
    ask(child, "alpha\x1b\rbeta")  # Esc-Enter inserts a newline
    ask(child, '"""\rx = 1 \\\ry = 2\r"""')  # a block; a backslash inside it is literal
    ask(child, "//slash")  # // sends a message that starts with /
    child.send("half typed")
    child.sendintr()  # Ctrl-C at the prompt clears the line and keeps the session
    child.expect_exact(PROMPT)
    ask(child, "whole")
    command(child, "/system Be brief.", "system message set")
    reused, prefilled = ask(child, "Short?")
    saved = tmp_path / "multi.json"
    command(child, f"/save {saved}", "saved 12 messages")
    child.sendeof()  # Ctrl-D on an empty line leaves with 0
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    data = json.loads(saved.read_text())
    users = [m["content"] for m in data["messages"] if m["role"] == "user"]
    assert users == ["first line\nsecond line", "alpha\nbeta", "x = 1 \\\ny = 2", "/slash", "whole", "Short?"]
    assert data["system"] == "Be brief."
    from twice.weights.tokenizer import Tokenizer

    request = [{"role": "system", "content": "Be brief."}] + [
        {"role": m["role"], "content": m["content"]} for m in data["messages"][:-1]]
    assert reused + prefilled == len(Tokenizer(folder).encode_chat(request))
    assert (tmp_path / "cache" / "chat_history").is_file()  # the default history file


@pytest.mark.slow
def test_ctrl_c_cuts_the_reply_and_keeps_the_session(model_dirs, tmp_path):
    # A long context so that the reply is still running when Ctrl-C arrives (a greedy
    # reply of this random model does not end by itself for thousands of tokens).
    folder = copy_model(model_dirs, tmp_path, "long")
    set_json(folder / "config.json", max_position_embeddings=4096)
    child = spawn(folder, tmp_path, "-n", "4000", "--temperature", "0")
    child.send("Tell me a long story.\r")
    child.expect(r"\d+ generated")  # the status line: decoding has started
    child.sendintr()
    child.expect_exact("[reply cut]")
    child.expect_exact(PROMPT)
    saved = tmp_path / "cut.json"
    command(child, f"/save {saved}", "saved 2 messages")
    data = json.loads(saved.read_text())
    assert data["messages"][0] == {"role": "user", "content": "Tell me a long story."}
    assert data["messages"][1]["role"] == "assistant" and data["messages"][1]["cut"] is True

    # Another turn works and reuses the cut reply's cache. Keep it short by padding the
    # conversation up to a few tokens under the context, so the reply stops there.
    from twice.weights.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    history = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
    pad = "Hello world! How are you today? "

    def padded_conversation(repeat):
        convo = history + [{"role": "user", "content": pad * repeat}, {"role": "assistant", "content": "Fine."},
                           {"role": "user", "content": "hi"}]
        return convo, len(tok.encode_chat(convo))

    base, per = padded_conversation(0)[1], (padded_conversation(100)[1] - padded_conversation(0)[1]) / 100
    repeat = int((4096 - 4 - base) / per) + 2
    while (size := padded_conversation(repeat)[1]) > 4096 - 4:
        repeat -= 1
    convo = padded_conversation(repeat)[0]
    padded = tmp_path / "padded.json"
    padded.write_text(json.dumps({"version": 1, "model": None, "system": None,
                                  "messages": data["messages"] + convo[len(history):-1]}))
    command(child, f"/load {padded}", "loaded 4 messages")
    child.send("hi\r")
    child.expect_exact("max new tokens lowered")  # the engine's note, with a hint
    child.expect(SUMMARY)
    reused, prefilled = int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact(PROMPT)
    first_prompt = len(tok.encode_chat(history[:1]))
    assert reused >= first_prompt - 1 and reused + prefilled == size
    leave(child)


# -- scripted standard input (no terminal) ---------------------------------------------------
def test_scripted_stdin_two_turns_and_context_overflow(model_dirs, tmp_path, capsys, monkeypatch):
    folder = model_dirs("llama")
    saved, early = tmp_path / "s.json", tmp_path / "early.json"
    too_long = "Hello world! How are you today? " * 21  # fits alone, not after two turns
    script = "\n".join(["Hello there", "How are you?\\", "Fine.", f"/save {early}", too_long, "/drop 2", too_long,
                        '"""', "/not a command", '"""', f"/save {saved}", ""])
    r = run_inprocess(["chat", "--model", str(folder), "-n", "8", "--temperature", "0", "--timing"], capsys,
                      script.encode(), monkeypatch)
    assert r.code == 0, r.err
    assert "Traceback" not in r.err
    turns = [tuple(map(int, m.groups()[:2])) for m in SUMMARY.finditer(r.err)]
    assert len(turns) == 4
    assert turns[0][0] == 0 and turns[1][0] > 0  # the second turn reused the first
    refused = [line for line in r.err.splitlines() if "no longer fits" in line]
    # Dropping the oldest turn is enough: the hint names the smallest N that fits.
    assert len(refused) == 1 and "/drop 1 " in refused[0] and "/reset" in refused[0]
    assert r.err.count("twice timing report") == 4  # --timing: one report per reply
    assert r.out.count("\n") == 4  # stdout: the four replies, one line each, nothing else
    users = [m["content"] for m in json.loads(early.read_text())["messages"] if m["role"] == "user"]
    assert users == ["Hello there", "How are you?\nFine."]  # a trailing backslash continued the line
    data = json.loads(saved.read_text())
    users = [m["content"] for m in data["messages"] if m["role"] == "user"]
    # /drop 2 removed the first two turns, not more; a block is a message even when it starts with /
    assert users == [too_long, "/not a command"]


@pytest.mark.parametrize("content, problem", [
    ("{ not json", "not valid JSON"),
    ('{"version": 2, "messages": []}', "unsupported version"),
    ('{"version": 1, "messages": {}}', "'messages' must be a list"),
    ('{"version": 1, "messages": [{"role": "tool", "content": "x"}]}', "messages[0].role"),
    ('{"version": 1, "messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
    ('[1, 2]', "not a twice chat file"),
    ('{"version": 1, "messages": [], "messages": [{"role": "user", "content": "x"}]}',
     'the key "messages" appears twice'),
])
def test_load_rejects_broken_files_and_keeps_the_conversation(model_dirs, tmp_path, capsys, monkeypatch,
                                                               content, problem):
    folder = model_dirs("llama")
    bad, saved = tmp_path / "bad.json", tmp_path / "keep.json"
    bad.write_text(content)
    script = f"Hello there\n/load {bad}\n/save {saved}\n/save {bad}\n"
    r = run_inprocess(["chat", "--model", str(folder), "-n", "4"], capsys, script.encode(), monkeypatch)
    assert r.code == 0, r.err
    errors = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and problem in errors[0] and "unchanged" in errors[0]
    assert "not a twice chat file" in errors[1]  # /save does not overwrite a foreign file
    assert bad.read_text() == content
    assert [m["content"] for m in json.loads(saved.read_text())["messages"]][0] == "Hello there"


# -- models whose chat template cannot be used -------------------------------------------------
def test_template_reaching_python_internals_is_refused(model_dirs, tmp_path, capsys, monkeypatch):
    folder = copy_model(model_dirs, tmp_path)
    set_json(folder / "tokenizer_config.json",
             chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    r = run_inprocess(["chat", "--model", str(folder)], capsys, b"hello\n", monkeypatch)
    assert r.code == 2
    assert r.err.strip().startswith("twice: error: chat template refused by the sandbox")
    assert len(r.err.strip().splitlines()) == 1 and r.out == ""


def test_model_without_chat_template(model_dirs, tmp_path, capsys, monkeypatch):
    folder = copy_model(model_dirs, tmp_path)
    set_json(folder / "tokenizer_config.json", chat_template=None)
    r = run_inprocess(["chat", "--model", str(folder)], capsys, b"hello\n", monkeypatch)
    assert r.code == 2
    assert "no chat template" in r.err and len(r.err.strip().splitlines()) == 1


@pytest.mark.slow
def test_compile_gives_the_same_replies(model_dirs, capsys, monkeypatch):
    """--compile (the torch.compile'd step; GPT-2 has no native one): the same greedy
    replies over two turns as the eager layers, the second reusing the cache."""
    folder = model_dirs("gpt2")
    script = "Hello there\nHow are you?\n".encode()
    plain = run_inprocess(["chat", "--model", str(folder), "-n", "8", "--temperature", "0"], capsys, script,
                          monkeypatch)
    compiled = run_inprocess(["chat", "--model", str(folder), "-n", "8", "--temperature", "0", "--compile", "--timing"],
                             capsys, script, monkeypatch)
    assert plain.code == compiled.code == 0, compiled.err
    assert compiled.out == plain.out and compiled.out.count("\n") == 2
    assert re.search(r"│ step +│ +compiled │", compiled.err) and "Traceback" not in compiled.err
    note = next(line for line in compiled.err.splitlines() if "compiling the decode step" in line)
    assert "/drop" not in note  # the context hint belongs to notes about the context only
