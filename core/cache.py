"""The KV cache: keys and values of every layer, preallocated once and written in place.

Layout: one K and one V tensor of shape [layers, batch, kv_heads, capacity, head_dim].
Rows of a batch are left-aligned to one shared column counter: row b holds padding in
columns [0, start[b]) and its tokens from start[b] on, so a decode step writes every row
at the same column (one static-shape slice write, no per-row scatter). Grouped-query
attention reads the kv_heads as stored; nothing is repeated per query head.

Bytes: 2 · layers · batch · tokens · kv_heads · head_dim · element size, where tokens is
`capacity` for what is allocated and `length` (columns filled) for what is in use.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .hugepages import zeros


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """On the CPU in huge pages where the OS gives them (hugepages.py), else as usual."""
    if torch.device(device).type == "cpu":
        t = zeros(shape, dtype)
        if t is not None:
            return t
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_heads: int | None = None,
    ):
        self.num_layers = config.num_hidden_layers
        self.kv_heads = kv_heads if kv_heads is not None else config.num_key_value_heads
        self.head_dim = config.head_dim
        self.batch = batch
        self.capacity = capacity
        shape = (self.num_layers, batch, self.kv_heads, capacity, self.head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.length = 0  # columns [0, length) hold keys/values
        # First real column of each row (left padding before it); None = no padding.
        self.starts: torch.Tensor | None = None

    # -- sizes -------------------------------------------------------------------------
    @property
    def element_size(self) -> int:
        return self.k.element_size()

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one row, over all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.element_size

    @property
    def bytes_allocated(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_in_use(self) -> int:
        return self.bytes_per_token * self.batch * self.length

    # -- writes ------------------------------------------------------------------------
    def write(self, layer: int, column: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, D] at columns [column, column+T) of `layer` and
        return views of all keys/values [B, kv_heads, column+T, D] for attention."""
        end = column + k.shape[2]
        self.k[layer, :, :, column:end] = k
        self.v[layer, :, :, column:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def truncate(self, length: int) -> None:
        """Forget columns from `length` on (they are overwritten by the next writes)."""
        self.length = max(0, min(length, self.length))

    def keep_rows(self, rows: list[int]) -> None:
        """Drop finished rows so the next steps compute only the live ones."""
        if len(rows) == self.batch:
            return
        index = torch.tensor(rows, device=self.k.device)
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)
        if self.starts is not None:
            self.starts = self.starts.index_select(0, index)
        self.batch = len(rows)

    def grow(self, capacity: int) -> None:
        """Reallocate to a larger capacity, keeping the filled columns (chat sessions)."""
        if capacity <= self.capacity:
            return
        shape = (self.num_layers, self.batch, self.kv_heads, capacity, self.head_dim)
        k = _zeros(shape, self.k.dtype, self.k.device)
        v = _zeros(shape, self.v.dtype, self.v.device)
        k[:, :, :, : self.length] = self.k[:, :, :, : self.length]
        v[:, :, :, : self.length] = self.v[:, :, :, : self.length]
        # Swapped together, so an interrupt never leaves K and V of different sizes.
        self.k, self.v, self.capacity = k, v, capacity
