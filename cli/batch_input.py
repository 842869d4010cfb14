"""`twice batch` input: .txt and .jsonl prompt files, parsed into records or per-line errors.

Pure functions (text in, records and errors out), so the parser can be fuzzed without
files or a model.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from twice.core.errors import PromptError
from twice.core.fields import DuplicateKeyError, loads, show, unique_keys, unpaired_surrogate

from .prompt_input import strip_bom

FORMATS = ("txt", "jsonl")
MAX_LINE_CHARS = 64 * 2**20  # as cli/prompt_input.py's MAX_PROMPT_BYTES: one prompt
LINE_OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "response_format")
KNOWN_KEYS = frozenset(("id", "prompt", "messages", *LINE_OPTIONS))


@dataclass(frozen=True)
class Record:
    line: int  # 1-based line number in the input
    id: str | int
    prompt: str | None = None
    messages: list | None = None
    options: dict = field(default_factory=dict)  # per-line settings, already type-checked
    unknown_keys: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        # Ids compare as text: 7 and "7" are the same prompt (and the same line on --resume).
        return str(self.id)


@dataclass(frozen=True)
class LineError:
    line: int
    message: str


class _BadLine(Exception):
    pass


def sniff_format(text: str) -> str:
    """jsonl when the first non-blank line starts with '{', else txt."""
    for line in text.split("\n"):
        if line.strip():
            return "jsonl" if line.lstrip().startswith("{") else "txt"
    return "txt"


def parse_input(text: str, fmt: str) -> tuple[list[Record], list[LineError]]:
    """Parse a whole input (txt or jsonl) into records and per-line errors. Blank lines are
    skipped; a repeated id is an error on the later line."""
    if fmt not in FORMATS:
        raise ValueError(fmt)
    parse = _parse_txt if fmt == "txt" else _parse_jsonl
    records: list[Record] = []
    errors: list[LineError] = []
    first_seen: dict[str, int] = {}
    for number, line in enumerate(_lines(text), start=1):
        if len(line) > MAX_LINE_CHARS:  # sizes before work: never parsed (nor tokenized)
            errors.append(LineError(number, f"the line is {len(line):,} characters; a line is at most "
                                            f"{MAX_LINE_CHARS:,} (a prompt is at most 64 MiB)"))
            continue
        if not line.strip():
            continue
        try:
            record = parse(number, line)
        except _BadLine as e:
            errors.append(LineError(number, str(e)))
            continue
        if record.key in first_seen:
            errors.append(LineError(number, f"duplicate id {show(record.id)} (first on line {first_seen[record.key]}); skipped"))
            continue
        first_seen[record.key] = number
        records.append(record)
    return records, errors


def _lines(text: str) -> list[str]:
    # Split on \n only: str.splitlines would also split on U+2028 and friends, which JSON
    # strings may hold raw, and line numbers would no longer match an editor's.
    text = strip_bom(text)
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _parse_txt(number: int, line: str) -> Record:
    return Record(number, str(number), prompt=_text(line, "the prompt"))


def _parse_jsonl(number: int, line: str) -> Record:
    try:
        # bounded: nesting depth, integer sizes, no NaN (core/fields.py); a key given twice
        # ({"prompt": "a", "prompt": "b"}) is a bad line, not the last one winning quietly
        obj = loads(line, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except DuplicateKeyError as e:
        raise _BadLine(str(e)) from None
    except ValueError as e:  # huge integers, absurd nesting
        raise _BadLine(f"invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"expected a JSON object, got {_kind(obj)}")
    record_id = _record_id(obj)
    has_prompt, has_messages = obj.get("prompt") is not None, obj.get("messages") is not None
    if has_prompt == has_messages:
        raise _BadLine('give either "prompt" (a string) or "messages" (a list), not both' if has_prompt
                       else 'missing "prompt" (a string) or "messages" (a list of {role, content})')
    options = {k: _option(k, obj[k]) for k in LINE_OPTIONS if obj.get(k) is not None}
    unknown = tuple(sorted(k for k in obj if k not in KNOWN_KEYS))
    if has_prompt:
        prompt = _text(obj["prompt"], '"prompt"')
        if not prompt.strip():
            raise _BadLine('"prompt" is empty')
        return Record(number, record_id, prompt=prompt, options=options, unknown_keys=unknown)
    return Record(number, record_id, messages=_messages(obj["messages"]), options=options, unknown_keys=unknown)


def _record_id(obj: dict) -> str | int:
    if "id" not in obj:
        raise _BadLine('missing "id" (a string or an integer)')
    value = obj["id"]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _BadLine(f'"id" must be a string or an integer, got {_kind(value)}')
    if isinstance(value, str) and not _text(value, '"id"').strip():
        raise _BadLine('"id" is empty')
    return value


def _messages(value) -> list:
    if not isinstance(value, list) or not value:
        raise _BadLine(f'"messages" must be a non-empty list of {{role, content}} objects, got {_kind(value)}')
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _BadLine(f'"messages"[{i}] must be an object, got {_kind(message)}')
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise _BadLine(f'"messages"[{i}].{key} must be a string, got {_kind(message.get(key))}')
            _text(message[key], f'"messages"[{i}].{key}')
    return value


def _option(key: str, value):
    """Check one per-line setting's type and range; return it in the form the engine takes."""
    if key == "response_format":  # checked and compiled by core/constraints.py (cli/batch.py's line_settings)
        if not isinstance(value, dict):
            raise _BadLine(f'"response_format" must be an object, got {_kind(value)}')
        return value
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _BadLine(f'"stop" must be a string or a list of strings, got {_kind(value)}')
        if "" in stops:  # as --stop "": a text that matches nothing is a mistake, not a request
            raise _BadLine('"stop" holds an empty text, which matches nothing')
        return tuple(_text(s, '"stop"') for s in stops)
    if key in ("temperature", "top_p"):
        number = _float(key, value)
        if key == "temperature" and number < 0:
            raise _BadLine(f'"temperature" must be >= 0 (0 = greedy), got {number}')
        if key == "top_p" and not 0 < number <= 1:
            raise _BadLine(f'"top_p" must be in (0, 1], got {number}')
        return number
    if isinstance(value, bool) or not isinstance(value, int):
        raise _BadLine(f'"{key}" must be an integer, got {_kind(value)}')
    low, high = {"max_new_tokens": (1, None), "top_k": (0, None), "seed": (0, 2**63 - 1)}[key]
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, 2^63)"
        raise _BadLine(f'"{key}" must be {limit}, got {show(value)}')
    return value


