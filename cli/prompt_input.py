"""Reading a prompt from the command line or standard input."""

from __future__ import annotations

import sys

from twice.core.errors import PromptError


def read_prompt(prompt: str | None) -> str:
    text = _read(prompt)
    if not text.strip():
        raise PromptError("the prompt is empty")
    return text


def _read(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise PromptError("no prompt: give one as an argument, or pipe it in (twice generate - < prompt.txt)")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError(f"standard input is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
