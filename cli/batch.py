"""`twice batch INPUT`: many prompts through the model in batches, one JSON line each.

The input is parsed whole before the model loads, so bad lines are reported (and, with
--strict, stop the run) before any work. Prompts are sorted by token length and cut into
batches so that rows of a batch need little left padding. Each result is written as one
complete line with a single write() (and fsync'ed to a file) the moment its row finishes:
a killed run loses only the prompts in flight, and `--resume` drops a torn last line,
skips the ids already written and appends the rest.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer

from twice.core.errors import PromptError, TwiceError

from . import options as o
from .app import app
from .console import COLOR, err_console
from .errors import Terminated
from .format import human_bytes, seconds

FORMATS = ("txt", "jsonl")
LINE_OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
KNOWN_KEYS = frozenset(("id", "prompt", "messages", *LINE_OPTIONS))
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
MEMORY_SHARE = 0.25  # of available memory, for the KV cache of one batch
FALLBACK_BATCH_SIZE = 8  # when available memory cannot be read
OUR_PREFIX = b'{"id": '  # every line we write starts so (json.dumps of a dict whose first key is id)


# -- input parsing (pure: text in, records and per-line errors out) ---------------------
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
        if not line.strip():
            continue
        try:
            record = parse(number, line)
        except _BadLine as e:
            errors.append(LineError(number, str(e)))
            continue
        if record.key in first_seen:
            errors.append(LineError(number, f"duplicate id {_show(record.id)} (first on line {first_seen[record.key]}); skipped"))
            continue
        first_seen[record.key] = number
        records.append(record)
    return records, errors


def _lines(text: str) -> list[str]:
    # Split on \n only: str.splitlines would also split on U+2028 and friends, which JSON
    # strings may hold raw, and line numbers would no longer match an editor's.
    if text.startswith("\ufeff"):  # a byte-order mark some editors write
        text = text[1:]
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _parse_txt(number: int, line: str) -> Record:
    return Record(number, str(number), prompt=_text(line, "the prompt"))


def _parse_jsonl(number: int, line: str) -> Record:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # huge integers, absurd nesting
        raise _BadLine(f"invalid JSON ({type(e).__name__})") from None
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
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _BadLine(f'"stop" must be a string or a list of strings, got {_kind(value)}')
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
        raise _BadLine(f'"{key}" must be {limit}, got {_show(value)}')
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
    try:
        value.encode("utf-8")  # JSON's \ud800 escapes decode to lone surrogates, which cannot be written back
    except UnicodeEncodeError:
        raise _BadLine(f"{what} holds an unpaired surrogate (an invalid \\uD800-\\uDFFF escape)") from None
    return value


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _show(value) -> str:
    shown = json.dumps(value, ensure_ascii=True)  # quoted, escaped: always one line
    return shown if len(shown) <= 60 else shown[:57] + "..."


# -- the output file and --resume -------------------------------------------------------
@dataclass
class OutputState:
    """What --resume found in an existing output: the ids already there, and where a
    damaged tail (a torn last write) starts, if there is one."""

    done: set[str] = field(default_factory=set)
    existing: bool = False  # the file is there and was read (--resume): append to it
    keep_bytes: int | None = None  # truncate the file to this length before appending
    dropped_bytes: int = 0
    identity: tuple | None = None  # (device, inode, size, mtime) of the file that was read


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


def _our_line(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("finish_reason"), str):
        return None
    value = obj.get("id")
    return obj if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
        return True
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False


def _starts_like_ours(tail: bytes) -> bool:
    return tail.startswith(OUR_PREFIX) or OUR_PREFIX.startswith(tail)


def check_output(output: str | None, resume: bool) -> tuple[Path | None, OutputState]:
    """Refuse anything that could clobber a file or fail only after the work is done.

    The output is never reached through a symbolic link: in a shared folder, a link put
    where our output will be could otherwise point the results (or --resume's truncation
    of a torn line) at someone else's file."""
    if output in (None, "-"):
        if resume:
            raise PromptError("--resume needs --output FILE.jsonl (there is nothing to resume on standard output)")
        return None, OutputState()
    path = Path(output)
    if not path.parent.is_dir():
        raise PromptError(f"{output}: the folder {str(path.parent)!r} does not exist")
    if path.is_symlink():
        raise PromptError(f"{output} is a symbolic link; give the file itself (twice never writes through a link)")
    if path.is_dir():
        raise PromptError(f"{output} is a folder; --output takes a file name")
    if not path.exists():
        return path, OutputState()
    if not resume:
        raise PromptError(f"{output} already exists; pass --resume to continue it, or choose another --output file")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block us
    except OSError as e:
        raise TwiceError(f"cannot read {output}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PromptError(f"{output} is not a regular file; --resume continues a file that twice wrote")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    except OSError as e:
        raise TwiceError(f"cannot read {output}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    state = scan_output(data, output)
    state.identity = (st.st_dev, st.st_ino, len(data), st.st_mtime_ns)
    return path, state


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Writer:
    """One JSON line per result, each with a single write() of the whole line.

    A new file is created with O_EXCL (never an existing file, never through a link); an
    existing one (--resume) is opened with O_NOFOLLOW and must still be the very file
    --resume read. A line that cannot be written whole (disk full, file size limit) is cut
    back off, so the file never ends in a torn line of this run."""

    def __init__(self, path: Path | None, state: OutputState):
        self.path, self.fd = path, None
        if path is None:
            return
        flags = os.O_WRONLY | os.O_APPEND | _NOFOLLOW
        if not state.existing:
            flags |= os.O_CREAT | os.O_EXCL  # if someone created it since we looked: refuse, never clobber
        try:
            self.fd = os.open(path, flags, 0o644)
            if state.identity is not None:
                st = os.fstat(self.fd)
                if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != state.identity:
                    raise PromptError(f"{path} changed while twice was starting; run again")
            if state.keep_bytes is not None:
                os.ftruncate(self.fd, state.keep_bytes)
                os.fsync(self.fd)
            elif not state.existing:
                _sync_folder(path.parent)  # so that a crash cannot lose the new file's name
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


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every system lets a folder be opened; the lines are still synced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


# -- planning: settings, tokens, batch size ---------------------------------------------
@dataclass
class Job:
    record: Record
    settings: object  # GenerationSettings
    ids: list[int]


def build_request(record: Record, use_chat: bool, system: str | None):
    from twice.core.engine import Request

    if record.messages is not None:  # messages always go through the chat template
        messages = record.messages
        if system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system}, *messages]
        return Request(messages=messages)
    if use_chat:
        return Request(messages=([{"role": "system", "content": system}] if system else [])
                       + [{"role": "user", "content": record.prompt}])
    return Request(text=record.prompt)


