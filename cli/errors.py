"""One place that turns failures into one-line messages and exit codes.

Exit codes: 0 done, 1 unexpected internal error, 2 bad input (TwiceError), 3 device
problem (no GPU, out of memory), 130 interrupted. `--debug` (or TWICE_DEBUG=1) shows the
traceback instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from twice.core.errors import TwiceError

DEBUG = {"on": bool(os.environ.get("TWICE_DEBUG"))}


def fail(message: str, code: int = 2) -> None:
    """Print `twice: error: ...` on stderr and exit."""
    sys.stderr.write(f"twice: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def run_guarded(fn: Callable[[], None]) -> None:
    try:
        fn()
    except TwiceError as e:
        if DEBUG["on"]:
            raise
        fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("\ntwice: interrupted\n")
        raise SystemExit(130) from None
    except BrokenPipeError:
        # The reader went away (`twice generate ... | head`): end quietly. Point stdout at
        # devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(0) from None
    except MemoryError:
        if DEBUG["on"]:
            raise
        fail("out of memory; try a smaller model, --dtype bfloat16, or fewer tokens", 3)
