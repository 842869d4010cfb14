"""Stop strings on streamed text.

Text that might be the beginning of a stop string is held back until it is clear either
way, so a stop string never reaches the output, not even in part.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text; return (text safe to show, whether a stop string matched)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
