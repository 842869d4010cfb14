"""rich consoles: stdout carries only generated text; everything else goes to stderr.

Every console twice prints through is made here, so that NO_COLOR (any non-empty value, as
no-color.org asks) and --no-color mean no ANSI styles at all: rich's own no_color keeps
bold, dim and italic, so a console without colour is made with color_system=None, which
renders no style (cursor movement for the live status line still works).
"""

from __future__ import annotations

import os
from functools import cache

from rich.console import Console

COLOR = {"on": True}  # False: --no-color was given (reset at the start of every command)


def color_on(no_color: bool = False) -> bool:
    """Whether styles may be printed: not with --no-color, nor with NO_COLOR set to anything."""
    return COLOR["on"] and not no_color and not os.environ.get("NO_COLOR")


def make_console(no_color: bool = False, **kwargs) -> Console:
    """A rich Console; without colour (see color_on) it renders no styles at all."""
    kwargs.setdefault("highlight", False)
    if not color_on(no_color):
        kwargs.update(no_color=True, color_system=None)
    return Console(**kwargs)


@cache
def _cached(stderr: bool, color: bool) -> Console:
    return make_console(no_color=not color, stderr=stderr)


def err_console() -> Console:
    return _cached(True, color_on())


def out_console() -> Console:
    return _cached(False, color_on())


def wide_console(stderr: bool, min_width: int, no_color: bool = False) -> Console:
    """A console for tables: the terminal's width, or at least `min_width` off a terminal
    (a file or a pipe has no width, and rich would squeeze the table into 80 columns)."""
    console = make_console(no_color, stderr=stderr)
    if not console.is_terminal:
        console = make_console(no_color, stderr=stderr, width=max(console.width, min_width))
    return console
