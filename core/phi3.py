"""The phi3 family: Microsoft's Phi-3, Phi-3.5 and Phi-4-mini (transformers' Phi3ForCausalLM).

How it differs from llama (llama.py), as transformers 5's modeling_phi3.py computes it:

* the checkpoint stores q/k/v fused as `self_attn.qkv_proj` (rows q | k | v) and gate/up as
  `mlp.gate_up_proj` (rows gate | up, chunked in that order): exactly the layout of our fused
  parameters, so each checkpoint tensor fills its parameter whole. No biases anywhere
  (modeling_phi3 builds every projection with bias=False; an `attention_bias` key is ignored
  there and here);
* RoPE: `partial_rotary_factor` (Phi-4-mini: 0.75: only the first int(head_dim · factor)
  dimensions of each head rotate, the rest pass through) and `longrope` scaling, the Hub's
  `rope_scaling: {"type": "su" | "longrope", short_factor, long_factor}` with a top-level
  `original_max_position_embeddings` (transformers also reads phi3's "yarn" as longrope).
  Both live in the shared rope.py (RotaryTables holds the short and long tables and the
  attention scaling sqrt(1 + log(factor) / log(original)) folded into cos/sin);
* `sliding_window`, when set, applies on every layer (Phi-3-mini-4k: 2047).

The blocks themselves are llama's: x += attn(norm1(x)); x += mlp(norm2(x)) (transformers'
residual dropouts are identities at inference).

Tensor parallelism splits as llama's: a rank's share of the fused qkv_proj is three slices of
the one checkpoint tensor (its q heads, its k heads, its v heads; of gate_up_proj two: its gate
and up rows), so each fused checkpoint tensor fills several places (model.fuse).
"""

from __future__ import annotations

import math

from .config import ModelConfig, size_field
from .errors import UnsupportedModelError, WeightsError
from .family import Family, GgufForm, GgufNames
from .fields import Fields, show
from .llama import GGUF_NAMES as _LLAMA_GGUF_NAMES
from .llama import LlamaModel
from .llama import parameter_count as _llama_parameter_count
from .model import Placement, fuse
from .rope import rotary_dim


class Phi3Model(LlamaModel):
    """llama's layers under phi3's checkpoint names; module names are llama's
    (layers.N.self_attn.qkv_proj, layers.N.mlp.gate_up_proj, input_layernorm, ...)."""

    def features(self) -> frozenset[str]:
        # Partial rotary: the rope tables are rotary_dim wide and only a head's first
        # rotary_dim dimensions rotate (rope.apply_rotary). longrope needs no feature: the
        # steps index the model's cos/sin tables (rope.RotaryTables says what they hold).
        partial = rotary_dim(self.config) < self.config.head_dim
        return super().features() | ({"rope:partial"} if partial else set())

    def targets(self) -> dict[str, Placement]:
        t = super().targets()  # llama's, with q/k/v and gate/up as separate checkpoint tensors
        for i in range(self.config.num_hidden_layers):
            attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            fuse(t, f"{attn}.qkv_proj.weight", (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight",
                                                f"{attn}.v_proj.weight"))
            fuse(t, f"{mlp}.gate_up_proj.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"))
        return t


