"""Where twice keeps what it writes: the user cache (converted models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TWICE_CACHE, else $XDG_CACHE_HOME/twice, else ~/.cache/twice."""
    if os.environ.get("TWICE_CACHE"):
        return Path(os.environ["TWICE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "twice"
