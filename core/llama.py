"""The llama family: Llama 2/3/3.x, SmolLM/SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3.

They differ only by flags the config carries: biases on q/k/v (qwen2) or on every
projection (llama's attention_bias), RMSNorm on q and k per head (qwen3), an explicit
head_dim, sliding windows (mistral, optionally qwen2/3) and the RoPE scaling type.
"""

from __future__ import annotations

import torch

from .attention import CachedSelfAttention, Step
from .cache import KVCache
from .config import ModelConfig, layer_types_from, size_field
from .errors import UnsupportedModelError
from .family import Family, GgufForm, GgufNames, attention_parameters
from .fields import Fields
from .layers import Embedding, GatedMLP, Linear, RMSNorm, WiredBlock
from .model import CausalLM, Source, Target, columns, fused_rows
from .parallel import SINGLE, Shard
from .rope import RotaryTables, apply_rotary


class Block(WiredBlock):
    def __init__(self, config: ModelConfig, layer: int, shard: Shard):
        super().__init__()
        c = config
        heads = shard.part(c.num_attention_heads, "num_attention_heads")[1]
        kv_heads = shard.part(c.num_key_value_heads, "num_key_value_heads")[1]
        norms = (RMSNorm(c.head_dim, c.rms_norm_eps), RMSNorm(c.head_dim, c.rms_norm_eps)) if c.qk_norm else (None, None)
        self.self_attn = CachedSelfAttention(
            c.hidden_size, heads, kv_heads, c.head_dim, c.qkv_bias, c.o_bias, scale=c.head_dim**-0.5, layer=layer,
            window=c.window_for_layer(layer), qk_norm=norms[0], k_norm=norms[1], shard=shard,
        )
        self.mlp = self.make_mlp(c, layer, shard)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def make_mlp(self, c: ModelConfig, layer: int, shard: Shard) -> torch.nn.Module:
        """The layer's feed-forward part (a mixture of experts' blocks swap in theirs)."""
        intermediate = shard.part(c.intermediate_size, "intermediate_size")[1]
        return GatedMLP(c.hidden_size, intermediate, c.hidden_act, c.mlp_bias, shard=shard)

    def wire(self, x: torch.Tensor, attention, mlp) -> torch.Tensor:
        x = x + attention(self.input_layernorm(x))
        return x + mlp(self.post_attention_layernorm(x))


class LlamaModel(CausalLM):
    # What a family built on llama's embedding, RoPE, final norm and head swaps in (gemma,
    # olmo2, the MoE families): its block (config, layer, shard) and its norm class.
    Block = Block
    Norm = RMSNorm

    def __init__(self, config: ModelConfig, shard: Shard = SINGLE):
        super().__init__(config, shard)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(self.Block(config, i, shard) for i in range(config.num_hidden_layers))
        self.norm = self.Norm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            # Split by vocabulary rows across ranks when it divides evenly; else replicated.
            self.vocab_parallel = shard.active and config.vocab_size % shard.world == 0
            rows = config.vocab_size // shard.world if self.vocab_parallel else config.vocab_size
            self.lm_head = Linear(config.hidden_size, rows, bias=False)
        self.rope: RotaryTables | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def features(self) -> frozenset[str]:
        c = self.config
        flags = {"qkv_bias": c.qkv_bias, "o_bias": c.o_bias, "mlp_bias": c.mlp_bias, "qk_norm": c.qk_norm,
                 "window": any(w is not None for w in self.windows), "tp": self.shard.active}
        return frozenset({"block:llama", f"act:{c.hidden_act}"} | {k for k, v in flags.items() if v})

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
        c, shard, d = self.config, self.shard, self.config.head_dim
        h0, hn = shard.part(c.num_attention_heads, "num_attention_heads")
        k0, kn = shard.part(c.num_key_value_heads, "num_key_value_heads")
        i0, i_n = shard.part(c.intermediate_size, "intermediate_size")
        q_part = (h0 * d, hn * d, c.num_attention_heads * d)
        kv_part = (k0 * d, kn * d, c.num_key_value_heads * d)
        mlp_part = (i0, i_n, c.intermediate_size)
        t: dict[str, Target] = {"model.embed_tokens.weight": Target("embed_tokens.weight"),
                                "model.norm.weight": Target("norm.weight")}
        # A tied head may be stored under either name; both fill the embedding.
        if c.tie_word_embeddings:
            t["lm_head.weight"] = Target("embed_tokens.weight")
        elif self.vocab_parallel:
            rows = self.lm_head.weight.shape[0]
            t["lm_head.weight"] = Target("lm_head.weight", source=Source(0, shard.rank * rows,
                                                                         (shard.rank + 1) * rows, c.vocab_size))
        else:
            t["lm_head.weight"] = Target("lm_head.weight")
        for i in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            t.update(fused_rows(f"{hf}.self_attn", f"{ours}.self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"),
                                (q_part, kv_part, kv_part), c.qkv_bias))
            t[f"{hf}.self_attn.o_proj.weight"] = columns(f"{ours}.self_attn.o_proj.weight", *q_part)
            if c.o_bias:
                t[f"{hf}.self_attn.o_proj.bias"] = Target(f"{ours}.self_attn.o_proj.bias")
            if c.qk_norm:
                t[f"{hf}.self_attn.q_norm.weight"] = Target(f"{ours}.self_attn.q_norm.weight")
                t[f"{hf}.self_attn.k_norm.weight"] = Target(f"{ours}.self_attn.k_norm.weight")
            t.update(fused_rows(f"{hf}.mlp", f"{ours}.mlp.gate_up_proj", ("gate_proj", "up_proj"),
                                (mlp_part, mlp_part), c.mlp_bias))
            t[f"{hf}.mlp.down_proj.weight"] = columns(f"{ours}.mlp.down_proj.weight", *mlp_part)
            if c.mlp_bias:
                t[f"{hf}.mlp.down_proj.bias"] = Target(f"{ours}.mlp.down_proj.bias")
            t[f"{hf}.input_layernorm.weight"] = Target(f"{ours}.input_layernorm.weight")
            t[f"{hf}.post_attention_layernorm.weight"] = Target(f"{ours}.post_attention_layernorm.weight")
        return t


