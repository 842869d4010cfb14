"""Reading a prompt from the command line or standard input, and checking the text that
command-line flags carry.

Sizes before work: standard input is read in bounded chunks and refused past
MAX_PROMPT_BYTES without reading the rest (a 10 GB pipe is not read whole); the engine then
refuses a text that cannot fit the model's context before tokenizing it (core/engine.py).
"""

from __future__ import annotations

import sys

from twice.core.errors import PromptError

MAX_PROMPT_BYTES = 64 * 2**20  # a prompt from standard input; a line of a batch file likewise
_CHUNK = 2**20


def strip_bom(text: str) -> str:
    """Text read from a file or standard input without the byte-order mark some editors (and
    PowerShell's redirection) put first: it is no part of the text, and a tokenizer would
    count it as tokens of the prompt."""
    return text.removeprefix("\ufeff")


def read_prompt(prompt: str | None) -> str:
    text = _read(prompt)
    if not text.strip():
        raise PromptError("the prompt is empty")
    return text


def _read(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":
        check_text_arguments(prompt=prompt)
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise PromptError("no prompt: give one as an argument, or pipe it in (twice generate - < prompt.txt)")
    data = read_limited_stream(sys.stdin.buffer, MAX_PROMPT_BYTES, "standard input")
    try:
        # One line ending off the end, as a shell's $(...) takes it: `echo TEXT | twice generate -`
        # is the prompt TEXT, as the argument TEXT is (the newline echo adds changed the reply).
        return _one_line_ending_off(strip_bom(data.decode("utf-8")))
    except UnicodeDecodeError as e:
        raise PromptError(f"standard input is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def _one_line_ending_off(text: str) -> str:
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def read_limited_stream(stream, limit: int, name: str) -> bytes:
    """All of `stream`, read in chunks; more than `limit` bytes is refused as soon as it is
    seen (the rest is never read)."""
    chunks, size = [], 0
    while True:
        chunk = stream.read(min(_CHUNK, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise PromptError(f"{name} holds more than {_mib(limit)} (a prompt is at most {_mib(limit)}; "
                              "no model's context holds that much text)")
        chunks.append(chunk)


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def check_text_arguments(**arguments: str | list[str] | tuple[str, ...] | None) -> None:
    """Command-line text (the prompt, --system, --stop, ...) must be valid UTF-8. Python hands
    argv over as str with each invalid byte as a lone surrogate (U+DC80-U+DCFF), which no
    tokenizer can take: refuse it in one line naming the argument and the byte offset.
    Keywords are the argument names ('prompt', 'system' -> --system); a value may be a list
    (a repeated flag)."""
    for name, value in arguments.items():
        values = [value] if isinstance(value, str) else list(value or ())
        for text in values:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                shown = "the prompt argument" if name == "prompt" else f"--{name.replace('_', '-')}"
                offset = len(text[:e.start].encode("utf-8"))  # everything before the first bad byte is valid
                try:
                    raw = text[e.start:e.start + 1].encode("utf-8", "surrogateescape")  # the byte as given
                except UnicodeEncodeError:  # a surrogate that no invalid byte stands for
                    raise PromptError(f"{shown} holds an unpaired surrogate at character {e.start}") from None
                raise PromptError(f"{shown} is not valid UTF-8 (byte {offset}: {raw!r})") from None
