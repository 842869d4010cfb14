"""Running the CLI in-process (fast) or as a real subprocess (for exit codes and streams)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Run:
    code: int
    out: str
    err: str


def run_inprocess(args: list[str], capsys, stdin: bytes | None = None, monkeypatch=None,
                  restore_threads: bool = True) -> Run:
    from twice.cli.app import main

    if stdin is not None:
        import io

        class _In(io.TextIOWrapper):
            def isatty(self):
                return False

        monkeypatch.setattr(sys, "stdin", _In(io.BytesIO(stdin), encoding="utf-8"))
    import torch

    capsys.readouterr()  # drop whatever fixtures printed before the command runs
    old, threads = sys.argv, torch.get_num_threads()
    sys.argv = ["twice", *args]
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        # --threads N sets torch's threads for the process: the tests after it keep theirs
        # (float sums reduce in another order on another thread count).
        sys.argv = old
        if restore_threads:
            torch.set_num_threads(threads)
    cap = capsys.readouterr()
    return Run(code, cap.out, cap.err)


def run_subprocess(args: list[str], stdin: bytes | None = None, env: dict | None = None, timeout: float = 120) -> Run:
    full_env = {**os.environ, **(env or {})}
    p = subprocess.run([sys.executable, "-c", "from twice.cli.app import main; main()", *args], input=stdin,
                       capture_output=True, env=full_env, timeout=timeout)
    return Run(p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"))


def one_error_line(r: Run, code: int = 2) -> str:
    """The run failed with `code` and said so in exactly one line, with no traceback."""
    assert r.code == code, r
    assert "Traceback" not in r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twice: error: "), r.err
    return lines[0]
