"""The olmo2 family: AllenAI's OLMo 2 (transformers' Olmo2ForCausalLM).

How it differs from llama (llama.py), as transformers 5's modeling_olmo2.py computes it:

* no norms before attention and MLP; each block normalizes what the attention and the MLP
  return, before adding it to the residual stream:
      x = x + post_attention_layernorm(attn(x));  x = x + post_feedforward_layernorm(mlp(x))
* q and k are RMS-normalized over the whole projection (q_norm over heads · head_dim, k_norm
  over kv_heads · head_dim), before the split into heads and before RoPE (qwen3 and gemma3
  normalize each head instead);
* its RMSNorm scales in float32 and casts after (llama's casts, then scales);
* `attention_bias` puts biases on q, k, v and o; the MLP never has one.

Tensor parallelism is refused: a norm over the whole q (or k) projection needs the squares of
every head, which a rank holding some heads would have to all-reduce first.
"""

from __future__ import annotations

import torch

from .attention import CachedSelfAttention, Step
from .cache import KVCache
from .config import ModelConfig
from .errors import UnsupportedModelError
from .family import Family, attention_parameters
from .fields import Fields
from .layers import GatedMLP, RMSNorm
from .llama import LlamaModel
from .model import Target, fused_rows
from .parallel import SINGLE, Shard


class Olmo2RMSNorm(RMSNorm):
    """transformers' Olmo2RMSNorm: normalize and scale in float32, then cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


class Olmo2Attention(CachedSelfAttention):
    """The shared attention with q/k norms over the whole projections, before the head split."""

    def __init__(self, c: ModelConfig, layer: int):
        super().__init__(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qkv_bias,
                         c.o_bias, scale=c.head_dim**-0.5, layer=layer, window=None)
        self.q_norm = Olmo2RMSNorm(self.q_size, c.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(self.kv_size, c.rms_norm_eps)

    def normed(self, q: torch.Tensor, k: torch.Tensor, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q), self.k_norm(k)
        return (q.view(b, t, self.heads, self.head_dim).transpose(1, 2),
                k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2))


class Block(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: Shard = SINGLE):
        super().__init__()
        c = config
        self.self_attn = Olmo2Attention(c, layer)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, False)
        self.post_attention_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache, rope) -> torch.Tensor:
        return self.wire(x, lambda h: self.self_attn(h, step, cache, rope), self.mlp)

    def wire(self, x: torch.Tensor, attention, mlp) -> torch.Tensor:
        """The block around its attention and MLP (callables: the eager or the compiled step's)."""
        x = x + self.post_attention_layernorm(attention(x))
        return x + self.post_feedforward_layernorm(mlp(x))


class Olmo2Model(LlamaModel):
    """llama's embedding, RoPE, final norm and head (and hidden_states), with olmo2's blocks and norms."""

    Block = Block
    Norm = Olmo2RMSNorm

    def __init__(self, config: ModelConfig, shard: Shard = SINGLE):
        if shard.active:
            raise UnsupportedModelError("tensor parallelism (--tp) is not implemented for olmo2: its q/k norms span "
                                        "every head of the projection")
        super().__init__(config, shard)

    def features(self) -> frozenset[str]:
        c = self.config
        flags = {"qkv_bias": c.qkv_bias, "o_bias": c.o_bias}
        return frozenset({"block:post_norm", "qk_norm:full", f"act:{c.hidden_act}"} | {k for k, v in flags.items() if v})

    def targets(self) -> dict[str, Target]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        i = c.intermediate_size
        t: dict[str, Target] = {"model.embed_tokens.weight": Target("embed_tokens.weight"),
                                "model.norm.weight": Target("norm.weight"),
                                # a tied head may be stored under either name; both fill the embedding
                                "lm_head.weight": Target("embed_tokens.weight" if c.tie_word_embeddings
                                                         else "lm_head.weight")}
        for n in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{n}", f"layers.{n}"
            t.update(fused_rows(f"{hf}.self_attn", f"{ours}.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"),
                                ((0, q, q), (0, kv, kv), (0, kv, kv)), c.qkv_bias))
            t[f"{hf}.self_attn.o_proj.weight"] = Target(f"{ours}.self_attn.o_proj.weight")
            if c.o_bias:
                t[f"{hf}.self_attn.o_proj.bias"] = Target(f"{ours}.self_attn.o_proj.bias")
            for leaf in ("self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm",
                         "post_feedforward_layernorm"):
                t[f"{hf}.{leaf}.weight"] = Target(f"{ours}.{leaf}.weight")
            t.update(fused_rows(f"{hf}.mlp", f"{ours}.mlp.gate_up_proj", ("gate_proj", "up_proj"),
                                ((0, i, i), (0, i, i)), False))
            t[f"{hf}.mlp.down_proj.weight"] = Target(f"{ours}.mlp.down_proj.weight")
        return t


def configure(model_type: str, f: Fields, d: dict, layers: int) -> dict:
    # attention_bias covers q, k, v and o; the MLP has no bias (transformers reads no mlp_bias).
    bias = f.bool("attention_bias", False)
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False)


def parameter_count(c: ModelConfig) -> int:
    h = c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = attention_parameters(h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qkv_bias, c.o_bias)
    norms = 2 * h + q + kv  # post-attention, post-feedforward, q_norm, k_norm
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.num_hidden_layers * (attn + 3 * h * c.intermediate_size + norms) + c.vocab_size * h + h + head


FAMILY = Family(
    model_types=("olmo2",),
    model=Olmo2Model,
    configure=configure,
    parameter_count=parameter_count,
    defaults={"olmo2": dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                            tie_word_embeddings=False, hidden_act="silu")},
    hf_config={"olmo2": "Olmo2Config"},
)
