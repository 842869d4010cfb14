"""Causal self-attention over the KV cache, shared by every model family.

`Step` is computed once per forward pass (not once per layer): which cache columns the
new tokens go to, their positions, and the attention masks. Grouped-query attention
goes through SDPA's `enable_gqa`, whose CPU and CUDA kernels index the shared KV head
instead of repeating K and V in memory. New tokens with nothing masked but the future (a
prompt, a chunk, a chat turn) go to the native CPU kernel where it applies
(kernels/prefill.c), SDPA otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels
from .cache import KVCache, key_bias
from .layers import Linear, ReducedLinear


@dataclass
class Step:
    column: int  # first cache column this forward pass writes
    positions: torch.Tensor  # [B, T] token positions (for RoPE / learned positions)
    # Per sliding window: None (attend to every filled column), CAUSAL (a fresh prompt:
    # SDPA's own causal kernel), CausalAfter (new tokens after cached ones, nothing else
    # masked) or a bool mask [B, 1, T, end], True = attend.
    masks: dict[int | None, "torch.Tensor | str | CausalAfter | None"]

    @staticmethod
    def build(cache: KVCache, tokens: int, windows: set[int | None]) -> "Step":
        column = cache.length
        end = column + tokens
        device = cache.k.device
        q_cols = torch.arange(column, end, device=device)
        starts = cache.starts
        if starts is None:
            positions = q_cols.unsqueeze(0).expand(cache.batch, tokens)
        else:
            positions = (q_cols.unsqueeze(0) - starts.unsqueeze(1)).clamp(min=0)
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in windows:
            needs_window = window is not None and end > window
            if starts is None and not needs_window:
                if tokens == 1:
                    masks[window] = None  # one query attending to every filled column
                    continue
                if column == 0:
                    masks[window] = CAUSAL
                    continue
            k_cols = torch.arange(end, device=device)
            allowed = k_cols[None, :] <= q_cols[:, None]  # causal [T, end]
            if needs_window:
                allowed = allowed & (q_cols[:, None] - k_cols[None, :] < window)
            allowed = allowed.unsqueeze(0)  # [1, T, end]
            if starts is not None:
                real = k_cols[None, None, :] >= starts[:, None, None]
                # A padding query sees only itself, so its (ignored) softmax stays finite.
                own = k_cols[None, None, :] == q_cols[None, :, None]
                allowed = allowed & (real | own)
            masks[window] = allowed.unsqueeze(1)
            if not needs_window:  # several tokens after cached ones, or rows with left padding
                masks[window] = CausalAfter(column, masks[window], starts)
        return Step(column=column, positions=positions, masks=masks)


CAUSAL = "causal"


@dataclass(frozen=True)
class CausalAfter:
    """Causal attention of new tokens after `column` cached ones (a prompt's later chunk, a
    chat turn), in rows that may start later (`starts`: left padding): token t sees columns
    [start, column + t], a padding token only itself. `mask` says the same as a bool mask,
    for SDPA."""

    column: int
    mask: torch.Tensor
    starts: torch.Tensor | None = None


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "torch.Tensor | str | CausalAfter | None", scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, kv_heads, S, D] → [B, T, H*D]. Query head h uses KV head
    h // (H / kv_heads), transformers' repeat_kv order. `softcap` (gemma2's
    attn_logit_softcapping) caps the scores at ±softcap (tanh(s / cap) · cap, before the mask),
    which neither SDPA nor the native kernel can: those scores are computed explicitly."""
    b, h, t, d = q.shape
    if softcap is not None:
        return _capped_attention(q, k, v, mask, scale, softcap)
    gqa = k.shape[1] != h
    if mask is CAUSAL or isinstance(mask, CausalAfter):
        # New tokens on the CPU: the native kernel, 2.8× SDPA's in bf16 (kernels/prefill.c).
        native = (kernels.causal_attention(q, k, v, scale) if mask is CAUSAL
                  else kernels.causal_attention(q, k, v, scale, mask.column, mask.starts))
        if native is not None:
            return native
        if isinstance(mask, CausalAfter):
            mask = mask.mask
    if mask is CAUSAL:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(b, t, h * d)


