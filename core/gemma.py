"""The gemma family: Google's Gemma 2 (`gemma2`) and Gemma 3 (`gemma3_text`, and the text part
of a `gemma3` image-text checkpoint).

How it differs from llama (llama.py), as transformers 5's modeling_gemma2.py / modeling_gemma3.py
compute it:

* sandwich blocks, four norms per layer ("block:sandwich"):
      x = x + post_attention_layernorm(attn(input_layernorm(x)))
      x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
* every RMSNorm scales by (1 + w), normalizing and scaling in float32 before the cast
  (layers.OffsetRMSNorm, "norm:offset1"); gemma3 also normalizes q and k per head with it;
* the embeddings are multiplied by sqrt(hidden_size) rounded to the activation dtype
  (transformers' normalizer is a tensor of that dtype: 55.4256 becomes 55.5 in bf16);
* the MLP is gated with `hidden_activation` (gelu_pytorch_tanh: GeGLU);
* attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
* gemma2 soft-caps the attention scores (tanh(s / cap) · cap before the mask,
  `attn_logit_softcapping`: attention.attend computes those scores explicitly) and both
  gemma2 and gemma3_text soft-cap the output logits (`final_logit_softcapping`). transformers
  5.24 passes no soft-cap to gemma3's attention and applies no final cap in
  Gemma3ForConditionalGeneration: a `gemma3` config's caps are checked but not applied, as there;
* sliding-window and global layers alternate (`layer_types`; by default gemma2 slides on every
  even layer, gemma3 on all but every `sliding_window_pattern`-th, default 6);
* gemma3's sliding layers use a second RoPE table (`rope_local_base_freq`, default 10000,
  "rope:local"), its global layers the config's RoPE (theta 1e6, linear scaling on the larger
  models). Both config forms: the Hub's rope_theta + rope_scaling + rope_local_base_freq, and
  transformers 5's rope_parameters per layer type {"full_attention": ..., "sliding_attention": ...}.

How each feature is held (for the decode steps that read this module): block i is
`layers[i]` with `input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
`post_feedforward_layernorm` (OffsetRMSNorm: `.weight` is w, `.eps`), `self_attn`
(attention.CachedSelfAttention: fused `qkv_proj`, `o_proj`, `q_norm`/`k_norm` (OffsetRMSNorm
over head_dim, gemma3), `scale`, `softcap` (None or the cap), `window`), `mlp`
(layers.GatedMLP: `gate_up_proj`, `down_proj`, `act`) and `local_rope` (True: its cos/sin come
from `model.rope_local`, else from `model.rope`). `model.embed_scale` is the embedding
multiplier (a 0-dim tensor in the activation dtype), `model.options.final_logit_softcapping`
the output cap applied (None: none), `model.norm` the final OffsetRMSNorm.

Tensor parallelism shards as llama does (heads, MLP rows, vocabulary rows of an untied head):
the post-norms act on the all-reduced outputs, so nothing else splits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .attention import CachedSelfAttention, Step
from .cache import KVCache
from .config import ModelConfig, layer_types_from, normalize_rope, size_field
from .errors import TwiceError, UnsupportedModelError, WeightsError
from .family import Family, GgufForm, GgufNames, attention_parameters
from .fields import Fields, show
from .layers import GatedMLP, OffsetRMSNorm, WiredBlock
from .llama import GGUF_NAMES as _LLAMA_GGUF_NAMES
from .llama import LlamaModel
from .model import Target
from .parallel import SINGLE, Shard
from .rope import RotaryTables, apply_rotary


@dataclass(frozen=True)
class GemmaOptions:
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None  # as applied: None where transformers applies none
    final_logit_softcapping: float | None  # as applied
    local_rope: dict | None  # gemma3: the sliding layers' RoPE parameters (normalized)


class Block(WiredBlock):
    def __init__(self, config: ModelConfig, layer: int, shard: Shard):
        super().__init__()
        c, o = config, config.options
        heads = shard.part(c.num_attention_heads, "num_attention_heads")[1]
        kv_heads = shard.part(c.num_key_value_heads, "num_key_value_heads")[1]
        norms = ((OffsetRMSNorm(c.head_dim, c.rms_norm_eps), OffsetRMSNorm(c.head_dim, c.rms_norm_eps)) if c.qk_norm
                 else (None, None))
        self.self_attn = CachedSelfAttention(
            c.hidden_size, heads, kv_heads, c.head_dim, c.qkv_bias, c.o_bias, scale=o.query_pre_attn_scalar**-0.5,
            layer=layer, window=c.window_for_layer(layer), qk_norm=norms[0], k_norm=norms[1], shard=shard,
            softcap=o.attn_logit_softcapping,
        )
        intermediate = shard.part(c.intermediate_size, "intermediate_size")[1]
        self.mlp = GatedMLP(c.hidden_size, intermediate, c.hidden_act, False, shard=shard)
        self.input_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.local_rope = o.local_rope is not None and c.layer_types[layer] == "sliding_attention"

    def wire(self, x: torch.Tensor, attention, mlp) -> torch.Tensor:
        x = x + self.post_attention_layernorm(attention(self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x)))


# Where a gemma3 image-text checkpoint keeps its text model (transformers 5 saves the first
# form, the Hub's newer checkpoints carry the second) and what else it holds.
_MULTIMODAL_PREFIXES = ("language_model.model.", "model.language_model.")
_MULTIMODAL_HEADS = ("language_model.lm_head.weight",)
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaModel(LlamaModel):
    """llama's checkpoint names plus the two feed-forward norms; llama's module names."""

    Block = Block
    Norm = OffsetRMSNorm

    def __init__(self, config: ModelConfig, shard: Shard = SINGLE):
        super().__init__(config, shard)
        self.options: GemmaOptions = config.options
        self.multimodal = config.model_type == "gemma3"
        if self.multimodal:
            self.unused_prefixes = _VISION_PREFIXES
        self.rope_local: RotaryTables | None = None
        self.embed_scale: torch.Tensor | None = None

    def features(self) -> frozenset[str]:
        c, o = self.config, self.options
        flags = {"qkv_bias": c.qkv_bias, "o_bias": c.o_bias, "qk_norm": c.qk_norm,
                 "window": any(w is not None for w in self.windows), "tp": self.shard.active,
                 "attn_softcap": o.attn_logit_softcapping is not None,
                 "final_softcap": o.final_logit_softcapping is not None,
                 "rope:local": any(block.local_rope for block in self.layers)}
        return frozenset({"block:sandwich", f"act:{c.hidden_act}", "norm:offset1", "embed_scale"}
                         | {k for k, v in flags.items() if v})

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        self.rope = RotaryTables(self.config, device, dtype)
        if self.options.local_rope is not None:
            self.rope_local = RotaryTables(dataclasses.replace(self.config, rope_parameters=self.options.local_rope),
                                           device, dtype)
        # transformers: a float32 tensor of sqrt(hidden), cast to the embedding's dtype
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5, device=device).to(dtype)

    def hidden_states(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        end = step.column + input_ids.shape[1]
        tables = {False: self.rope} if self.rope_local is None else {False: self.rope, True: self.rope_local}
        ropes = {}
        for local, table in tables.items():
            table.ensure(end)
            cos, sin = table.lookup(step.positions)
            ropes[local] = lambda x, cos=cos, sin=sin: apply_rotary(x, cos, sin)
        x = self.embed_tokens(input_ids) * self.embed_scale
        for block in self.layers:
            x = block(x, step, cache, ropes[block.local_rope])
        return self.norm(x)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.options.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def hf_config_kwargs(self) -> dict:
        """What transformers' Gemma2Config / Gemma3TextConfig need beyond the shared fields to
        build this model's twin (benchmark.hf_twin): the windows, the layer types and, for
        gemma3, the RoPE per layer type (a flat rope_parameters would lose the global one)."""
        c = self.config
        out = dict(sliding_window=c.sliding_window, layer_types=list(c.layer_types))
        if self.options.local_rope is not None:
            out["rope_parameters"] = {"full_attention": dict(c.rope_parameters),
                                      "sliding_attention": dict(self.options.local_rope)}
        return out

    def targets(self) -> dict[str, Target]:
        t = super().targets()
        for i in range(self.config.num_hidden_layers):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                t[f"model.layers.{i}.{name}.weight"] = Target(f"layers.{i}.{name}.weight")
        if self.multimodal:  # the same tensors under the image-text model's names
            for name, target in list(t.items()):
                if name.startswith("model."):
                    for prefix in _MULTIMODAL_PREFIXES:
                        t[prefix + name.removeprefix("model.")] = target
            for name in _MULTIMODAL_HEADS:
                t[name] = t["lm_head.weight"]
        return t


# -- the family's config: transformers' defaults and checks ----------------------------------------------

_SHARED = dict(intermediate_size=9216, hidden_size=2304, num_hidden_layers=26, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               bos_token_id=2, eos_token_id=1, tie_word_embeddings=True, attention_bias=False,
               query_pre_attn_scalar=256, sliding_window=4096)
GEMMA2_DEFAULTS = dict(_SHARED, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
                       final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
GEMMA3_TEXT_DEFAULTS = dict(_SHARED, vocab_size=262208, max_position_embeddings=131072, rope_theta=1_000_000.0,
                            rope_local_base_freq=10000.0)
# In a `gemma3` (image-text) config.json these stay the top level's (transformers ties the
# head by the top-level config's tie_word_embeddings); everything else is text_config's.
_TOP_LEVEL = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype", "torch_dtype")
_LAYER_TYPES_KEY = "_gemma_rope_per_layer_type"


def complete(d: dict) -> None:
    """Before config.py reads the shared fields: a gemma3 image-text config's text_config
    merged in (over gemma3_text's defaults);
    transformers 5's per-layer-type rope_parameters split: the full-attention entry is
    the model's rope (checked by config.py), the sliding one is read by `configure`."""
    if d.get("model_type") == "gemma3":
        text = d.get("text_config")
        merged = dict(GEMMA3_TEXT_DEFAULTS)
        if isinstance(text, dict):  # else configure names the field
            merged.update({k: v for k, v in text.items() if v is not None or k == "sliding_window"})
        merged.update({k: d[k] for k in _TOP_LEVEL if k in d})
        merged.update(model_type="gemma3", text_config=text)
        d.clear()
        d.update(merged)
    rope = d.get("rope_parameters")
    if (d.get("model_type") in ("gemma3_text", "gemma3") and isinstance(rope, dict) and rope and set(rope) <= {"full_attention", "sliding_attention"}
            and all(v is None or isinstance(v, dict) for v in rope.values())):
        d[_LAYER_TYPES_KEY] = rope
        d["rope_parameters"] = dict(rope.get("full_attention") or {"rope_type": "default"})


def configure(model_type: str, f: Fields, d: dict, layers: int) -> dict:
    source = f.source
    if model_type == "gemma3":
        text = f.dict("text_config", {})
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise UnsupportedModelError(f"{source}: text_config.model_type {show(text.get('model_type'))} is not "
                                        "supported in a gemma3 checkpoint; expected gemma3_text")
    if f.bool("use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention is not supported (twice generates "
                                    "causally)")
    scalar = f.float("query_pre_attn_scalar", lo=0, lo_open=True, hi=1e30)
    attn_cap = f.float("attn_logit_softcapping", None, lo=0, lo_open=True, hi=1e30)
    final_cap = f.float("final_logit_softcapping", None, lo=0, lo_open=True, hi=1e30)
    gemma2 = model_type == "gemma2"
    if not gemma2:
        attn_cap = None  # transformers 5.24 passes no soft-cap to gemma3's attention
        if model_type == "gemma3":
            final_cap = None  # nor caps Gemma3ForConditionalGeneration's logits

    layer_types = layer_types_from(f, d, layers)
    if not gemma2:
        pattern = f.int("sliding_window_pattern", 6, lo=1)
    if layer_types is None:
        if gemma2:
            layer_types = tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
        else:
            layer_types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                                for i in range(layers))
    window = size_field(f, "sliding_window") if "sliding_attention" in layer_types else None

    local_rope = None
    if not gemma2:
        per_type = d.get(_LAYER_TYPES_KEY) or {}
        local = dict(per_type.get("sliding_attention") or {"rope_type": "default"})
        if local.get("rope_theta") is None:
            local["rope_theta"] = f.float("rope_local_base_freq", 10000.0, lo=1, lo_open=True, hi=1e30)
        try:
            local_rope = normalize_rope({**d, "rope_parameters": local, "rope_scaling": None}, source)
        except TwiceError as e:  # name the entry it came from
            raise type(e)(str(e).replace("rope_parameters", "rope_parameters.sliding_attention")) from None
    bias = f.bool("attention_bias", False)
    options = GemmaOptions(query_pre_attn_scalar=scalar, attn_logit_softcapping=attn_cap,
                           final_logit_softcapping=final_cap, local_rope=local_rope)
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=not gemma2, sliding_window=window,
                layer_types=layer_types, options=options)


