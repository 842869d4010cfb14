"""Hardening of `twice chat` (issue 13, items 7, 13 and 14): /load checks a file whole
before anything changes, /save never replaces a file unasked, a reply cut before any text
leaves no empty message, no exception of a turn ends the REPL, /set and /retry, and the
live readout never writes a reply's lines twice when a signal lands in a terminal write."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import pytest

from clirun import run_inprocess

pexpect = pytest.importorskip("pexpect")

TIMEOUT = 30


# -- the readout: a signal inside a terminal write ------------------------------------------
READOUT_CHILD = textwrap.dedent('''
    import os, sys
    from types import SimpleNamespace

    from twice.cli.readout import Readout

    # The engine's events as the readout reads them (by name), without importing torch.
    class PrefillStart(SimpleNamespace):
        pass

    class TokenEvent(SimpleNamespace):
        pass

    ready, gate = sys.argv[1], sys.argv[2]

    class SlowTerminal:
        """The terminal takes the first line of the reply slowly: the write that carries it
        waits (as a write to a busy terminal does) until the test, having sent Ctrl-C,
        opens the gate."""

        def __init__(self, real):
            self.real, self.waited = real, False

        def write(self, text):
            self.real.write(text)
            self.real.flush()
            if not self.waited and "FIRST-LINE" in text:
                self.waited = True
                open(ready, "w").close()
                with open(gate, "rb") as g:  # a FIFO: blocks until the test writes to it
                    g.read(1)
            return len(text)

        def flush(self):
            self.real.flush()

        def isatty(self):
            return True

        def fileno(self):
            return self.real.fileno()

        @property
        def encoding(self):
            return self.real.encoding

    cache = SimpleNamespace(bytes_per_token=64, bytes_in_use=640, bytes_allocated=1280, tokens=10,
                            context_length=256)
    stream = SlowTerminal(sys.stdout)

    def token(text, index):
        return TokenEvent(text=text, index=index, step_seconds=0.01, elapsed=0.1, cache=cache)

    try:
        with Readout(stream=stream) as readout:
            readout.on_event(PrefillStart(prompt_tokens=10, reused_tokens=0, new_tokens=10, cache=cache))
            readout.on_event(token("FIRST-LINE of the reply\\n", 0))
            readout.on_event(token("second line\\n", 1))
            readout.on_event(token("third", 2))
        print("\\n[not interrupted]")
    except KeyboardInterrupt:
        print("\\n[interrupted]")
''')


def test_ctrl_c_inside_a_terminal_write_never_repeats_the_reply(tmp_path):
    """Ctrl-C while the terminal is taking a draw of the live readout (a slow terminal, a
    slow step's draw): the reply's first line reaches the terminal once. Before, rich kept
    the interrupted write's text in its buffer and the closing draw wrote it again."""
    script, ready, gate = tmp_path / "child.py", tmp_path / "ready", tmp_path / "gate"
    script.write_text(READOUT_CHILD)
    os.mkfifo(gate)
    child = pexpect.spawn(sys.executable, [str(script), str(ready), str(gate)], timeout=TIMEOUT,
                          dimensions=(24, 80), env={**os.environ, "TERM": "xterm"})
    seen = b""
    while not ready.exists():  # the child is inside the write that carries the first line
        try:
            seen += child.read_nonblocking(65536, timeout=0.05)
        except pexpect.TIMEOUT:
            pass
    # Ctrl-C's signal, sent straight to the process: the pseudo-terminal's own ^C would
    # also discard the output it has not handed over yet, which would hide what is checked.
    child.kill(signal.SIGINT)
    fd = os.open(gate, os.O_RDWR)  # (a FIFO opened for both never waits for the other end)
    os.write(fd, b"x")
    os.close(fd)
    child.expect(pexpect.EOF)
    output = seen + child.before
    child.close()
    assert b"[interrupted]" in output  # Ctrl-C still acts: right after the draw
    assert output.count(b"FIRST-LINE") == 1, output
