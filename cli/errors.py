"""One place that turns failures into one-line messages and exit codes.

Exit codes: 0 done, 1 unexpected internal error, 2 bad input or environment (TwiceError;
an output that cannot be written: disk full, file too large), 3 device problem (no GPU,
out of memory), and 128 + the signal for an ending the user or the system asked for:
130 interrupted (Ctrl-C), 129 hangup, 143 terminated (SIGTERM), 141 standard output
closed by its reader (`twice generate ... | head`). `--debug` (or TWICE_DEBUG=1) shows
the traceback of an error instead of its line.

Whatever way a run ends, standard output is flushed first (a partial reply is not lost)
or, when it can no longer be written, pointed at /dev/null, so that the interpreter's
own final flush adds no "Exception ignored" noise.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
from collections.abc import Callable

from twice.core.errors import TwiceError

DEBUG = {"on": bool(os.environ.get("TWICE_DEBUG"))}

# Errors writing an output that are the environment's doing, not a bug.
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.ENXIO})
_SIGNAL_WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hangup"}


class Terminated(SystemExit):
    """Raised (from the signal handler main() installs) when SIGTERM or SIGHUP arrives, so
    that the stack unwinds like for Ctrl-C: the live readout and prompt-toolkit restore
    the terminal, batch closes its output, and nothing prints a traceback. A SystemExit
    (with code 128 + the signal), so that no `except Exception` (nor chat's `except
    KeyboardInterrupt`) swallows it, asyncio re-raises it out of prompt-toolkit's event
    loop instead of handing it to the loop's exception handler, and even where nothing
    catches it the process ends quietly with the right status."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def fail(message: str, code: int = 2) -> None:
    """Print `twice: error: ...` on stderr and exit."""
    _settle_stdout()
    _write_stderr(f"twice: error: {message}\n")
    raise SystemExit(code)


def run_guarded(fn: Callable[[], None]) -> None:
    try:
        fn()
        _flush_stdout()  # a reader that went away shows up here at the latest
    except TwiceError as e:
        if DEBUG["on"]:
            raise
        fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        _ignore(signal.SIGINT)  # a second Ctrl-C while we say goodbye must not print a traceback
        _settle_stdout()
        _write_stderr("\ntwice: interrupted\n")
        raise SystemExit(128 + signal.SIGINT) from None
    except Terminated as e:
        _settle_stdout()
        _write_stderr(f"\ntwice: {_SIGNAL_WORDS.get(e.signum, 'stopped by a signal')}\n")
        raise SystemExit(128 + e.signum) from None
    except BrokenPipeError:
        # The reader went away (`twice generate ... | head`): end quietly, as a tool killed
        # by SIGPIPE would.
        _discard_stdout()
        raise SystemExit(128 + signal.SIGPIPE) from None
    except OSError as e:
        if DEBUG["on"] or e.errno not in _OUTPUT_ERRNOS:
            raise
        # Without a file name it was a write to standard output (everything else names its file).
        fail(f"{e.filename}: {e.strerror or e}" if e.filename else f"cannot write the output: {e.strerror or e}", 2)
    except MemoryError:
        if DEBUG["on"]:
            raise
        fail("out of memory; try a smaller model, --dtype bfloat16, or fewer tokens", 3)
    except RuntimeError as e:  # torch's allocators raise RuntimeError subclasses, not MemoryError
        if DEBUG["on"] or not _is_out_of_memory(e):
            raise
        fail(f"out of memory{_allocation(e)}; try a smaller model, --dtype bfloat16, or fewer tokens", 3)


def _is_out_of_memory(e: RuntimeError) -> bool:
    text = str(e)
    return type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text or "out of memory" in text


def _allocation(e: RuntimeError) -> str:
    match = re.search(r"allocate (\d+) bytes", str(e))
    if not match:
        return ""
    size = float(match[1])
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f" (an allocation of {size:.0f} {unit})" if unit == "bytes" else f" (an allocation of {size:.1f} {unit})"
        size /= 1024
    return ""


# -- standard streams --------------------------------------------------------------------
def _flush_stdout() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()


def _settle_stdout() -> None:
    """Flush what was written so far; if standard output cannot take it, drop it."""
    try:
        _flush_stdout()
    except (OSError, ValueError):
        _discard_stdout()


def _discard_stdout() -> None:
    """Point fd 1 at /dev/null, so that buffered text and the interpreter's final flush
    go nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
        finally:
            os.close(devnull)
    except OSError:
        return
    try:
        _flush_stdout()
    except (OSError, ValueError):
        pass


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed too: nothing more to say
        pass


# -- signals -----------------------------------------------------------------------------
def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _ignore(signum: int) -> None:
    if _main_thread():
        try:
            signal.signal(signum, signal.SIG_IGN)
        except (OSError, ValueError):
            pass


def _raise_terminated(signum, frame) -> None:
    # Once: a second SIGTERM during the unwinding must not interrupt the cleanup.
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


class signals_installed:
    """While a command runs: SIGTERM and SIGHUP unwind the stack (Terminated), Ctrl-C
    raises KeyboardInterrupt, and SIGXFSZ is ignored so that a file-size limit
    (RLIMIT_FSIZE) becomes a write error we can report instead of a core dump. A signal
    the parent set to be ignored (nohup, a background job) stays ignored. Everything is
    put back on exit, so running the CLI inside another program (the tests) leaves it as
    it was."""

    WANTED = {
        "SIGINT": signal.default_int_handler,
        "SIGTERM": _raise_terminated,
        "SIGHUP": _raise_terminated,
        "SIGXFSZ": signal.SIG_IGN,
    }

    def __enter__(self):
        self.previous: dict[int, object] = {}
        if not _main_thread():
            return self
        for name, handler in self.WANTED.items():
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                current = signal.getsignal(signum)
                if current == signal.SIG_IGN and name != "SIGXFSZ":
                    continue
                self.previous[signum] = current
                signal.signal(signum, handler)
            except (OSError, ValueError):
                pass
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            try:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            except (OSError, ValueError, TypeError):
                pass
        return False
