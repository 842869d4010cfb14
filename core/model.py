"""What every model family shares: the forward contract and the checkpoint name map.

A family module (llama.py, gpt2.py) builds its layers and says, through `targets()`, which
Hugging Face tensor name fills which parameter (or which rows of a fused one). The loader
in twice.weights only follows that map; it never needs to know a family's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import Step
from .cache import KVCache
from .config import ModelConfig
from .hugepages import keep_freed_memory
from .parallel import SINGLE, Shard
from .qweight import product


@dataclass(frozen=True)
class Source:
    """The part of a checkpoint tensor a tensor-parallel rank reads: [start, stop) along
    `dim` of a tensor whose full size there is `total`."""

    dim: int
    start: int
    stop: int
    total: int


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param`, rows [row, row + rows) of it if `rows`,
    transposed first if `transpose` (GPT-2's Conv1D stores [in, out]); only the `source`
    slice of the checkpoint tensor when the model is split across ranks. `stored_shape`: the
    checkpoint tensor's shape when it differs from the rows it fills only by how the leading
    dimensions group (stacked experts [experts, rows, in] filling [experts · rows, in])."""

    param: str
    row: int = 0
    rows: int | None = None
    transpose: bool = False
    source: Source | None = None
    stored_shape: tuple[int, ...] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.param, self.row)

    def checkpoint_shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape, given the shape of the parameter it fills."""
        dest = tuple(param_shape) if self.rows is None else (self.rows, *param_shape[1:])
        expected = list(self.stored_shape or (dest[::-1] if self.transpose else dest))
        if self.source is not None:  # this rank keeps a slice: the file holds the whole tensor
            expected[self.source.dim] = self.source.total
        return tuple(expected)

    @property
    def param_dim(self) -> int | None:
        """The dimension of the parameter that `source` slices: the checkpoint's own, but
        the other one where the checkpoint tensor is the parameter transposed (a GGUF file,
        and --quantize's layouts, hold matrices as the parameter does)."""
        if self.source is None:
            return None
        return 1 - self.source.dim if self.transpose else self.source.dim


# What one checkpoint tensor fills: one place, or several where a tensor-parallel rank keeps
# several slices of it (phi3's fused qkv_proj: its q heads, its k heads, its v heads).
Placement = Target | tuple[Target, ...]


class CausalLM(torch.nn.Module):
    config: ModelConfig
    # Checkpoint tensors under these prefixes belong to no part this model runs and are
    # skipped by the loader (a multimodal checkpoint's vision tower, gemma.py); else an
    # unknown tensor is an error.
    unused_prefixes: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, shard: Shard = SINGLE):
        super().__init__()
        self.config = config
        self.shard = shard
        self.kv_heads = config.num_key_value_heads // shard.world  # stored in this rank's KV cache
        self.windows = {config.window_for_layer(i) for i in range(config.num_hidden_layers)}
        self.vocab_parallel = False  # an untied head split by vocabulary rows across ranks

    # Family modules implement these two.
    def hidden_states(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        raise NotImplementedError

    def targets(self) -> dict[str, Placement]:
        raise NotImplementedError

    def placements(self) -> dict[str, tuple[Target, ...]]:
        """targets() with every entry a tuple of the places its checkpoint tensor fills: what
        the loaders read."""
        return {name: t if isinstance(t, tuple) else (t,) for name, t in self.targets().items()}

    def features(self) -> frozenset[str]:
        """What a decode step must implement to run this model (family.py): the block kind
        ("block:llama"), the activation ("act:silu") and each option the model uses
        ("qk_norm", "window", "tp", ...). A step runs a model only if it implements them all."""
        raise NotImplementedError

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build non-parameter state (RoPE tables) once the weights are in place."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The output head's logits as the family returns them (gemma's final soft-cap);
        identity by default."""
        return logits

    def forward(self, input_ids: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run tokens [B, T] at the cache's next columns; return logits [B, T, V] if
        `all_logits` else the last position's [B, V] (prefill needs only that one, and the
        vocabulary projection of every prompt token would cost more than the layers)."""
        t = input_ids.shape[1]
        if cache.length + t > cache.capacity:
            raise ValueError(f"cache holds {cache.capacity} tokens; {cache.length} + {t} do not fit")
        if input_ids.device.type == "cpu":
            keep_freed_memory()  # once: a prefill's activations reuse one layer's memory in the next
        step = Step.build(cache, t, self.windows)
        h = self.hidden_states(input_ids, step, cache)
        cache.length += t
        if not all_logits:
            h = h[:, -1]
        logits = product(h, self.lm_head_weight)
        return self.finish_logits(self.shard.all_gather_last(logits) if self.vocab_parallel else logits)

    def active_weight_bytes(self) -> int:
        """Bytes of the weights one token's decode step reads: all of them, except in a
        mixture of experts (moe.py), where only the chosen experts' count."""
        return self.weight_bytes()

    def weight_bytes(self) -> int:
        """Bytes of every parameter and block buffer (each stored tensor once)."""
        seen, total = set(), 0
        for p in [*self.parameters(), *self.buffers()]:
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.nbytes
        return total


def fused_rows(prefix_hf: str, param: str, names: tuple[str, ...], parts: tuple[tuple[int, int, int], ...],
               bias: bool) -> dict[str, Target]:
    """Targets for checkpoint tensors that we store stacked in one fused parameter
    (q/k/v → qkv_proj, gate/up → gate_up_proj). `parts` gives, per tensor, (first row,
    rows, total rows) of the checkpoint tensor that this rank keeps."""
    out: dict[str, Target] = {}
    row = 0
    for name, (start, size, total) in zip(names, parts):
        source = Source(0, start, start + size, total) if size != total else None
        out[f"{prefix_hf}.{name}.weight"] = Target(f"{param}.weight", row, size, source=source)
        if bias:
            out[f"{prefix_hf}.{name}.bias"] = Target(f"{param}.bias", row, size, source=source)
        row += size
    return out


def fused(parts: list[Target]) -> Placement:
    """What one checkpoint tensor fills that stacks `parts` along one dimension (phi3's
    qkv_proj: rows q | k | v; GPT-2's c_attn: columns q | k | v), each part a Target as if it
    were a tensor of its own (its `source`, if any, this rank's slice of that part), filling
    consecutive rows of one parameter: one Target when this rank keeps the whole tensor, else
    one per part, its slice offset into the whole."""
    first = parts[0]
    assert all(p.rows is not None and p.param == first.param and p.transpose == first.transpose for p in parts)
    if all(p.source is None for p in parts):
        return Target(first.param, first.row, sum(p.rows for p in parts), transpose=first.transpose)
    dim = next(p.source.dim for p in parts if p.source is not None)
    sizes = [p.source.total if p.source else p.rows for p in parts]  # each part's extent in the whole
    out, offset = [], 0
    for p, size in zip(parts, sizes):
        start, stop = (p.source.start, p.source.stop) if p.source else (0, p.rows)
        out.append(Target(p.param, p.row, p.rows, transpose=p.transpose,
                          source=Source(dim, offset + start, offset + stop, sum(sizes))))
        offset += size
    return tuple(out)


def fuse(targets: dict[str, Placement], name: str, names: tuple[str, ...]) -> None:
    """A checkpoint that stores as one tensor `name` what others store as `names` (phi3's
    qkv_proj for q/k/v_proj): the entries `names` (as fused_rows made them) become one entry."""
    targets[name] = fused([targets.pop(n) for n in names])


def columns(param: str, start: int, size: int, total: int) -> Target:
    """A weight whose input columns are split across ranks (o_proj, down_proj)."""
    return Target(param, source=Source(1, start, start + size, total) if size != total else None)
