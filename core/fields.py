"""Typed, bounded values out of untrusted JSON: the one place every file twice reads is checked.

Every JSON file twice reads (config.json, generation_config.json, tokenizer_config.json,
a shard index, a chat file for /load, a batch line, a resume file) goes through `loads`
(size, nesting depth and number sizes bounded before or while parsing, one-line errors)
and then `Fields`, whose getters check a value's type and range and name the file and the
key when it is wrong. A bool is never a number here (JSON's `true` is not 1), an integer
of 400 digits is not a float, a string is never a bool ("no" is not false), and NaN or
infinity is refused wherever a finite number is meant.

Pure Python, no torch: the CLI, the loaders and the engine's config all use it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import ConfigError, TwiceError

MAX_DEPTH = 64  # nesting of arrays and objects; real configs nest 3–4 deep
MAX_INT_DIGITS = 100  # an integer in a config file longer than this is corrupt, not a value


class JSONLimitError(ValueError):
    """A JSON text exceeds one of `loads`' bounds."""


def _too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests deeper than `limit`: level by level (iterative: no recursion to
    exhaust; json.loads makes only dicts and lists, so exact type checks do; a tokenizer.json's
    150k merges cost 0.17 s here against 0.69 s for a stack of (item, depth) pairs)."""
    containers = (dict, list)
    level = [value] if type(value) in containers else []
    depth = 1
    while level:
        if depth > limit:
            return True
        deeper: list = []
        for item in level:
            deeper += [c for c in (item.values() if type(item) is dict else item) if type(c) in containers]
        level, depth = deeper, depth + 1
    return False


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise JSONLimitError(f"an integer of {digits} digits")
    return int(text)


class DuplicateKeyError(JSONLimitError):
    """One JSON object names a key twice (json.loads would keep the last quietly)."""

    def __init__(self, key: str):
        super().__init__(f"the key {json.dumps(key, ensure_ascii=True)} appears twice in one object")
        self.key = key


def unique_keys(pairs: list) -> dict:
    """An object_pairs_hook: a key given twice is an error, not the last one winning (a
    batch line {"prompt": "a", "prompt": "b"}, a safetensors header naming a tensor twice)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def _parse_constant(name: str) -> float:
    # Python's json accepts NaN, Infinity and -Infinity, which JSON does not have.
    raise JSONLimitError(f"{name} is not a JSON value")


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH, max_bytes: int | None = None, **kwargs) -> Any:
    """json.loads with bounds: at most `max_bytes` (checked before parsing), at most
    `max_depth` levels of nesting, integers of at most MAX_INT_DIGITS digits, no NaN or
    Infinity literals (`object_pairs_hook=unique_keys` refuses a key given twice). Raises
    ValueError (JSONLimitError for a bound, json.JSONDecodeError for bad syntax,
    UnicodeDecodeError for bytes that are not UTF-8) with a one-line message; callers add
    the file's name."""
    if max_bytes is not None and len(text) > max_bytes:
        raise JSONLimitError(f"{len(text):,} bytes, more than the {max_bytes:,} allowed")
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    kwargs.setdefault("parse_int", _parse_int)
    kwargs.setdefault("parse_constant", _parse_constant)
    try:
        value = json.loads(text, **kwargs)
    except RecursionError:
        raise JSONLimitError(f"nested more than {max_depth} levels deep") from None
    if _too_deep(value, max_depth):
        raise JSONLimitError(f"nested more than {max_depth} levels deep")
    return value


def describe_json_error(e: ValueError) -> str:
    """One line for a ValueError from `loads`."""
    if isinstance(e, json.JSONDecodeError):
        return f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (byte {e.start})"
    return f"not accepted ({e})"


def show(value: Any, limit: int = 60) -> str:
    """A short, printable rendering of a bad value for an error message, in JSON's spelling
    (true, null, "text": what the file or request holds), on one line, ASCII-escaped."""
    try:
        # a float JSON cannot write (1e400 read as inf) as Python does, not as "Infinity"
        text = repr(value) if isinstance(value, float) and not math.isfinite(value) else \
            json.dumps(value, ensure_ascii=True, default=repr)
    except (ValueError, RecursionError):  # an int too long for str(), a deep structure
        text = f"<{type(value).__name__}>"
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


_MISSING = object()


