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
  process dies, so a killed writer never leaves a stale lock (only a lock file, which the
  next run takes and, like every run, removes when it is done). `wait=False` refuses at once
  with "another twice run is writing ..."; `wait=True` waits (a second conversion into
  the cache waits for the first and then finds its result).
- `ensure_folder(path)`: a folder to write into, created if missing; a regular file (or
  a link) where the folder should be is one line, not a traceback.
- `atomic_folder(dest, overwrite)`: a folder written whole or not at all (a converted
  model, a cache entry): under `dest`'s lock, the temporary folders `.NAME.tmp-*` that dead
  writers left are removed (any that exist while we hold the lock are dead: a live writer
  holds it), the new one is written inside a private temporary folder beside `dest` and
  renamed into place, an old `dest` moved aside first when `overwrite`.
- `atomic_file(path)`: the same for one file that another program writes (the native
  kernels' library, which the compiler writes): a temporary name beside `path` to write
  to, renamed over `path` when the block succeeds, removed when it fails.

A lock is held per thread: taking one that this thread already holds (resolve locks a
cache entry to look for it, then the conversion locks it again to write it) goes straight
through, while another thread or process waits or is refused.

Modes: a file twice writes for the user (an output, a saved chat, a converted model) gets
0666 less the umask, as `open()` would give it, whether it was written by one process or
merged by rank 0 (mkstemp alone would leave 0600); a file it replaces keeps the mode it
had (a chat the user made 0600 stays private); private files (history, locks) 0600.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from twice.core.errors import TwiceError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
PRIVATE = 0o600


class WriteError(TwiceError):
    """A file twice was asked to write cannot be written safely (a link, a folder, busy)."""


def replacing_mode(path: Path) -> int:
    """The mode a file written over `path` gets: the permissions of the regular file it
    replaces, else what open() gives a new one (user_mode)."""
    try:
        st = os.lstat(path)
    except OSError:
        return user_mode()
    return st.st_mode & 0o777 if stat.S_ISREG(st.st_mode) else user_mode()


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


def sync_folder(folder: Path) -> None:
    """fsync a folder, so that a crash cannot lose the name of a file just created or renamed in it
    (not every system lets a folder be opened: then nothing)."""
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
            os.fchmod(f.fileno(), replacing_mode(path) if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    sync_folder(folder)


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


_HELD = threading.local()  # the lock files this thread holds


def _held() -> set[str]:
    if not hasattr(_HELD, "paths"):
        _HELD.paths = set()
    return _HELD.paths


@contextlib.contextmanager
def exclusive_lock(path: Path, *, wait: bool = False, what: str | None = None,
                   error: type[TwiceError] = WriteError) -> Iterator[None]:
    """Hold the one lock for writing `path` (see the module's docstring)."""
    import fcntl

    lock = lock_path(path)
    key = os.path.abspath(lock)
    held = _held()
    if key in held:  # this thread holds it already
        yield
        return
    while True:
        fd = _open_lock(lock, error)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise error(f"{path}: another twice run is writing {what or 'it'} now; wait for it to finish") from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, lock):
            break
        os.close(fd)  # the run before us removed the lock file it held: lock the new one
    held.add(key)
    try:
        yield
    finally:
        held.discard(key)
        # Removed while still held, so no lock files are left behind; a run that opened
        # this one meanwhile sees it gone once it gets the flock, and takes a new one.
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)  # closing releases the flock


