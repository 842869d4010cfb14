"""Bit and byte unpacking shared by the block codecs (pure torch)."""

from __future__ import annotations

import torch

def _u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


NIBBLE_SHIFTS = _u8([0, 4])
CRUMB_SHIFTS = _u8([0, 2, 4, 6])
BIT_SHIFTS = _u8(list(range(8)))


def f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) little-endian fp16 bytes -> (n, 1) float32."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Split each run of ``run`` bytes into its low nibbles, then its high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run) >> NIBBLE_SHIFTS.to(qs.device).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) of its bits, bit 0 first."""
    n = qh.shape[0]
    return ((qh.reshape(n, 4, 1) >> BIT_SHIFTS.to(qh.device).reshape(1, 1, 8)) & 1).reshape(n, 32)
