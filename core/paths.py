"""Where twice keeps what it writes: the user cache (converted models, compiled kernels)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import PromptError, TwiceError


def user_path(text: str | os.PathLike) -> Path:
    """`text` as a path with a leading ~ or ~user expanded, as the shell would; a ~user
    for a user this system does not know is one line (pathlib raises RuntimeError)."""
    path = Path(text)
    try:
        return path.expanduser()
    except RuntimeError:
        head = str(text).split("/", 1)[0]
        who = f"no user '{head[1:]}'" if len(head) > 1 else "no home folder"
        raise PromptError(f"{text}: cannot expand {head}: {who} on this system") from None


def cache_dir() -> Path:
    """$TWICE_CACHE, else $XDG_CACHE_HOME/twice, else ~/.cache/twice. A cache that cannot
    be a folder (it, or a folder above it, is a regular file or another non-folder) is one
    line naming the variable that put it there, for every user of the cache alike (the
    model cache, the kernel cache, the chat history), instead of whatever the first
    mkdir() under it would raise."""
    if os.environ.get("TWICE_CACHE"):
        path, origin = user_path(os.environ["TWICE_CACHE"]), "TWICE_CACHE"
    elif os.environ.get("XDG_CACHE_HOME"):
        path, origin = Path(os.environ["XDG_CACHE_HOME"]) / "twice", "XDG_CACHE_HOME"
    else:
        path, origin = Path(os.path.expanduser("~")) / ".cache" / "twice", "HOME"
    _check_folder(path, origin)
    return path


def _check_folder(path: Path, origin: str) -> None:
    """The nearest existing one of `path` and its parents must be a folder (links followed,
    as a cache folder may be a link to another disk)."""
    for candidate in (path, *path.parents):
        try:
            st = os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):  # not there (or under a file): look above
            continue
        except OSError:  # unreadable, a loop of links...: the write under it will say
            return
        if not stat.S_ISDIR(st.st_mode):
            where = "is" if candidate == path else f"is inside {candidate}, which is"
            kind = "a file" if stat.S_ISREG(st.st_mode) else "not a folder"
            raise TwiceError(f"the cache folder {path} (from {origin}) {where} {kind}; "
                             f"set TWICE_CACHE to a folder twice may write into")
        return