def line_settings(record: Record, base):
    """The run's settings with this line's own values in their place."""
    opts = record.options
    sampling = {k: opts[k] for k in ("temperature", "top_p", "top_k", "seed") if k in opts}
    changes = {}
    if sampling:
        changes["sampling"] = dataclasses.replace(base.sampling, **sampling)  # validates
    if "max_new_tokens" in opts:
        changes["max_new_tokens"] = opts["max_new_tokens"]
    if "stop" in opts:
        changes["stop"] = opts["stop"]
    return dataclasses.replace(base, **changes) if changes else base


def plan_jobs(records: list[Record], engine, base, use_chat: bool, system: str | None):
    """Settings and token ids for each record; a line that cannot be tokenized (its chat
    template fails, say) becomes a LineError like a malformed line."""
    jobs: list[Job] = []
    errors: list[LineError] = []
    for record in records:
        try:
            settings = line_settings(record, base)
            ids = engine.tokenize(build_request(record, use_chat, system))
        except TwiceError as e:
            errors.append(LineError(record.line, str(e)))
            continue
        jobs.append(Job(record, settings, ids))
    return jobs, errors


def make_batches(jobs: list[Job], size: int) -> list[list[Job]]:
    """Sort by prompt length (input order breaks ties) so a batch's rows need little padding."""
    ordered = sorted(jobs, key=lambda j: (len(j.ids), j.record.line))
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def auto_batch_size(tokens_per_row: int, bytes_per_token: int, available: int | None) -> int:
    """The largest of 1, 2, 4, ..., 64 whose KV cache (rows × tokens × bytes per token) fits
    in MEMORY_SHARE of the available memory."""
    if available is None:
        return FALLBACK_BATCH_SIZE
    budget = available * MEMORY_SHARE
    fitting = [b for b in BATCH_SIZES if b * tokens_per_row * bytes_per_token <= budget]
    return fitting[-1] if fitting else 1