def complete(d: dict) -> None:
    """transformers' Phi3Config reads the rope types "su" and "yarn" as longrope."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if isinstance(rope, dict):
            kind = rope.get("rope_type", rope.get("type"))
            if kind in ("su", "yarn"):
                d[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}


def configure(model_type: str, f: Fields, d: dict, layers: int) -> dict:
    rope = d.get("rope_parameters") if d.get("rope_parameters") is not None else d.get("rope_scaling")
    kind = (rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else "default"
    if kind not in ("default", "longrope"):  # Phi3Config.validate_rope refuses the others too
        raise UnsupportedModelError(f"{f.source}: phi3 rope type {show(kind)} is not supported; phi3 reads "
                                    "default and longrope (su)")
    window = d.get("sliding_window")
    if window is not None:
        window = size_field(f, "sliding_window")
    return dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=window,
                layer_types=("sliding_attention",) * layers if window is not None else ())


def parameter_count(c: ModelConfig) -> int:
    return _llama_parameter_count(c)  # the same matrices and norms, fused or not; no biases


# -- Phi-3 in llama.cpp's GGUF files (its converter's Phi3MiniModel) --------------------------------------

# q/k/v fused (attn_qkv) and gate|up fused (ffn_up, [2 · intermediate, hidden]) in both.
_GGUF_NAMES = GgufNames(
    whole=_LLAMA_GGUF_NAMES.whole,
    layer={"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj",
           "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
)


def _gguf_read(config: dict, m) -> None:
    """Partial rotary as rope.dimension_count, longrope's factors as the rope_factors_long/short
    tensors with the original context in rope.scaling.original_context_length, the window as
    attention.sliding_window (0: none), no biases."""
    del config["attention_bias"], config["mlp_bias"]
    rotary, head_dim = m.get("rope.dimension_count", config["head_dim"]), config["head_dim"]
    # transformers rotates int(head_dim · factor) dimensions: the nearest float to rotary /
    # head_dim can fall just short of `rotary` (30 / 44 gives 29), the next one up does not.
    factor = rotary / head_dim
    while int(head_dim * factor) < rotary:
        factor = math.nextafter(factor, math.inf)
    config["partial_rotary_factor"] = factor
    window = m.get("attention.sliding_window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise WeightsError(f"{m.src}: metadata phi3.attention.sliding_window must be a whole number, got {window!r}")
    config["sliding_window"] = window or None
    long, short = m.values("rope_factors_long.weight"), m.values("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise WeightsError(f"{m.src}: phi3 needs both rope_factors_long.weight and rope_factors_short.weight, or "
                           "neither")
    if long is None:
        return
    factors = {}
    for key, name, values in (("long_factor", "rope_factors_long.weight", long),
                              ("short_factor", "rope_factors_short.weight", short)):
        if values.size != rotary // 2 or not all(math.isfinite(v) and v > 0 for v in values.tolist()):
            got = f"{values.size} values" if values.size != rotary // 2 else "a zero, negative or non-finite one"
            raise WeightsError(f"{m.src}: {name} must hold {rotary // 2} positive finite factors, got {got}")
        factors[key] = [float(v) for v in values.astype("float32")]
    original = m.int("rope.scaling.original_context_length")
    config["original_max_position_embeddings"] = original
    config["rope_scaling"] = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
    # llama.cpp scales attention by rope.scaling.attn_factor; the converter writes the value
    # longrope implies, which stays implied (exact) unless the file says otherwise.
    scale = config["max_position_embeddings"] / original
    implied = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    given = m.float("rope.scaling.attn_factor", default=implied)
    if abs(given - implied) > 1e-6 * implied:
        config["rope_scaling"]["attention_factor"] = float(given)


def _gguf_write(config: ModelConfig, raw: dict, arch: str) -> list:
    """Phi3MiniModel's keys: the rotated dimensions of each head, the original context (always,
    as the converter writes it), the window (0: none) and longrope's attention factor (its
    factors are tensors, written with the settings tensors)."""
    rope = config.rope_parameters or {}
    kv = [("phi3.rope.dimension_count", "uint32", int(config.head_dim * rope.get("partial_rotary_factor", 1.0)))]
    original = rope.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if isinstance(original, int) and not isinstance(original, bool) and original > 0:
        kv.append(("phi3.rope.scaling.original_context_length", "uint32", original))
    kv.append(("phi3.attention.sliding_window", "uint32", config.sliding_window or 0))
    if rope.get("rope_type") == "longrope":
        kv.append(("phi3.rope.scaling.attn_factor", "float32", _longrope_attention_factor(config, rope)))
    return kv


def _longrope_attention_factor(config: ModelConfig, rope: dict) -> float:
    """The attention scaling longrope implies (transformers' and the converter's formula), or
    the config's own attention_factor."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = int(rope["original_max_position_embeddings"])
    scale = rope.get("factor") or config.max_position_embeddings / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


FAMILY = Family(
    model_types=("phi3",),
    model=Phi3Model,
    configure=configure,
    parameter_count=parameter_count,
    defaults={"phi3": dict(hidden_act="silu", max_position_embeddings=4096, original_max_position_embeddings=4096,
                           rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None)},
    complete=complete,
    partial_rotary=True,
    hf_config={"phi3": "Phi3Config"},
    gguf={"phi3": GgufForm("phi3", "Phi3ForCausalLM", _GGUF_NAMES, read=_gguf_read, write=_gguf_write, window=True,
                           rope_tensors=("longrope",))},
)
