"""Prompt-cache files on the command line: `twice generate --prompt-cache FILE
[--prompt-cache-ro]` and the KV sidecar of `twice chat`'s /save and /load.

A file that cannot be used (another model's, stale, corrupt, not a prompt cache) is
refused in one notice and the run goes on with a normal prefill; a file that cannot be
written (a read-only folder, a full disk, a link) is one notice too and the run's result
stands. A stale or corrupt cache is replaced by this run's; a sound cache of another model,
tokenizer, dtype or kv dtype is kept (it still serves the runs it was made for), and a file
that is not a twice prompt cache is never replaced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from twice.core.paths import user_path


@dataclass
class PromptCacheUse:
    """What happened to a prompt-cache file in one run (for notices and --json)."""

    file: str
    loaded_tokens: int = 0
    loaded_ids: list[int] | None = None
    refused: str | None = None  # why the file was not used
    saved_tokens: int = 0
    not_saved: str | None = None  # why it was not written
    missing: bool = False  # no file there (a first run makes it; with --prompt-cache-ro, a typo?)
    foreign: bool = False  # a sound cache of another model or setting: kept

    def to_dict(self) -> dict:
        return {"file": self.file, "loaded_tokens": self.loaded_tokens, "refused": self.refused,
                "saved_tokens": self.saved_tokens, "not_saved": self.not_saved}


def check_options(path: str | None, read_only: bool, tp: int = 1) -> None:
    """--prompt-cache / --prompt-cache-ro: one line before anything loads."""
    from twice.core.errors import UsageError

    if read_only and path is None:
        raise UsageError("--prompt-cache-ro needs --prompt-cache FILE")
    if path is None:
        return
    if not path.strip():
        raise UsageError("--prompt-cache needs a file name")
    if tp > 1:
        raise UsageError("--prompt-cache does not work with --tp (a cache file holds one process's keys and values)")
    if path.endswith(("/", os.sep)):
        raise UsageError(f"--prompt-cache {path}: names a folder (it ends with {path[-1]}); give a file name")
    try:
        if user_path(path).is_dir():
            raise UsageError(f"--prompt-cache {path}: is a folder, not a file")
    except OSError as e:  # a name longer than the system allows, ...
        from .format import os_message

        raise UsageError(f"--prompt-cache {path}: {os_message(e)}") from None


def _reason(e: Exception, path: Path) -> str:
    text = str(e)
    prefix = f"{path}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def load(engine, path: str) -> PromptCacheUse:
    """Load `path` into the engine's session cache if it is there and belongs to this
    model; `refused` says why not (the engine is then untouched)."""
    from twice.core.errors import TwiceError
    from twice.core.prompt_cache import ForeignPromptCache
    from twice.weights import prompt_cache_file as pcf

    use = PromptCacheUse(file=path)
    p = user_path(path)
    if not p.exists() and not p.is_symlink():
        use.missing = True
        return use
    try:
        use.loaded_tokens = pcf.load_into(engine, p)
        use.loaded_ids = list(engine.cached_ids)
    except TwiceError as e:
        use.refused = _reason(e, p)
        use.foreign = isinstance(e, ForeignPromptCache)
    return use


def save(engine, use: PromptCacheUse, tokens: int, ids: list[int] | None = None) -> None:
    """Write the engine's first `tokens` cached tokens to use.file, unless it already holds
    exactly `ids`; a failure is recorded in use.not_saved (one line)."""
    from twice.core.errors import TwiceError
    from twice.weights import prompt_cache_file as pcf

    p = user_path(use.file)
    if ids is not None and use.loaded_ids == ids:
        return  # the file already holds this prompt
    if use.foreign:
        use.not_saved = "it holds a sound cache for another model or setting (kept; delete it or name another file)"
        return
    if (p.exists() or p.is_symlink()) and not p.is_symlink() and p.is_file() and not pcf.looks_like_one(p):
        use.not_saved = "the file exists and is not a twice prompt cache (not replaced; choose another name)"
        return
    try:
        use.saved_tokens = pcf.save_from(engine, p, tokens)
    except TwiceError as e:
        use.not_saved = _reason(e, p)
    except OSError as e:
        from .format import os_message

        use.not_saved = os_message(e)


def notices(use: PromptCacheUse, read_only: bool = False) -> list[str]:
    """The lines a run says about its prompt cache."""
    out = []
    if use.missing and read_only:  # nothing will ever make it: say so, once
        out.append(f"prompt cache {use.file}: no such file (--prompt-cache-ro never writes one); "
                   "prefilling the whole prompt")
    if use.refused is not None:
        out.append(f"prompt cache {use.file} not used ({use.refused}); prefilling the whole prompt")
    elif use.loaded_tokens:
        out.append(f"prompt cache {use.file}: {use.loaded_tokens} tokens loaded")
    if use.not_saved is not None:
        out.append(f"prompt cache not saved to {use.file}: {use.not_saved}")
    return out


def sidecar(path: Path) -> Path:
    """Where /save FILE puts the conversation's KV cache: FILE.kv beside it."""
    return path.with_name(path.name + ".kv")
