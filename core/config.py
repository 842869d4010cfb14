"""One normalized model config, read from a Hugging Face `config.json` dict.

Field names are Hugging Face's own (as mlx-lm keeps them), so a reader can hold this file
next to a checkpoint's config.json. GPT-2's older names (`n_embd`, `n_layer`, ...) are read
through the same alias table transformers uses (`attribute_map`).

Both forms of RoPE settings are accepted: the Hub's (`rope_theta` and `rope_scaling` at the
top level) and transformers 5's (`rope_parameters`). Either way they end up in
`rope_parameters`, a dict with at least `rope_type` and `rope_theta`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MAX_LAYERS = 100_000
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")

# transformers' per-family defaults for fields a config.json may leave out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
    "mistral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, rope_theta=10000.0,
                    tie_word_embeddings=False, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
    "qwen3": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  head_dim=128),
    "gpt2": dict(max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True),
}

# GPT-2 spells the common fields its own way (transformers' GPT2Config.attribute_map).
_GPT2_ALIASES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
    "n_inner": "intermediate_size",
    "layer_norm_epsilon": "rms_norm_eps",
    "activation_function": "hidden_act",
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float  # the LayerNorm epsilon for gpt2
    hidden_act: str
    tie_word_embeddings: bool
    rope_parameters: dict | None  # None for learned absolute positions (gpt2)
    # Which projections carry a bias: llama's `attention_bias` covers q, k, v and o;
    # qwen2 has q/k/v biases but none on o; gpt2 has biases everywhere.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" / "sliding_attention" per layer
    scale_attn_weights: bool = True  # gpt2 option: scale scores by 1/sqrt(head_dim)
    scale_attn_by_inverse_layer_idx: bool = False  # gpt2 option
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the dtype the checkpoint was saved in, if it says
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def window_for_layer(self, layer: int) -> int | None:
        if self.sliding_window and self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def kv_bytes_per_token(self, element_size: int) -> int:
        """2 (K and V) · layers · kv_heads · head_dim · bytes per element, for one sequence."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size

    def parameter_count(self) -> int:
        """Parameters as stored (a tied head counted once)."""
        h, L, v = self.hidden_size, self.num_hidden_layers, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        mlp_mats = 2 if self.model_type == "gpt2" else 3
        mlp = mlp_mats * h * self.intermediate_size
        if self.mlp_bias:
            mlp += self.intermediate_size + h
        norms = (2 * h if self.model_type != "gpt2" else 4 * h) + (2 * self.head_dim if self.qk_norm else 0)
        total = L * (attn + mlp + norms) + v * h + (h if self.model_type != "gpt2" else 2 * h)
        if self.model_type == "gpt2":
            total += self.max_position_embeddings * h
        if not self.tie_word_embeddings:
            total += v * h
        return total


def _positive_int(d: dict, key: str, source: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _positive_float(d: dict, key: str, source: str) -> float:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}: {key} must be a positive number, got {value!r}")
    return float(value)


