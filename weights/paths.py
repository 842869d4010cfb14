"""Where converted models go in the user cache."""

from __future__ import annotations

from pathlib import Path

from twice.core.paths import cache_dir


def models_dir() -> Path:
    return cache_dir() / "models"
