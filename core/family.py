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


def attention_parameters(hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool) -> int:
    """q, k, v and o projections (and their biases) of one layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if qkv_bias else 0) + (hidden if o_bias else 0)