def available_memory(device) -> int | None:
    """Bytes available for the KV cache on the device (a torch.device), or None when unknown."""
    if device.type != "cpu":
        from twice.core.device import free_memory_bytes

        return free_memory_bytes(device)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# -- running ----------------------------------------------------------------------------
@dataclass
class Stats:
    prompts: int = 0  # rows sent to the engine
    done: int = 0
    failed: int = 0
    batches: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    peak_memory: int = 0
    kv_per_token: int = 0
    kv_allocated: list[int] = field(default_factory=list)
    started: float = 0.0
    wall: float = 0.0
    oom_retries: int = 0  # batches cut in half because the device ran out of memory


def result_line(record: Record, result) -> dict:
    echo = {"prompt": record.prompt} if record.messages is None else {"messages": record.messages}
    return {
        "id": record.id,
        **echo,
        "completion": result.text,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "generated_tokens": result.generated_tokens,
        "timings": {
            "ttft_s": result.ttft_seconds,
            "prefill_s": result.prefill_seconds,
            "decode_s": result.decode_seconds,
            "decode_tokens_per_s": result.decode_tokens_per_second,
        },
    }


def error_line(record: Record, message: str) -> dict:
    return {"id": record.id, "error": message, "finish_reason": "error"}


def run_batches(engine, batches: list[list[Job]], writer: Writer, stats: Stats, progress, say) -> int:
    """Run the batches in order, writing each result as its row finishes. When the device
    runs out of memory mid-batch, the rows that finished are kept and the others are run
    again in batches half the size (and every later batch at that size too); only a single
    prompt that does not fit by itself stops the run. Returns the batch size in use at the
    end."""
    from twice.core.engine import Done, Failed, Notice, PrefillStart, Request, TokenEvent
    from twice.core.errors import DeviceError

    stats.started = time.perf_counter()
    pending = [job for batch in batches for job in batch]
    size = max((len(batch) for batch in batches), default=1)
    while pending:
        batch, pending = pending[:size], pending[size:]
        stats.batches += 1
        stats.prompts += len(batch)
        finished: set[int] = set()
        tokens = [0] * len(batch)
        # Pass token ids: each prompt was tokenized once already, to sort by length.
        events = engine.generate_batch([Request(ids=j.ids) for j in batch], [j.settings for j in batch])
        try:
            for event in events:
                if isinstance(event, TokenEvent):
                    stats.generated_tokens += 1
                    tokens[event.row] += 1
                    progress.tick(stats)
                elif isinstance(event, Done):
                    _record_done(batch[event.row].record, event.result, writer, stats)
                    finished.add(event.row)
                    progress.advance(stats)
                elif isinstance(event, Failed):
                    writer.write(error_line(batch[event.row].record, event.message))
                    stats.failed += 1
                    finished.add(event.row)
                    progress.advance(stats)
                elif isinstance(event, PrefillStart):
                    stats.kv_per_token = event.cache.bytes_per_token
                    stats.kv_allocated.append(event.cache.bytes_allocated)
                elif isinstance(event, Notice):
                    where = f"id {_show(batch[event.row].record.id)}: " if event.row is not None else ""
                    say(f"note: {where}{event.message}")
        except DeviceError as e:
            if "out of memory" not in str(e):
                raise
            left = [i for i in range(len(batch)) if i not in finished]
            if len(batch) == 1:
                raise DeviceError(f"{e} (even one prompt at a time: id {_show(batch[0].record.id)})") from None
            size = max(1, len(batch) // 2)
            stats.oom_retries += 1
            stats.prompts -= len(left)
            stats.generated_tokens -= sum(tokens[i] for i in left)
            say(f"note: out of memory with {len(batch)} prompts in a batch; running the "
                f"{_count(len(left), 'unfinished prompt')} again, {size} at a time")
            pending = [batch[i] for i in left] + pending
        finally:
            events.close()
    stats.wall = time.perf_counter() - stats.started
    return size


def _record_done(record: Record, result, writer: Writer, stats: Stats) -> None:
    writer.write(result_line(record, result))
    stats.done += 1
    stats.prompt_tokens += result.prompt_tokens
    stats.ttfts.append(result.ttft_seconds)
    stats.peak_memory = max(stats.peak_memory, result.peak_memory_bytes)


class ProgressBar:
    """A transient rich progress bar on stderr (prompts done, aggregate tokens/s, ETA), or nothing."""

    REFRESH_SECONDS = 0.25

    def __init__(self, total: int, enabled: bool):
        self.bar = self.task = None
        self._last = 0.0
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                            TextColumn("ETA"), TimeRemainingColumn(), console=err_console(), transient=True,
                            redirect_stdout=False, redirect_stderr=False)
        self.task = self.bar.add_task("batch", total=total, rate="")

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def tick(self, stats: Stats) -> None:
        now = time.perf_counter()
        if self.bar is not None and now - self._last >= self.REFRESH_SECONDS:
            self._last = now
            self.bar.update(self.task, rate=_rate_text(stats, now))

    def advance(self, stats: Stats) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, rate=_rate_text(stats, time.perf_counter()))