def _token_ids(value: Any, key: str, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{source}: {key} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def normalize_rope(d: dict, source: str) -> dict:
    """Merge the Hub form (rope_theta + rope_scaling) and the transformers 5 form
    (rope_parameters) into one dict with `rope_type` and `rope_theta`."""
    params = d.get("rope_parameters")
    if params is None:
        params = d.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters / rope_scaling must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"{source}: per-layer-type RoPE parameters are not supported")
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", d.get("rope_theta"))
    params["rope_theta"] = _positive_float({"rope_theta": theta}, "rope_theta", source)
    params["rope_type"] = rope_type
    if d.get("partial_rotary_factor") not in (None, 1, 1.0) or params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise UnsupportedModelError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
    if rope_type in ("linear", "llama3", "yarn"):
        if rope_type != "yarn" or params.get("factor") is not None:
            _positive_float(params, "factor", source)
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
        _positive_int(params, "original_max_position_embeddings", source)
    if rope_type == "llama3":
        low = _positive_float(params, "low_freq_factor", source)
        high = _positive_float(params, "high_freq_factor", source)
        if high <= low:
            raise ConfigError(f"{source}: rope high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    return params


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    """Validate a config.json dict and turn it into a ModelConfig (errors name `source`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        shown = "no model_type" if model_type is None else f"model_type {model_type!r}"
        raise UnsupportedModelError(
            f"{source}: {shown} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    d = dict(_FAMILY_DEFAULTS[model_type])
    if model_type == "gpt2":
        d.update({"hidden_act": "gelu_new", "rms_norm_eps": 1e-5})
        for old, new in _GPT2_ALIASES.items():
            if old in raw and raw[old] is not None:
                d[new] = raw[old]
    d.update({k: v for k, v in raw.items() if v is not None or k in ("sliding_window",)})

    vocab_size = _positive_int(d, "vocab_size", source)
    hidden = _positive_int(d, "hidden_size", source)
    layers = _positive_int(d, "num_hidden_layers", source)
    if layers > MAX_LAYERS:  # checked before anything is built per layer
        raise ConfigError(f"{source}: num_hidden_layers {layers} is not a plausible layer count (at most {MAX_LAYERS:,})")
    heads = _positive_int(d, "num_attention_heads", source)
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = heads
    kv_heads = _positive_int(d, "num_key_value_heads", source)
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if d.get("head_dim") is None or model_type == "gpt2":
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
        d["head_dim"] = hidden // heads
    head_dim = _positive_int(d, "head_dim", source)
    if head_dim % 2 and model_type != "gpt2":
        raise ConfigError(f"{source}: head_dim ({head_dim}) must be even for rotary embeddings")
    if model_type == "gpt2" and d.get("intermediate_size") is None:
        d["intermediate_size"] = 4 * hidden
    intermediate = _positive_int(d, "intermediate_size", source)
    max_pos = _positive_int(d, "max_position_embeddings", source)
    eps = _positive_float(d, "rms_norm_eps", source)
    act = d.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: activation {act!r} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )

    rope = None if model_type == "gpt2" else normalize_rope(d, source)

    if model_type == "llama":
        qkv_bias = o_bias = bool(d.get("attention_bias", False))
    elif model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type == "qwen3":
        qkv_bias = o_bias = bool(d.get("attention_bias", False))
    elif model_type == "gpt2":
        qkv_bias = o_bias = True
    else:  # mistral
        qkv_bias = o_bias = False
    mlp_bias = True if model_type == "gpt2" else bool(d.get("mlp_bias", False))

    # Sliding windows: mistral applies its window on every layer; qwen2/qwen3 only when
    # use_sliding_window is set, and then on the layers from max_window_layers on
    # (or as an explicit layer_types list says).
    window = d.get("sliding_window")
    layer_types: tuple[str, ...] = ()
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    if window is not None:
        window = _positive_int({"sliding_window": window}, "sliding_window", source)
        if model_type == "mistral":
            layer_types = ("sliding_attention",) * layers
        elif model_type in ("qwen2", "qwen3"):
            given = d.get("layer_types")
            if given is not None:
                if not isinstance(given, list) or len(given) != layers or any(
                    t not in ("full_attention", "sliding_attention") for t in given
                ):
                    raise ConfigError(f"{source}: layer_types must list full_attention/sliding_attention per layer")
                layer_types = tuple(given)
            else:
                first = d.get("max_window_layers", 28)
                layer_types = tuple(
                    "sliding_attention" if i >= first else "full_attention" for i in range(layers)
                )
        else:
            window = None

    dtype = d.get("dtype", d.get("torch_dtype"))
    known = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=eps,
        hidden_act=act,
        tie_word_embeddings=bool(d.get("tie_word_embeddings")),
        rope_parameters=rope,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=window,
        layer_types=layer_types,
        scale_attn_weights=bool(d.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(d.get("scale_attn_by_inverse_layer_idx", False)),
        bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None,
        eos_token_id=_token_ids(d.get("eos_token_id"), "eos_token_id", source),
        torch_dtype=dtype if isinstance(dtype, str) else None,
        extra={k: v for k, v in raw.items() if k not in known},
    )
