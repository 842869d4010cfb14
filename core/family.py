"""What a model family declares, so that adding one is one file.

A family module (llama.py, gpt2.py, gemma.py, ...) ends with a `FAMILY = Family(...)`: the
Hugging Face `model_type`s it reads, transformers' defaults for the fields a config.json may
leave out, a `configure` function holding its own config checks (biases, norms, windows,
soft-caps, experts: whatever it needs beyond the fields every family shares), its model
class, and its parameter count. models.py collects them; config.py parses the shared fields
and hands the rest to the family. Nothing else keeps a list of model types.

Which fast decode step may run a model is declared the same way: the model lists the
features it needs (`CausalLM.features()`), each step the features it implements, and a step
runs only a model whose needs it covers (engine.py), so a family or a feature a step does not
know falls back to the eager layers instead of running wrong.

How llama.cpp's GGUF files hold a model type is declared there too (`gguf`, a GgufForm per
model_type): the architecture name, the tensor names, and the family's own metadata keys
read and written. weights/gguf*.py read and write the files through these forms only, so
they keep no list of families either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    # (config, shard) → the model's modules; a CausalLM subclass.
    model: Callable[..., Any]
    # (model_type, Fields over the merged config dict, that dict, layers) → the ModelConfig
    # fields this family sets beyond the shared ones (qkv_bias, qk_norm, sliding_window,
    # layer_types, options, ...). Raises ConfigError / UnsupportedModelError naming the field.
    configure: Callable[[str, Any, dict, int], dict]
    # ModelConfig → parameters as stored (a tied head counted once); checked against the
    # checkpoint's size before anything is built.
    parameter_count: Callable[[Any], int]
    # ModelConfig → the parameters one token's forward pass reads (a mixture of experts reads
    # only its chosen experts'); None: all of them (parameter_count).
    active_parameter_count: Callable[[Any], int] | None = None
    # transformers' defaults per model_type, for fields a config.json may leave out.
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Older field names read as the shared ones (GPT-2's n_embd → hidden_size, ...), as
    # transformers' attribute_map: where a config.json has both, the shared name wins.
    aliases: Mapping[str, str] = field(default_factory=dict)
    # Fields the family's transformers config names its own way and reads only so (GPT2Config
    # reads activation_function, never hidden_act; gemma hidden_activation): the shared name in
    # its config.json is ignored, as transformers ignores it. Read after `complete`.
    renamed: Mapping[str, str] = field(default_factory=dict)
    # Fills defaults that depend on other fields, in the merged dict, before it is read
    # (GPT-2's intermediate size of 4 · hidden).
    complete: Callable[[dict], None] = lambda d: None
    # Fields whose explicit null in a config.json means "none" (no soft-cap), not the default.
    nullable: tuple[str, ...] = ()
    # Rotary position embeddings (rope_theta / rope_scaling / rope_parameters are read and
    # checked); False for learned absolute positions.
    rotary: bool = True
    # Its attention rotates only partial_rotary_factor of each head (phi3). Elsewhere a
    # factor other than 1 is refused: transformers ignores it for some of those families and
    # fails on it for others, so no reading of it is the model's.
    partial_rotary: bool = False
    # transformers' config class per model_type (benchmark twins and tests build with it).
    hf_config: Mapping[str, str] = field(default_factory=dict)
    # How llama.cpp's GGUF files hold each model_type (none: no GGUF form).
    gguf: Mapping[str, "GgufForm"] = field(default_factory=dict)


@dataclass(frozen=True)
class GgufNames:
    """Tensor names in llama.cpp's files against the checkpoint's: whole-model tensors by name,
    layer tensors `blk.N.STEM.weight|bias` ↔ `PREFIX.N.HF_STEM.weight|bias`. A stem whose
    HF side holds `experts.*.` is one of llama.cpp's stacked expert tensors ([experts, rows,
    cols]), one checkpoint tensor per expert."""

    whole: Mapping[str, str]
    layer: Mapping[str, str]
    prefix: str = "model.layers"
    # A prefix checkpoints may leave out of every name (GPT-2's "transformer.": the original
    # OpenAI-converted checkpoints have bare names).
    optional_root: str = ""


def _no_keys(*_args) -> list:
    return []


def _nothing(*_args) -> None:
    return None


@dataclass(frozen=True)
class GgufForm:
    """One model_type as llama.cpp's architecture `arch` holds it. Reading a file finds the
    form by its general.architecture (and whether it has experts); writing one, by the
    model_type. `read` and `write` hold the family's own keys; the keys every llama-like
    architecture shares (sizes, heads, norm epsilon, RoPE base and linear scaling) are read
    and written by weights/gguf.py and gguf_write.py, unless `shared_keys` is false (GPT-2's
    are its own: `read` builds the whole config)."""

    arch: str
    hf_class: str  # config.json's "architectures"
    names: GgufNames
    # (config dict of the shared keys, a weights.gguf_metadata.Metadata) → the family's keys
    # added to / removed from the dict in place; each bad value one WeightsError naming the key.
    read: Callable[[dict, Any], None] = _nothing
    # (ModelConfig, its raw config.json dict, arch) → [(key, GGUF value type, value)] beyond
    # the shared keys; an entry with a shared key replaces it.
    write: Callable[[Any, dict, str], list] = _no_keys
    # (ModelConfig, where) → raises UnsupportedModelError for what the architecture cannot
    # express beyond what the fields below say.
    check: Callable[[Any, Any], None] = _nothing
    shared_keys: bool = True
    experts: bool = False  # the architecture with expert_count > 0 (Mixtral is llama's)
    # A file of `arch` reads back as this model_type (Mistral is written as llama, and reads
    # back as llama; gemma3 image-text checkpoints quantize by gemma3's names in memory only).
    reads_back: bool = True
    writes: bool = True  # `twice quantize` writes files of it (else: --quantize in memory only)
    permuted_qk: bool = False  # llama.cpp's converter permuted q/k rows for its RoPE (its llama)
    norm_shift: float = 0.0  # added to every norm weight in the file (gemma's converter adds 1)
    # Checkpoint names whose tensors the file holds transposed (GPT-2's Conv1D [in, out]).
    transposed: tuple[str, ...] = ()
    window: bool = False  # the architecture has sliding-window attention
    # RoPE scaling types the architecture keeps as tensors (llama3's divisors: rope_freqs;
    # longrope's factors: rope_factors_long/short); other types than linear have no form.
    rope_tensors: tuple[str, ...] = ()
    activations: tuple[str, ...] = ("silu", "swish")  # what its MLP may use
    o_bias: bool = False  # an output-projection bias


def attention_parameters(hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool) -> int:
    """q, k, v and o projections (and their biases) of one layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if qkv_bias else 0) + (hidden if o_bias else 0)