def _rate_text(stats: Stats, now: float) -> str:
    elapsed = now - stats.started
    return f"{stats.generated_tokens / elapsed:,.1f} tok/s" if elapsed > 0 else ""


def summary_table(stats: Stats, batch_size: int, why: str, loaded):
    """--timing: totals over the run, each with the definition it was measured by."""
    from rich.table import Table

    t = Table(title="twice batch timing report", header_style="bold", title_justify="left")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("definition", style="dim")
    rate = stats.generated_tokens / stats.wall if stats.wall > 0 else 0.0
    mean_ttft = sum(stats.ttfts) / len(stats.ttfts) if stats.ttfts else 0.0
    rows = [
        ("load", seconds(loaded.load_seconds), "read config, weights and tokenizer"),
        ("prompts", f"{stats.done} done, {stats.failed} failed", "rows sent to the engine in this run"),
        ("batches", str(stats.batches), "generate_batch calls (prompts sorted by token length)"),
        ("batch size", str(batch_size), f"most rows per batch; {why}"),
        ("prompt tokens", f"{stats.prompt_tokens:,}", "sum over finished prompts"),
        ("generated tokens", f"{stats.generated_tokens:,}", "sum over all rows"),
        ("wall time", seconds(stats.wall), "first batch start → last batch end (prefill + decode, all batches)"),
        ("aggregate tokens/s", f"{rate:,.1f}", "generated tokens ÷ wall time"),
        ("mean TTFT", seconds(mean_ttft), "mean over prompts of: its batch's start → its first token's text"),
        ("peak memory", human_bytes(stats.peak_memory), "peak process RSS on cpu, torch.cuda.max_memory_allocated on cuda"),
        ("KV per token", human_bytes(stats.kv_per_token), "2 · layers · kv heads · head dim · bytes, one row"),
        ("KV per batch", human_bytes(max(stats.kv_allocated, default=0)),
         "largest cache allocated for one batch: rows × (longest prompt + max new tokens − 1) × per token"),
    ]
    for row in rows:
        t.add_row(*row)
    return t


@dataclass
class Plan:
    """What the command decided before the model loaded."""

    name: str  # the input, as messages name it
    todo: list[Record]
    errors: list[LineError]
    state: OutputState
    out_path: Path | None
    already: int  # prompts skipped because --resume found them in the output
    strict: bool
    batch_size: int | None
    timing: bool
    system: str | None
    use_chat: bool = False


# -- the command ------------------------------------------------------------------------
BATCH_SIZE_HELP = (
    "Prompts per batch. Default: the largest of 1, 2, 4, ..., 64 whose KV cache for "
    "(longest prompt + max new tokens) tokens per row fits in 25% of the available memory "
    "(MemAvailable on cpu, after the weights are loaded); 8 when that cannot be read."
)


