"""Mixture-of-experts layers, shared by every MoE family (moe.py: mixtral, qwen2_moe, qwen3_moe).

A sparse MLP block routes each token to `top_k` of `experts` gated MLPs:

    probabilities = softmax(router(x)) in float32;  weights, chosen = topk(probabilities, top_k)
    weights /= weights.sum()            (when `renormalize`: mixtral always, qwen's norm_topk_prob)
    y = Σ_chosen weight_e · down_e(act(gate_e(x)) · up_e(x))      (+ sigmoid(g(x)) · shared(x))

as transformers 5.24 computes it (modeling_mixtral.py, modeling_qwen3_moe.py, modeling_qwen2_moe.py):
the router's product in the activation dtype, the softmax in float32, mixtral's weights kept in
float32 (the product with an expert's output then rounds once to the activation dtype), qwen's
cast to the activation dtype first, and the experts' outputs summed in increasing expert order.

Storage: one stacked matrix per projection, as transformers 5 holds them in memory and llama.cpp's
GGUF stores them (ffn_gate_exps / ffn_up_exps / ffn_down_exps), flattened to 2-D so that it is an
ordinary Linear weight (and an ordinary BlockLinear once quantized, core/qweight.py):

    experts.gate_up_proj.weight  [experts · 2·inter, hidden]   expert e's rows: [e·2·inter, (e+1)·2·inter),
                                                               gate rows first, then up rows
    experts.down_proj.weight     [experts · hidden, inter]     expert e's rows: [e·hidden, (e+1)·hidden)

Expert e's weights are one contiguous run of rows (of float values, or of GGUF blocks of
`row_bytes` each), so a step reads exactly the chosen experts' rows: in the eager path below,
and in a native step at `base + e · rows_per_expert · row_bytes` (see /work/notes/moe.md).

Tokens are grouped by expert (one product per chosen expert over the tokens that chose it), so
a batch-1 decode step runs `top_k` expert MLPs and never touches the others' weights; a prefill
runs each hit expert once over its tokens.
"""

from __future__ import annotations

import torch

from .layers import ACTIVATIONS, GatedMLP, Linear
from .model import Source, Target
from .qweight import BlockWeight, Part, product


def route(logits: torch.Tensor, top_k: int, renormalize: bool, float_weights: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, experts] → (weights [N, top_k], expert ids [N, top_k])."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float_weights else weights.to(logits.dtype)), chosen


def rows_of(weight, start: int, stop: int):
    """Rows [start, stop) of a float matrix (a view) or of a BlockWeight (views of its blocks)."""
    if not isinstance(weight, BlockWeight):
        return weight[start:stop]
    parts, row = [], 0
    for p in weight.parts:
        lo, hi = max(start, row), min(stop, row + p.rows)
        if lo < hi:
            parts.append(Part(p.codec, hi - lo, p.data[lo - row: hi - row]))
        row += p.rows
    return BlockWeight(parts, weight.in_features)


