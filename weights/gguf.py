"""Turn a llama.cpp GGUF file into a Hugging Face model folder twice (and transformers) can load.

A GGUF holds everything a model folder does, in llama.cpp's own spelling: the config as
`llama.*` metadata keys, the tokenizer as `tokenizer.ggml.*` arrays, and the weights as
(often quantized) tensors named `blk.N.attn_q.weight` and so on. `convert_gguf` reads them
(gguf_file.py checks the header; the `gguf` package dequantizes) and writes

    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Three things llama.cpp changed on the way in are undone here:

* quantized tensors are dequantized (to float32, then cast to the requested dtype);
* the rows of q_proj and k_proj were permuted so that llama.cpp's RoPE can rotate adjacent
  pairs; the inverse permutation restores Hugging Face's rotate-half layout; GPT-2's Conv1D
  matrices were transposed from [in, out] to [out, in]: they are transposed back (the
  as-stored loader keeps the file's [out, in], the layout twice's linear layers hold);
* the tokenizer is rebuilt as a `tokenizers` pipeline from its vocabulary and merges, with
  the pre-tokenizer its `tokenizer.ggml.pre` name stands for.

Only what can be converted exactly is accepted: the llama (also Mixtral: llama with stacked
experts, read one slice per expert), qwen2, qwen3, gpt2, olmo2, phi3, gemma2 and gemma3
architectures (and qwen3moe, qwen2moe) with the tokenizers gguf_tokenizer.py rebuilds (gemma's norms hold w + 1 in the
file: the 1 is subtracted). Anything else is refused with a one-line `UnsupportedModelError`;
a file that is not a GGUF, is cut short, is laid out as llama.cpp would refuse (gguf_file.py)
or lacks a required key is a `WeightsError`. The
folder appears at `dest` only once it is complete (it is written beside it and renamed).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twice.core.errors import TwiceError, UnsupportedModelError, WeightsError

from .gguf_file import Skipped, read_gguf
from .gguf_metadata import positive_float, positive_int, require, token_id
from .gguf_names import GEMMA_ARCHITECTURES, GPT2_CONV1D, hf_name
from .gguf_tokenizer import build_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt2", "olmo2", "phi3", "gemma2", "gemma3", "qwen3moe",
                           "qwen2moe")
# GGUF architecture → the Hugging Face class its config names.
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "gpt2": "GPT2LMHeadModel", "olmo2": "Olmo2ForCausalLM",
                     "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                     "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
# GGUF architecture → the Hugging Face model_type (where they differ).
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

Progress = Callable[[str], None]
GGUF_SOURCE = "gguf.json"  # in a folder made with weights=False: the GGUF file its tensors come from


# -- public entry point --------------------------------------------------------------------


def convert_gguf(
    src: Path,
    dest: Path,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    weights: bool = True,
) -> Path:
    """Convert the GGUF file `src` into a Hugging Face model folder at `dest`; return `dest`.

    `dtype` is the dtype of the written tensors ("float32", "bfloat16" or "float16"). An existing
    non-empty `dest` is refused unless `overwrite` is set. `progress`, if given, is called with a
    short line for each step. Raises WeightsError or UnsupportedModelError, naming the file.

    With `weights=False` only the model's description is written (config, generation config,
    tokenizer: a few MB, from the header alone) plus `gguf.json` naming `src`, whose tensors
    are then loaded as stored (gguf_load.py): the folder a GGUF runs from without a float copy.
    """
    src, dest = Path(src), Path(dest)
    if dtype not in OUTPUT_DTYPES:
        raise WeightsError(f"{src}: cannot write dtype {dtype!r}; choose one of {', '.join(OUTPUT_DTYPES)}")
    _check_destination(dest, overwrite)
    say = progress or (lambda _message: None)

    # Everything that can be refused is checked before anything is written.
    say(f"reading {src}")
    reader = _open_reader(src)
    with _reading(src):
        metadata = reader.metadata  # plain Python values (strings, numbers, lists)
        rope_freqs = _find_tensor(reader, "rope_freqs.weight")
        config = _model_config(metadata, src, rope_freqs, lambda name: _find_tensor(reader, name))
        jobs = _plan_tensors(reader, config, src, dequantized=weights)
        tokenizer, tokenizer_config = build_tokenizer(metadata, config, src)
    config["torch_dtype"] = config["dtype"] = dtype

    with _atomic_folder(dest, overwrite) as folder:
        _write_json(folder / "config.json", config)
        _write_json(folder / "generation_config.json", _generation_config(metadata, config))
        _save_tokenizer(tokenizer, folder / "tokenizer.json")
        _write_json(folder / "tokenizer_config.json", tokenizer_config)
        if weights:
            _write_safetensors(folder / "model.safetensors", jobs, OUTPUT_DTYPES[dtype], src, say)
        else:
            st = src.stat()
            _write_json(folder / GGUF_SOURCE, {"file": str(src.resolve()), "size": st.st_size,
                                               "mtime_ns": st.st_mtime_ns})
    say(f"wrote {dest}")
    return dest


# -- reading the file ----------------------------------------------------------------------


def _open_reader(src: Path, big_arrays: bool = True):
    """The header of `src` (metadata, tensor table), checked as llama.cpp checks it before
    any tensor data is read (gguf_file.py): a foreign, truncated or corrupt file, or one
    whose tensors overlap, leave gaps or lie outside the file, is one WeightsError.
    `big_arrays=False`: the tokenizer's arrays are walked, not made (read_gguf)."""
    with _reading(src):
        return read_gguf(src, big_arrays)


