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

from .config import ModelConfig, size_field
from .errors import UnsupportedModelError
from .family import Family
from .fields import Fields, show
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
)