class Experts(torch.nn.Module):
    """`experts` gated MLPs stored stacked (see the module doc). Under tensor parallelism
    `intermediate` is this rank's share of every expert's rows (the caller all-reduces)."""

    def __init__(self, experts: int, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.experts, self.hidden, self.intermediate = experts, hidden, intermediate
        self.gate_up_proj = Linear(hidden, experts * 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, experts * hidden, bias=False)
        # Quantized (--quantize), each is one buffer of blocks per run of a type, not a part per expert.
        self.gate_up_proj.stacked = self.down_proj.stacked = True
        self.act = ACTIVATIONS[act]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP on tokens x [n, hidden]: reads only its own rows."""
        i, h = self.intermediate, self.hidden
        gate, up = product(x, rows_of(self.gate_up_proj.weight, e * 2 * i, (e + 1) * 2 * i)).split(i, dim=-1)
        return product(self.act(gate) * up, rows_of(self.down_proj.weight, e * h, (e + 1) * h))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], chosen/weights [N, top_k] → Σ weight · expert(x) [N, hidden]."""
        top_k = chosen.shape[1]
        flat = chosen.reshape(-1)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # one token: its top_k experts, in increasing order
            picks = sorted(zip(flat.tolist(), range(top_k)))
            for e, k in picks:
                y = self.expert(e, x) * weights[:, k, None]
                out += y.to(out.dtype)
            return out
        order = torch.argsort(flat, stable=True)  # token slots grouped by expert
        hit, counts = torch.unique(flat, sorted=True, return_counts=True)
        start = 0
        for e, n in zip(hit.tolist(), counts.tolist()):
            slots = order[start:start + n]
            start += n
            tokens = slots // top_k
            y = self.expert(e, x[tokens]) * weights.reshape(-1)[slots, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SparseMoE(torch.nn.Module):
    """The MLP of a sparse layer: router (`gate`), experts, and optionally qwen2_moe's shared
    expert with its sigmoid gate. Module names follow the checkpoints' (`mlp.gate`, ...)."""

    def __init__(self, hidden: int, experts: int, intermediate: int, act: str, top_k: int, renormalize: bool,
                 float_weights: bool, shared_intermediate: int = 0, shard=None):
        super().__init__()
        self.top_k, self.renormalize, self.float_weights = top_k, renormalize, float_weights
        self.gate = Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, intermediate, act)
        self.shard = shard
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act, False, shard=shard)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, chosen = route(self.gate(x2), self.top_k, self.renormalize, self.float_weights)
        y = self.experts(x2, chosen, weights)
        if self.shard is not None and self.shard.active:
            y = self.shard.all_reduce(y)  # each rank summed its rows' share of every chosen expert
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        return y.view(shape)


def expert_targets(hf: str, ours: str, names: tuple[str, str, str], experts: int, hidden: int, intermediate: int,
                   shard, per_expert: bool = True, stacked: bool = True) -> dict[str, Target]:
    """Checkpoint names → rows of the stacked expert matrices of one layer.

    `hf` is the layer's MLP prefix ("model.layers.3.mlp"), `ours` the SparseMoE's
    ("layers.3.mlp"); `names` the per-expert gate, up and down names ("gate_proj", "up_proj",
    "down_proj"; mixtral's "w1", "w3", "w2"). Both forms are accepted: per-expert tensors
    (`{hf}.experts.E.gate_proj.weight`: what the Hub's files hold and transformers 5's
    save_pretrained writes) and the stacked form transformers 5 holds in memory
    (`{hf}.experts.gate_up_proj` [experts, 2·inter, hidden], `{hf}.experts.down_proj`
    [experts, hidden, inter]). Under tensor parallelism each rank keeps rows [i0, i0 + n) of
    every expert's gate and up and those columns of its down (only the per-expert form)."""
    i0, n = shard.part(intermediate, "moe_intermediate_size")
    gate, up, down = names
    t: dict[str, Target] = {}
    for e in range(experts if per_expert else 0):
        src = Source(0, i0, i0 + n, intermediate) if n != intermediate else None
        cols = Source(1, i0, i0 + n, intermediate) if n != intermediate else None
        p = f"{hf}.experts.{e}"
        t[f"{p}.{gate}.weight"] = Target(f"{ours}.experts.gate_up_proj.weight", e * 2 * n, n, source=src)
        t[f"{p}.{up}.weight"] = Target(f"{ours}.experts.gate_up_proj.weight", e * 2 * n + n, n, source=src)
        t[f"{p}.{down}.weight"] = Target(f"{ours}.experts.down_proj.weight", e * hidden, hidden, source=cols)
    if stacked and n == intermediate:
        t[f"{hf}.experts.gate_up_proj"] = Target(f"{ours}.experts.gate_up_proj.weight", 0, experts * 2 * n,
                                                 stored_shape=(experts, 2 * n, hidden))
        t[f"{hf}.experts.down_proj"] = Target(f"{ours}.experts.down_proj.weight", 0, experts * hidden,
                                              stored_shape=(experts, hidden, n))
    return t
