"""One normalized model config, read from a Hugging Face `config.json` dict.

Field names are Hugging Face's own (as mlx-lm keeps them), so a reader can hold this file
next to a checkpoint's config.json. GPT-2's older names (`n_embd`, `n_layer`, ...) are read
through the same alias table transformers uses (`attribute_map`).

Both forms of RoPE settings are accepted: the Hub's (`rope_theta` and `rope_scaling` at the
top level) and transformers 5's (`rope_parameters`). Either way they end up in
`rope_parameters`, a dict with at least `rope_type` and `rope_theta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, UnsupportedModelError
from .fields import _MISSING, Fields, show

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
MAX_LAYERS = 100_000
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")


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
    # What only one family reads (gemma's soft-caps, an MoE's experts, ...): a frozen
    # dataclass its own module defines and its `configure` fills.
    options: Any = None
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
        """Parameters as stored (a tied head counted once), as the family counts them."""
        from .models import family

        return family(self.model_type).parameter_count(self)


def _positive_int(f: Fields, key: str) -> int:
    return f.int(key, lo=1)


def _positive_float(f: Fields, key: str) -> float:
    return f.float(key, lo=0, lo_open=True)


MAX_SIZE = 2**31 - 1  # a tensor dimension or a position (torch indexes them as int64; real ones are far smaller)


def size_field(f: Fields, key: str) -> int:
    """A positive integer of at most MAX_SIZE (the bound is named only when exceeded)."""
    value = f.int(key, lo=1)
    if value > MAX_SIZE:
        raise ConfigError(f"{f.source}: {f.name(key)} must be a positive integer of at most {MAX_SIZE:,}, got {show(value)}")
    return value


# The numeric fields of each RoPE type: (key, kind, lo, lo_open, hi, required). Ranges keep
# every derived quantity finite (yarn divides by log(rope_theta) and by mscale terms, and
# takes logarithms of original / beta), so any value accepted here computes; a scaling
# factor is at least 1, as transformers' own validation says.
_ROPE_FIELDS: dict[str, tuple[tuple, ...]] = {
    "default": (),
    "linear": (("factor", "float", 1, False, 1e6, True),),
    "llama3": (("factor", "float", 1, False, 1e6, True), ("low_freq_factor", "float", 0, True, 1e6, True),
               ("high_freq_factor", "float", 0, True, 1e6, True),
               ("original_max_position_embeddings", "int", 1, False, MAX_SIZE, True)),
    "yarn": (("factor", "float", 1, False, 1e6, True), ("original_max_position_embeddings", "int", 1, False, MAX_SIZE, True),
             ("beta_fast", "float", 0, True, 1e6, False), ("beta_slow", "float", 0, True, 1e6, False),
             ("mscale", "float", 0, False, 1e6, False), ("mscale_all_dim", "float", 0, False, 1e6, False),
             ("attention_factor", "float", 0, True, 1e6, False)),
    # short_factor / long_factor (lists) are checked against the rotary dimension below; the
    # attention scaling divides by log(original_max_position_embeddings), hence at least 2.
    "longrope": (("factor", "float", 1, False, 1e6, False), ("original_max_position_embeddings", "int", 2, False, MAX_SIZE, True),
                 ("attention_factor", "float", 0, True, 1e6, False)),
}


def normalize_rope(d: dict, source: str, partial_rotary: bool = False) -> dict:
    """Merge the Hub form (rope_theta + rope_scaling) and the transformers 5 form
    (rope_parameters) into one dict with `rope_type` and `rope_theta`, every numeric field
    of the rope type checked for its type and range (one-line ConfigError naming the key)."""
    top = Fields(d, source)
    params = d.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = d.get("rope_scaling"), "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters / rope_scaling must be an object, got {show(params)}")
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"{source}: per-layer-type RoPE parameters are not supported")
    params = dict(params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "su":  # the Hub's older name of longrope (Phi-3's first configs)
        rope_type = "longrope"
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope type {show(rope_type)} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = top.int("max_position_embeddings", lo=1)
    if rope_type == "longrope":
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings
        # (where Phi-3 keeps it) wins over the rope dict's own; else max_position_embeddings.
        if d.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = top.int("original_max_position_embeddings", lo=2, hi=MAX_SIZE)
        elif params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = top.int("max_position_embeddings", lo=1)
    rope = Fields({f"{key}.{k}": v for k, v in params.items()}, source)  # errors name e.g. "rope_scaling.factor"
    # rope_theta > 1: only then do the frequencies fall with the dimension (yarn divides by its log)
    if params.get("rope_theta") is not None:
        params["rope_theta"] = rope.float(f"{key}.rope_theta", lo=1, lo_open=True, hi=1e30)
    else:
        params["rope_theta"] = top.float("rope_theta", lo=1, lo_open=True, hi=1e30)
    params["rope_type"] = rope_type
    # partial_rotary_factor: the rope dict's own, else the top level's (transformers moves it
    # there); only the first rotary_dim = int(head_dim · factor) dimensions of a head rotate.
    top_partial = top.float("partial_rotary_factor", 1.0, lo=0, lo_open=True, hi=1)
    partial = rope.float(f"{key}.partial_rotary_factor", top_partial, lo=0, lo_open=True, hi=1)
    if partial != 1.0 and not partial_rotary:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor {partial:g}: {d.get('model_type')} models rotate "
                                    "the whole head (partial rotary embeddings are phi3's); remove the field")
    head_dim = d.get("head_dim") or top.int("hidden_size", lo=1) // top.int("num_attention_heads", lo=1)
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"{source}: partial_rotary_factor {partial:g} of head_dim {head_dim} gives a rotary "
                          f"dimension of {rotary_dim}; it must be even and at least 2")
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    for name, kind, lo, lo_open, hi, required in _ROPE_FIELDS[rope_type]:
        default = _MISSING if required else None
        if kind == "int":
            value = rope.int(f"{key}.{name}", default, lo=lo, hi=hi)
        else:
            value = rope.float(f"{key}.{name}", default, lo=lo, lo_open=lo_open, hi=hi)
        if value is not None:
            params[name] = value
    if rope_type == "llama3":
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        if high <= low:
            raise ConfigError(f"{source}: rope high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    if rope_type == "yarn":
        params["truncate"] = rope.bool(f"{key}.truncate", True)
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            params[name] = _factor_list(rope, f"{key}.{name}", rotary_dim)
    return params


def _factor_list(f: Fields, key: str, rotary_dim: int) -> list[float]:
    """longrope's short_factor / long_factor: one number per rotated pair, in [1e-6, 1e6] (the
    frequencies they divide stay finite in float32 at every position)."""
    value = f.list(key)
    wanted = f"a list of {rotary_dim // 2} numbers (one per pair of the {rotary_dim} rotary dimensions)"
    if len(value) != rotary_dim // 2:
        raise ConfigError(f"{f.source}: {key} must be {wanted}, got {len(value)} entries")
    out = []
    for i, x in enumerate(value):
        out.append(Fields({f"{key}[{i}]": x}, f.source).float(f"{key}[{i}]", lo=1e-6, hi=1e6))
    return out


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    """Validate a config.json dict and turn it into a ModelConfig (errors name `source`).
    The fields every family shares are read here; the family's own `configure` (found by
    `model_type`, models.py) reads the rest."""
    from .models import FAMILIES

    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        shown = "no model_type" if model_type is None else f"model_type {show(model_type)}"
        raise UnsupportedModelError(
            f"{source}: {shown} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    fam = FAMILIES[model_type]
    d = dict(fam.defaults.get(model_type, {}))
    spelled = {}
    for old, new in fam.aliases.items():
        if old in raw and raw[old] is not None:
            d[new] = raw[old]
            if raw.get(new) is None:
                spelled[new] = old
    # null means "none" for the fields a family says so of (a window, a soft-cap), else "the default"
    shadowed = set(fam.renamed.values())  # read only under the family's own names
    d.update({k: v for k, v in raw.items()
              if (v is not None or k in ("sliding_window", *fam.nullable)) and k not in shadowed})
    fam.complete(d)
    for own, new in fam.renamed.items():  # after complete: gemma3's text_config is merged in by then
        if d.get(own) is not None:
            d[new] = d[own]
            spelled[new] = own
    f = Fields(d, source, spelled=spelled)

    vocab_size = _positive_int(f, "vocab_size")
    hidden = size_field(f, "hidden_size")
    layers = _positive_int(f, "num_hidden_layers")
    if layers > MAX_LAYERS:  # checked before anything is built per layer
        raise ConfigError(f"{source}: {f.name('num_hidden_layers')} {layers} is not a plausible layer count "
                          f"(at most {MAX_LAYERS:,})")
    heads = size_field(f, "num_attention_heads")
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = heads
    kv_heads = size_field(f, "num_key_value_heads")
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: {f.name('num_attention_heads')} ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if d.get("head_dim") is None:
        if hidden % heads:
            raise ConfigError(f"{source}: {f.name('hidden_size')} ({hidden}) is not divisible by "
                              f"{f.name('num_attention_heads')} ({heads})")
        d["head_dim"] = hidden // heads
    head_dim = size_field(f, "head_dim")
    if head_dim % 2 and fam.rotary:
        raise ConfigError(f"{source}: head_dim ({head_dim}) must be even for rotary embeddings")
    intermediate = size_field(f, "intermediate_size")
    max_pos = size_field(f, "max_position_embeddings")
    eps = _positive_float(f, "rms_norm_eps")
    act = f.str("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: activation {show(act)} is not supported; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    rope = normalize_rope(d, source, fam.partial_rotary) if fam.rotary else None
    tied = f.bool("tie_word_embeddings", False)  # true/false only: "no" in a config is a mistake
    bos = f.int("bos_token_id", None, lo=0)
    eos = f.token_ids("eos_token_id")
    if d.get("layer_types") is not None:
        # checked wherever a config gives it, as transformers checks it in every config; the
        # families that slide read it in their configure
        layer_types_from(f, d, layers)
    own = fam.configure(model_type, f, d, layers)

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
        tie_word_embeddings=tied,
        rope_parameters=rope,
        bos_token_id=bos,
        eos_token_id=eos,
        torch_dtype=dtype if isinstance(dtype, str) else None,
        extra={k: v for k, v in raw.items() if k not in known},
        **own,
    )


def layer_types_from(f: Fields, d: dict, layers: int, kinds: tuple[str, ...] = ("full_attention", "sliding_attention")
                     ) -> tuple[str, ...] | None:
    """An explicit `layer_types` list, checked: one of `kinds` per layer; None if absent."""
    given = d.get("layer_types")
    if given is None:
        return None
    if not isinstance(given, list) or len(given) != layers or any(t not in kinds for t in given):
        if isinstance(given, list):
            bad = next((i for i, t in enumerate(given) if t not in kinds), None)
            shown = f"{len(given)} entr{'y' if len(given) == 1 else 'ies'}"
            shown += f", layer_types[{bad}] {show(given[bad])[:60]}" if bad is not None else ""
        else:
            shown = show(given)
        raise ConfigError(f"{f.source}: layer_types must list one of {'/'.join(kinds)} per layer "
                          f"({layers} layers), got {shown}")
    return tuple(given)
