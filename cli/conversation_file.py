"""The conversation files of `twice chat` (/save, /load): JSON, checked on the way in,
written atomically and never through a symbolic link."""

from __future__ import annotations

import json
from pathlib import Path

SAVE_VERSION = 1
ROLES = ("user", "assistant")


def read_conversation(path: Path) -> tuple[str | None, list[dict], str | None]:
    """Read and check a file written by /save; ValueError names the first problem."""
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise ValueError("it is a folder") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError("not a twice chat file (expected a JSON object)")
    if data.get("version") != SAVE_VERSION:
        raise ValueError(f"unsupported version {data.get('version')!r} (expected {SAVE_VERSION})")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string or null")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("'model' must be a string or null")
    messages = data.get("messages")
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be 'user' or 'assistant', got {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
        if "cut" in m and not isinstance(m["cut"], bool):
            raise ValueError(f"messages[{i}].cut must be true or false")
        entry = {"role": m["role"], "content": m["content"]}
        if m.get("cut"):
            entry["cut"] = True
        checked.append(entry)
    return system or None, checked, model


def refuse_overwrite(path: Path) -> None:
    """/save replaces an earlier chat file, never some other file the user had there, and
    never writes through a symbolic link (one placed where the file goes, in a shared
    folder, is refused here; one placed later is replaced by the rename, not followed)."""
    if path.is_symlink():
        raise ValueError("it is a symbolic link; choose another name (twice does not write through links)")
    if path.is_dir():
        raise ValueError("it is a folder")
    if path.exists():
        try:
            read_conversation(path)
        except (OSError, ValueError):
            raise ValueError("the file exists and is not a twice chat file; choose another name") from None


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
