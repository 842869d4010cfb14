"""Reading typed values out of a GGUF file's metadata, each failure a one-line
WeightsError that names the file and the key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from twice.core.config import MAX_SIZE
from twice.core.errors import UnsupportedModelError, WeightsError


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


class Metadata:
    """A file's `ARCH.*` metadata and settings tensors as a family's GGUF form reads them
    (core/family.GgufForm.read): keys relative to the architecture ("attention.head_count" is
    `llama.attention.head_count` in a llama file), each bad value one WeightsError naming the
    file and the whole key."""

    def __init__(self, metadata: dict, src: Path, arch: str, find=lambda name: None):
        self.metadata, self.src, self.arch, self._find = metadata, src, arch, find

    def key(self, key: str) -> str:
        return f"{self.arch}.{key}"

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(self.key(key), default)

    def __contains__(self, key: str) -> bool:
        return self.key(key) in self.metadata

    def int(self, key: str, default: int | None = None) -> int:
        return positive_int(self.metadata, self.key(key), self.src, default)

    def float(self, key: str, default: float | None = None) -> float:
        return positive_float(self.metadata, self.key(key), self.src, default)

    def kv_heads(self, heads: int) -> int:
        """attention.head_count_kv: a number, or (in some files) one number per layer."""
        key = self.key("attention.head_count_kv")
        value = self.metadata.get(key, heads)
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise UnsupportedModelError(f"{self.src}: a different number of key/value heads per layer is not "
                                            "supported")
            value = value[0]
        return positive_int({key: value}, key, self.src)

    def has_tensor(self, name: str) -> bool:
        return self._find(name) is not None

    def values(self, tensor: str):
        """The values of a settings tensor (phi3's RoPE factors) as float64, or None if the
        file has no tensor of that name."""
        t = self._find(tensor)
        if t is None:
            return None
        import gguf
        import numpy as np

        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()