BATCH_HELP = "\n\n".join(" ".join(p.split()) for p in """
Generate for every prompt in INPUT, in batches, writing one JSON line per prompt.

A .jsonl line is an object with "id" (a string or an integer) and "prompt" (a string) or
"messages" (a list of role/content objects, always rendered with the chat template);
optional per-line "max_new_tokens", "temperature", "top_p", "top_k", "seed" and "stop"
replace the command-line values for that line; other keys are ignored. In a .txt file
each non-blank line is a prompt whose id is its line number.

Each output line holds id, prompt (or messages), completion, finish_reason,
prompt_tokens, generated_tokens and timings; a prompt the engine cannot serve gets a
line with id, error and finish_reason "error". Lines are written (and synced to disk) as
prompts finish, so they come out in completion order: match them by id.

Bad input lines (invalid JSON, missing or mistyped fields, a repeated id; ids compare
as text, so 7 and "7" are the same) are reported as INPUT:LINE on stderr and skipped.
Exit status 0 when at least one prompt ran, 2 when none could.
""".strip().split("\n\n"))


@app.command(help=BATCH_HELP)
def batch(
    input: str = typer.Argument(..., help="A .txt file (one prompt per line), a .jsonl file, or '-' for standard input."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write the JSON lines to FILE.jsonl (default: standard output). An existing file is never overwritten."),
    resume: bool = typer.Option(False, "--resume", help="Continue an earlier --output file: drop a torn last line, skip the ids already in it, append the rest."),
    strict: bool = typer.Option(False, "--strict", help="Any bad input line stops the run before any work (all bad lines listed)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", help=BATCH_SIZE_HELP),
    input_format: Optional[str] = typer.Option(None, "--format", help="txt or jsonl. Default: from the extension; otherwise (and for '-') jsonl when the first non-blank line starts with '{'."),
    model: o.Model = None,
    revision: o.Revision = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    max_new_tokens: o.MaxNew = 256,
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    repetition_penalty: o.RepPenalty = None,
    seed: o.Seed = None,
    stop: o.Stop = None,
    system: o.System = None,
    chat: o.Chat = None,
    prefill_chunk: o.PrefillChunk = None,
    timing: o.Timing = False,
    no_color: o.NoColor = False,
):
    from twice.weights.load import load

    if no_color:
        COLOR["on"] = False
    if batch_size is not None and batch_size < 1:
        raise PromptError(f"--batch-size must be at least 1, got {batch_size}")
    if input_format is not None and input_format not in FORMATS:
        raise PromptError(f"--format must be txt or jsonl, got {input_format!r}")
    out_path, state = check_output(output, resume)
    name, text, fmt = read_input(input, input_format)
    records, errors = parse_input(text, fmt)
    _report_lines(name, errors, records)
    if strict and errors:
        raise PromptError(f"{_count(len(errors), 'bad line')} in {name}; nothing was run (--strict)")
    todo = [r for r in records if r.key not in state.done]
    if not records and not errors:
        raise PromptError(f"{name} holds no prompts")
    if records and not todo:
        _say(f"nothing to do: all {_count(len(records), 'prompt')} of {name} are already in {output}")
        return
    if not todo:
        raise PromptError(f"no prompt could run: all {_count(len(errors), 'line')} of {name} are bad")

    plan = Plan(name, todo, errors, state, out_path, already=len(records) - len(todo), strict=strict,
                batch_size=batch_size, timing=timing, system=system)
    loaded = _load(load, model, revision, device, dtype)
    plan.use_chat = loaded.tokenizer.chat_template is not None if chat is None else chat
    base = _base_settings(loaded, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop,
                          prefill_chunk)
    _run(loaded, plan, base)


def _run(loaded, plan: Plan, base) -> None:
    from twice.core.engine import Engine

    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids)
    jobs, token_errors = plan_jobs(plan.todo, engine, base, plan.use_chat, plan.system)
    _report_lines(plan.name, token_errors, [])
    errors = plan.errors + token_errors
    if plan.strict and token_errors:
        raise PromptError(f"{_count(len(token_errors), 'prompt')} of {plan.name} cannot be tokenized; "
                          "nothing was run (--strict)")
    if not jobs:
        raise PromptError(f"no prompt could run: all {_count(len(errors), 'line')} of {plan.name} are bad")
    size, why = (plan.batch_size, "--batch-size") if plan.batch_size else _auto_size(engine, jobs, loaded.device)
    if plan.state.keep_bytes is not None:
        _say(f"note: {plan.out_path}: dropped an incomplete last line ({_count(plan.state.dropped_bytes, 'byte')}) "
             "left by an interrupted run")
    stats = Stats()
    writer = Writer(plan.out_path, plan.state)
    used = size
    try:
        show_bar = _isatty(sys.stderr) and (plan.out_path is not None or not _isatty(sys.stdout))
        with ProgressBar(len(jobs), show_bar) as progress:
            used = run_batches(engine, make_batches(jobs, size), writer, stats, progress, _say)
    except (KeyboardInterrupt, Terminated, TwiceError):
        # Said whatever was counted: a signal can land between a line's write and its count.
        if plan.out_path is not None:
            _say(f"note: the results so far are in {plan.out_path}; the same command with --resume "
                 "continues from there")
        raise
    finally:
        writer.close()
    if plan.timing:
        if stats.oom_retries:
            why = f"{why}; cut to {used} after running out of memory"
        err_console().print(summary_table(stats, min(size, len(jobs)), why, loaded))
    _finish(stats, len(errors), plan.already)