def parameter_count(c: ModelConfig) -> int:
    h = c.hidden_size
    attn = attention_parameters(h, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qkv_bias, c.o_bias)
    norms = 4 * h + (2 * c.head_dim if c.qk_norm else 0)
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.num_hidden_layers * (attn + 3 * h * c.intermediate_size + norms) + c.vocab_size * h + h + head


# -- Gemma in llama.cpp's GGUF files (its converter's Gemma2Model / Gemma3Model) ------------------------

# Sandwich norms (attn_norm, post_attention_norm, ffn_norm = the pre-feed-forward norm,
# post_ffw_norm), gemma3's per-head q/k norms. Every norm's weight is w + 1 in the file
# (llama.cpp's converter adds gemma's 1: the form's norm_shift).
_GGUF_NAMES = GgufNames(_LLAMA_GGUF_NAMES.whole, {
    **_LLAMA_GGUF_NAMES.layer, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"})
# Gemma models llama.cpp knows by their layer count as the 27B, whose queries it scales by
# (hidden / heads) ** -0.5; every other size by head_dim ** -0.5 (models/gemma2.cpp, gemma3.cpp).
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's sliding pattern where the file has none: every n-th layer global (gemma2 2, gemma3 6).
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}


def gguf_query_scalar(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp's gemma graphs imply (no key holds it)."""
    return hidden // heads if layers == _GGUF_27B_LAYERS[arch] else head_dim


def _gguf_sliding_layers(m, layers: int) -> list[bool]:
    """Which layers slide, as llama.cpp reads them: attention.sliding_window_pattern as one flag
    per layer, or as n (every n-th layer global), else the architecture's default n; gemma3
    without a window (0 or absent) has no sliding layer."""
    if m.arch == "gemma3" and not m.get("attention.sliding_window"):
        return [False] * layers
    pattern = m.get("attention.sliding_window_pattern", _GGUF_PATTERN[m.arch])
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            got = f"{len(pattern)} values" if len(pattern) != layers else "values that are not all true or false"
            raise WeightsError(f"{m.src}: {m.arch}.attention.sliding_window_pattern must hold one flag (true or "
                               f"false) per layer ({layers}), got {got}")
        return list(pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise WeightsError(f"{m.src}: {m.arch}.attention.sliding_window_pattern must be a whole number, got "
                           f"{pattern!r}")
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def _gguf_read(config: dict, m) -> None:
    """GeGLU, the soft-caps (gemma2: attention 50 and final 30 unless the file says; gemma3: a
    final cap only where the file has one), the window and sliding layers, gemma3's local RoPE
    base (rope.freq_base_swa, default 10000) beside the global one and its linear scaling;
    query_pre_attn_scalar as llama.cpp derives it."""
    arch, src = m.arch, m.src
    del config["mlp_bias"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    del config["hidden_act"]
    layers = config["num_hidden_layers"]
    config["query_pre_attn_scalar"] = gguf_query_scalar(arch, layers, config["hidden_size"],
                                                        config["num_attention_heads"], config["head_dim"])
    final = m.get("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0)
    if isinstance(final, bool) or not isinstance(final, (int, float)) or not math.isfinite(final) or final < 0:
        raise WeightsError(f"{src}: metadata {arch}.final_logit_softcapping must be a number >= 0, got {final!r}")
    config["final_logit_softcapping"] = float(final) or None
    if arch == "gemma2":
        config["attn_logit_softcapping"] = m.float("attn_logit_softcapping", default=50.0)
        if m.get("rope.freq_base_swa", config["rope_theta"]) != config["rope_theta"]:
            raise UnsupportedModelError(f"{src}: gemma2 with a separate sliding-layer RoPE base is not supported")
    else:
        config["rope_local_base_freq"] = m.float("rope.freq_base_swa", default=10000.0)
    sliding = _gguf_sliding_layers(m, layers)
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    window = m.get("attention.sliding_window", 4096 if arch == "gemma2" else 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0 or (any(sliding) and window == 0):
        raise WeightsError(f"{src}: metadata {arch}.attention.sliding_window must be a positive whole number, "
                           f"got {window!r}")
    config["sliding_window"] = window or None


def _gguf_write(config: ModelConfig, raw: dict, arch: str) -> list:
    """Gemma2Model / Gemma3Model's keys (the head size always), and the sliding layers as one
    flag per layer (which llama.cpp reads, for any pattern; the converter leaves llama.cpp's
    default)."""
    o = config.options
    kv: list = [(f"{arch}.attention.key_length", "uint32", config.head_dim),
                (f"{arch}.attention.value_length", "uint32", config.head_dim)]
    if arch == "gemma2":
        kv.append(("gemma2.attn_logit_softcapping", "float32", o.attn_logit_softcapping))
    if o.final_logit_softcapping is not None:
        kv.append((f"{arch}.final_logit_softcapping", "float32", o.final_logit_softcapping))
    sliding = [config.window_for_layer(i) is not None for i in range(config.num_hidden_layers)]
    if any(sliding):
        kv += [(f"{arch}.attention.sliding_window", "uint32", config.sliding_window),
               (f"{arch}.attention.sliding_window_pattern", "bools", sliding)]
    elif arch == "gemma2":  # llama.cpp's gemma2 slides every other layer unless told
        kv += [("gemma2.attention.sliding_window", "uint32", config.max_position_embeddings),
               ("gemma2.attention.sliding_window_pattern", "bools", sliding)]
    if arch == "gemma3" and o.local_rope is not None:
        kv.append(("gemma3.rope.freq_base_swa", "float32", float(o.local_rope["rope_theta"])))
    return kv


def _gguf_check(config: ModelConfig, where) -> None:
    """What llama.cpp's gemma2/gemma3 graphs cannot run as transformers does."""
    arch, o = FAMILY.gguf[config.model_type].arch, config.options
    if config.hidden_act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{where}: gemma with hidden_activation {config.hidden_act!r} has no GGUF form "
                                    "(llama.cpp runs gelu_pytorch_tanh)")
    if config.qkv_bias or config.o_bias:
        raise UnsupportedModelError(f"{where}: gemma with attention_bias has no GGUF form")
    implied = gguf_query_scalar(arch, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                                config.head_dim)
    if o.query_pre_attn_scalar != implied:
        raise UnsupportedModelError(f"{where}: query_pre_attn_scalar {o.query_pre_attn_scalar:g} has no GGUF form: "
                                    f"llama.cpp scales {arch}'s queries by {implied} ** -0.5 for this size")
    if arch == "gemma2":
        if not config.tie_word_embeddings:
            raise UnsupportedModelError(f"{where}: gemma2 with an untied lm_head has no GGUF form (llama.cpp's gemma2 "
                                        "uses the embedding as its head)")
        if o.attn_logit_softcapping is None or o.final_logit_softcapping is None:
            raise UnsupportedModelError(f"{where}: gemma2 without attn_logit_softcapping or final_logit_softcapping "
                                        "has no GGUF form (llama.cpp's gemma2 always caps)")
    elif o.local_rope and o.local_rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{where}: gemma3 with RoPE scaling on its sliding layers has no GGUF form")


def _gguf_form(arch: str, hf_class: str, **more) -> GgufForm:
    return GgufForm(arch, hf_class, _GGUF_NAMES, read=_gguf_read, write=_gguf_write, check=_gguf_check,
                    norm_shift=1.0, window=True, activations=("gelu_pytorch_tanh",), **more)


FAMILY = Family(
    model_types=("gemma2", "gemma3_text", "gemma3"),
    model=GemmaModel,
    configure=configure,
    parameter_count=parameter_count,
    defaults={"gemma2": GEMMA2_DEFAULTS, "gemma3_text": GEMMA3_TEXT_DEFAULTS,
              "gemma3": dict(tie_word_embeddings=True)},
    complete=complete,
    renamed={"hidden_activation": "hidden_act"},  # gemma's name for it; a stray hidden_act is not read
    nullable=("attn_logit_softcapping", "final_logit_softcapping"),  # null: no cap, as transformers reads it
    hf_config={"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "gemma3": "Gemma3Config"},
    # gemma3 image-text checkpoints: their text model quantizes in memory as gemma3_text's
    # (no file is written of them, and a gemma3 file reads back as gemma3_text).
    gguf={"gemma2": _gguf_form("gemma2", "Gemma2ForCausalLM"), "gemma3_text": _gguf_form("gemma3", "Gemma3ForCausalLM"),
          "gemma3": _gguf_form("gemma3", "Gemma3ForCausalLM", reads_back=False, writes=False)},
)
