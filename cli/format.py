"""Plain formatting helpers for numbers people read."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def short_bytes(n: float) -> str:
    """Compact bytes for tight places (the status line): 512B, 19.5K, 1.2M, 3.0G."""
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def human_count(n: float) -> str:
    """A count in thousands, millions, billions: 127.3 K, 135.0 M, 1.7 B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f}"


def seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def os_message(e: Exception) -> str:
    """An OSError as people read it ("No space left on device"), else the error's text."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e)


def counted(n: int, word: str) -> str:
    """"1 message", "2 messages": n and the word, plural unless n is 1."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"