@contextmanager
def _reading(src: Path) -> Iterator[None]:
    """Report anything the gguf reader (or numpy under it) raises on a damaged file as one
    WeightsError that names the file; our own errors pass through unchanged."""
    try:
        yield
    except (TwiceError, MemoryError):
        raise
    except Exception as e:  # the reader raises ValueError, IndexError, KeyError, struct.error, ...
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise WeightsError(
            f"{src}: truncated or corrupt GGUF file ({type(e).__name__}{': ' + detail if detail else ''})"
        ) from None


def _find_tensor(reader, name: str):
    return next((t for t in reader.tensors if t.name == name), None)


# -- config --------------------------------------------------------------------------------


def _model_config(metadata: dict, src: Path, rope_freqs, find: Callable[[str], Any] = lambda name: None) -> dict:
    """config.json for the Hugging Face model of the file's architecture, from its `ARCH.*`
    metadata (and the tensors llama.cpp keeps settings in, by `find(name)`: phi3's RoPE factors)."""
    arch = require(metadata, "general.architecture", src)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{src}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    experts = metadata.get(f"{arch}.expert_count", 0)
    if experts and arch not in ("llama", "qwen3moe", "qwen2moe"):
        raise UnsupportedModelError(f"{src}: mixture-of-experts {arch} models are not supported (Mixtral, as "
                                    "llama with experts, is)")
    if arch == "gpt2":
        return _gpt2_config(metadata, src)

    hidden = positive_int(metadata, f"{arch}.embedding_length", src)
    heads = positive_int(metadata, f"{arch}.attention.head_count", src)
    kv_heads = _kv_heads(metadata, f"{arch}.attention.head_count_kv", heads, src)
    if heads % kv_heads:
        raise WeightsError(f"{src}: {heads} attention heads is not a multiple of {kv_heads} key/value heads")
    if hidden % heads and f"{arch}.attention.key_length" not in metadata:
        raise WeightsError(f"{src}: embedding_length {hidden} is not divisible by head_count {heads}")
    head_dim = positive_int(metadata, f"{arch}.attention.key_length", src, default=hidden // heads)
    if metadata.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{src}: attention value_length differs from key_length, which {arch} cannot express")
    # llama.cpp rotates rope.dimension_count dims of each head; HF llama rotates all of them
    # (phi3: partial_rotary_factor of them).
    rotary = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if arch == "phi3" and isinstance(rotary, int) and not isinstance(rotary, bool) and 0 < rotary <= head_dim \
            and rotary % 2 == 0:
        pass
    elif rotary != head_dim:
        raise UnsupportedModelError(
            f"{src}: partial rotary embeddings (rope.dimension_count "
            f"{metadata[f'{arch}.rope.dimension_count']} of head_dim {head_dim}) are not supported"
        )
    if head_dim % 2:
        raise WeightsError(f"{src}: head dimension {head_dim} must be even for rotary embeddings")

    vocab_size = _vocab_size(metadata, arch, src)
    rope_theta = positive_float(metadata, f"{arch}.rope.freq_base", src, default=10000.0)

    config = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": positive_int(metadata, f"{arch}.feed_forward_length", src),
        "num_hidden_layers": positive_int(metadata, f"{arch}.block_count", src),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": positive_int(metadata, f"{arch}.context_length", src),
        "rms_norm_eps": positive_float(metadata, f"{arch}.attention.layer_norm_rms_epsilon", src),
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,  # settled by _plan_tensors once it has seen output.weight
    }
    if arch == "phi3":
        _phi3_config(config, metadata, rotary, find, src)
    if arch in ("gemma2", "gemma3"):
        _gemma_config(config, metadata, arch, src)
    if experts and arch == "llama":
        _mixtral_config(config, metadata, src)
    if arch == "qwen3moe":
        _qwen3moe_config(config, metadata, src)
    if arch == "qwen2moe":
        _qwen2moe_config(config, metadata, src)
    if arch == "olmo2":  # its MLP has no bias setting; no sliding windows (OLMo 3's are another arch)
        del config["mlp_bias"]
        if metadata.get("olmo2.attention.sliding_window"):
            raise UnsupportedModelError(f"{src}: olmo2 with sliding-window layers (OLMo 3) is not supported")
    scaling = _rope_scaling(metadata, arch, src) or _llama3_rope_from_freqs(rope_freqs, rope_theta, head_dim, src)
    if scaling and "rope_scaling" in config:
        raise UnsupportedModelError(f"{src}: phi3 with both longrope factors and RoPE scaling keys is not supported")
    if scaling:
        config["rope_scaling"] = scaling
    return _with_special_ids(config, metadata, vocab_size, src)