def _open_lock(lock: Path, error: type[TwiceError]) -> int:
    refuse_link(lock, error)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, PRIVATE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{lock}: is a symbolic link; twice does not write through links") from None
        raise error(f"{lock}: cannot create the lock file ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size:
        # Our lock files are empty regular files, removed after use: anything else under the
        # name is someone's data, which removing the lock afterwards would destroy.
        os.close(fd)
        raise error(f"{lock}: is not a twice lock file (it {'holds data' if stat.S_ISREG(st.st_mode) else 'is not a regular file'}); "
                    "move it away, twice needs the name for its lock")
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, now = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


# -- whole folders and files written by others ------------------------------------------
_TMP_RANDOM = r"[a-z0-9_]{8}"  # what tempfile puts in its names


def temp_prefix(path: Path) -> str:
    """How the temporary names of `path`'s writers begin: `.NAME.tmp-`."""
    return f".{Path(path).name}.tmp-"


def remove_leftovers(path: Path) -> list[str]:
    """Remove the temporary folders and files `.NAME.tmp-XXXXXXXX` that dead writers of
    `path` left beside it. Call it only while holding `path`'s lock: a live writer holds
    the lock, so any such name then is a dead one's. Only what this user owns is removed,
    and a link is never followed (nor removed: it is not something twice made). Returns
    the names removed."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    pattern = re.compile(re.escape(temp_prefix(path)) + _TMP_RANDOM)
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        if not pattern.fullmatch(entry.name):
            continue
        try:
            st = os.lstat(entry.path)
            if uid is not None and st.st_uid != uid:
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry.path)  # fd-based where the platform allows: no link inside is followed
            elif stat.S_ISREG(st.st_mode):
                os.unlink(entry.path)
            else:
                continue
        except OSError:
            continue
        removed.append(entry.name)
    return removed


def check_folder_destination(dest: Path, overwrite: bool, error: type[TwiceError] = WriteError) -> None:
    """`dest` may become a new folder: nothing there, an empty folder, or (`overwrite`) a
    folder to replace; a link is refused rather than followed (replacing it would swap the
    link, not its target)."""
    if os.path.islink(dest):
        raise error(f"{dest}: is a symbolic link; give the folder it points to instead")
    if dest.exists() and not dest.is_dir():
        raise error(f"{dest}: exists and is not a folder; choose another destination")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise error(f"{dest}: folder exists and is not empty (pass overwrite=True to replace it)")


@contextlib.contextmanager
def atomic_folder(dest: Path, overwrite: bool = False, *, wait: bool = False, what: str | None = None,
                  check: Callable[[Path, bool], None] | None = None,
                  error: type[TwiceError] = WriteError) -> Iterator[Path]:
    """Yield an empty folder to write into; when the block succeeds it becomes `dest`
    (replacing an old `dest` if `overwrite`), otherwise it is deleted (see the module's
    docstring). `check(dest, overwrite)` (default check_folder_destination) runs under the
    lock before anything is written and again just before the rename.

    The folder lives inside a private temporary one beside `dest` (same filesystem, so the
    rename is atomic). mkdtemp creates that one itself under a random name, so nothing placed
    at its path beforehand is followed; the folder inside is made by a plain mkdir, so it gets
    the permissions the user's umask gives a new folder, not mkdtemp's 0700. OSErrors of the
    block propagate for the caller's own message."""
    dest = Path(dest)
    check = check or (lambda d, o: check_folder_destination(d, o, error))
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"{dest}: cannot create the output folder ({e.strerror or e})") from None
    with exclusive_lock(dest, wait=wait, what=what, error=error):
        check(dest, overwrite)
        remove_leftovers(dest)
        try:
            private = Path(tempfile.mkdtemp(prefix=temp_prefix(dest), dir=dest.parent))
        except OSError as e:
            raise error(f"{dest}: cannot create the output folder ({e.strerror or e})") from None
        try:
            work = private / dest.name
            try:
                work.mkdir()
            except OSError as e:
                raise error(f"{dest}: cannot create the output folder ({e.strerror or e})") from None
            yield work
            check(dest, overwrite)  # it may have changed while we wrote (not by twice: we hold the lock)
            _replace_folder(work, dest, what, error)
        finally:
            shutil.rmtree(private, ignore_errors=True)


def _replace_folder(work: Path, dest: Path, what: str | None, error: type[TwiceError]) -> None:
    """rename(2) replaces only an empty folder, so an old one is first moved aside (into the
    private temporary folder, which is deleted afterwards). A link found at `dest` here is
    moved aside as a link, never followed."""
    old = work.parent / f"{dest.name}.old"
    had_old = os.path.lexists(dest) and not (dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()))
    try:
        if had_old:
            os.replace(dest, old)
        os.replace(work, dest)
    except OSError as e:
        if had_old and os.path.lexists(old) and not os.path.lexists(dest):
            os.replace(old, dest)  # put the previous one back
        raise error(f"{dest}: cannot move {what or 'the new folder'} into place ({e.strerror or e})") from None
    sync_folder(dest.parent)


@contextlib.contextmanager
def atomic_file(path: Path, *, mode: int | None = None, wait: bool = True, what: str | None = None,
                error: type[TwiceError] = WriteError) -> Iterator[Path]:
    """Yield a temporary path beside `path` for another program to write (the compiler's
    -o); when the block succeeds it gets `mode` (default: the replaced file's, else 0666 less
    the umask) and is renamed over `path`, otherwise it is removed. Under `path`'s lock
    (waiting by default), with the leftovers of dead writers removed first. The temporary
    file is created by mkstemp (O_EXCL, nothing planted at its name is followed): use it in
    a folder others cannot write, as a program that writes by name may replace it."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    with exclusive_lock(path, wait=wait, what=what, error=error):
        refuse_non_regular(path, error)
        remove_leftovers(path)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=temp_prefix(path))
        os.close(fd)
        try:
            yield Path(tmp)
            os.chmod(tmp, replacing_mode(path) if mode is None else mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        sync_folder(folder)
