"""`twice batch` output: JSON lines written whole and synced, and what --resume finds in
an earlier run's file.

Each result is one complete line written with a single write() (and fsync'ed): a killed
run leaves at most one torn last line, which --resume drops before appending.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from twice.core.errors import PromptError, TwiceError
from twice.core.fields import JSONLimitError, loads, show
from twice.weights.safe_write import sync_folder

OUR_PREFIX = b'{"id": '  # every line we write starts so (json.dumps of a dict whose first key is id)


@dataclass
class OutputState:
    """What --resume found in an existing output: the ids already there, and where a
    damaged tail (a torn last write) starts, if there is one."""

    done: set[str] = field(default_factory=set)
    existing: bool = False  # the file is there and was read (--resume): append to it
    keep_bytes: int | None = None  # truncate the file to this length before appending
    dropped_bytes: int = 0
    identity: tuple | None = None  # (device, inode, size, mtime) of the file that was read
    # id -> (line number, digest of the prompt or messages the result line echoes): a
    # result line answers one prompt, and --resume must not skip a prompt it did not answer.
    echoes: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    # model name -> the first line it wrote (result lines name their model; older ones do not)
    models: dict[str, int] = field(default_factory=dict)
    # id -> (line number, the settings its result line records; older lines record none)
    settings: dict[str, tuple[int, dict]] = field(default_factory=dict)


def scan_output(data: bytes, name: str) -> OutputState:
    """Read an earlier run's output. A last line without its newline, or a last line that
    is not JSON at all, is a torn write and is dropped; any other line must be one of ours,
    so that a user's unrelated file is refused rather than cut."""
    state = OutputState(existing=True)
    end = data.rfind(b"\n") + 1  # end of the last complete line
    lines = data[:end].split(b"\n")[:-1]
    keep = end
    if lines and not _is_json(lines[-1]):
        keep -= len(lines[-1]) + 1
        lines.pop()
    for number, raw in enumerate(lines, start=1):
        if (obj := _our_line(raw)) is None:
            raise TwiceError(f"{name}:{number}: not a line of ours, so {name} is not a twice batch output; "
                             "choose another --output file")
        state.done.add(str(obj["id"]))
        if (echo := echo_digest(obj)) is not None:
            state.echoes[str(obj["id"])] = (number, echo)
        if isinstance(model := obj.get("model"), str):
            state.models.setdefault(model, number)
        if isinstance(recorded := obj.get("settings"), dict):
            state.settings[str(obj["id"])] = (number, recorded)
    torn = data[keep:]
    if torn:
        # Our writer ends each line in the same write(): a complete JSON value without
        # its newline, or a first line that does not begin like ours, was not torn from us.
        tail = data[end:]
        if (tail and _is_json(tail) and _our_line(tail) is None) or (not lines and not _starts_like_ours(torn)):
            raise TwiceError(f"{name} is not a twice batch output (its last line is not one of ours); "
                             "choose another --output file")
        state.keep_bytes, state.dropped_bytes = keep, len(torn)
    return state


def echo_digest(obj: dict) -> bytes | None:
    """A digest of the prompt (or messages) a result line echoes; None for an error line,
    which echoes nothing."""
    if "prompt" in obj:
        echo = {"prompt": obj["prompt"]}
    elif "messages" in obj:
        echo = {"messages": obj["messages"]}
    else:
        return None
    text = json.dumps(echo, sort_keys=True, ensure_ascii=True)
    return hashlib.blake2b(text.encode("ascii"), digest_size=16).digest()


def check_resumed(state: OutputState, records, name: str, output: str) -> None:
    """Refuse to continue an output whose results answer other prompts than the input's
    under the same ids (another input's output, or an input edited since): --resume would
    skip those prompts and leave their lines answering something else."""
    for record in records:
        if (seen := state.echoes.get(record.key)) is None:
            continue
        echo = {"prompt": record.prompt} if record.messages is None else {"messages": record.messages}
        if echo_digest(echo) != seen[1]:
            raise PromptError(f"{output}:{seen[0]}: the result for id {show(record.id)} answers another "
                              f"{'prompt' if record.messages is None else 'conversation'} than {name}:{record.line}; "
                              "--resume continues the run of the same input (choose another --output file)")


