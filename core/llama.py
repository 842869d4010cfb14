"""The llama family: Llama 2/3/3.x, SmolLM/SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3.

They differ only by flags the config carries: biases on q/k/v (qwen2) or on every
projection (llama's attention_bias), RMSNorm on q and k per head (qwen3), an explicit
head_dim, sliding windows (mistral, optionally qwen2/3) and the RoPE scaling type.
"""

from __future__ import annotations

import torch

from .attention import CachedSelfAttention, Step
from .cache import KVCache
from .config import ModelConfig
from .layers import Embedding, GatedMLP, Linear, RMSNorm
from .model import CausalLM, Target, fused_rows
from .rope import RotaryTables, apply_rotary


class Block(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        c = config
        norms = (RMSNorm(c.head_dim, c.rms_norm_eps), RMSNorm(c.head_dim, c.rms_norm_eps)) if c.qk_norm else (None, None)
        self.self_attn = CachedSelfAttention(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qkv_bias, c.o_bias,
            scale=c.head_dim**-0.5, layer=layer, window=c.window_for_layer(layer), qk_norm=norms[0], k_norm=norms[1],
        )
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache, rope) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, cache, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryTables | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        self.rope = RotaryTables(self.config, device, dtype)

    def hidden_states(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        self.rope.ensure(step.column + input_ids.shape[1])
        cos, sin = self.rope.lookup(step.positions)

        def rope(x: torch.Tensor) -> torch.Tensor:
            return apply_rotary(x, cos, sin)

        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x, step, cache, rope)
        return self.norm(x)

    def targets(self) -> dict[str, Target]:
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        t: dict[str, Target] = {"model.embed_tokens.weight": Target("embed_tokens.weight"),
                                "model.norm.weight": Target("norm.weight")}
        # A tied head may be stored under either name; both fill the embedding.
        t["lm_head.weight"] = Target("embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
        for i in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            t.update(fused_rows(f"{hf}.self_attn", f"{ours}.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"),
                                (q, kv, kv), c.qkv_bias))
            t[f"{hf}.self_attn.o_proj.weight"] = Target(f"{ours}.self_attn.o_proj.weight")
            if c.o_bias:
                t[f"{hf}.self_attn.o_proj.bias"] = Target(f"{ours}.self_attn.o_proj.bias")
            if c.qk_norm:
                t[f"{hf}.self_attn.q_norm.weight"] = Target(f"{ours}.self_attn.q_norm.weight")
                t[f"{hf}.self_attn.k_norm.weight"] = Target(f"{ours}.self_attn.k_norm.weight")
            t.update(fused_rows(f"{hf}.mlp", f"{ours}.mlp.gate_up_proj", ("gate_proj", "up_proj"),
                                (inter, inter), c.mlp_bias))
            t[f"{hf}.mlp.down_proj.weight"] = Target(f"{ours}.mlp.down_proj.weight")
            if c.mlp_bias:
                t[f"{hf}.mlp.down_proj.bias"] = Target(f"{ours}.mlp.down_proj.bias")
            t[f"{hf}.input_layernorm.weight"] = Target(f"{ours}.input_layernorm.weight")
            t[f"{hf}.post_attention_layernorm.weight"] = Target(f"{ours}.post_attention_layernorm.weight")
        return t
