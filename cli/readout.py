"""The live readout: streamed text with a status line under it.

On a terminal the text streams to stdout and one status line (phase, prompt tokens, TTFT,
prefill and decode speed, tokens generated, KV cache, share of the context) is drawn
under it with rich Live. Drawing happens at most every REFRESH_SECONDS (plus once at each
change of phase), never per token, so that it never costs decode speed; the region is
transient, so at the end it is erased and scrollback keeps only the text. Completed lines
are printed above the live region at draw time; the line being written sits inside it
until its newline arrives.

stdout not a terminal: stdout gets the text alone, written as it comes; the status line
goes to stderr if that is a terminal (and is erased there at the end), else nowhere.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .console import make_console
from .format import human_bytes, short_bytes

REFRESH_SECONDS = 0.25  # at most 4 redraws a second while tokens stream
RATE_WINDOW = 32  # tokens in the rolling decode rate
# How the status line gives way in a narrow terminal, step by step until it fits: first
# the compact forms, then the least important fields dropped (the phase is never dropped).
# Worst case measured (12,345-token prompt, 12,000 reused, 1,234 generated, 119 MiB of KV):
# everything at 191 columns; at 120 (118 used) all but the reused count, the per-token KV bytes
# and the dtype, compact; at 100 also without the prefill rate and the allocated KV; at 80 the
# phase, TTFT, tok/s, tokens generated, KV in use and the share of the context.
STATUS_STEPS = (
    ("speculation", "short"), ("dtype", "short"), ("kv", "short"), ("per_token", "short"), ("context", "short"), ("ttft", "short"),
    ("prompt", "short"), ("prefill", "short"), ("detail", "drop"), ("per_token", "drop"), ("dtype", "drop"),
    ("prompt", "short"), ("rate", "short"), ("kv", "short"), ("prefill", "drop"), ("prompt", "drop"),
    ("kv", "drop"), ("speculation", "drop"), ("context", "drop"), ("ttft", "drop"), ("rate", "drop"), ("generated", "drop"),
)


class Readout:
    def __init__(self, show_text: bool = True, live: bool | None = None, stream=None, no_color: bool = False):
        self.stream = stream or sys.stdout
        self.show_text = show_text
        self.no_color = no_color  # also NO_COLOR and --no-color everywhere: see console.make_console
        out_tty = _isatty(self.stream)
        err_tty = _isatty(sys.stderr)
        # live=None: automatic (a status line wherever there is a terminal); False: none.
        want_live = (out_tty or err_tty) if live is None else bool(live)
        self.live_on_stdout = want_live and show_text and out_tty
        self.console: Console | None = None
        if want_live and (self.live_on_stdout or err_tty):
            self.console = make_console(self.no_color, file=self.stream if self.live_on_stdout else sys.stderr,
                                        emoji=False, markup=False)
        self.live: Live | None = None
        self.partial = ""  # text not yet shown (live on stdout): completed lines, then the open line
        self.phase = "loading"
        self.detail = ""
        self.prompt_tokens = self.reused = 0
        self.ttft = self.prefill_tps = None
        self.generated = 0
        self.cache = None
        self.speculation = None  # speculative.SpeculationStats while speculating (live counts)
        self.context_length = 0
        self.dtype: tuple[str, ...] = ()  # forms of "cpu bfloat16 (why)", shown last (set_model)
        self._recent: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)  # (time, tokens) for a rolling rate
        self._last_draw = 0.0
        self.draws = 0  # how many times the status was drawn (tests check it stays small)

    @property
    def active(self) -> bool:
        """Whether a status line is being drawn."""
        return self.live is not None

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> "Readout":
        if self.console is not None:
            self.live = Live(_Dynamic(self), console=self.console, transient=True, auto_refresh=False,
                             redirect_stdout=False, redirect_stderr=False)
            with signals_held():
                self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.live is not None:
            with signals_held():
                self._flush_lines()
                live, self.live = self.live, None
                live.stop()  # erases the status line (transient)
        if self.partial:
            self.stream.write(self.partial)
            self.partial = ""
        self.stream.flush()

    # -- updates -----------------------------------------------------------------------
    def set_phase(self, phase: str, detail: str = "") -> None:
        self.phase, self.detail = phase, detail
        self._draw(force=True)

    def set_model(self, where: str, short: str = "") -> None:
        """Where the model runs, in what and why ("cpu bfloat16 (auto: this CPU has AVX-512
        BF16)"; `short`: "cpu bfloat16"), shown at the end of the status line while it fits."""
        self.dtype = (where, short) if short and short != where else (where,)

    def note(self, message: str, style: str = "yellow") -> None:
        """A one-line message on stderr that does not disturb the status line."""
        from .errors import printable  # notes may quote files' contents: never raw escapes

        line = Text("note: ", style=style) + Text(printable(message))
        if self.live is not None and (not self.live_on_stdout or _isatty(sys.stderr)):
            # Above the live region, on the terminal it is drawn on (writing to the same
            # terminal through another stream would tear the region).
            with signals_held():
                self._flush_lines()
                self.live.console.print(line, soft_wrap=True)
            return
        make_console(self.no_color, stderr=True).print(line, soft_wrap=True)

    def on_event(self, event) -> None:
        kind = type(event).__name__
        if kind == "TokenEvent":
            self.cache = event.cache
            self.speculation = getattr(event, "speculation", None)
            self.generated += 1
            self._recent.append((time.perf_counter(), self.generated))
            if self.show_text and event.text:
                self.write(event.text)
            if event.index == 0:
                self.ttft = event.elapsed
                new = self.prompt_tokens - self.reused
                self.prefill_tps = new / event.step_seconds if event.step_seconds > 0 else None
                self.set_phase("decode")
            else:
                self._draw()
        elif kind == "PrefillStart":
            self.prompt_tokens, self.reused = event.prompt_tokens, event.reused_tokens
            self.cache, self.context_length = event.cache, event.cache.context_length
            self.generated = 0
            self.ttft = self.prefill_tps = None
            self._recent.clear()
            detail = f"{event.new_tokens} new tokens" if event.reused_tokens else ""
            self.set_phase("prefill", detail)

    def write(self, text: str) -> None:
        if self.live is None or not self.live_on_stdout:
            self.stream.write(text)
            self.stream.flush()
            return
        self.partial += text  # shown at the next draw (at most REFRESH_SECONDS away)

    # -- drawing -----------------------------------------------------------------------
    def _draw(self, force: bool = False) -> None:
        if self.live is None:
            return
        now = time.perf_counter()
        if force or now - self._last_draw >= REFRESH_SECONDS:
            self._last_draw = now
            self.draws += 1
            with signals_held():  # a draw is whole or not at all (see signals_held)
                if self._flush_lines():
                    return  # printing above the live region redrew it already
                self.live.refresh()

    def _flush_lines(self) -> bool:
        """Print the completed lines (and whole terminal rows of a line too long for the
        terminal) above the live region; keep the open line inside it. True if printed."""
        if not self.live_on_stdout or not self.partial:
            return False
        done = ""
        if "\n" in self.partial:
            done, self.partial = self.partial.rsplit("\n", 1)
            done += "\n"
        width = max(20, self.console.width)
        if cell_len(self.partial) >= width:
            rows = chop_cells(self.partial, width)
            # A row of exactly the terminal's width followed by a newline looks the same
            # as the terminal wrapping it; the last (short) row stays open.
            full = rows[:-1] if cell_len(rows[-1]) < width else rows
            done += "".join(r + "\n" for r in full)
            self.partial = "".join(rows[len(full):])
        if not done:
            return False
        self.live.console.print(Text(done[:-1]), soft_wrap=True)
        return True

    def status_text(self, width: int | None = None) -> str:
        """The status line, fitted to `width` columns: every field in its longest form when
        that fits; else STATUS_STEPS in order (shorten a field to its next form, or drop
        it) until it fits, so that what is shown is whole, never cut to `ctx …`: the least
        important fields go first, the phase, tokens/s and tokens generated last."""
        parts = dict(self._status_parts())

        def text() -> str:
            return " · ".join(forms[0] for forms in parts.values())

        for key, action in STATUS_STEPS:
            if width is None or cell_len(text()) <= width:
                break
            if key not in parts:
                continue
            if action == "drop":
                del parts[key]
            elif len(parts[key]) > 1:
                parts[key] = parts[key][1:]
        return text()

    def _status_parts(self) -> list[tuple[str, tuple[str, ...]]]:
        """(field, its forms from the longest to the shortest), in display order."""
        parts: list[tuple[str, tuple[str, ...]]] = [("phase", (self.phase,))]
        if self.detail:
            parts.append(("detail", (self.detail,)))
        if self.prompt_tokens:
            n, reused = f"{self.prompt_tokens:,}", f" ({self.reused:,} reused)" if self.reused else ""
            parts.append(("prompt", (f"prompt {n} tok{reused}", f"prompt {n}{reused}", f"prompt {n}")))
        if self.ttft is not None:
            ms = f"{self.ttft * 1000:,.0f}"
            parts.append(("ttft", (f"TTFT {ms} ms", f"TTFT {ms}ms")))
        if self.prefill_tps:
            parts.append(("prefill", (f"prefill {self.prefill_tps:,.0f} tok/s", f"prefill {self.prefill_tps:,.0f}/s")))
        rate = self.decode_rate()
        if rate:
            parts.append(("rate", (f"decode {rate:,.1f} tok/s", f"{rate:,.1f} tok/s")))
        if self.generated:
            parts.append(("generated", (f"{self.generated:,} generated",)))
        s = self.speculation
        if s is not None and s.passes:
            rate, per = f"{100 * s.acceptance_rate:.0f}%", f"{s.tokens_per_pass:.2f}"
            parts.append(("speculation", (f"accepted {rate} · {per} tok/pass", f"acc {rate} {per}/pass")))
        if self.cache is not None:
            c = self.cache
            parts.append(("kv", (f"KV {human_bytes(c.bytes_in_use)} / {human_bytes(c.bytes_allocated)}",
                                 f"KV {short_bytes(c.bytes_in_use)}/{short_bytes(c.bytes_allocated)}",
                                 f"KV {short_bytes(c.bytes_in_use)}")))
            parts.append(("per_token", (f"{human_bytes(c.bytes_per_token)}/tok", f"{short_bytes(c.bytes_per_token)}/tok")))
            if self.context_length:
                pct = f"{100 * c.tokens / self.context_length:.1f}%"
                parts.append(("context", (f"context {pct}", f"ctx {pct}")))
        if self.dtype:
            parts.append(("dtype", self.dtype))
        return parts

    def decode_rate(self) -> float | None:
        """Tokens per second over the last RATE_WINDOW tokens (first token excluded)."""
        if len(self._recent) < 2:
            return None
        (t0, n0), (t1, n1) = self._recent[0], self._recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def _render(self):
        width = self.console.width if self.console is not None else None
        status = Text(self.status_text(width), style="dim", no_wrap=True, overflow="ellipsis")
        if self.live_on_stdout and self.partial:
            return Group(Text(self.partial), status)
        return status