class Fields:
    """Typed getters over one untrusted dict; errors are `error` (a TwiceError class)
    saying `source: key must be ..., got ...`."""

    def __init__(self, data: dict, source: str, error: type[TwiceError] = ConfigError,
                 spelled: dict[str, str] | None = None):
        if not isinstance(data, dict):
            raise error(f"{source}: expected a JSON object, got {type(data).__name__}")
        self.data = data
        self.source = source
        self.error = error
        # key -> how the file wrote it, where that differs (GPT-2's n_embd for hidden_size):
        # a message names what the user can find in the file
        self.spelled = spelled or {}

    def name(self, key: str) -> str:
        return self.spelled.get(key, key)

    def _fail(self, key: str, wanted: str, value: Any) -> TwiceError:
        return self.error(f"{self.source}: {self.name(key)} must be {wanted}, got {show(value)}")

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                error = self.error(f"{self.source}: {key} is missing")
                error.missing_key = key  # a required field left out (serve answers missing_required_parameter)
                raise error
            return default
        return value

    def int(self, key: str, default: Any = _MISSING, *, lo: int | None = None, hi: int | None = None) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        wanted = _range_words("an integer", lo, hi)
        if isinstance(value, bool) or not isinstance(value, int):
            # 2.0 in a config is an integer written as a float; 2.5 is not
            if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
                value = int(value)
            else:
                raise self._fail(key, wanted, value)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self._fail(key, wanted, value)
        return value

    def float(self, key: str, default: Any = _MISSING, *, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False, hi_open: bool = False) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        wanted = _range_words("a number", lo, hi, lo_open, hi_open)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, wanted, value)
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            raise self._fail(key, wanted, value) from None
        if not math.isfinite(number):
            raise self._fail(key, wanted, value)
        if lo is not None and (number < lo or (lo_open and number == lo)):
            raise self._fail(key, wanted, value)
        if hi is not None and (number > hi or (hi_open and number == hi)):
            raise self._fail(key, wanted, value)
        return number

    def bool(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, bool):
            raise self._fail(key, "true or false", value)
        return value

    def str(self, key: str, default: Any = _MISSING, *, choices: tuple[str, ...] | None = None,
            max_len: int = 1 << 20) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str) or len(value) > max_len:
            raise self._fail(key, "a string", value)
        if choices is not None and value not in choices:
            raise self._fail(key, "one of " + ", ".join(choices), value)
        return value

    def token_ids(self, key: str, *, hi: int | None = None) -> tuple[int, ...]:
        """A token id or a list of them (absent or null: none)."""
        value = self.data.get(key)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 and (hi is None or v < hi) for v in values)
        if not ok or len(values) > 1024:
            raise self._fail(key, "a token id or a list of them", value)
        return tuple(values)

    def dict(self, key: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, dict):
            raise self._fail(key, "an object", value)
        return value

    def list(self, key: str, default: Any = _MISSING, *, max_len: int = 1 << 20) -> Any:
        value = self._get(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or len(value) > max_len:
            raise self._fail(key, "a list", value)
        return value


def _number(x) -> str:
    """1000000 and 1e6 as 1,000,000; 1e30 as 1e+30; 0.5 as 0.5."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        x = int(x)
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _range_words(kind: str, lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    lo_text, hi_text = (None if lo is None else _number(lo)), (None if hi is None else _number(hi))
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{lo_text}, {hi_text}{')' if hi_open else ']'}"
    if lo is not None:
        if lo == 1 and kind == "an integer" and not lo_open:
            return "a positive integer"
        if lo == 0:
            return f"a positive {kind.split()[-1]}" if lo_open else f"a non-negative {kind.split()[-1]}"
        return f"{kind} {'>' if lo_open else '≥'} {lo_text}"
    if hi is not None:
        return f"{kind} ≤ {hi_text}"
    return kind


def first_unknown(obj: dict, fields: set[str] | frozenset[str]) -> str | None:
    """The first key of `obj` (in sorted order) outside `fields`, or None: an untrusted
    object's typo, refused by its reader (a serve request, a message, a response_format)."""
    return min((k for k in obj if k not in fields), default=None)


def unpaired_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (None if there is none): JSON's
    \\uD800-\\uDFFF escapes decode to them, and they are not text (UTF-8 cannot hold them)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start
