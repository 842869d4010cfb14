"""Every file twice writes goes through here: never through a symbolic link, whole or not
at all, with sane modes, and under an exclusive lock where two writers may meet.

- `write_atomic(path, data)`: a temporary file beside `path` (O_EXCL, so nothing planted
  at its name is followed), written, fsync'ed, given the mode, renamed over `path`. The
  destination is either the old file or the complete new one; a link at the destination
  is refused before and replaced (not followed) by the rename after.
- `open_append(path)`: append to a file of ours (a history), never through a link, never
  to anything but a regular file we own.
- `exclusive_lock(path)`: one lock per written thing (an output file and its parts, a
  cache entry), a `flock` on `.NAME.lock` beside it, released by the kernel when the
  process dies, so a killed writer never leaves a stale lock. `wait=False` refuses at once
  with "another twice run is writing ..."; `wait=True` waits (a second conversion into
  the cache waits for the first and then finds its result).
- `ensure_folder(path)`: a folder to write into, created if missing; a regular file (or
  a link) where the folder should be is one line, not a traceback.

Modes: a file twice writes for the user (an output, a saved chat, a converted model) gets
0666 less the umask, as `open()` would give it, whether it was written by one process or
merged by rank 0 (mkstemp alone would leave 0600); private files (history, locks) 0600.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from twice.core.errors import TwiceError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
PRIVATE = 0o600


class WriteError(TwiceError):
    """A file twice was asked to write cannot be written safely (a link, a folder, busy)."""


def user_mode() -> int:
    """0666 less the process's umask: what open() gives a new file."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no way to read it without setting it; put it straight back
    os.umask(mask)
    return 0o666 & ~mask


def refuse_link(path: Path, error: type[TwiceError] = WriteError) -> None:
    """A symbolic link (dangling or not) where twice is to write is refused, never followed."""
    if os.path.islink(path):
        raise error(f"{path}: is a symbolic link; twice does not write through links (choose another name)")


def refuse_non_regular(path: Path, error: type[TwiceError] = WriteError) -> None:
    refuse_link(path, error)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{path}: is a folder")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: exists and is not a regular file")


def ensure_folder(path: Path, error: type[TwiceError] = WriteError, what: str = "folder") -> Path:
    """`path` as an existing folder (created with its parents if missing)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise error(f"{path}: exists and is not a folder (twice needs a {what} there)") from None
    except NotADirectoryError:
        raise error(f"{path}: a part of this path is a file, not a folder (twice needs a {what} there)") from None
    except OSError as e:
        raise error(f"{path}: cannot create the {what} ({e.strerror or e})") from None
    if not path.is_dir():
        raise error(f"{path}: exists and is not a folder (twice needs a {what} there)")
    return path


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str, *, mode: int | None = None,
                 error: type[TwiceError] = WriteError) -> None:
    """Replace `path` with `data`, whole or not at all (see the module's docstring).
    OSErrors of the write itself (disk full, file too large) propagate with the file's
    name, for the caller's own message; what must not be written through is `error`."""
    path = Path(path)
    refuse_non_regular(path, error)
    folder = path.parent if str(path.parent) else Path(".")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), user_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_folder(folder)


def open_append(path: Path, *, mode: int = PRIVATE, error: type[TwiceError] = WriteError):
    """A binary file object appending to `path`: created `mode` if missing, never through a
    link (O_NOFOLLOW), only a regular file of this user."""
    path = Path(path)
    refuse_link(path, error)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{path}: is a symbolic link; twice does not write through links") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: exists and is not a regular file")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise error(f"{path}: belongs to another user (uid {st.st_uid}); twice will not write to it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def lock_path(path: Path) -> Path:
    path = Path(path)
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def exclusive_lock(path: Path, *, wait: bool = False, what: str | None = None,
                   error: type[TwiceError] = WriteError) -> Iterator[None]:
    """Hold the one lock for writing `path` (see the module's docstring)."""
    import fcntl

    lock = lock_path(path)
    refuse_link(lock, error)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, PRIVATE)
    except OSError as e:
        raise error(f"{lock}: cannot create the lock file ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise error(f"{path}: another twice run is writing {what or 'it'} now; wait for it to finish") from None
        yield
    finally:
        os.close(fd)  # closing releases the flock
