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

Only what can be converted exactly is accepted: the architectures the model families declare
GGUF forms for (core/family.GgufForm: their names, their own metadata keys; Mixtral is llama
with stacked experts, read one slice per expert; gemma's norms hold w + 1 in the file: the 1 is
subtracted), with the tokenizers gguf_tokenizer.py rebuilds. Anything else is refused with a one-line `UnsupportedModelError`;
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
from .gguf_metadata import Metadata, positive_float, positive_int, require, token_id
from .gguf_names import hf_name
from .gguf_tokenizer import build_tokenizer

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
    metadata (and the tensors llama.cpp keeps settings in, by `find(name)`: phi3's RoPE
    factors): the keys every llama-like architecture shares here, the family's own by its
    GGUF form (core/family.GgufForm.read)."""
    from twice.core import models

    arch = require(metadata, "general.architecture", src)
    if not isinstance(arch, str):
        raise WeightsError(f"{src}: metadata general.architecture must be a string, got {arch!r}")
    experts = metadata.get(f"{arch}.expert_count", 0)
    found = models.gguf_form_of_file(arch, bool(experts))
    if found is None:
        raise UnsupportedModelError(
            f"{src}: GGUF architecture {arch!r} is not supported; supported: {', '.join(models.GGUF_ARCHITECTURES)}"
        )
    model_type, form = found
    if experts and not form.experts:
        raise UnsupportedModelError(f"{src}: mixture-of-experts {arch} models are not supported (Mixtral, as "
                                    "llama with experts, is)")
    m = Metadata(metadata, src, arch, find)
    config = {"architectures": [form.hf_class], "model_type": model_type, "vocab_size": _vocab_size(metadata, arch, src)}
    if form.shared_keys:
        config.update(_shared_config(m, models.family(model_type).partial_rotary))
    form.read(config, m)
    config["tie_word_embeddings"] = True  # settled by _plan_tensors once it has seen output.weight
    if rope_freqs is not None and "llama3" not in form.rope_tensors:
        raise UnsupportedModelError(f"{src}: tensor rope_freqs.weight (llama3 RoPE frequency factors) is not part of "
                                    f"llama.cpp's {arch} architecture")
    if form.shared_keys:
        scaling = _rope_scaling(metadata, arch, src)
        divisors = _rope_divisors(rope_freqs, config["head_dim"], src)
        if scaling and divisors is not None:
            raise UnsupportedModelError(f"{src}: both rope_freqs.weight (llama3 RoPE scaling) and {scaling['rope_type']} "
                                        "RoPE scaling keys; a model has one scaling")
        if divisors is not None:
            scaling = _llama3_rope_from_divisors(divisors, config["rope_theta"], config["head_dim"], src)
        if scaling and "rope_scaling" in config:
            raise UnsupportedModelError(f"{src}: {arch} with both longrope factors and RoPE scaling keys is not "
                                        "supported")
        if scaling:
            config["rope_scaling"] = scaling
    return _with_special_ids(config, metadata, config["vocab_size"], src)


def _shared_config(m: Metadata, partial_rotary: bool) -> dict:
    """The keys every llama-like architecture shares: sizes, heads, the RMSNorm epsilon, the
    RoPE base (and which dimensions rotate: all, except in a family with partial rotary)."""
    src, arch = m.src, m.arch
    hidden = m.int("embedding_length")
    heads = m.int("attention.head_count")
    kv_heads = m.kv_heads(heads)
    if heads % kv_heads:
        raise WeightsError(f"{src}: {heads} attention heads is not a multiple of {kv_heads} key/value heads")
    if hidden % heads and "attention.key_length" not in m:
        raise WeightsError(f"{src}: embedding_length {hidden} is not divisible by head_count {heads}")
    head_dim = m.int("attention.key_length", default=hidden // heads)
    if m.int("attention.value_length", default=head_dim) != head_dim:
        raise UnsupportedModelError(f"{src}: attention value_length differs from key_length, which {arch} cannot express")
    # llama.cpp rotates rope.dimension_count dims of each head; HF llama rotates all of them
    # (phi3: partial_rotary_factor of them).
    rotary = m.int("rope.dimension_count", default=head_dim)
    if rotary != head_dim and not partial_rotary:
        raise UnsupportedModelError(f"{src}: partial rotary embeddings (rope.dimension_count {rotary} of head_dim "
                                    f"{head_dim}) are not supported in {arch}")
    if rotary > head_dim or rotary % 2:
        raise WeightsError(f"{src}: metadata {arch}.rope.dimension_count {rotary} must be even and at most the head "
                           f"dimension {head_dim}")
    if head_dim % 2:
        raise WeightsError(f"{src}: head dimension {head_dim} must be even for rotary embeddings")
    return {
        "hidden_size": hidden,
        "intermediate_size": m.int("feed_forward_length"),
        "num_hidden_layers": m.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": m.int("context_length"),
        "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon"),
        "rope_theta": m.float("rope.freq_base", default=10000.0),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


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


def _rope_scaling(metadata: dict, arch: str, src: Path) -> dict | None:
    """rope_scaling for the scaling types whose meaning is the same in llama.cpp and HF:
    linear, and YaRN with llama.cpp's defaults for what transformers' yarn derives (its
    attention factor 0.1 · ln(factor) + 1, the ramp's ends rounded outwards)."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        # Files from before rope.scaling.type carry a bare linear factor.
        factor = metadata.get(f"{arch}.rope.scale_linear")
        if factor in (None, 1, 1.0):
            return None
        kind = "linear"
    else:
        factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"{src}: RoPE scaling type {kind!r} is not supported; supported: none, linear, "
                                    "yarn")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise WeightsError(f"{src}: {kind} RoPE scaling needs a positive rope.scaling.factor, got {factor!r}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    for key in ("attn_factor", "yarn_attn_factor", "yarn_ext_factor"):  # llama.cpp's knobs beyond transformers'
        if metadata.get(f"{arch}.rope.scaling.{key}", 1.0) != 1.0:
            raise UnsupportedModelError(f"{src}: yarn RoPE scaling with {arch}.rope.scaling.{key} "
                                        f"{metadata[f'{arch}.rope.scaling.{key}']!r} is not supported (1 only)")
    scaling = {"rope_type": "yarn", "factor": float(factor),
               "original_max_position_embeddings": positive_int(metadata, f"{arch}.rope.scaling.original_context_length",
                                                                src)}
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{key}" in metadata:
            scaling[hf] = positive_float(metadata, f"{arch}.rope.scaling.{key}", src)
    return scaling


# llama3 RoPE settings are not metadata in a GGUF: llama.cpp stores the per-frequency
# divisors they produce (the rope_freqs tensor), and we find settings that give them again.
def _rope_divisors(rope_freqs, head_dim: int, src: Path) -> np.ndarray | None:
    """The per-frequency divisors of a rope_freqs tensor, checked; None where there is none or
    it divides nothing (all ones)."""
    if rope_freqs is None:
        return None
    import gguf

    divisors = np.asarray(gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float64).ravel()
    if divisors.shape != (head_dim // 2,):
        raise WeightsError(f"{src}: rope_freqs.weight has {divisors.size} values, expected {head_dim // 2}")
    if not np.isfinite(divisors).all() or (divisors <= 0).any():
        raise WeightsError(f"{src}: rope_freqs.weight must hold {head_dim // 2} positive finite factors")
    return None if np.allclose(divisors, 1.0) else divisors


def _llama3_rope_from_divisors(divisors: np.ndarray, theta: float, head_dim: int, src: Path) -> dict:
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


def _expected(config: dict, src: Path, stored: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """HF name → (its shape in a checkpoint, its Target), for every checkpoint tensor a model of
    this config reads: the family's own map (its targets() on the meta device), so no list of
    weights per family is kept here. Names that fill the same place (GPT-2's with and without
    "transformer.", a head tied to the embedding) share a Target. A config that implies far
    more parameters than the file's `stored` values is refused first, as a folder's is."""
    from twice.core.config import config_from_dict
    from twice.core.models import meta_model

    from .checkpoint import SIZE_SLACK_FACTOR, SIZE_SLACK_PARAMS

    parsed = config_from_dict(config, str(src))
    implied = parsed.parameter_count()
    if implied > SIZE_SLACK_FACTOR * stored + SIZE_SLACK_PARAMS:
        raise WeightsError(f"{src}: its metadata describes a model of {implied:,} parameters but its tensors hold "
                           f"{stored:,} values; check block_count, expert_count and the sizes")
    model = meta_model(parsed)
    params = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    return {name: (places[0].checkpoint_shape(params[places[0].param]), places[0])
            for name, places in model.placements().items()}


def _plan_tensors(reader, config: dict, src: Path, dequantized: bool = True) -> list[_TensorJob]:
    """Match every GGUF tensor to its HF weight, checking names, shapes and quantization types
    up front, so a file that cannot be converted is refused before anything is written. What
    the file alone shows (names, expert counts, its size against the config's) is checked
    before the model's map is built: that costs time and memory in proportion to the layers
    and experts the metadata claims."""
    from twice.core.models import GGUF_FORMS

    from .gguf_names import reads_as

    layers, count, model_type = config["num_hidden_layers"], len(reader.tensors), config["model_type"]
    if layers > count:  # checked before listing every expected weight: the count may be absurd
        raise WeightsError(f"{src}: metadata says {layers} layers (block_count) but the file holds only {count} tensors")
    named: dict[str, Any] = {}
    for tensor in _expert_slices(reader.tensors, config, src):
        if tensor.name in _CONSUMED_TENSORS:
            continue
        name = getattr(tensor, "hf", None) or hf_name(tensor.name, layers, model_type)
        if name is None:
            raise UnsupportedModelError(
                f"{src}: tensor {tensor.name} has no counterpart in a {model_type} model (experts and "
                "extra layers are not supported)"
            )
        if name in named:
            raise WeightsError(f"{src}: tensors {named[name].name} and {tensor.name} are the same weight ({name})")
        named[name] = tensor
    config["tie_word_embeddings"] = "lm_head.weight" not in named
    form = GGUF_FORMS[model_type]
    expected = _expected(config, src, sum(t.n_elements for t in reader.tensors))
    found: dict[str, _TensorJob] = {}
    for name, tensor in named.items():
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if name not in expected:
            raise UnsupportedModelError(f"{src}: tensor {tensor.name} has no counterpart in a {model_type} model")
        want, target = expected[name]
        transpose = target.transpose  # GPT-2's Conv1D: [in, out] in the checkpoint, [out, in] in the file
        if shape != (want[::-1] if transpose else want):
            raise WeightsError(f"{src}: tensor {tensor.name} has shape {list(shape)}, expected "
                               f"{list(want[::-1] if transpose else want)}")
        _check_quantization(tensor, src) if dequantized else _check_stored_type(tensor, shape, src)
        shift = form.norm_shift if name.endswith("norm.weight") else 0.0
        found[name] = _TensorJob(tensor, name, want, _permuted_heads(tensor.name, config, form.permuted_qk), transpose,
                                 shift)

    filled = {expected[n][1].key for n in found}
    missing: dict[Any, str] = {}  # each unfilled place, by the name the file would give it
    for name, (_, target) in expected.items():
        if target.key not in filled and (target.key not in missing or reads_as(name, model_type, layers)):
            missing[target.key] = name
    if missing:
        first = next(iter(missing.values()))
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightsError(f"{src}: tensor for {first}{more} is missing")
    return [found[n] for n in expected if n in found]  # the family's order: embeddings, layers, norm, head


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


def _permuted_heads(gguf_name: str, config: dict, permuted: bool) -> int:
    """llama.cpp permuted q_proj per attention head and k_proj per key/value head where its
    architecture's RoPE rotates adjacent pairs (its llama: the form's permuted_qk; qwen's
    rotates halves)."""
    if not permuted:
        return 0
    if gguf_name.endswith((".attn_q.weight", ".attn_q.bias")):
        return config["num_attention_heads"]
    if gguf_name.endswith((".attn_k.weight", ".attn_k.bias")):
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
