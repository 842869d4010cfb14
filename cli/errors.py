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

Ctrl-C ends a run with 130 wherever it lands, also inside an import (see _guarded_import)
or where Python can only drop the KeyboardInterrupt (see _unraisable_interrupt). Every
message printed from here goes through `printable`: text from files (a tensor name, a
template's error) never reaches the terminal with its control characters.
"""

from __future__ import annotations

import _thread
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


# What must never reach a terminal raw from a file's contents (a tensor name, a template's
# raise_exception text, a folder name): C0 controls (ESC starts every escape sequence; BEL,
# BS and CR rewrite what is shown), DEL, C1 controls (U+009B is a one-character CSI), the
# bidirectional overrides and isolates that reorder what is shown, the line and paragraph
# separators, and lone surrogates (undecodable bytes of a file name).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                          "\ud800-\udfff]")


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every control character shown as an escape (ESC as \\x1b, U+202E as
    \\u202e): the one place that makes text from files safe to print. fail() and notice()
    apply it; so does every message the CLI prints that may quote a file."""
    return _UNPRINTABLE.sub(_escaped, str(text))


def fail(message: str, code: int = 2) -> None:
    """Print `twice: error: ...` on stderr (made printable) and exit."""
    _settle_stdout()
    _write_stderr(f"twice: error: {printable(message)}\n")
    raise _ending(code)


def _ending(code: int) -> SystemExit:
    """The SystemExit of an ending already reported on stderr: an enclosing run_guarded
    passes it on without a word."""
    ending = SystemExit(code)
    ending.reported = True
    return ending


def notice(message: str) -> None:
    """A one-line `note: ...` on stderr (made printable), for a command's own remarks
    before or outside its live readout."""
    from rich.text import Text

    from .console import err_console

    err_console().print(Text(f"note: {printable(message)}", style="yellow"), soft_wrap=True)


def run_guarded(fn: Callable[[], None]) -> None:
    try:
        fn()
        _flush_stdout()  # a reader that went away shows up here at the latest
    except TwiceError as e:
        if DEBUG["on"]:
            raise
        fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        _interrupted()
    except ImportError as e:
        # Ctrl-C inside an import can come back as an ImportError: a C extension whose
        # initialization the KeyboardInterrupt cut short refuses to be initialized again
        # (numpy: "cannot load module more than once per process") when the next import
        # of it comes. After a Ctrl-C, a failed import is the interrupt's doing.
        if not (_SIGINTS["count"] or _caused_by_interrupt(e)):
            raise
        _interrupted()
    except Terminated as e:
        _settle_stdout()
        _write_stderr(f"\ntwice: {_SIGNAL_WORDS.get(e.signum, 'stopped by a signal')}\n")
        raise _ending(128 + e.signum) from None
    except SystemExit as e:
        # Click (inside typer) turns a Ctrl-C while it parses the arguments (typer imports
        # pydantic there) into a silent exit: say it as for any other Ctrl-C.
        if not getattr(e, "reported", False) and _caused_by_interrupt(e):
            _interrupted()
        raise
    except BrokenPipeError:
        # The reader went away (`twice generate ... | head`): end quietly, as a tool killed
        # by SIGPIPE would.
        _discard_stdout()
        raise _ending(128 + signal.SIGPIPE) from None
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


def _interrupted() -> None:
    _ignore(signal.SIGINT)  # a second Ctrl-C while we say goodbye must not print a traceback
    _settle_stdout()
    _write_stderr("\ntwice: interrupted\n")
    raise _ending(128 + signal.SIGINT) from None


def _caused_by_interrupt(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


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


_SIGINTS = {"count": 0}  # Ctrl-Cs received while a command ran (see run_guarded's ImportError)


def _raise_interrupt(signum, frame) -> None:
    """signal.default_int_handler that also counts, and notes a Ctrl-C inside an import."""
    _SIGINTS["count"] += 1
    if _IMPORTS["depth"]:
        _IMPORTS["interrupted"] = True
    raise KeyboardInterrupt


# Ctrl-C inside an import does not always come out of it as a KeyboardInterrupt: C code
# that imports a module and clears the failure (torch's extension imports numpy so, and
# goes on without it) drops it, and a C extension whose initialization it cut short
# refuses to be initialized again (numpy: "cannot load module more than once per
# process"), an ImportError. While a command runs, every import statement goes through
# _guarded_import, which sees to it that an import during which Ctrl-C came ends in a
# KeyboardInterrupt: at the next import it starts, or at the end of the outermost one.
_IMPORTS: dict = {"depth": 0, "interrupted": False, "real": None, "thread": None}


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if _thread.get_ident() != _IMPORTS["thread"]:  # signals reach the main thread only
        return _IMPORTS["real"](name, globals, locals, fromlist, level)
    if _IMPORTS["interrupted"]:  # a Ctrl-C inside this import was swallowed: deliver it here
        raise KeyboardInterrupt
    _IMPORTS["depth"] += 1
    try:
        module = _IMPORTS["real"](name, globals, locals, fromlist, level)
    except KeyboardInterrupt:
        if _IMPORTS["depth"] == 1:
            _IMPORTS["interrupted"] = False  # it came out: nothing more to deliver
        raise
    except BaseException:
        if _IMPORTS["depth"] == 1 and _IMPORTS["interrupted"]:
            _IMPORTS["interrupted"] = False
            raise KeyboardInterrupt from None  # what the Ctrl-C turned into is no error of its own
        raise
    finally:
        _IMPORTS["depth"] -= 1
    if _IMPORTS["depth"] == 0 and _IMPORTS["interrupted"]:
        _IMPORTS["interrupted"] = False
        raise KeyboardInterrupt
    return module


def _unraisable_interrupt(previous):
    """A sys.unraisablehook that does not lose a Ctrl-C: a KeyboardInterrupt raised where
    Python can only report and drop exceptions (a weakref callback of the import system, a
    __del__, a garbage collection) is delivered again, so that it surfaces at the next
    point that can raise it, instead of a run that ignores the Ctrl-C (and prints
    "Exception ignored in ...")."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) or (
                isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, KeyboardInterrupt)):
            try:
                signal.raise_signal(signal.SIGINT)
            except (OSError, ValueError):
                pass
            return
        if isinstance(unraisable.exc_value, Terminated):  # the same for SIGTERM and SIGHUP
            try:
                signal.signal(unraisable.exc_value.signum, _raise_terminated)  # it set itself to be ignored
                signal.raise_signal(unraisable.exc_value.signum)
            except (OSError, ValueError):
                pass
            return
        previous(unraisable)

    return hook


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
        "SIGINT": _raise_interrupt,
        "SIGTERM": _raise_terminated,
        "SIGHUP": _raise_terminated,
        "SIGXFSZ": signal.SIG_IGN,
    }

    def __enter__(self):
        self.previous: dict[int, object] = {}
        _SIGINTS["count"] = 0
        self.unraisable = sys.unraisablehook
        sys.unraisablehook = _unraisable_interrupt(self.unraisable)
        self.real_import = None
        import builtins

        if builtins.__import__ is not _guarded_import and _main_thread():
            _IMPORTS.update(depth=0, interrupted=False, real=builtins.__import__, thread=_thread.get_ident())
            self.real_import = builtins.__import__
            builtins.__import__ = _guarded_import
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
        sys.unraisablehook = self.unraisable
        if self.real_import is not None:
            import builtins

            builtins.__import__ = self.real_import
            _IMPORTS.update(depth=0, interrupted=False, thread=None)  # "real" stays: a thread may be inside
        for signum, handler in self.previous.items():
            try:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            except (OSError, ValueError, TypeError):
                pass
        return False
