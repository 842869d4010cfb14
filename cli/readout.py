"""The live readout: streamed text with a status line under it.

On a terminal the text streams to stdout and one status line (phase, TTFT, prefill and
decode speed, KV cache) is drawn under it with rich Live, refreshed at most a few times a
second so that drawing never costs decode speed, and removed at the end (transient), so
scrollback keeps only the text. Completed lines are printed above the live region; the
line being written sits inside it until its newline arrives.

stdout not a terminal: stdout gets the text alone; the status line goes to stderr if that
is a terminal, else nowhere.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .console import COLOR
from .format import human_bytes

REFRESH_SECONDS = 0.25


class Readout:
    def __init__(self, show_text: bool = True, live: bool | None = None, stream=None):
        self.stream = stream or sys.stdout
        self.show_text = show_text
        out_tty = _isatty(self.stream)
        err_tty = _isatty(sys.stderr)
        self.live_on_stdout = show_text and out_tty if live is None else (live and out_tty and show_text)
        want_live = (out_tty or err_tty) if live is None else live
        self.console: Console | None = None
        if want_live and (self.live_on_stdout or err_tty):
            self.console = Console(file=self.stream if self.live_on_stdout else sys.stderr,
                                   no_color=not COLOR["on"], highlight=False, emoji=False, markup=False)
        self.live: Live | None = None
        self.partial = ""  # the line being written (live mode)
        self.phase = "loading"
        self.detail = ""
        self.prompt_tokens = self.reused = 0
        self.ttft = self.prefill_tps = None
        self.generated = 0
        self.cache = None
        self.context_length = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=32)  # (time, tokens) for a rolling rate
        self._last_draw = 0.0

    # -- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> "Readout":
        if self.console is not None:
            self.live = Live(_Dynamic(self), console=self.console, transient=True, auto_refresh=False,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        if self.partial:
            self.stream.write(self.partial)
            self.partial = ""
        self.stream.flush()

    # -- updates -----------------------------------------------------------------------
    def set_phase(self, phase: str, detail: str = "") -> None:
        self.phase, self.detail = phase, detail
        self._draw(force=True)

    def on_event(self, event) -> None:
        kind = type(event).__name__
        if kind == "PrefillStart":
            self.prompt_tokens, self.reused = event.prompt_tokens, event.reused_tokens
            self.cache, self.context_length = event.cache, event.cache.context_length
            self.generated = 0
            self._recent.clear()
            detail = f"reused {event.reused_tokens} cached tokens, prefilling {event.new_tokens} new" \
                if event.reused_tokens else f"{event.prompt_tokens} prompt tokens"
            self.set_phase("prefill", detail)
        elif kind == "TokenEvent":
            self.cache = event.cache
            self.generated += 1
            if event.index == 0:
                self.ttft = event.elapsed
                new = self.prompt_tokens - self.reused
                self.prefill_tps = new / event.step_seconds if event.step_seconds > 0 else None
                self.phase = "decode"
                self.detail = (f"reused {self.reused} cached tokens, prefilled {new} new" if self.reused else "")
            self._recent.append((time.perf_counter(), self.generated))
            if self.show_text and event.text:
                self.write(event.text)
            self._draw()

    def write(self, text: str) -> None:
        if self.live is None or not self.live_on_stdout:
            self.stream.write(text)
            self.stream.flush()
            return
        self.partial += text
        if "\n" in self.partial:
            done, self.partial = self.partial.rsplit("\n", 1)
            self.live.console.print(Text(done), soft_wrap=True)
        width = max(20, self.console.width)
        while len(self.partial) >= width:  # a line wider than the terminal: flush whole rows
            row, self.partial = self.partial[:width], self.partial[width:]
            self.live.console.print(Text(row), soft_wrap=True)

    # -- drawing -----------------------------------------------------------------------
    def _draw(self, force: bool = False) -> None:
        if self.live is None:
            return
        now = time.perf_counter()
        if force or now - self._last_draw >= REFRESH_SECONDS:
            self._last_draw = now
            self.live.refresh()

    def status_text(self) -> str:
        parts = [self.phase]
        if self.detail:
            parts.append(self.detail)
        elif self.prompt_tokens:
            parts.append(f"prompt {self.prompt_tokens} tok")
        if self.ttft is not None:
            parts.append(f"TTFT {self.ttft * 1000:.0f} ms")
        if self.prefill_tps:
            parts.append(f"prefill {self.prefill_tps:,.0f} tok/s")
        rate = self.decode_rate()
        if rate:
            parts.append(f"decode {rate:,.1f} tok/s")
        if self.generated:
            parts.append(f"{self.generated} generated")
        if self.cache is not None:
            c = self.cache
            used = f"KV {human_bytes(c.bytes_in_use)} / {human_bytes(c.bytes_allocated)}"
            used += f" ({human_bytes(c.bytes_per_token)}/tok)"
            if self.context_length:
                used += f", ctx {100 * c.tokens / self.context_length:.1f}%"
            parts.append(used)
        return " · ".join(parts)

    def decode_rate(self) -> float | None:
        if len(self._recent) < 2:
            return None
        (t0, n0), (t1, n1) = self._recent[0], self._recent[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def _render(self):
        status = Text(self.status_text(), style="dim", no_wrap=True, overflow="ellipsis")
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


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
