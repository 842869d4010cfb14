"""A readiness signal for signal tests, without sleeping: a `sitecustomize` module put on
the child's PYTHONPATH that stops the child at a chosen point (an import, or a call of a
function of ours), prints one line on stderr when it gets there, and waits (signal.pause,
no timing) for the signal the test then sends. So "Ctrl-C while importing" and "Ctrl-C
while loading" are sent exactly there, however fast or slow the machine.

TWICE_TEST_BLOCK: "import:MODULE" (stop when MODULE's import starts: inside the import
machinery, as a Ctrl-C during a slow import lands) or "call:MODULE:FUNCTION" (stop at the
start of FUNCTION, once MODULE is imported). TWICE_TEST_BLOCK_MODE: what the stopped code
does with the KeyboardInterrupt: "" re-raises it; "importerror" turns it into an
ImportError, as a C extension whose initialization was cut short does on its next import
(numpy: "cannot load module more than once per process"); "swallow" drops it and goes on,
as C code that imports a module and clears the failure does (torch's extension importing
numpy).
"""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from pathlib import Path

READY = "twice-test: blocked in "

SITECUSTOMIZE = r'''
import os, sys

_spec = os.environ.get("TWICE_TEST_BLOCK", "")
_mode = os.environ.get("TWICE_TEST_BLOCK_MODE", "")
if _spec:
    import importlib.abc, importlib.machinery, signal

    _kind, _, _target = _spec.partition(":")
    _module, _, _function = _target.partition(":")

    def _block(what):
        try:  # the signal may come as soon as the line is out: inside the try already
            os.write(2, ("twice-test: blocked in " + what + "\n").encode())
            while True:
                signal.pause()
        except KeyboardInterrupt:
            if _mode == "importerror":
                raise ImportError("cannot load module more than once per process") from None
            if _mode != "swallow":
                raise

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _module:
                return None
            sys.meta_path.remove(self)
            if _kind == "import":
                _block("import " + name)
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                real = getattr(module, _function)

                def stopped(*args, **kwargs):
                    _block(name + "." + _function)
                    return real(*args, **kwargs)

                setattr(module, _function, stopped)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
'''


def hook_env(folder: Path, block: str, mode: str = "") -> dict:
    """Environment entries that install the hook in a child Python (folder: where to put it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TWICE_TEST_BLOCK": block, "TWICE_TEST_BLOCK_MODE": mode}


def wait_until_blocked(proc: subprocess.Popen, timeout: float = 120.0) -> tuple[str, bytes]:
    """Read the child's stderr until the hook's line; return that line and every byte of
    stderr read so far (the rest is still in the pipe). Fails if the child ends first or
    the line does not come within `timeout`."""
    deadline = time.monotonic() + timeout
    seen = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no readiness line within {timeout} s: {seen.decode(errors='replace')[-2000:]}")
            if not sel.select(left):
                continue
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"ended ({proc.wait()}) before the readiness line: "
                                     f"{seen.decode(errors='replace')[-2000:]}")
            seen += chunk
            text = seen.decode(errors="replace")
            if READY in text and "\n" in text[text.index(READY):]:
                return text[text.index(READY):].split("\n", 1)[0], seen