def _phi3_config(config: dict, metadata: dict, rotary: int, find, src: Path) -> None:
    """Phi-3 as llama.cpp's converter writes it (Phi3MiniModel): partial rotary as
    rope.dimension_count, longrope's factors as the rope_factors_long/short tensors with the
    original context in rope.scaling.original_context_length, the window as
    attention.sliding_window (0: none), no biases."""
    del config["attention_bias"], config["mlp_bias"]
    config["partial_rotary_factor"] = rotary / config["head_dim"]
    window = metadata.get("phi3.attention.sliding_window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise WeightsError(f"{src}: metadata phi3.attention.sliding_window must be a whole number, got {window!r}")
    config["sliding_window"] = window or None
    long, short = find("rope_factors_long.weight"), find("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise WeightsError(f"{src}: phi3 needs both rope_factors_long.weight and rope_factors_short.weight, or neither")
    if long is None:
        return
    import gguf

    factors = {}
    for key, t in (("long_factor", long), ("short_factor", short)):
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()
        if values.size != rotary // 2 or not np.isfinite(values).all() or (values <= 0).any():
            raise WeightsError(f"{src}: {t.name} must hold {rotary // 2} positive factors, got {values.size} values")
        factors[key] = [float(v) for v in values.astype(np.float32)]
    original = positive_int(metadata, "phi3.rope.scaling.original_context_length", src)
    config["original_max_position_embeddings"] = original
    config["rope_scaling"] = {"rope_type": "longrope", **factors, "original_max_position_embeddings": original}
    # llama.cpp scales attention by rope.scaling.attn_factor; the converter writes the value
    # longrope implies, which stays implied (exact) unless the file says otherwise.
    scale = config["max_position_embeddings"] / original
    implied = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    given = positive_float(metadata, "phi3.rope.scaling.attn_factor", src, default=implied)
    if abs(given - implied) > 1e-6 * implied:
        config["rope_scaling"]["attention_factor"] = float(given)


def _mixtral_config(config: dict, metadata: dict, src: Path) -> None:
    """Mixtral as llama.cpp holds it: the llama architecture with expert_count experts of
    feed_forward_length rows, expert_used_count per token (softmax, top-k, renormalized), every
    layer sparse, no window."""
    experts = positive_int(metadata, "llama.expert_count", src)
    used = positive_int(metadata, "llama.expert_used_count", src)
    if used > experts:
        raise WeightsError(f"{src}: llama.expert_used_count {used} exceeds llama.expert_count {experts}")
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                  num_experts_per_tok=used, sliding_window=None)
    del config["attention_bias"], config["mlp_bias"]


def _qwen3moe_config(config: dict, metadata: dict, src: Path) -> None:
    """Qwen3-MoE as llama.cpp runs it (models/qwen3moe.cpp): every layer sparse, experts of
    expert_feed_forward_length rows, the top-k weights always renormalized, q/k norms per head."""
    experts = positive_int(metadata, "qwen3moe.expert_count", src)
    used = positive_int(metadata, "qwen3moe.expert_used_count", src)
    if used > experts:
        raise WeightsError(f"{src}: qwen3moe.expert_used_count {used} exceeds qwen3moe.expert_count {experts}")
    config.update(num_experts=experts, num_experts_per_tok=used, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], moe_intermediate_size=positive_int(metadata, "qwen3moe.expert_feed_forward_length",
                                                                          src))
    del config["mlp_bias"]


