"""The conversation files of `twice chat` (/save, /load): JSON, checked whole on the way
in (before anything in the session changes), written atomically and never through a
symbolic link, and never over an existing file unless asked (/save!).

What /load accepts, and why each bound is there:
- a regular file (a FIFO or a device is refused without blocking) of at most
  MAX_FILE_BYTES, checked before it is read;
- JSON through `fields.loads`: at most 64 levels of nesting (a file nested 100,000 deep
  raised a RecursionError traceback), integers of at most 100 digits, no NaN/Infinity;
- at most MAX_MESSAGES messages, each a user or assistant message whose content is text:
  every string must be encodable as UTF-8, so a lone surrogate (JSON lets "\\ud800" through)
  is refused here instead of crashing the tokenizer on the next turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from twice.core.errors import TwiceError
from twice.core.fields import unpaired_surrogate

SAVE_VERSION = 1
ROLES = ("user", "assistant")
MAX_FILE_BYTES = 16 << 20  # 16 MiB: about 4 million tokens of text, more than any model's context
MAX_MESSAGES = 100_000


class _Unreadable(TwiceError):
    """weights.files' refusal of the file itself; turned into the ValueError /load reports."""


def read_conversation(path: Path) -> tuple[str | None, list[dict], str | None]:
    """Read and check a file written by /save; ValueError names the first problem (one
    line, without the file's name, which the caller says)."""
    from twice.core.fields import JSONLimitError, describe_json_error, loads, show, unique_keys
    from twice.weights.files import read_limited

    if path.is_dir():
        raise ValueError("it is a folder")
    try:
        raw = read_limited(path, MAX_FILE_BYTES, _Unreadable)
    except _Unreadable as e:
        text, prefix = str(e), f"{path}: "
        raise ValueError(text[len(prefix):] if text.startswith(prefix) else text) from None
    try:
        data = loads(raw, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except JSONLimitError as e:
        raise ValueError(f"not a twice chat file ({e})") from None
    except ValueError as e:  # not UTF-8
        raise ValueError(describe_json_error(e)) from None
    if not isinstance(data, dict):
        raise ValueError("not a twice chat file (expected a JSON object)")
    version = data.get("version")
    if type(version) is not int or version != SAVE_VERSION:  # true is not 1
        raise ValueError(f"unsupported version {show(version)} (expected {SAVE_VERSION})")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string or null")
    _check_text(system, "'system'")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("'model' must be a string or null")
    _check_text(model, "'model'")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"{len(messages):,} messages, more than the {MAX_MESSAGES:,} /load takes")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role must be 'user' or 'assistant', got {show(role)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        _check_text(m["content"], f"messages[{i}].content")
        if "cut" in m and not isinstance(m["cut"], bool):
            raise ValueError(f"messages[{i}].cut must be true or false")
        entry = {"role": role, "content": m["content"]}
        if m.get("cut"):
            entry["cut"] = True
        checked.append(entry)
    return system or None, checked, model


def _check_text(value: str | None, what: str) -> None:
    """Text that can be encoded as UTF-8 (what the tokenizer and /save need): JSON's
    \\uXXXX escapes can spell a lone surrogate, which is not a character."""
    if value is not None and (at := unpaired_surrogate(value)) is not None:
        raise ValueError(f"{what} holds a lone surrogate (\\u{ord(value[at]):04x} at character {at}), "
                         f"which is not text")


def refuse_overwrite(path: Path, force: bool = False) -> None:
    """/save writes a new file; it replaces an earlier chat file only when asked (`force`,
    /save!), never some other file the user had there, never a folder or anything but a
    regular file, and never writes through a symbolic link (one placed where the file goes,
    in a shared folder, is refused here; one placed later is replaced by the rename, not
    followed)."""
    import os
    import stat

    if path.is_symlink():
        raise ValueError("it is a symbolic link; choose another name (twice does not write through links)")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError("it is a folder")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("it exists and is not a regular file; choose another name")
    try:
        read_conversation(path)
    except (OSError, ValueError):
        raise ValueError("the file exists and is not a twice chat file; choose another name") from None
    if not force:
        raise ValueError(f"the file exists (an earlier chat); /save! {path} replaces it")


def write_atomic(path: Path, text: str) -> None:
    """safe_write.write_atomic: the destination is either the old file or the complete new
    one (a temporary file beside it, fsync'ed, renamed), never written through a link, 0666
    less the umask. What must not be written is a ValueError, as /save reports it."""
    from twice.weights.safe_write import WriteError
    from twice.weights.safe_write import write_atomic as write_whole

    try:
        write_whole(path, text)
    except WriteError as e:
        message, prefix = str(e), f"{path}: "
        raise ValueError(message[len(prefix):] if message.startswith(prefix) else message) from None
