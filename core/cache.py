"""The KV cache: keys and values of every layer, preallocated once and written in place.

Layout: one K and one V tensor of shape [layers, batch, kv_heads, capacity, head_dim].
Rows of a batch are left-aligned to one shared column counter: row b holds padding in
columns [0, start[b]) and its tokens from start[b] on, so a decode step writes every row
at the same column (one static-shape slice write, no per-row scatter). Grouped-query
attention reads the kv_heads as stored; nothing is repeated per query head.

The element type (`--kv-dtype`, `kv_dtype`): "auto" (the model's dtype), float32, bfloat16,
float16, or a block type, q8_0 / q4_0. A quantized cache stores each token's head vector of
head_dim values as head_dim / 32 blocks of GGUF's Q8_0 (34 bytes per 32 values: an fp16 scale
d, 32 int8 q; x = d·q) or Q4_0 (18 bytes: fp16 d, 16 bytes of 4-bit q, values 0..15 in the low
nibbles, 16..31 in the high ones; x = d·(q − 8)), so K and V are uint8 tensors [layers, batch,
kv_heads, capacity, head_dim / 32 · 34 (or 18)]: a token's column is still one slice along the
capacity axis (copies between caches, keep_rows, grow and truncate are as for a float cache).
The blocks are core/quant's Q8_0/Q4_0 codecs bit for bit (llama.cpp's reference quantizers;
kernels/decode.c quantizes the native step's new keys/values with the same arithmetic). Each
token is quantized once, when it is written; the native decode step reads the blocks as stored
(int8/int4 keys dotted with the query, values accumulated from the blocks); the eager layers get
a dequantized copy of the columns in use from `write` (in the model's dtype). head_dim must be a
multiple of 32 (KVDtypeError otherwise).

Keys of a block cache are stored minus the layer's key bias where the model has one (Qwen2's
k_proj bias; `offset_keys`): the bias is one fixed vector added to every key (up to ±200 in some
of Qwen2.5's layers, where the rest of a key is ~±5), so a block's absmax scale would spend its
levels on it. softmax(q·k_j) does not change when one vector is subtracted from every key, so
the native step attends to the stored keys as they are; `read`, `decode_keys` and `write`'s
keys add the bias back (float32), so every caller still gets the keys; kernels/decode.c
subtracts the same bias before it quantizes a new key (Dims.kv_unbias). The bias is added before
RoPE, so the stored difference also holds R(pos)·b − b: small where Qwen2.5's large entries sit
(slowly rotating dimensions); a large entry in a fast one would gain nothing (and lose nothing).
The offset is the model's own weights, so caches and prompt-cache files of one model agree.
Float caches store keys as they are.

Bytes: 2 · layers · batch · tokens · kv_heads · head_dim · bytes per element (float32 4,
bfloat16/float16 2, q8_0 34/32, q4_0 18/32), where tokens is `capacity` for what is allocated
and `length` (columns filled) for what is in use.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .errors import TwiceError
from .hugepages import zeros

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0", "q4_0")
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVDtypeError(TwiceError):
    """A --kv-dtype this model's cache cannot use (an unknown name, a head size the block
    layout cannot hold)."""


@dataclass(frozen=True)
class KVFormat:
    """What one cached value costs: `name` as --kv-dtype says it; float caches store
    `dtype`, block caches `block` values in `block_bytes` bytes (ggml type `ggml_type`)."""

    name: str
    dtype: torch.dtype | None = None  # float caches
    block: int = 1
    block_bytes: int = 0
    ggml_type: int = -1  # 8 Q8_0, 2 Q4_0; -1 a float cache

    @property
    def quantized(self) -> bool:
        return self.dtype is None

    def bytes_per_values(self, n: int) -> int:
        """Bytes of n values (n whole blocks for a block type)."""
        if self.quantized:
            return n // self.block * self.block_bytes
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_element(self) -> float:
        """34/32 for q8_0, 18/32 for q4_0, the element size of a float type."""
        return self.bytes_per_values(self.block) / self.block

    @property
    def codec(self):
        from . import quant  # only block caches need the codecs

        return quant.CODECS[self.name.upper()]


BLOCK_FORMATS = {"q8_0": KVFormat("q8_0", block=32, block_bytes=34, ggml_type=8),
                 "q4_0": KVFormat("q4_0", block=32, block_bytes=18, ggml_type=2)}


def kv_format(kv_dtype: str | torch.dtype | None, dtype: torch.dtype, head_dim: int | None = None) -> KVFormat:
    """The format --kv-dtype `kv_dtype` gives a model computing in `dtype` ("auto"/None: that
    dtype); KVDtypeError (one line) for an unknown name or a head size that is not whole blocks."""
    if isinstance(kv_dtype, torch.dtype):
        dtype, kv_dtype = kv_dtype, None
    if kv_dtype in (None, "auto"):
        from .device import DTYPE_NAMES

        return KVFormat(DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")), dtype=dtype)
    if kv_dtype in _FLOATS:
        return KVFormat(kv_dtype, dtype=_FLOATS[kv_dtype])
    f = BLOCK_FORMATS.get(kv_dtype)
    if f is None:
        raise KVDtypeError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if head_dim is not None and head_dim % f.block:
        raise KVDtypeError(f"--kv-dtype {kv_dtype} needs a head size that is a multiple of {f.block}, "
                           f"this model's is {head_dim}")
    return f


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """On the CPU in huge pages where the OS gives them (hugepages.py), else as usual."""
    if torch.device(device).type == "cpu":
        t = zeros(shape, dtype)
        if t is not None:
            return t
    return torch.zeros(shape, dtype=dtype, device=device)


def _whole_storage(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous tensor's storage from its first element to the storage's end, as one flat
    tensor of its dtype (the memory KVCache.relaid may reuse); None if not contiguous."""
    if not t.is_contiguous():
        return None
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size() - t.storage_offset()
    return t.new_empty(0).set_(storage, t.storage_offset(), (n,), (1,))


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_heads: int | None = None,
        kv_dtype: str | None = None,
    ):
        self.num_layers = config.num_hidden_layers
        self.kv_heads = kv_heads if kv_heads is not None else config.num_key_value_heads
        self.head_dim = config.head_dim
        self.batch = batch
        self.capacity = capacity
        self.dtype = dtype  # the model's: what `write` takes and returns
        self.format = kv_format(kv_dtype, dtype, self.head_dim)
        self.kv_dtype = self.format.name  # as --kv-dtype says it (float32, bfloat16, q8_0, ...)
        self.quantized = self.format.quantized
        shape = self._shape(batch, capacity)
        storage = torch.uint8 if self.quantized else self.format.dtype
        self.k = _zeros(shape, storage, device)
        self.v = _zeros(shape, storage, device)
        self.length = 0  # columns [0, length) hold keys/values
        # First real column of each row (left padding before it); None = no padding.
        self.starts: torch.Tensor | None = None
        # Block caches: [layers, kv_heads, head_dim] float32 subtracted from keys before they are
        # quantized (offset_keys; zero for a layer without a key bias); None: none.
        self.key_offset: torch.Tensor | None = None
        self._offset_layers: frozenset[int] = frozenset()

    def _shape(self, batch: int, capacity: int) -> tuple[int, ...]:
        last = self.format.bytes_per_values(self.head_dim) if self.quantized else self.head_dim
        return (self.num_layers, batch, self.kv_heads, capacity, last)

    # -- sizes -------------------------------------------------------------------------
    @property
    def element_size(self) -> float:
        """Bytes per cached value: 4, 2, or a block type's 34/32 (q8_0), 18/32 (q4_0)."""
        return self.format.bytes_per_element

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one row, over all layers."""
        return 2 * self.num_layers * self.kv_heads * self.format.bytes_per_values(self.head_dim)

    @property
    def bytes_allocated(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_held(self) -> int:
        """The memory behind K and V (a cache laid out again in a larger one's memory, `relaid`,
        holds all of it)."""
        return sum(t.untyped_storage().nbytes() for t in (self.k, self.v))

    @property
    def bytes_in_use(self) -> int:
        return self.bytes_per_token * self.batch * self.length

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as stored (prompt caches): K and V, float or blocks."""
        return {"k": self.k, "v": self.v}

    # -- the block codec -----------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Values [..., head_dim] → what the cache stores for them ([..., bytes] of blocks for
        a quantized cache, the cache's float dtype otherwise)."""
        if not self.quantized:
            return x.to(self.k.dtype)
        lead = x.shape[:-1]
        blocks = x.detach().to(torch.float32).reshape(-1, self.format.block)
        out = self.format.codec.quantize_blocks(blocks)
        return out.reshape(*lead, self.k.shape[-1])

    def decode(self, stored: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """What the cache stores ([..., bytes] of blocks, or floats) → values [..., head_dim] in
        `dtype` (float32 by default for blocks; the stored dtype for a float cache)."""
        if not self.quantized:
            return stored if dtype is None else stored.to(dtype)
        lead = stored.shape[:-1]
        values = self.format.codec.dequantize_blocks(stored.reshape(-1, self.format.block_bytes))
        values = values.reshape(*lead, self.head_dim)
        return values if dtype is None else values.to(dtype)

    # -- the key offset (block caches of models with a key bias) ------------------------
    def offset_keys(self, layer: int, bias: torch.Tensor) -> None:
        """Store `layer`'s keys minus `bias` (its key projection's bias, kv_heads · head_dim
        values) from now on, if this is a block cache (float caches: nothing). Set once per layer,
        before its first key is written (the attention modules and the native step call it
        with the model's own bias, so every cache of a model, and every file saved from one,
        holds the same offsets)."""
        if not self.quantized or layer in self._offset_layers:
            return
        if self.key_offset is None:
            self.key_offset = torch.zeros(self.num_layers, self.kv_heads, self.head_dim, dtype=torch.float32,
                                          device=self.k.device)
        self.key_offset[layer] = bias.detach().to(device=self.k.device, dtype=torch.float32).view(
            self.kv_heads, self.head_dim)
        self._offset_layers = self._offset_layers | {layer}

    def _offset(self, layer) -> torch.Tensor | None:
        """The key offset of `layer` (an int: [kv_heads, 1, D]; None: every layer, [L, 1, kv_heads,
        1, D]) for keys laid out [..., kv_heads, T, D]; None where there is none."""
        if self.key_offset is None:
            return None
        if layer is None:
            return self.key_offset[:, None, :, None, :]
        return self.key_offset[layer][:, None, :]

    def encode_keys(self, k: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Keys [..., kv_heads, T, D] of `layer` (None: k holds every layer first) → as stored."""
        c = self._offset(layer)
        return self.encode(k if c is None else k.to(torch.float32) - c)

    def decode_keys(self, stored: torch.Tensor, layer: int | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored keys of `layer` (None: every layer) → keys, the offset added back."""
        c = self._offset(layer)
        if c is None:
            return self.decode(stored, dtype)
        keys = self.decode(stored) + c
        return keys if dtype is None else keys.to(dtype)

    # -- writes ------------------------------------------------------------------------
    def write(self, layer: int, column: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, D] at columns [column, column+T) of `layer` and
        return views of all keys/values [B, kv_heads, column+T, D] for attention (`attended`)."""
        self.store(layer, column, k, v)
        return self.attended(layer, column + k.shape[2], k.dtype)

    def store(self, layer: int, column: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, D] at columns [column, column+T) of `layer`, encoded as
        the cache stores them."""
        end = column + k.shape[2]
        self.k[layer, :, :, column:end] = self.encode_keys(k, layer)
        self.v[layer, :, :, column:end] = self.encode(v)

    def attended(self, layer: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, end, D] of `layer`'s columns [0, end) as values in
        `dtype`: views of the cache where it stores them so, else (a quantized cache, a float
        one of another dtype) a copy."""
        keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]
        if self.quantized or keys.dtype != dtype:
            return self.decode_keys(keys, layer, dtype), self.decode(values, dtype)
        return keys, values

    def read(self, layer: int, row: int, start: int, end: int,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, end - start, D] of one row's columns, as values in `dtype`."""
        return (self.decode_keys(self.k[layer, row, :, start:end], layer, dtype),
                self.decode(self.v[layer, row, :, start:end], dtype))

    def put(self, layer: int, row: int, column: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store values k, v [kv_heads, T, D] at one row's columns [column, column+T) (encoded as
        the cache stores them): the inverse of `read` (context shift re-rotates keys this way)."""
        end = column + k.shape[1]
        self.k[layer, row, :, column:end] = self.encode_keys(k, layer)
        self.v[layer, row, :, column:end] = self.encode(v)

    def truncate(self, length: int) -> None:
        """Forget columns from `length` on (they are overwritten by the next writes)."""
        self.length = max(0, min(length, self.length))

    def relaid(self, moves: list[tuple[int, int, int]], end: int, batch: int, capacity: int) -> "KVCache":
        """This cache laid out again as `batch` rows × `capacity` columns (a scheduler's batch
        when rows join): new row r holds the columns [first, end) of old row `row` at columns
        [at, at + end - first), for moves[r] = (row, first, at). Where the new layout fits in
        this cache's memory it is built there, in place (a fresh cache of ~100 MB faulted in and
        zero-filled cost 80-170 ms on a 2-core VM, longer than a dozen decode steps), and this
        cache must not be used again; else in a fresh one. Columns outside what was moved (and
        rows past the moves) then hold stale but whole token slots of this cache, never read:
        a row's attention reads from its start (native) or masks what lies before it (eager),
        and every column from `end` on is written before it is read."""
        new = copy.copy(self)
        new.batch, new.capacity, new.starts = batch, capacity, None
        shape = self._shape(batch, capacity)
        per_layer = math.prod(shape[1:])
        for name in ("k", "v"):
            old = getattr(self, name)
            flat = _whole_storage(old)
            if flat is None or flat.numel() < self.num_layers * per_layer:
                fresh = _zeros(shape, old.dtype, old.device)
                for r, (row, first, at) in enumerate(moves):
                    fresh[:, r, :, at:at + end - first] = old[:, row, :, first:end]
                setattr(new, name, fresh)
                continue
            # Layer by layer, each layer's moved columns copied out before its new place is
            # written: a smaller layer's new place ends before the old next layer begins
            # (ascending), a larger one's begins after the old previous layer ends (descending),
            # so no layer is overwritten before it has been read.
            layers = range(self.num_layers) if per_layer <= math.prod(old.shape[1:]) else reversed(range(self.num_layers))
            for layer in layers:
                pieces = [old[layer, row, :, first:end].clone() for row, first, _ in moves]
                dst = flat[layer * per_layer:(layer + 1) * per_layer].view(shape[1:])
                for r, ((_, first, at), piece) in enumerate(zip(moves, pieces)):
                    dst[r, :, at:at + end - first] = piece
            setattr(new, name, flat[:self.num_layers * per_layer].view(shape))
        return new

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
        shape = self._shape(self.batch, capacity)
        k = _zeros(shape, self.k.dtype, self.k.device)
        v = _zeros(shape, self.v.dtype, self.v.device)
        k[:, :, :, : self.length] = self.k[:, :, :, : self.length]
        v[:, :, :, : self.length] = self.v[:, :, :, : self.length]
        # Swapped together, so an interrupt never leaves K and V of different sizes.
        self.k, self.v, self.capacity = k, v, capacity


def key_bias(attention) -> tuple[int, torch.Tensor] | None:
    """(layer, the key part of its bias) of an attention module whose keys a block cache stores
    minus that bias (core/attention.py's CachedSelfAttention with a q/k/v bias and no score
    soft-cap: a soft-cap is not shift invariant); None otherwise."""
    proj = getattr(attention, "qkv_proj", None)
    bias = getattr(proj, "bias", None) if proj is not None else None
    if bias is None or getattr(attention, "softcap", None) is not None:
        return None
    q, kv = attention.q_size, attention.kv_size
    return attention.layer, bias[q:q + kv]


def offset_keys_of(cache: KVCache, model) -> None:
    """Give a block cache `model`'s key offsets for every layer (offset_keys)."""
    if getattr(cache, "quantized", False):
        for module in model.modules():
            found = key_bias(module)
            if found is not None:
                cache.offset_keys(*found)
