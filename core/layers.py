"""Small building blocks: norms, activations and the two MLP shapes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class Linear(torch.nn.Linear):
    """A linear layer whose weights are left uninitialized: the loader overwrites every
    one, so random init would only cost time (seconds for a 1B model)."""

    def reset_parameters(self) -> None:
        pass


class ReducedLinear(Linear):
    """A linear layer whose input features are split across tensor-parallel ranks: each
    rank multiplies its slice, the partial sums are all-reduced, and only then is the bias
    added (once). With one rank it is an ordinary linear layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard=None):
        super().__init__(in_features, out_features, bias=bias)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard is None or not self.shard.active:
            return F.linear(x, self.weight, self.bias)
        y = self.shard.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class WiredBlock(torch.nn.Module):
    """A transformer block that states once how it wires its attention (`self_attn`) and MLP
    (`mlp`) together: `wire(x, attention, mlp)` with callables. The eager forward passes the
    cached attention and the block's own MLP; the compiled step (fastpath.py) passes its own."""

    def forward(self, x: torch.Tensor, step, cache, rope) -> torch.Tensor:
        return self.wire(x, lambda h: self.self_attn(h, step, cache, rope), self.mlp)

    def wire(self, x: torch.Tensor, attention, mlp) -> torch.Tensor:
        raise NotImplementedError


class Embedding(torch.nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm: normalize in float32, scale in the model dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class OffsetRMSNorm(torch.nn.Module):
    """transformers' Gemma2RMSNorm / Gemma3RMSNorm ("norm:offset1"): normalize and scale by
    (1 + w), both in float32, then cast to the input's dtype. The checkpoint stores w (zero
    means no scaling)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's tanh approximation, written as transformers' NewGELUActivation writes it.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul. Under tensor
    parallelism `intermediate` is this rank's share."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, shard=None):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = ReducedLinear(intermediate, hidden, bias=bias, shard=shard)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class PlainMLP(torch.nn.Module):
    """GPT-2's c_proj(act(c_fc(x)))."""

    def __init__(self, hidden: int, intermediate: int, act: str, shard=None):
        super().__init__()
        self.c_fc = Linear(hidden, intermediate)
        self.c_proj = ReducedLinear(intermediate, hidden, bias=True, shard=shard)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))