def _finish(stats: Stats, bad_lines: int, already: int) -> None:
    parts = [f"{_count(stats.done, 'prompt')} done", f"{bad_lines} skipped (bad lines)"]
    if stats.failed:
        parts.insert(1, f"{stats.failed} failed (error lines in the output)")
    if already:
        parts.append(f"{already} already in the output")
    _say(", ".join(parts))
    if not stats.done:
        raise PromptError("no prompt could be served (see the error lines)")


def _base_settings(loaded, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop,
                   prefill_chunk):
    from twice.core.engine import GenerationSettings

    sampling = o.sampling_params(loaded.generation.sampling, temperature, top_k, top_p, min_p, repetition_penalty, seed)
    return GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop or ()),
                              prefill_chunk=prefill_chunk)


def _auto_size(engine, jobs: list[Job], device) -> tuple[int, str]:
    """The batch size from memory, and how it was chosen (for --timing)."""
    longest = max(len(j.ids) for j in jobs)
    most_new = max(j.settings.max_new_tokens for j in jobs)
    tokens = min(longest + most_new, engine.context_length)  # the engine clamps to the context
    available = available_memory(device)
    size = auto_batch_size(tokens, engine.cache_stats().bytes_per_token, available)
    if available is None:
        return size, f"available memory on {device.type} unknown: the fallback"
    return size, (f"largest power of 2 ≤ 64 with rows × {tokens} tokens × KV per token ≤ "
                  f"{MEMORY_SHARE:.0%} of {human_bytes(available)} available")


def _load(load, model, revision, device, dtype):
    err = err_console()
    if not _isatty(sys.stderr):
        return load(model, revision, device, dtype)
    with err.status("loading the model") as status:
        return load(model, revision, device, dtype, progress=lambda msg: status.update(f"loading: {msg}"))


def _report_lines(name: str, errors: list[LineError], records: list[Record]) -> None:
    for e in errors:
        _say(f"{name}:{e.line}: {e.message}")
    unused: dict[str, int] = {}
    for r in records:
        for key in r.unknown_keys:
            unused.setdefault(key, r.line)
    for key, line in unused.items():  # once per key, not per line: a typo shows up without flooding
        _say(f"note: {name}:{line}: key {_show(key)} is not used (known: {', '.join(sorted(KNOWN_KEYS))})")


def _say(message: str) -> None:
    # markup off: messages quote user text, whose brackets are not rich markup.
    err_console().print(message, markup=False, highlight=False, soft_wrap=True)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