def _float(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _BadLine(f'"{key}" must be a number, got {_kind(value)}')
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _BadLine(f'"{key}" must be a finite number')
    return number


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise _BadLine(f"{what} must be a string, got {_kind(value)}")
    if unpaired_surrogate(value) is not None:  # it could not be written back
        raise _BadLine(f"{what} holds an unpaired surrogate (an invalid \\uD800-\\uDFFF escape)")
    return value


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


# -- the output file and --resume -------------------------------------------------------
# -- reading the input ------------------------------------------------------------------
def read_input(source: str, fmt: str | None) -> tuple[str, str, str]:
    """Return (name for messages, text, format)."""
    if source == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise PromptError("no input: give a .txt or .jsonl file, or pipe prompts in (twice batch - < prompts.jsonl)")
        name, data = "<stdin>", sys.stdin.buffer.read()
    else:
        name = source
        try:
            data = Path(source).read_bytes()
        except FileNotFoundError:
            raise PromptError(f"{source}: no such file") from None
        except IsADirectoryError:
            raise PromptError(f"{source} is a folder; give a .txt or .jsonl file") from None
        except OSError as e:
            raise PromptError(f"cannot read {source}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PromptError(f"{name}:{line}: not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    if fmt is None:
        suffix = Path(source).suffix.lower() if source != "-" else ""
        fmt = {".txt": "txt", ".jsonl": "jsonl"}.get(suffix) or sniff_format(text)
    return name, text, fmt