def _qwen2moe_config(config: dict, metadata: dict, src: Path) -> None:
    """Qwen2-MoE as llama.cpp runs it (src/models/qwen2moe.cpp): every layer sparse, the top-k
    softmax weights never renormalized, a shared expert (expert_shared_feed_forward_length rows,
    feed_forward_length where absent) behind its sigmoid gate, q/k/v biases, no window."""
    experts = positive_int(metadata, "qwen2moe.expert_count", src)
    used = positive_int(metadata, "qwen2moe.expert_used_count", src)
    if used > experts:
        raise WeightsError(f"{src}: qwen2moe.expert_used_count {used} exceeds qwen2moe.expert_count {experts}")
    inter = config["intermediate_size"]
    config.update(num_experts=experts, num_experts_per_tok=used, norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[], qkv_bias=True, use_sliding_window=False,
                  moe_intermediate_size=positive_int(metadata, "qwen2moe.expert_feed_forward_length", src,
                                                     default=max(inter // used, 1)),
                  shared_expert_intermediate_size=positive_int(metadata, "qwen2moe.expert_shared_feed_forward_length",
                                                               src, default=inter))
    del config["attention_bias"], config["mlp_bias"]


# Gemma models llama.cpp knows by their layer count as the 27B, whose queries it scales by
# (hidden / heads) ** -0.5; every other size by head_dim ** -0.5 (models/gemma2.cpp, gemma3.cpp).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's sliding pattern where the file has none: every n-th layer global (gemma2 2, gemma3 6).
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}


def gemma_query_scalar(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp's gemma graphs imply (no key holds it)."""
    return hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim


def gemma_sliding_layers(metadata: dict, arch: str, layers: int, src: Path) -> list[bool]:
    """Which layers slide, as llama.cpp reads them: attention.sliding_window_pattern as one flag
    per layer, or as n (every n-th layer global), else the architecture's default n; gemma3
    without a window (0 or absent) has no sliding layer."""
    window = metadata.get(f"{arch}.attention.sliding_window")
    if arch == "gemma3" and not window:
        return [False] * layers
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise WeightsError(f"{src}: {arch}.attention.sliding_window_pattern must hold one flag per layer "
                               f"({layers}), got {len(pattern)} values")
        return list(pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise WeightsError(f"{src}: {arch}.attention.sliding_window_pattern must be a whole number, got {pattern!r}")
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]


def _gemma_config(config: dict, metadata: dict, arch: str, src: Path) -> None:
    """Gemma 2 / 3 as llama.cpp reads them (Gemma2Model / Gemma3Model write them): GeGLU, the
    soft-caps (gemma2: attention 50 and final 30 unless the file says; gemma3: a final cap only
    where the file has one), the window and sliding layers, gemma3's local RoPE base
    (rope.freq_base_swa, default 10000) beside the global one and its linear scaling;
    query_pre_attn_scalar as llama.cpp derives it."""
    del config["mlp_bias"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    del config["hidden_act"]
    layers = config["num_hidden_layers"]
    config["query_pre_attn_scalar"] = gemma_query_scalar(arch, layers, config["hidden_size"],
                                                         config["num_attention_heads"], config["head_dim"])
    final = metadata.get(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0)
    if isinstance(final, bool) or not isinstance(final, (int, float)) or not math.isfinite(final) or final < 0:
        raise WeightsError(f"{src}: metadata {arch}.final_logit_softcapping must be a number >= 0, got {final!r}")
    config["final_logit_softcapping"] = float(final) or None
    if arch == "gemma2":
        config["attn_logit_softcapping"] = positive_float(metadata, "gemma2.attn_logit_softcapping", src, default=50.0)
        if metadata.get("gemma2.rope.freq_base_swa", config["rope_theta"]) != config["rope_theta"]:
            raise UnsupportedModelError(f"{src}: gemma2 with a separate sliding-layer RoPE base is not supported")
    else:
        config["rope_local_base_freq"] = positive_float(metadata, "gemma3.rope.freq_base_swa", src, default=10000.0)
    sliding = gemma_sliding_layers(metadata, arch, layers, src)
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    window = metadata.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0 or (any(sliding) and window == 0):
        raise WeightsError(f"{src}: metadata {arch}.attention.sliding_window must be a positive whole number, "
                           f"got {window!r}")
    config["sliding_window"] = window or None


def _with_special_ids(config: dict, metadata: dict, vocab_size: int, src: Path) -> dict:
    """`config` with the bos/eos/pad ids the file names (each checked against the vocabulary)."""
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = token_id(metadata, gguf_key, vocab_size, src)
        if value is not None:
            config[key] = value
    return config


def _vocab_size(metadata: dict, arch: str, src: Path) -> int:
    tokens = metadata.get("tokenizer.ggml.tokens")
    default_vocab = len(tokens) if isinstance(tokens, (list, Skipped)) and len(tokens) else None
    if f"{arch}.vocab_size" not in metadata and default_vocab is None:
        raise WeightsError(f"{src}: required metadata key {arch}.vocab_size (or tokenizer.ggml.tokens) is missing")
    return positive_int(metadata, f"{arch}.vocab_size", src, default=default_vocab)


def _gpt2_config(metadata: dict, src: Path) -> dict:
    """config.json of a Hugging Face GPT-2 (GPT2LMHeadModel) from `gpt2.*` metadata, as
    llama.cpp's convert_hf_to_gguf.py writes it (GPT2Model): learned positions (no RoPE
    keys), LayerNorm with bias and its epsilon, the tanh-approximated GELU llama.cpp runs
    (transformers' "gelu_new"), one key/value head per attention head. The sizes go under
    the names both transformers' GPT2Config (through its attribute map) and twice read;
    the MLP width, epsilon and activation under GPT-2's own (n_inner, layer_norm_epsilon,
    activation_function)."""
    hidden = positive_int(metadata, "gpt2.embedding_length", src)
    heads = positive_int(metadata, "gpt2.attention.head_count", src)
    kv_heads = _kv_heads(metadata, "gpt2.attention.head_count_kv", heads, src)
    if kv_heads != heads:
        raise UnsupportedModelError(f"{src}: gpt2 with {kv_heads} key/value heads for {heads} attention heads "
                                    "(grouped-query attention) is not supported")
    if hidden % heads:
        raise WeightsError(f"{src}: embedding_length {hidden} is not divisible by head_count {heads}")
    for key in ("key_length", "value_length"):
        if metadata.get(f"gpt2.attention.{key}", hidden // heads) != hidden // heads:
            raise UnsupportedModelError(f"{src}: gpt2 attention {key} {metadata[f'gpt2.attention.{key}']!r} is not "
                                        f"embedding_length / head_count ({hidden // heads}), which GPT-2 cannot express")
    vocab_size = _vocab_size(metadata, "gpt2", src)
    config = {
        "architectures": [_HF_ARCHITECTURES["gpt2"]],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": positive_int(metadata, "gpt2.block_count", src),
        "num_attention_heads": heads,
        "max_position_embeddings": positive_int(metadata, "gpt2.context_length", src),
        "n_inner": positive_int(metadata, "gpt2.feed_forward_length", src),
        "layer_norm_epsilon": positive_float(metadata, "gpt2.attention.layer_norm_epsilon", src),
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,  # settled by _plan_tensors once it has seen output.weight
    }
    return _with_special_ids(config, metadata, vocab_size, src)


def _kv_heads(metadata: dict, key: str, heads: int, src: Path) -> int:
    """head_count_kv is a number, or (in some files) one number per layer."""
    value = metadata.get(key, heads)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedModelError(f"{src}: a different number of key/value heads per layer is not supported")
        value = value[0]
    return positive_int({key: value}, key, src)


def _rope_scaling(metadata: dict, arch: str, src: Path) -> dict | None:
    """rope_scaling for the scaling types whose meaning is the same in llama.cpp and HF."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        # Files from before rope.scaling.type carry a bare linear factor.
        factor = metadata.get(f"{arch}.rope.scale_linear")
        if factor in (None, 1, 1.0):
            return None
        kind = "linear"
    else:
        factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind != "linear":
        raise UnsupportedModelError(f"{src}: RoPE scaling type {kind!r} is not supported; supported: none, linear")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise WeightsError(f"{src}: linear RoPE scaling needs a positive rope.scaling.factor, got {factor!r}")
    return {"rope_type": "linear", "factor": float(factor)}


# llama3 RoPE settings are not metadata in a GGUF: llama.cpp stores the per-frequency
# divisors they produce (the rope_freqs tensor), and we find settings that give them again.
def _llama3_rope_from_freqs(rope_freqs, theta: float, head_dim: int, src: Path) -> dict | None:
    if rope_freqs is None:
        return None
    import gguf

    divisors = np.asarray(gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float64).ravel()
    if divisors.shape != (head_dim // 2,):
        raise WeightsError(f"{src}: rope_freqs.weight has {divisors.size} values, expected {head_dim // 2}")
    if np.allclose(divisors, 1.0):
        return None
    found = llama3_rope_from_divisors(divisors, theta, head_dim)
    if found is None:
        raise UnsupportedModelError(
            f"{src}: rope_freqs.weight holds RoPE frequency factors that match no supported scaling (none of "
            "llama3's settings gives them)"
        )
    return found


def llama3_rope_from_divisors(divisors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """llama3 RoPE settings that give these per-frequency divisors, or None. A GGUF keeps
    only the divisors, and settings that scale original context, low and high factors
    together give the same ones: this answers with low_freq_factor 1 (as Llama 3.1 and
    3.2 have), Llama 3.1's own settings first. Each candidate is checked by recomputing
    the divisors, so an answer is never a guess."""
    factor = float(divisors.max())
    wavelen = _wavelengths(theta, head_dim)
    # the divisors strictly between 1 and the factor lie in the smoothed band, where
    # 1 / divisor = (1 - s) / factor + s and s = (original / wavelen - low) / (high - low)
    undivided, divided = np.isclose(divisors, 1.0, rtol=1e-6), np.isclose(divisors, factor, rtol=1e-6)
    mid = ~undivided & ~divided
    smooth = (1 / divisors[mid] - 1 / factor) / (1 - 1 / factor) if factor > 1 else np.zeros(0)
    candidates = []  # (original, low, high)
    if mid.sum() >= 2:  # two points fix a = original / (high - low) and b = low / (high - low)
        a, minus_b = np.polyfit(1 / wavelen[mid], smooth, 1)
        b = -minus_b
        if a > 0 and b > 0:
            # any original then gives the same divisors: low 1 where that makes it whole, else 8192's
            for original in dict.fromkeys((max(1, round(a / b)), 8192)):
                candidates.append((original, original * b / a, original * (b + 1) / a))
    # With low 1 and fewer smoothed points, the bands bound the original context: above the
    # smoothed point (or the last undivided wavelength), below the first fully divided one.
    kept, divided = wavelen[undivided], wavelen[divided]
    floor = float(wavelen[mid].max()) if mid.any() else float(kept.max()) if kept.size else 1.0
    ceiling = float(divided.min()) if divided.size else floor * 1e3
    spread = [round(floor * (ceiling / floor) ** (k / 32)) for k in range(1, 32)] if ceiling > floor else []
    for original in dict.fromkeys([8192, *(2**k for k in range(1, 25)), *spread]):
        if mid.any():  # with low 1: high - 1 = (original / wavelen - 1) / s, at each smoothed point
            gaps = (original / wavelen[mid] - 1) / smooth
            if np.all(np.isfinite(gaps)) and np.all(gaps > 0):
                candidates.append((original, 1.0, 1 + float(np.mean(gaps))))
        else:  # high anywhere that keeps the undivided wavelengths below original / high
            top = original / float(kept.max()) if kept.size else 8.0
            if top > 1:
                candidates.append((original, 1.0, min(4.0, (1 + top) / 2)))
    for original, low, high in candidates:
        candidate = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(f"{low:.6g}"),
                     "high_freq_factor": float(f"{high:.6g}"), "original_max_position_embeddings": original}
        if np.allclose(divisors, _llama3_divisors(candidate, theta, head_dim), rtol=1e-4, atol=1e-6):
            return candidate
    return None


def _wavelengths(theta: float, head_dim: int) -> np.ndarray:
    """The wavelength of each RoPE frequency pair, 2π · theta^(2i / head_dim)."""
    return 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _llama3_divisors(params: dict, theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py writes as rope_freqs for these llama3 settings."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = _wavelengths(theta, head_dim)
    smooth = (old_context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_context / high, 1.0, np.where(wavelen > old_context / low, factor, mid))


def _generation_config(metadata: dict, config: dict) -> dict:
    """bos/eos for generation; llama.cpp's end-of-turn tokens also end generation."""
    eos = [config.get("eos_token_id")]
    for name in ("eot_token_id", "eom_token_id"):
        extra = metadata.get(f"tokenizer.ggml.{name}")
        if isinstance(extra, int) and not isinstance(extra, bool) and 0 <= extra < config["vocab_size"]:
            eos.append(extra)
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    out: dict[str, Any] = {}
    if "bos_token_id" in config:
        out["bos_token_id"] = config["bos_token_id"]
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad_token_id" in config:
        out["pad_token_id"] = config["pad_token_id"]
    return out


# -- tensors -------------------------------------------------------------------------------

# Tensors llama.cpp adds that are not weights of the HF model (read into the config instead).
_CONSUMED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class _TensorJob:
    """One tensor to write: where it comes from, its HF name and shape, the head count its
    rows were permuted with (0 when they were not), and whether the checkpoint holds it
    transposed (GPT-2's Conv1D [in, out]; the file holds [out, in], `stored_shape`)."""

    tensor: Any  # gguf_file.GGUFTensor
    name: str
    shape: tuple[int, ...]
    unpermute_heads: int = 0
    transpose: bool = False
    shift: float = 0.0  # subtracted from the file's values (gemma's norms: the converter's + 1)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape as the file stores it, rows first: [out, in] for every matrix."""
        return self.shape[::-1] if self.transpose else self.shape


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape, for every weight a model of this config has (lm_head included):
    qwen2 adds q/k/v biases, qwen3 q/k norms over each head; gpt2 has its own."""
    if config["model_type"] == "gpt2":
        return _gpt2_expected_shapes(config)
    h, v, i = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    per_layer = {
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i),
    }
    per_layer = {f"{leaf}.weight": shape for leaf, shape in per_layer.items()}
    if config["model_type"] == "qwen2":
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if config["model_type"] == "qwen3":
        d = config["head_dim"]
        per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if config["model_type"] == "phi3":  # q/k/v and gate/up fused in the checkpoint as in the file
        for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            del per_layer[f"{leaf}.weight"]
        per_layer.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * i, h)})
    if config["model_type"] == "mixtral":  # every layer's MLP: a router and per-expert w1 (gate), w3 (up), w2 (down)
        for leaf in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            del per_layer[f"{leaf}.weight"]
        per_layer["block_sparse_moe.gate.weight"] = (config["num_local_experts"], h)
        for e in range(config["num_local_experts"]):
            per_layer.update({f"block_sparse_moe.experts.{e}.w1.weight": (i, h),
                              f"block_sparse_moe.experts.{e}.w3.weight": (i, h),
                              f"block_sparse_moe.experts.{e}.w2.weight": (h, i)})
    if config["model_type"] == "qwen3_moe":  # qwen3's attention; every layer: a router and per-expert MLPs
        d, m = config["head_dim"], config["moe_intermediate_size"]
        for leaf in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            del per_layer[f"{leaf}.weight"]
        per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                          "mlp.gate.weight": (config["num_experts"], h)})
        for e in range(config["num_experts"]):
            per_layer.update({f"mlp.experts.{e}.gate_proj.weight": (m, h), f"mlp.experts.{e}.up_proj.weight": (m, h),
                              f"mlp.experts.{e}.down_proj.weight": (h, m)})
    if config["model_type"] == "qwen2_moe":  # qwen2's biases; every layer: a router, experts and a shared expert
        m, sh = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
        for leaf in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            del per_layer[f"{leaf}.weight"]
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
                          "mlp.gate.weight": (config["num_experts"], h), "mlp.shared_expert_gate.weight": (1, h),
                          "mlp.shared_expert.gate_proj.weight": (sh, h), "mlp.shared_expert.up_proj.weight": (sh, h),
                          "mlp.shared_expert.down_proj.weight": (h, sh)})
        for e in range(config["num_experts"]):
            per_layer.update({f"mlp.experts.{e}.gate_proj.weight": (m, h), f"mlp.experts.{e}.up_proj.weight": (m, h),
                              f"mlp.experts.{e}.down_proj.weight": (h, m)})
    if config["model_type"] in GEMMA_ARCHITECTURES:  # sandwich norms; gemma3: per-head q/k norms
        per_layer.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
        if config["model_type"] != "gemma2":
            d = config["head_dim"]
            per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if config["model_type"] == "olmo2":  # norms after attention and MLP; q/k norms over the whole projections
        del per_layer["input_layernorm.weight"]
        per_layer.update({"post_feedforward_layernorm.weight": (h,), "self_attn.q_norm.weight": (q,),
                          "self_attn.k_norm.weight": (kv,)})
    for layer in range(config["num_hidden_layers"]):
        for leaf, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{leaf}"] = shape
    return shapes


def _gpt2_expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """GPT2LMHeadModel's weights in its checkpoint layout (Conv1D matrices [in, out]), in
    the order transformers saves them; biases everywhere, LayerNorms with bias."""
    h, v, i = config["hidden_size"], config["vocab_size"], config["n_inner"]
    shapes = {"transformer.wte.weight": (v, h), "transformer.wpe.weight": (config["max_position_embeddings"], h)}
    per_layer = {
        "ln_1.weight": (h,), "ln_1.bias": (h,),
        "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
        "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,),
        "ln_2.weight": (h,), "ln_2.bias": (h,),
        "mlp.c_fc.weight": (h, i), "mlp.c_fc.bias": (i,),
        "mlp.c_proj.weight": (i, h), "mlp.c_proj.bias": (h,),
    }
    for layer in range(config["num_hidden_layers"]):
        for leaf, shape in per_layer.items():
            shapes[f"transformer.h.{layer}.{leaf}"] = shape
    shapes.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,), "lm_head.weight": (v, h)})
    return shapes


def _plan_tensors(reader, config: dict, src: Path, dequantized: bool = True) -> list[_TensorJob]:
    """Match every GGUF tensor to its HF weight, checking names, shapes and quantization types
    up front, so a file that cannot be converted is refused before anything is written."""
    layers, count = config["num_hidden_layers"], len(reader.tensors)
    if layers > count:  # checked before listing every expected weight: the count may be absurd
        raise WeightsError(f"{src}: metadata says {layers} layers (block_count) but the file holds only {count} tensors")
    expected = _expected_shapes(config)
    found: dict[str, _TensorJob] = {}
    for tensor in _expert_slices(reader.tensors, config, src):
        if tensor.name in _CONSUMED_TENSORS:
            continue
        name = getattr(tensor, "hf", None) or hf_name(tensor.name, config["num_hidden_layers"], config["model_type"])
        if name is None:
            raise UnsupportedModelError(
                f"{src}: tensor {tensor.name} has no counterpart in a {config['model_type']} model (experts and "
                "extra layers are not supported)"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if name not in expected:
            raise UnsupportedModelError(f"{src}: tensor {tensor.name} has no counterpart in a {config['model_type']} model")
        transpose = config["model_type"] == "gpt2" and name.endswith(GPT2_CONV1D)
        want = expected[name][::-1] if transpose else expected[name]
        if shape != want:
            raise WeightsError(f"{src}: tensor {tensor.name} has shape {list(shape)}, expected {list(want)}")
        _check_quantization(tensor, src) if dequantized else _check_stored_type(tensor, shape, src)
        shift = 1.0 if config["model_type"] in GEMMA_ARCHITECTURES and name.endswith("norm.weight") else 0.0
        found[name] = _TensorJob(tensor, name, expected[name], _permuted_heads(tensor.name, config), transpose, shift)

    config["tie_word_embeddings"] = "lm_head.weight" not in found
    missing = [n for n in expected if n not in found and n != "lm_head.weight"]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightsError(f"{src}: tensor for {missing[0]}{more} is missing")
    return [found[n] for n in expected if n in found]  # HF order: embeddings, layers, norm, head


def _expert_slices(tensors, config: dict, src: Path):
    """The file's tensors, each stacked expert tensor (blk.N.ffn_*_exps, [experts, rows, cols])
    as one slice per expert under its per-expert checkpoint name (`hf`): the same file bytes,
    expert e's rows being the e-th of the leading dimension (for float and block types alike)."""
    import dataclasses

    from .gguf_names import expert_hf_name

    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    for tensor in tensors:
        template = expert_hf_name(tensor.name, config["num_hidden_layers"], config["model_type"])
        if template is None:
            yield tensor
            continue
        if len(tensor.shape) != 3 or tensor.shape[2] != experts or tensor.n_bytes % experts:
            raise WeightsError(f"{src}: tensor {tensor.name} has shape {list(reversed(tensor.shape))}, expected "
                               f"{experts} experts first")
        per = tensor.n_bytes // experts
        for e in range(experts):
            piece = dataclasses.replace(tensor, shape=tensor.shape[:2], n_elements=tensor.n_elements // experts,
                                        n_bytes=per, data_offset=tensor.data_offset + e * per)
            object.__setattr__(piece, "hf", template.replace("*", str(e)))
            yield piece


def _permuted_heads(gguf_name: str, config: dict) -> int:
    """llama.cpp permuted q_proj per attention head and k_proj per key/value head, for the
    llama architecture only (its RoPE rotates adjacent pairs there; qwen's rotates halves)."""
    if config["model_type"] not in ("llama", "mixtral"):  # mixtral: llama.cpp's llama architecture
        return 0
    if gguf_name.endswith(".attn_q.weight"):
        return config["num_attention_heads"]
    if gguf_name.endswith(".attn_k.weight"):
        return config["num_key_value_heads"]
    return 0


def _check_quantization(tensor, src: Path) -> None:
    if not _can_dequantize(tensor.tensor_type):
        name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        raise UnsupportedModelError(
            f"{src}: tensor {tensor.name} uses quantization type {name}, which cannot be dequantized "
            "(supported: F32, F16, BF16 and the Q*/IQ* types the gguf package implements)"
        )


def _check_stored_type(tensor, shape: tuple[int, ...], src: Path) -> None:
    """A tensor loaded as stored: a type twice's codecs hold (twice.core.quant), and for
    vectors (norms, biases) a float type."""
    from twice.core import quant

    name = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
    c = quant.BY_GGML_TYPE.get(int(tensor.tensor_type))
    if c is None:
        known = ", ".join(quant.CODECS)
        raise UnsupportedModelError(
            f"{src}: tensor {tensor.name} has type {name}, which twice cannot run as stored (supported: {known}); "
            "--dequantize converts types the gguf package knows into a float copy")
    if len(shape) == 1 and c.quantized:
        raise UnsupportedModelError(f"{src}: tensor {tensor.name} is a vector stored as {name}; twice needs vectors "
                                    "(norms, biases) in F32, F16 or BF16")


@lru_cache(maxsize=None)
def _can_dequantize(qtype) -> bool:
    """Whether gguf.quants can dequantize `qtype`, found by trying it on one zero block (the
    package has no public list, and raises NotImplementedError for the rest)."""
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return True
    if qtype not in gguf.GGML_QUANT_SIZES:
        return False
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        return gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype).size == block
    except (NotImplementedError, ValueError):
        return False


def _unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation.

    convert_hf_to_gguf.py reorders each head's rows from HF's rotate-half layout (first half,
    second half) to interleaved pairs, so that ggml's RoPE rotates adjacent elements:
        w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(w.shape)
    Swapping the same two axes back, from the permuted shape, restores the original order."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _load_weight(job: _TensorJob, src: Path, hf_layout: bool = True) -> np.ndarray:
    """One tensor as float32 in HF layout (a fresh array or a read-only view of the file);
    with `hf_layout` false, a transposed job (GPT-2's Conv1D) stays in the file's [out, in]."""
    import gguf

    with _reading(src):
        data = job.tensor.data
        if data.dtype.kind == "f":  # F32/F16 in the file's byte order: gguf's view(np.float32) would drop it
            weight = data.astype(np.float32)
        else:
            weight = gguf.quants.dequantize(data, job.tensor.tensor_type)
        weight = np.asarray(weight, dtype=np.float32).reshape(job.stored_shape)
    if not np.isfinite(weight).all():  # every float copy (as stored, --dequantize, twice convert) checks here
        raise WeightsError(f"{src}: tensor {job.tensor.name} contains NaN or infinite values")
    if job.unpermute_heads:
        weight = _unpermute_rows(weight, job.unpermute_heads)
    if job.shift:
        weight = weight - np.float32(job.shift)
    if job.transpose and hf_layout:
        weight = weight.T
    return weight


def _tensor_bytes(weight: np.ndarray, dtype: torch.dtype) -> memoryview:
    """The little-endian bytes of `weight` cast to `dtype` (numpy has no bfloat16: torch casts)."""
    if dtype == torch.float32:
        data = np.ascontiguousarray(weight, dtype="<f4")
    elif dtype == torch.float16:
        data = np.ascontiguousarray(weight, dtype="<f2")
    else:
        writable = weight if weight.flags.writeable else weight.copy()
        data = torch.from_numpy(np.ascontiguousarray(writable)).to(dtype).view(torch.int16).numpy().astype("<i2", copy=False)
    return memoryview(data).cast("B")


def _write_safetensors(path: Path, jobs: list[_TensorJob], dtype: torch.dtype, src: Path, say: Progress) -> None:
    """Write model.safetensors one tensor at a time.

    The header only needs names, shapes and sizes, which the plan already knows, so each
    tensor is dequantized, written and dropped before the next: memory stays at one tensor,
    never the whole float32 model."""
    element = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for job in jobs:
        size = math.prod(job.shape) * element
        header[job.name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(job.shape),
                            "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data that follows starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for index, job in enumerate(jobs, 1):
            say(f"tensor {index}/{len(jobs)}: {job.tensor.name} -> {job.name}")
            f.write(_tensor_bytes(_load_weight(job, src), dtype))


class DestinationExists(WeightsError):
    """The destination is a folder that is not empty and `overwrite` was not given (the CLI
    names its own flag instead of the Python argument)."""


def _check_destination(dest: Path, overwrite: bool) -> None:
    # A link is refused rather than followed: replacing it would swap the link, not its target.
    if dest.is_symlink():
        raise WeightsError(f"{dest}: is a symbolic link; give the folder it points to instead")
    if dest.exists() and not dest.is_dir():
        raise WeightsError(f"{dest}: exists and is not a folder; choose another destination")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise DestinationExists(f"{dest}: folder exists and is not empty (pass overwrite=True to replace it)")


@contextmanager
def _atomic_folder(dest: Path, overwrite: bool) -> Iterator[Path]:
    """safe_write.atomic_folder with this module's errors: an empty folder to write into,
    renamed to `dest` when the block succeeds (replacing an old `dest` if `overwrite`),
    deleted otherwise; under `dest`'s lock (a second conversion into the same folder is
    refused while the first runs; resolve's cache entries hold the lock already, waiting),
    with the temporary folders of dead conversions removed first."""
    from .safe_write import atomic_folder

    # _check_destination is looked up at each call, so that a test can stand in for it.
    with atomic_folder(dest, overwrite, what="the converted model", error=WeightsError,
                       check=lambda d, o: _check_destination(d, o)) as work:
        try:
            yield work
        except OSError as e:
            raise WeightsError(f"{dest}: cannot write the converted model ({e.strerror or e})") from None


def _save_tokenizer(tokenizer, path: Path) -> None:
    try:
        tokenizer.save(str(path))
    except Exception as e:  # tokenizers reports I/O errors (disk full, ...) as a bare Exception
        raise OSError(str(e).splitlines()[0] if str(e) else "cannot write tokenizer.json") from None


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
