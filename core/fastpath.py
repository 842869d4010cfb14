"""The fast decode path: one new token of one sequence per step, each transformer block
compiled with torch.compile (inductor).

Why it is faster than the eager model on a CPU: decode is memory-bound, one read of every
weight per token, and aten's matrix-vector product streams a weight at ~10 GB/s here,
a quarter of what the memory allows. Written as a blocked multiply-and-sum, inductor
turns each projection into one fused, vectorized reduction that streams the weight once
at 2-3x that speed, and it fuses the norms, RoPE, the cache write and the attention
softmax, so the ~40 small kernels per layer that cost Python dispatch time in eager mode
become a handful.

Shapes are static: the cache is allocated in buckets of CAPACITY_BUCKET tokens, the
attention reads the whole bucket under a mask (columns past the current position are
masked), and the position is a tensor, so a whole generation reuses one compiled graph,
and so do all layers (the block module is an argument, not a constant). A new bucket
compiles once more; inductor's on-disk cache makes later processes start fast.
"""

from __future__ import annotations

import time

import torch

from . import kernels
from .cache import KVCache
from .gpt2 import GPT2Model
from .model import CausalLM

NATIVE = False  # set by CompiledDecoder: the native gemv kernel was built and loads
CAPACITY_BUCKET = 256
GEMV_BLOCK = 16  # rows reduced together: enough independent accumulators to keep the FMAs busy


def bucketed(capacity: int) -> int:
    return -(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET


def gemv(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x [1, in] @ weight.T (+ bias), accumulated in float32, for compiled code only: the
    native kernel where it was built (kernels/gemv.c, AVX-512 BF16 dot products), else one
    fused inductor reduction."""
    w = linear.weight
    out, inn = w.shape
    if NATIVE and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16):
        y = torch.ops.twice.gemv(x, w)
    elif out % GEMV_BLOCK:
        y = (w.float() * x.float()).sum(-1).view(1, out)
    else:
        y = (w.view(out // GEMV_BLOCK, GEMV_BLOCK, inn).float() * x.float().view(1, 1, inn)).sum(-1).view(1, out)
    if linear.bias is not None:
        y = y + linear.bias.float()
    return y.to(x.dtype)


def _attention(attn, x, k_cache, v_cache, pos, cos, sin, mask):
    """attn: CachedSelfAttention; x [1, hidden]; k/v_cache [kv_heads, S, D] (this layer,
    this row, written in place at `pos`); mask [S] bool."""
    q, k, v = gemv(x, attn.qkv_proj).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
    d = attn.head_dim
    q, k, v = q.view(attn.heads, 1, d), k.view(attn.kv_heads, 1, d), v.view(attn.kv_heads, 1, d)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if cos is not None:
        half = d // 2
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
    k_cache.index_copy_(1, pos, k)
    v_cache.index_copy_(1, pos, v)
    # Query heads that share a KV head are grouped: [kv_heads, n_rep, D] against [kv_heads, S, D].
    qg = q.view(attn.kv_heads, attn.heads // attn.kv_heads, d).float()
    scores = (qg @ k_cache.float().transpose(1, 2)) * attn.scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = (probs @ v_cache.float()).to(x.dtype).view(1, attn.q_size)
    return gemv(out, attn.o_proj)


def _llama_block(block, x, k_cache, v_cache, pos, cos, sin, mask):
    x = x + _attention(block.self_attn, block.input_layernorm(x), k_cache, v_cache, pos, cos, sin, mask)
    mlp = block.mlp
    gate, up = gemv(block.post_attention_layernorm(x), mlp.gate_up_proj).split(mlp.intermediate, dim=-1)
    return x + gemv(mlp.act(gate) * up, mlp.down_proj)


def _gpt2_block(block, x, k_cache, v_cache, pos, cos, sin, mask):
    x = x + _attention(block.attn, block.ln_1(x), k_cache, v_cache, pos, None, None, mask)
    mlp = block.mlp
    return x + gemv(mlp.act(gemv(block.ln_2(x), mlp.c_fc)), mlp.c_proj)


def _head(norm, head: torch.nn.Linear, x):
    return gemv(norm(x), head)


class CompiledDecoder:
    """Decode steps for batch-1 caches of `model`, compiled on first use."""

    def __init__(self, model: CausalLM):
        global NATIVE
        NATIVE = kernels.available()  # builds it once, before any graph is traced
        self.model = model
        self.gpt2 = isinstance(model, GPT2Model)
        block_fn = _gpt2_block if self.gpt2 else _llama_block
        self.block = torch.compile(block_fn, fullgraph=True, dynamic=False)
        self.head = torch.compile(_head, fullgraph=True, dynamic=False)
        # The head reads the (possibly tied) output matrix through a Linear-shaped view.
        self.head_linear = torch.nn.Linear(1, 1, bias=False, device="meta")
        self.head_linear.weight = torch.nn.Parameter(model.lm_head_weight, requires_grad=False)
        self.warm: set[tuple] = set()
        self.compile_seconds = 0.0

    def supports(self, cache: KVCache) -> bool:
        return cache.batch == 1 and cache.capacity % CAPACITY_BUCKET == 0

    @staticmethod
    def _key(cache: KVCache) -> tuple:
        return (cache.capacity, cache.k.dtype, cache.starts is not None)

    def is_warm(self, cache: KVCache) -> bool:
        return self._key(cache) in self.warm

    def warmup(self, cache: KVCache) -> float:
        """Compile for this cache's shape (once per shape); returns the seconds it took.
        Runs one step at the cache's last column, which no token occupies yet."""
        key = self._key(cache)
        if key in self.warm:
            return 0.0
        t = time.perf_counter()
        length = cache.length
        cache.length = cache.capacity - 1
        try:
            self(torch.zeros(1, 1, dtype=torch.long, device=cache.k.device), cache)
        finally:
            cache.length = length
        self.warm.add(key)
        seconds = time.perf_counter() - t
        self.compile_seconds += seconds
        return seconds

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [1, 1] at column cache.length → logits [1, V]; advances the cache."""
        model, column = self.model, cache.length
        device = cache.k.device
        start = int(cache.starts[0]) if cache.starts is not None else 0
        position = column - start
        pos = torch.tensor([column], device=device)
        cols = torch.arange(cache.capacity, device=device)
        visible = (cols <= column) & (cols >= start)
        masks = {None: visible}
        for window in model.windows:
            if window is not None:
                masks[window] = visible & (column - cols < window)
        if self.gpt2:
            x = model.wte(tokens[0]) + model.wpe.weight[position]
            cos = sin = None
            blocks, norm = model.h, model.ln_f
        else:
            x = model.embed_tokens(tokens[0])
            model.rope.ensure(position + 1)
            cos, sin = model.rope.cos[position].view(1, 1, -1), model.rope.sin[position].view(1, 1, -1)
            blocks, norm = model.layers, model.norm
        for i, block in enumerate(blocks):
            window = (block.attn if self.gpt2 else block.self_attn).window
            x = self.block(block, x, cache.k[i, 0], cache.v[i, 0], pos, cos, sin, masks[window])
        cache.length = column + 1
        return self.head(norm, self.head_linear, x)
