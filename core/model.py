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


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param`, rows [row, row + rows) of it if `rows`,
    transposed first if `transpose` (GPT-2's Conv1D stores [in, out])."""

    param: str
    row: int = 0
    rows: int | None = None
    transpose: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.param, self.row)


class CausalLM(torch.nn.Module):
    config: ModelConfig

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.windows = {config.window_for_layer(i) for i in range(config.num_hidden_layers)}

    # Family modules implement these two.
    def hidden_states(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        raise NotImplementedError

    def targets(self) -> dict[str, Target]:
        raise NotImplementedError

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build non-parameter state (RoPE tables) once the weights are in place."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run tokens [B, T] at the cache's next columns; return logits [B, T, V] if
        `all_logits` else the last position's [B, V] (prefill needs only that one, and the
        vocabulary projection of every prompt token would cost more than the layers)."""
        t = input_ids.shape[1]
        if cache.length + t > cache.capacity:
            raise ValueError(f"cache holds {cache.capacity} tokens; {cache.length} + {t} do not fit")
        step = Step.build(cache, t, self.windows)
        h = self.hidden_states(input_ids, step, cache)
        cache.length += t
        if not all_logits:
            h = h[:, -1]
        return torch.nn.functional.linear(h, self.lm_head_weight)

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.nbytes
        return total


def fused_rows(prefix_hf: str, param: str, names: tuple[str, ...], sizes: tuple[int, ...], bias: bool) -> dict[str, Target]:
    """Targets for checkpoint tensors that we store stacked in one fused parameter
    (q/k/v → qkv_proj, gate/up → gate_up_proj)."""
    out: dict[str, Target] = {}
    row = 0
    for name, size in zip(names, sizes):
        out[f"{prefix_hf}.{name}.weight"] = Target(f"{param}.weight", row, size)
        if bias:
            out[f"{prefix_hf}.{name}.bias"] = Target(f"{param}.bias", row, size)
        row += size
    return out
