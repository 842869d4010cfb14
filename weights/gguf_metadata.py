"""Reading typed values out of a GGUF file's metadata, each failure a one-line
WeightsError that names the file and the key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from twice.core.config import MAX_SIZE
from twice.core.errors import WeightsError


def require(metadata: dict, key: str, src: Path) -> Any:
    if key not in metadata:
        raise WeightsError(f"{src}: required metadata key {key} is missing")
    return metadata[key]


def positive_int(metadata: dict, key: str, src: Path, default: int | None = None) -> int:
    value = metadata.get(key, default) if default is not None else require(metadata, key, src)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise WeightsError(f"{src}: metadata {key} must be a positive integer, got {value!r}")
    if value > MAX_SIZE:  # here, where the message can name the GGUF's key, not the config's
        raise WeightsError(f"{src}: metadata {key} must be at most {MAX_SIZE:,}, got {value:,}")
    return value


def positive_float(metadata: dict, key: str, src: Path, default: float | None = None) -> float:
    value = metadata.get(key, default) if default is not None else require(metadata, key, src)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise WeightsError(f"{src}: metadata {key} must be a positive number, got {value!r}")
    return float(value)


def token_id(metadata: dict, name: str, vocab_size: int, src: Path) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{name}")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise WeightsError(f"{src}: tokenizer.ggml.{name} {value!r} is not a token id below {vocab_size}")
    return value


def flag(metadata: dict, key: str, default: bool, src: Path) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise WeightsError(f"{src}: metadata {key} must be true or false, got {value!r}")
    return value


def string_list(metadata: dict, key: str, src: Path) -> list[str]:
    value = require(metadata, key, src)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WeightsError(f"{src}: metadata {key} must be a list of strings")
    return value