class _Dynamic:
    """Renders the readout's state at draw time (including redraws rich does when a
    completed line is printed above the live region)."""

    def __init__(self, readout: Readout):
        self.readout = readout

    def __rich__(self):
        return self.readout._render()


class signals_held:
    """Ctrl-C, SIGTERM and SIGHUP wait while the live region is drawn, and act right after.

    A draw is one terminal write of rich's buffer (erase the region, the completed lines,
    the region again), and rich empties its buffer only after the write returns. A signal
    handled inside that write (most likely when the terminal is slow to take it) raised
    KeyboardInterrupt there: the buffer kept what had already reached the terminal and the
    next draw (the one that closes the readout) wrote it again, so the completed lines of
    the reply appeared twice (or a region erased by the wrong height swallowed some). Here
    the first signal is noted and delivered to its own handler when the draw is over; a
    second one, should the terminal not take the text at all, is delivered at once."""

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __enter__(self) -> "signals_held":
        import signal
        import threading

        self.saved: dict = {}
        self.pending: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.NAMES:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            handler = signal.getsignal(signum)
            if handler in (signal.SIG_IGN, None):  # ignored, or not set from Python: leave it
                continue
            self.saved[signum] = handler
            signal.signal(signum, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.pending.append(signum)
        if len(self.pending) > 1:  # asked twice: stop waiting for the terminal
            self._restore()
            self._deliver()

    def _restore(self) -> None:
        import signal

        saved, self.saved = self.saved, {}
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        self.handlers = saved

    def _deliver(self) -> None:
        import os
        import signal

        pending, self.pending = self.pending, []
        for signum in dict.fromkeys(pending):
            handler = self.handlers.get(signum)
            if callable(handler):
                handler(signum, None)  # KeyboardInterrupt, or Terminated (cli/errors.py)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)

    def __exit__(self, *exc) -> None:
        self._restore()
        self._deliver()


def cell_len(text: str) -> int:
    from rich.cells import cell_len as _cell_len

    return _cell_len(text)


def chop_cells(text: str, width: int) -> list[str]:
    from rich.cells import chop_cells as _chop

    return _chop(text, width)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