def check_model(state: OutputState, model: str, output: str) -> None:
    """Refuse to continue an output whose results another model wrote: the file would mix
    two models' answers with nothing but a field per line to tell them apart. A name that
    is a path is compared as the folder or file it names (./m and m are one model)."""
    mine = model_key(model)
    for other, line in state.models.items():
        theirs = model_key(other)
        if theirs is not None and mine is not None and theirs != mine:
            raise PromptError(f"{output}:{line}: its results are from the model {show(other)}, this run "
                              f"loads {show(model)}; --resume continues the run of the same model "
                              "(choose another --output file)")


NUMERICS = ("dtype", "kv_dtype", "weights")  # core.engine.numerics' fields


def check_settings(state: OutputState, expected: dict[str, dict], output: str) -> None:
    """Refuse to continue an output whose results were drawn with other settings than this
    run would use for the same lines (another temperature, seed, stop, chat mode, ...): the
    file would mix two ways of answering with nothing but a field per line to tell them
    apart. `expected`: id -> the settings this run records for that line."""
    for key, (line, theirs) in state.settings.items():
        mine = expected.get(key)
        if mine is None:
            continue
        for name in sorted(set(theirs) | set(mine)):
            if name in NUMERICS and name not in theirs:
                continue  # a line written before twice recorded them: nothing to compare
            if theirs.get(name) != mine.get(name):
                raise PromptError(f"{output}:{line}: its result was generated with {name} {show(theirs.get(name))}, "
                                  f"this run gives {show(mine.get(name))}; --resume continues a run with the same "
                                  "settings (give the same options, or choose another --output file)")


def model_key(name: str) -> str | None:
    """What a model name stands for: a path's real location, else the name (a Hub id, a
    packaged name); None for a path that is not there from here (it cannot be compared)."""
    from twice.core.paths import user_path

    try:
        path = user_path(name)
    except TwiceError:
        return None
    if path.exists():
        return str(path.resolve())
    return None if name.startswith(("/", "./", "../", "~")) else name


def _our_line(raw: bytes) -> dict | None:
    try:
        obj = loads(raw)  # bounded (core/fields.py): deep nesting is refused, never a RecursionError
    except ValueError:  # also UnicodeDecodeError and fields.JSONLimitError
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("finish_reason"), str):
        return None
    if not isinstance(obj.get("settings", {}), dict) or not isinstance(obj.get("model", ""), str):
        return None  # ours record them as an object and a name (or not at all, before twice did)
    value = obj.get("id")
    return obj if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _is_json(raw: bytes) -> bool:
    try:
        loads(raw)
        return True
    except JSONLimitError:  # JSON beyond our bounds (deep, huge numbers) is still JSON: not a torn write
        return True
    except ValueError:
        return False


def _starts_like_ours(tail: bytes) -> bool:
    return tail.startswith(OUR_PREFIX) or OUR_PREFIX.startswith(tail)


def precheck_output(output: str) -> Path:
    """What can be refused about an output file without reading it: its folder must
    exist, and it must not be a symbolic link or a folder. The output is never reached
    through a symbolic link: in a shared folder, a link put where our output will be could
    otherwise point the results (or --resume's truncation of a torn line) at someone
    else's file."""
    path = Path(output)
    if not path.parent.is_dir():
        raise PromptError(f"{output}: the folder {str(path.parent)!r} does not exist")
    if path.is_symlink():
        raise PromptError(f"{output} is a symbolic link; give the file itself (twice never writes through a link)")
    if path.is_dir():
        raise PromptError(f"{output} is a folder; --output takes a file name")
    return path


def hold_output(path: Path, locks: contextlib.ExitStack) -> None:
    """Take the one lock for writing `path` (an output, a part file) until `locks` closes;
    another run holding it is one line, and nothing of the file is read or touched. Taken
    before reading what is done, so two --resume runs never both take the same ids."""
    from twice.weights.safe_write import exclusive_lock

    locks.enter_context(exclusive_lock(path, what="this output", error=PromptError))