# -- the family's config: transformers' defaults and what the flags mean -------------------------------

def configure(model_type: str, f: Fields, d: dict, layers: int) -> dict:
    # Biases: llama's attention_bias covers q, k, v and o; qwen2 has q/k/v biases, no o.
    if model_type in ("llama", "qwen3"):
        qkv_bias = o_bias = f.bool("attention_bias", False)
    elif model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:  # mistral
        qkv_bias = o_bias = False
    # Sliding windows: mistral applies its window on every layer; qwen2/qwen3 only when
    # use_sliding_window is set, and then on the layers from max_window_layers on (or as an
    # explicit layer_types list says). llama has none.
    window = d.get("sliding_window")
    layer_types: tuple[str, ...] = ()
    if model_type == "llama" or (model_type in ("qwen2", "qwen3") and not f.bool("use_sliding_window", False)):
        window = None
    if window is not None:
        window = size_field(f, "sliding_window")
        if model_type == "mistral":
            layer_types = ("sliding_attention",) * layers
        else:
            given = layer_types_from(f, d, layers)
            if given is None:
                first = f.int("max_window_layers", 28, lo=0)
                given = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
            layer_types = given
    # mlp_bias is LlamaConfig's alone: qwen2, qwen3 and mistral MLPs have no biases (transformers
    # ignores the field in their configs)
    mlp_bias = f.bool("mlp_bias", False) if model_type == "llama" else False
    return dict(qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=model_type == "qwen3",
                sliding_window=window, layer_types=layer_types)


def parameter_count(c: ModelConfig) -> int:
    h = c.hidden_size
    attn = attention_parameters(h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qkv_bias, c.o_bias)
    mlp = 3 * h * c.intermediate_size + ((2 * c.intermediate_size + h) if c.mlp_bias else 0)  # gate, up, down biases
    norms = 2 * h + (2 * c.head_dim if c.qk_norm else 0)
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.num_hidden_layers * (attn + mlp + norms) + c.vocab_size * h + h + head


# -- the family in llama.cpp's GGUF files ---------------------------------------------------------------

# llama.cpp's names, which the other llama-based families extend.
GGUF_NAMES = GgufNames(
    whole={"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"},
    layer={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
           "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
           "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
)


def _gguf_read_llama(config: dict, m) -> None:
    """llama.cpp's llama loads q/k/v/o and MLP biases where the file has them (each optional):
    transformers' attention_bias and mlp_bias, as the first layer's tensors say (a layer that
    lacks one the flag implies is a missing tensor)."""
    for key, stems in (("attention_bias", ("attn_q", "attn_k", "attn_v", "attn_output")),
                       ("mlp_bias", ("ffn_gate", "ffn_up", "ffn_down"))):
        present = [s for s in stems if m.has_tensor(f"blk.0.{s}.bias")]
        if present and len(present) < len(stems):
            raise UnsupportedModelError(
                f"{m.src}: biases on {', '.join(present)} but not on {', '.join(s for s in stems if s not in present)}: "
                f"a llama model ({key}) has them on all of {', '.join(stems)} or none")
        config[key] = bool(present)


def _gguf_llama_keys(config: ModelConfig, raw: dict, arch: str) -> list:
    return [(f"{arch}.rope.dimension_count", "uint32", config.head_dim)]


# llama.cpp's llama architecture: its converter permutes q/k rows so that ggml's RoPE rotates
# adjacent pairs (weights/gguf.py undoes it); Mistral is written as llama and reads back as it.
_GGUF = {"llama": GgufForm("llama", "LlamaForCausalLM", GGUF_NAMES, read=_gguf_read_llama, write=_gguf_llama_keys,
                           permuted_qk=True, o_bias=True, rope_tensors=("llama3",)),
         "mistral": GgufForm("llama", "LlamaForCausalLM", GGUF_NAMES, write=_gguf_llama_keys, permuted_qk=True,
                             reads_back=False, rope_tensors=("llama3",)),
         "qwen2": GgufForm("qwen2", "Qwen2ForCausalLM", GGUF_NAMES),
         "qwen3": GgufForm("qwen3", "Qwen3ForCausalLM", GGUF_NAMES)}


_COMMON = dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
FAMILY = Family(
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    model=LlamaModel,
    configure=configure,
    parameter_count=parameter_count,
    defaults={
        "llama": dict(_COMMON, max_position_embeddings=2048),
        "mistral": dict(_COMMON, max_position_embeddings=4096 * 32, sliding_window=4096),
        "qwen2": dict(_COMMON, max_position_embeddings=32768),
        "qwen3": dict(_COMMON, max_position_embeddings=32768, head_dim=128),
    },
    hf_config={"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"},
    gguf=_GGUF,
)
