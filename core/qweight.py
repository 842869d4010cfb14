"""Weights stored as GGUF blocks: the format is a property of the weight, not of the code path.

A float model's linear layer holds a float matrix; a quantized one holds a `BlockWeight`:
the rows of a matrix [out, in] as the blocks a GGUF file stores (core/quant's codecs),
possibly in row groups of different types (a fused q/k/v whose v rows are Q6_K while q and
k are Q4_K, as llama.cpp's Q4_K_M mixes them). Every path asks the weight for what it
needs instead of reading `.weight` as a float tensor:

* the eager layers call `product(x, weight, bias)` (a float weight: F.linear; blocks: the
  native integer kernel for a few rows, else dequantized tile by tile into the activation
  dtype and multiplied: prefill's shape, where the matrix product dominates);
* the embedding asks for rows (`BlockWeight.rows`);
* the native decode step asks for each part's pointer and type id (native_decode.py);
* sizes and readouts ask for `nbytes` and `formats()`.

On the CPU with the native kernels, the 32-value types' parts are rewritten once after loading
into the interleaved 8-row layout those kernels multiply fastest (`interleave_weights`,
core/quant/interleave.py): the part's codec then says so (ggml_type + X8, the same name), and
every reader here (dequantize, rows, products) honours it. TWICE_INTERLEAVE=0 keeps the rows
as stored.

The blocks live in the owning module's buffers (so .to(), state_dict and the huge-page
placement see them); `BlockWeight` is a cheap view built on each access.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels
from .quant import Codec, codec, interleave as x8

# Rows dequantized at once in the float product: bounds the temporary to a few MiB per
# call however large the matrix (a 150k-row vocabulary head would otherwise need ~1 GB).
_DEQUANTIZE_ROWS = 2048
# Up to this many activation rows, products go through the integer kernel (int8 activations,
# as llama.cpp multiplies: decode steps, chat turns, short prompts); beyond, the blocks are
# dequantized tile by tile and multiplied in float, where the float matrix product's speed
# pays for the dequantization (long prompts).
KERNEL_ROWS = 64


@dataclass(frozen=True)
class Part:
    """`rows` consecutive output rows of a weight, each stored as `codec` blocks in `data`
    (uint8 [rows, codec.row_bytes(in_features)])."""

    codec: Codec
    rows: int
    data: torch.Tensor


class BlockWeight:
    """A matrix [out_features, in_features] stored as GGUF blocks (see the module doc)."""

    def __init__(self, parts: list[Part], in_features: int):
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.parts[0].data.device

    @property
    def nbytes(self) -> int:
        return sum(p.data.nbytes for p in self.parts)

    def formats(self) -> Counter:
        """Values stored per type name."""
        out: Counter = Counter()
        for p in self.parts:
            out[p.codec.name] += p.rows * self.in_features
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) as a float tensor in `dtype`."""
        stop = self.out_features if stop is None else stop
        pieces, row = [], 0
        for p in self.parts:
            lo, hi = max(start, row), min(stop, row + p.rows)
            if lo < hi:
                pieces.append(_dequantize(p, lo - row, hi - row, self.in_features).to(dtype))
            row += p.rows
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` (any shape) as float → ids.shape + [in_features] (an embedding lookup)."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.in_features, dtype=dtype, device=self.device)
        row = 0
        for p in self.parts:
            inside = (flat >= row) & (flat < row + p.rows)
            if bool(inside.any()):
                wanted = flat[inside] - row
                if p.codec.rows_per_group == 1:
                    picked = p.data.index_select(0, wanted)
                    out[inside] = _dequantize(Part(p.codec, picked.shape[0], picked), 0, picked.shape[0],
                                              self.in_features).to(dtype)
                else:  # interleaved: the groups holding the rows, then the rows within them
                    g = p.codec.rows_per_group
                    groups, where = torch.unique(wanted // g, return_inverse=True)
                    picked = p.data.view(p.rows // g, -1).index_select(0, groups).view(-1, p.data.shape[1])
                    values = _dequantize(Part(p.codec, picked.shape[0], picked), 0, picked.shape[0], self.in_features)
                    out[inside] = values[where * g + wanted % g].to(dtype)
            row += p.rows
        return out.view(*ids.shape, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] @ self.T → [..., out_features] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        outs = [_part_product(x2, p, self.in_features) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.view(*lead, self.out_features)


def _dequantize(p: Part, start: int, stop: int, n: int) -> torch.Tensor:
    """Rows [start, stop) of one part as float32: the native dequantizer where it built
    (bit-exact with the reference), else core/quant's torch reference (an interleaved part:
    the whole groups the rows fall in, un-interleaved)."""
    if p.data.device.type == "cpu":
        if p.codec.rows_per_group == 1:
            got = kernels.dequantize_rows(p.data[start:stop].contiguous(), p.codec.ggml_type, n)
        else:
            got = kernels.dequantize_rows(p.data.contiguous(), p.codec.ggml_type, n, start=start, stop=stop)
        if got is not None:
            return got
    g = p.codec.rows_per_group
    lo, hi = start // g * g, -(-stop // g) * g
    return x8.dequantize_part(p.data[lo:hi], p.codec)[start - lo: stop - lo]


def _part_product(x: torch.Tensor, p: Part, n: int) -> torch.Tensor:
    """x [rows, n] @ part.T → [rows, part.rows] in x's dtype."""
    if x.device.type == "cpu" and x.shape[0] <= KERNEL_ROWS and p.codec.quantized and kernels.available():
        # Compiled graphs (fastpath.py) trace the kernel as a torch op; eagerly it is called
        # directly (a custom op's first call imports torch._dynamo: seconds on a first prompt).
        matmul = torch.ops.twice.quant_matmul if torch.compiler.is_compiling() else kernels.quant_matmul
        return matmul(x.float().contiguous(), p.data, p.codec.ggml_type).to(x.dtype)
    if p.rows <= _DEQUANTIZE_ROWS:
        return F.linear(x, _dequantize(p, 0, p.rows, n).to(x.dtype))
    y = torch.empty(x.shape[0], p.rows, dtype=x.dtype, device=x.device)
    for lo in range(0, p.rows, _DEQUANTIZE_ROWS):
        hi = min(p.rows, lo + _DEQUANTIZE_ROWS)
        y[:, lo:hi] = F.linear(x, _dequantize(p, lo, hi, n).to(x.dtype))
    return y


def product(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for a float weight or a BlockWeight: the one place every path
    multiplies by a weight whose format it does not know."""
    if isinstance(weight, BlockWeight):
        y = weight.matmul(x)
        return y + bias if bias is not None else y
    return F.linear(x, weight, bias)


def weight_format(weight) -> str:
    """A weight's storage as a type name: "Q4_K", "F32", "BF16", or "Q4_K+Q6_K" for mixed parts."""
    if isinstance(weight, BlockWeight):
        return "+".join(dict.fromkeys(p.codec.name for p in weight.parts))
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(weight.dtype, str(weight.dtype))


class _Blocks(torch.nn.Module):
    """Holds a BlockWeight's parts as buffers `blocks0`, `blocks1`, ..."""

    def _init_blocks(self, layout: list[tuple[str, int]], in_features: int, device) -> None:
        self.in_features = in_features
        self.codecs = [codec(name) for name, _ in layout]
        for i, ((_, rows), c) in enumerate(zip(layout, self.codecs)):
            self.register_buffer(f"blocks{i}", torch.empty(rows, c.row_bytes(in_features), dtype=torch.uint8,
                                                           device=device))

    @property
    def weight(self) -> BlockWeight:
        parts = [Part(c, getattr(self, f"blocks{i}").shape[0], getattr(self, f"blocks{i}"))
                 for i, c in enumerate(self.codecs)]
        return BlockWeight(parts, self.in_features)

    def store_rows(self, row: int, values: torch.Tensor) -> None:
        """Quantize float rows [row, row + len(values)) into their part's blocks (--quantize)."""
        from .quant import quantize

        buffer, first = self.part_for_row(row)
        part = self.codecs[int(buffer.removeprefix("blocks"))]
        if part.rows_per_group != 1:
            raise RuntimeError("store_rows into an interleaved part (interleave after loading, not before)")
        dest = getattr(self, buffer)[row - first: row - first + values.shape[0]]
        dest.copy_(quantize(values.to(torch.float32).cpu().contiguous(), part.name).view(dest.shape).to(dest.device))

    def interleave(self) -> int:
        """Rewrite, in place, each part of a 32-value type with whole groups of 8 rows into the
        interleaved 8-row layout (core/quant/interleave.py) and record it in the part's codec;
        the others stay as stored. Returns how many parts were rewritten. CPU only (the layout
        is the native kernels')."""
        done = 0
        for i, c in enumerate(self.codecs):
            buffer = getattr(self, f"blocks{i}")
            if (buffer.device.type != "cpu" or not buffer.is_contiguous() or not x8.eligible(c, buffer.shape[0])
                    or not kernels.x8_at_load(c.ggml_type)):
                continue
            with torch.no_grad():  # natively (a group's temporary), else by torch (one tensor's temporary)
                if not kernels.interleave_rows(buffer, c.ggml_type, self.in_features):
                    buffer.copy_(x8.interleave(buffer, c.name))
            self.codecs[i] = x8.interleaved(c)
            done += 1
        return done

    def stored_bytes(self, buffer: str, offsets):
        """The bytes at `offsets` (numpy int64) of buffer `buffer` ("blocks0") as its rows are
        stored in the file (numpy uint8), or None where the buffer holds them as stored: what
        a fingerprint of the weights samples, so that it does not depend on the layout. CPU
        buffers only."""
        if not (buffer.startswith("blocks") and buffer[6:].isdigit()):  # a bias
            return None
        c = self.codecs[int(buffer[6:])]
        if c.rows_per_group == 1:
            return None
        flat = getattr(self, buffer).detach().reshape(-1).numpy()
        return flat[x8.stored_positions(c.name, c.row_bytes(self.in_features), offsets)]

    def part_for_row(self, row: int) -> tuple[str, int]:
        """(buffer name, first row) of the part holding output row `row`."""
        start = 0
        for i in range(len(self.codecs)):
            rows = getattr(self, f"blocks{i}").shape[0]
            if start <= row < start + rows:
                return f"blocks{i}", start
            start += rows
        raise IndexError(row)


class BlockLinear(_Blocks):
    """A linear layer whose weight is stored as blocks; `layout` lists (type name, rows)
    per part, top to bottom."""

    def __init__(self, in_features: int, out_features: int, layout: list[tuple[str, int]], bias: torch.Tensor | None,
                 device, shard=None):
        super().__init__()
        if sum(rows for _, rows in layout) != out_features:
            raise ValueError("the parts' rows do not add up to the output features")
        self.out_features = out_features
        self._init_blocks(layout, in_features, device)
        self.bias = bias
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard is None or not self.shard.active:
            return product(x, self.weight, self.bias)
        y = self.shard.all_reduce(product(x, self.weight))
        return y + self.bias if self.bias is not None else y


class BlockEmbedding(_Blocks):
    def __init__(self, num_embeddings: int, embedding_dim: int, type_name: str, device):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._init_blocks([(type_name, num_embeddings)], embedding_dim, device)
        self.dtype = torch.get_default_dtype()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids, self.dtype)


def interleave_weights(model: torch.nn.Module) -> int:
    """Rewrite `model`'s block-stored matrices of the 32-value types into the interleaved 8-row
    layout of the native kernels (_Blocks.interleave), once, after loading (and after a
    tensor-parallel split: each rank's own rows): on the CPU, where the kernels built, unless
    TWICE_INTERLEAVE=0 (the one place it is read: A/B benchmarks and tests keep the rows as
    stored). Stacked experts stay as stored (their rows are sliced per expert). Returns the
    parts rewritten."""
    import os

    from .experts import Experts

    if os.environ.get("TWICE_INTERLEAVE", "1") == "0":
        return 0
    skip = {id(m) for e in model.modules() if isinstance(e, Experts) for m in e.modules()}
    todo = [m for m in model.modules() if isinstance(m, _Blocks) and id(m) not in skip
            and any(x8.eligible(c, getattr(m, f"blocks{i}").shape[0]) and kernels.x8_at_load(c.ggml_type)
                    and getattr(m, f"blocks{i}").device.type == "cpu"
                    for i, c in enumerate(m.codecs))]
    if not todo or not kernels.available():
        return 0
    return sum(m.interleave() for m in todo)


def store_as_blocks(model: torch.nn.Module, layouts: dict[str, list[tuple[str, int]]], device) -> None:
    """Replace each Linear / Embedding of `model` named in `layouts` (by its weight's
    parameter name, "layers.0.mlp.down_proj.weight") with its block-stored twin. Called on a
    model built on the meta device (nothing allocated yet); the biases are kept."""
    modules = dict(model.named_modules())
    for param, layout in layouts.items():
        name = param.removesuffix(".weight")
        old = modules[name]
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        if isinstance(old, torch.nn.Embedding):
            (type_name, _), = layout
            new = BlockEmbedding(old.num_embeddings, old.embedding_dim, type_name, device)
            new.dtype = old.weight.dtype
        else:
            new = BlockLinear(old.in_features, old.out_features, layout, old.bias, device,
                              shard=getattr(old, "shard", None))
        setattr(parent, leaf, new)
        modules[name] = new


def materialize(model: torch.nn.Module, device) -> None:
    """Give every parameter still on the meta device real (uninitialized) storage on `device`."""
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[key] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                             requires_grad=False)


def weight_formats(model: torch.nn.Module) -> dict:
    """What the model's weights are stored as: values per type name, bytes, bits per weight
    (over the matrices and embeddings; norms and biases are counted in `other_bytes`)."""
    values: Counter = Counter()
    matrix_bytes = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, _Blocks):
            w = module.weight
            values.update(w.formats())
            matrix_bytes += w.nbytes
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            w = module.weight
            if w.data_ptr() in seen:
                continue
            seen.add(w.data_ptr())
            values[weight_format(w)] += w.numel()
            matrix_bytes += w.nbytes
    total = sum(values.values())
    return {"types": dict(values.most_common()), "matrix_bytes": matrix_bytes,
            "bits_per_weight": 8 * matrix_bytes / total if total else 0.0}