def check_output(output: str | None, resume: bool) -> tuple[Path | None, OutputState]:
    """Refuse anything that could clobber a file or fail only after the work is done; with
    --resume, read what an earlier run left (hold the output's lock first: hold_output)."""
    if output in (None, "-"):
        if resume:
            raise PromptError("--resume needs --output FILE.jsonl (there is nothing to resume on standard output)")
        return None, OutputState()
    path = precheck_output(output)
    if not path.exists():
        return path, OutputState()
    if not resume:
        raise PromptError(f"{output} already exists; pass --resume to continue it, or choose another --output file")
    data, st = read_ours(path)
    state = scan_output(data, output)
    state.identity = (st.st_dev, st.st_ino, len(data), st.st_mtime_ns)
    return path, state


def read_ours(path: Path) -> tuple[bytes, os.stat_result]:
    """The bytes of an earlier output (or part file), never through a link and never from
    anything but a regular file (a FIFO must not block us)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PromptError(f"{path} is a symbolic link; give the file itself "
                              "(twice never writes through a link)") from None
        raise TwiceError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PromptError(f"{path} is not a regular file; --resume continues a file that twice wrote")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError as e:
        raise TwiceError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return data, st


def our_lines(data: bytes, name: str) -> list[tuple[str, bytes]]:
    """(id, line) for every whole line of an earlier output, as scan_output checks it (a
    file that is not ours refused, a torn last line dropped)."""
    state = scan_output(data, name)
    kept = data if state.keep_bytes is None else data[:state.keep_bytes]
    return [(str(json.loads(raw)["id"]), raw) for raw in kept.split(b"\n")[:-1]]


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Writer:
    """One JSON line per result, each with a single write() of the whole line.

    A new file is created with O_EXCL (never an existing file, never through a link), 0666
    less the umask (as a merged data-parallel output gets it); an existing one (--resume)
    is opened with O_NOFOLLOW and must still be the very file
    --resume read. A line that cannot be written whole (disk full, file size limit) is cut
    back off, so the file never ends in a torn line of this run."""

    def __init__(self, path: Path | None, state: OutputState, model: str | None = None):
        self.path, self.fd, self.model = path, None, model  # model: named on every result line
        if path is None:
            return
        flags = os.O_WRONLY | os.O_APPEND | _NOFOLLOW
        if not state.existing:
            flags |= os.O_CREAT | os.O_EXCL  # if someone created it since we looked: refuse, never clobber
        try:
            self.fd = os.open(path, flags, 0o666)  # less the umask, as open() and write_atomic give
            if state.identity is not None:
                st = os.fstat(self.fd)
                if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != state.identity:
                    raise PromptError(f"{path} changed while twice was starting; run again")
            if state.keep_bytes is not None:
                os.ftruncate(self.fd, state.keep_bytes)
                os.fsync(self.fd)
            elif not state.existing:
                sync_folder(path.parent)  # so that a crash cannot lose the new file's name
        except FileExistsError:
            raise PromptError(f"{path} appeared while twice was starting; pass --resume or choose another file") from None
        except OSError as e:
            self.close()
            if e.errno == errno.ELOOP:
                raise PromptError(f"{path} is a symbolic link; give the file itself "
                                  "(twice never writes through a link)") from None
            raise TwiceError(f"cannot write {path}: {e.strerror or e}") from None
        except BaseException:
            self.close()
            raise

    def write(self, obj: dict) -> None:
        if self.model is not None and "completion" in obj:
            obj = {**obj, "model": self.model}
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        if self.fd is None:
            try:
                _write_stdout(data)
            except BrokenPipeError:
                raise
            except OSError as e:
                raise TwiceError(f"cannot write standard output: {e.strerror or e}") from None
            return
        start = None
        try:
            start = os.fstat(self.fd).st_size
            while data:  # a regular file takes the whole line at once; loop only for safety
                data = data[os.write(self.fd, data):]
            os.fsync(self.fd)
        except OSError as e:
            if start is not None:
                try:
                    os.ftruncate(self.fd, start)  # take back the part of the line that made it
                except OSError:
                    pass
            raise TwiceError(f"cannot write {self.path}: {e.strerror or e}") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class NullWriter:
    """Where a tensor-parallel rank other than 0 writes: nowhere (rank 0 writes every line)."""

    def write(self, obj: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _write_stdout(data: bytes) -> None:
    out = sys.stdout
    buffer = getattr(out, "buffer", None)
    if buffer is None:  # a replaced text stream
        out.write(data.decode("utf-8"))
    else:  # bytes: JSON lines are UTF-8 whatever the locale says
        out.flush()
        buffer.write(data)
        buffer.flush()
    out.flush()


