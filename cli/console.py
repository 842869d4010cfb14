"""rich consoles: stdout carries only generated text; everything else goes to stderr."""

from __future__ import annotations

import os
from functools import cache

from rich.console import Console

COLOR = {"on": not os.environ.get("NO_COLOR")}


@cache
def err_console() -> Console:
    return Console(stderr=True, no_color=not COLOR["on"], highlight=False)


@cache
def out_console() -> Console:
    return Console(no_color=not COLOR["on"], highlight=False)
