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

Tensor parallelism shards as llama does (heads, MLP rows, vocabulary rows of an untied head);
a norm over the whole q (or k) projection needs the squares of every head, so each rank sums
the squares of its heads and the sums are all-reduced (one number per token and norm) before
it normalizes its part with its slice of the norm's weight (`ShardedRMSNorm`); the post-norms
act on the all-reduced outputs.
"""

from __future__ import annotations

import torch

from .attention import CachedSelfAttention
from .config import ModelConfig
from .errors import UnsupportedModelError
from .family import Family, GgufForm, GgufNames, attention_parameters
from .fields import Fields
from .layers import GatedMLP, RMSNorm, WiredBlock
from .llama import GGUF_NAMES as _LLAMA_GGUF_NAMES
from .llama import LlamaModel
from .model import Source, Target
from .parallel import SINGLE, Shard


class Olmo2RMSNorm(RMSNorm):
    """transformers' Olmo2RMSNorm: normalize and scale in float32, then cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(self.mean_square(x) + self.eps)
        return (self.weight * x).to(dtype)

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(-1, keepdim=True)


class ShardedRMSNorm(Olmo2RMSNorm):
    """Olmo2RMSNorm over a projection whose `total` features are split across tensor-parallel
    ranks (this rank holds `size` of them and that slice of the weight): the mean of the
    squares is the all-reduced sum of every rank's squares over `total`. One rank: exactly
    Olmo2RMSNorm."""

    def __init__(self, size: int, total: int, eps: float, shard: Shard):
        super().__init__(size, eps)
        self.total, self.shard = total, shard

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        if not self.shard.active:
            return super().mean_square(x)
        return self.shard.all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.total


class Olmo2Attention(CachedSelfAttention):
    """The shared attention with q/k norms over the whole projections, before the head split
    (under tensor parallelism: this rank's heads, the norms' squares all-reduced)."""

    def __init__(self, c: ModelConfig, layer: int, shard: Shard = SINGLE):
        heads = shard.part(c.num_attention_heads, "num_attention_heads")[1]
        kv_heads = shard.part(c.num_key_value_heads, "num_key_value_heads")[1]
        super().__init__(c.hidden_size, heads, kv_heads, c.head_dim, c.qkv_bias, c.o_bias, scale=c.head_dim**-0.5,
                         layer=layer, window=None, shard=shard)
        self.q_norm = ShardedRMSNorm(self.q_size, c.num_attention_heads * c.head_dim, c.rms_norm_eps, shard)
        self.k_norm = ShardedRMSNorm(self.kv_size, c.num_key_value_heads * c.head_dim, c.rms_norm_eps, shard)

    def normed(self, q: torch.Tensor, k: torch.Tensor, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q), self.k_norm(k)
        return (q.view(b, t, self.heads, self.head_dim).transpose(1, 2),
                k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2))


class Block(WiredBlock):
    def __init__(self, config: ModelConfig, layer: int, shard: Shard = SINGLE):
        super().__init__()
        c = config
        self.self_attn = Olmo2Attention(c, layer, shard)
        intermediate = shard.part(c.intermediate_size, "intermediate_size")[1]
        self.mlp = GatedMLP(c.hidden_size, intermediate, c.hidden_act, False, shard=shard)
        self.post_attention_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(c.hidden_size, c.rms_norm_eps)

    def wire(self, x: torch.Tensor, attention, mlp) -> torch.Tensor:
        x = x + self.post_attention_layernorm(attention(x))
        return x + self.post_feedforward_layernorm(mlp(x))


class Olmo2Model(LlamaModel):
    """llama's embedding, RoPE, final norm and head (and hidden_states), with olmo2's blocks and norms."""

    Block = Block
    Norm = Olmo2RMSNorm

    def features(self) -> frozenset[str]:
        c = self.config
        flags = {"qkv_bias": c.qkv_bias, "o_bias": c.o_bias, "tp": self.shard.active}
        return frozenset({"block:post_norm", "qk_norm:full", f"act:{c.hidden_act}"} | {k for k, v in flags.items() if v})

    def targets(self) -> dict[str, Target]:
        """llama's names, less the pre-norms, plus the post-norms and the q/k norms (sliced as
        this rank's heads of the projection they normalize)."""
        c, d = self.config, self.config.head_dim
        t = {name: target for name, target in super().targets().items()
             if not name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))}
        h0, hn = self.shard.part(c.num_attention_heads, "num_attention_heads")
        k0, kn = self.shard.part(c.num_key_value_heads, "num_key_value_heads")
        for n in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{n}", f"layers.{n}"
            for leaf, (start, size, total) in (("q_norm", (h0 * d, hn * d, c.num_attention_heads * d)),
                                               ("k_norm", (k0 * d, kn * d, c.num_key_value_heads * d))):
                source = Source(0, start, start + size, total) if size != total else None
                t[f"{hf}.self_attn.{leaf}.weight"] = Target(f"{ours}.self_attn.{leaf}.weight", source=source)
            for leaf in ("post_attention_layernorm", "post_feedforward_layernorm"):
                t[f"{hf}.{leaf}.weight"] = Target(f"{ours}.{leaf}.weight")
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


# -- OLMo 2 in llama.cpp's GGUF files -------------------------------------------------------------------

# Norms after attention and MLP (post_attention_norm / post_ffw_norm), q/k norms over the whole
# projections under the names qwen3 uses for its per-head ones.
_GGUF_NAMES = GgufNames(_LLAMA_GGUF_NAMES.whole, {
    **{g: h for g, h in _LLAMA_GGUF_NAMES.layer.items() if g not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"})


def _gguf_read(config: dict, m) -> None:
    """Its MLP has no bias setting; no sliding windows (OLMo 3's are another architecture)."""
    del config["mlp_bias"]
    if m.get("attention.sliding_window"):
        raise UnsupportedModelError(f"{m.src}: olmo2 with sliding-window layers (OLMo 3) is not supported")


FAMILY = Family(
    model_types=("olmo2",),
    model=Olmo2Model,
    configure=configure,
    parameter_count=parameter_count,
    defaults={"olmo2": dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                            tie_word_embeddings=False, hidden_act="silu")},
    hf_config={"olmo2": "Olmo2Config"},
    gguf={"olmo2": GgufForm("olmo2", "Olmo2ForCausalLM", _GGUF_NAMES, read=_gguf_read)},
)
