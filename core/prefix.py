"""The one rule of reusing a KV cache: a cache of tokens `a` serves a prompt `b` for as many
leading tokens as the two share (the engine's turns and prompt caches, speculation's
catch-ups, the scheduler's prefix reuse, chat's saved sidecar). No torch: the CLI uses it."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