def attend_blocks(q: torch.Tensor, cache: KVCache, layer: int, end: int, mask, scale: float) -> torch.Tensor | None:
    """attend() for new tokens over a block cache's columns [0, end) of `layer` as stored (the
    native kernel decodes each kv head's blocks into its own tiles: no float copy of the
    cache), bit for bit attend() over `cache.attended`; None where the kernel does not apply
    (another mask, device or shape: the caller decodes and attends)."""
    if not (mask is CAUSAL or isinstance(mask, CausalAfter)):
        return None
    column, starts = (0, None) if mask is CAUSAL else (mask.column, mask.starts)
    if column + q.shape[2] != end:
        return None
    offset = cache.key_offset[layer] if cache.key_offset is not None else None
    return kernels.causal_attention_blocks(q, cache.k[layer], cache.v[layer], cache.format.ggml_type, scale, column,
                                           starts, offset)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float,
                      softcap: float) -> torch.Tensor:
    """attend() with soft-capped scores, as transformers' eager_attention_forward computes it:
    scores in the activation dtype, capped, masked, softmax in float32, cast back."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    if groups > 1:  # repeat_kv: query head i reads kv head i // groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if isinstance(mask, CausalAfter):
        mask = mask.mask
    elif mask is CAUSAL:  # a fresh prompt: query t sees columns [0, t]
        mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(b, t, h * d)


class CachedSelfAttention(torch.nn.Module):
    """Fused QKV projection, optional q/k norm and RoPE, cache write, attention, output
    projection. Used by the llama family (with rope) and gpt2 (without). Under tensor
    parallelism `heads` and `kv_heads` are this rank's share."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool,
                 scale: float, layer: int, window: int | None, qk_norm: torch.nn.Module | None = None,
                 k_norm: torch.nn.Module | None = None, shard=None, softcap: float | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = ReducedLinear(self.q_size, hidden, bias=o_bias, shard=shard)
        self.q_norm, self.k_norm = qk_norm, k_norm
        self.scale, self.layer, self.window = scale, layer, window
        self.softcap = softcap  # attention-logit soft-cap (gemma2); None: SDPA / the native kernel

    def qkv(self, x: torch.Tensor, rope=None, product=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] → q [B, H, T, D], k and v [B, kv_heads, T, D]: projected (by the
        module, or `product(x, qkv_proj)`: the compiled step's), normalized where the family
        does, rotated by `rope`. The eager and compiled steps both start here."""
        b, t, _ = x.shape
        y = self.qkv_proj(x) if product is None else product(x, self.qkv_proj)
        q, k, v = y.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = self.normed(q, k, b, t)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = rope(q), rope(k)
        return q, k, v

    def normed(self, q: torch.Tensor, k: torch.Tensor, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections [B, T, H·D] as heads [B, H, T, D], each head RMS-normalized where
        the family does (qwen3, gemma3; olmo2 normalizes the whole projection instead)."""
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2)

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache, rope=None) -> torch.Tensor:
        q, k, v = self.qkv(x, rope)
        mask, end = step.masks[self.window], step.column + k.shape[2]
        blocks = getattr(cache, "quantized", False)
        if blocks and (bias := key_bias(self)) is not None:
            cache.offset_keys(*bias)  # block caches store keys minus the key bias (core/cache.py)
        cache.store(self.layer, step.column, k, v)
        # a block cache's blocks read as stored where the native kernel applies, else the
        # columns in use as values (views of a float cache, a decoded copy of blocks)
        out = attend_blocks(q, cache, self.layer, end, mask, self.scale) if blocks and self.softcap is None else None
        if out is None:
            out = attend(q, *cache.attended(self.layer, end, q.dtype), mask, self.scale, self.softcap)
        return self.o_proj(out)
