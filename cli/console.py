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


def wide_console(stderr: bool, min_width: int, no_color: bool = False) -> Console:
    """A console for tables: the terminal's width, or at least `min_width` off a terminal
    (a file or a pipe has no width, and rich would squeeze the table into 80 columns)."""
    color = None if (COLOR["on"] and not no_color) else True  # None: rich reads NO_COLOR itself
    console = Console(stderr=stderr, no_color=color, highlight=False)
    if not console.is_terminal:
        console = Console(stderr=stderr, no_color=color, highlight=False, width=max(console.width, min_width))
    return console
