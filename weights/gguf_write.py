"""A model folder → a GGUF file llama.cpp loads: metadata, tokenizer and (quantized) tensors.

The other direction of weights/gguf.py, in the spelling llama.cpp's convert_hf_to_gguf.py
and llama-quantize write:

* the config as `ARCH.*` keys (block_count, context_length, embedding_length,
  feed_forward_length, attention.head_count / head_count_kv, rope.freq_base, the norm
  epsilon, key/value_length where config.json gives head_dim, rope.dimension_count for
  llama, RoPE scaling: linear and yarn as keys, llama3 as the `rope_freqs.weight` tensor);
* the tokenizer as `tokenizer.ggml.*`: byte-level BPE only (model "gpt2"): tokens, token
  types, merges, the `pre` name that stands for the tokenizer.json's pre-tokenizer, the
  bos/eos/pad/unk ids, add_bos/add_eos as the tokenizer does them, the chat template;
* the tensors under llama.cpp's names (`blk.N.attn_q.weight`, ...), with llama's q/k rows
  permuted for llama.cpp's RoPE (qwen2/qwen3 rotate halves as HF does: no permutation) and
  GPT-2's Conv1D matrices transposed; each in the type the mixture gives it (norms, biases
  and every 1-D tensor stay F32, as llama.cpp keeps them; so do position embeddings).

Architectures: those the model families declare GGUF forms for (core/family.GgufForm, in each
family's file: its architecture name, tensor names, own metadata keys and what llama.cpp's graph
cannot express). Mistral and Mixtral are written as llama, whose graph has no sliding window,
so a window shorter than the context is refused (as for qwen2/qwen3); a mixture of experts'
per-expert tensors are stacked into ffn_{gate,up,down}_exps [experts, rows, cols].
Everything that can be refused is checked before a byte is written; the file is written
beside OUT and renamed (safe_write.atomic_file), tensor by tensor (one
tensor's float values in memory at a time), so a failure midway leaves nothing behind.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twice.core.config import ModelConfig
from twice.core.errors import ConfigError, TokenizerError, TwiceError, UnsupportedModelError, WeightsError
from twice.core.fields import show

from .gguf_names import gguf_name

# general.file_type (llama_ftype) of each mixture; the mixtures and their per-tensor rules are
# core/quant/mixes.py's.
FILE_TYPES: dict[str, int] = {
    "f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9,
    "q2_k": 10, "q3_k_m": 12, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18,
}


def _form(model_type: str, where, memory: bool = False):
    """The GGUF form of a model type (core/family.GgufForm): one a file is written of, or with
    `memory`, one --quantize follows llama.cpp's rules for in memory; UnsupportedModelError
    for the rest."""
    from twice.core.models import GGUF_FORMS

    form = GGUF_FORMS.get(model_type)
    if form is None or not (form.writes or memory):
        what = "has no GGUF form" if memory else "cannot be written as GGUF"
        raise UnsupportedModelError(f"{where}: model type {model_type!r} {what}")
    return form


# What convert_hf_to_gguf.py writes as tokenizer.ggml.pre for each pre-tokenizer (see _pre_name).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_CHUNK_VALUES = 1 << 22  # rows are converted and quantized this many float32 values at a time


def canonical_mixture(name: str) -> str:
    """The mixture a --type name stands for ("q4_k" → "q4_k_m"); UsageError for others."""
    from twice.core.errors import UsageError
    from twice.core.quant.mixes import ALIASES, MIXTURES

    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in MIXTURES or key not in FILE_TYPES:
        raise UsageError(f"--type {name!r} is not a quantization type; choose one of {', '.join(FILE_TYPES)} "
                         f"(or {', '.join(ALIASES)})")
    return key


# -- the plan ------------------------------------------------------------------------------


@dataclass
class TensorPlan:
    """One tensor of the output: where its values come from and what it becomes."""

    name: str  # llama.cpp's name
    shape: tuple[int, ...]  # rows first (numpy order)
    type_name: str  # "F32", "Q4_K", ...
    read: Callable[[], torch.Tensor]  # → float32 values in llama.cpp's layout, `shape`
    source: str = ""  # the checkpoint tensor it comes from

    @property
    def nbytes(self) -> int:
        from twice.core import quant

        codec = quant.codec(self.type_name)
        rows = math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1
        return rows * codec.row_bytes(self.shape[-1])


@dataclass
class Summary:
    """What was written (printed by the CLI, also as --json)."""

    path: str
    model: str
    architecture: str
    mixture: str
    tensors: int = 0
    types: dict[str, int] = field(default_factory=dict)  # tensors per type
    type_bytes: dict[str, int] = field(default_factory=dict)  # tensor bytes per type
    parameters: int = 0
    tensor_bytes: int = 0
    file_bytes: int = 0
    seconds: float = 0.0

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.tensor_bytes / self.parameters if self.parameters else 0.0

    def as_dict(self) -> dict:
        return {"path": self.path, "model": self.model, "architecture": self.architecture, "type": self.mixture,
                "tensors": self.tensors, "tensor_types": dict(self.types), "tensor_type_bytes": dict(self.type_bytes),
                "parameters": self.parameters, "tensor_bytes": self.tensor_bytes, "file_bytes": self.file_bytes,
                "bits_per_weight": round(self.bits_per_weight, 4), "seconds": round(self.seconds, 3)}


Progress = Callable[[int, int, TensorPlan], None]


def write_gguf(folder: Path, out: Path, mixture: str, *, overwrite: bool = False, name: str | None = None,
               progress: Progress | None = None) -> Summary:
    """Write the model in `folder` (config.json, safetensors, tokenizer.json) as the GGUF file
    `out`, its tensors in `mixture`'s types. An existing `out` is refused unless
    `overwrite`; `progress(i, n, plan)` is called before each tensor. Returns the summary."""
    from .files import read_json
    from .files import read_config
    from .safe_write import refuse_non_regular

    t0 = time.perf_counter()
    folder, out = Path(folder), Path(out)
    mixture = canonical_mixture(mixture)
    _check_destination(out, overwrite)
    config = read_config(folder)
    raw = read_json(folder / "config.json", ConfigError)
    form = _form(config.model_type, folder)
    arch = form.arch
    _check_supported(config, form, folder)
    metadata = _model_metadata(config, raw, form, mixture, name or folder.name)
    metadata += _tokenizer_metadata(folder, config)
    plans = _plan(folder, config, form, mixture)
    summary = Summary(str(out), name or str(folder), arch, mixture)
    summary.tensors = len(plans)
    for p in plans:
        summary.types[p.type_name] = summary.types.get(p.type_name, 0) + 1
        summary.type_bytes[p.type_name] = summary.type_bytes.get(p.type_name, 0) + p.nbytes
        summary.parameters += math.prod(p.shape) if p.name not in _SETTINGS_TENSORS else 0
        summary.tensor_bytes += p.nbytes

    refuse_non_regular(out, WeightsError)
    _write_file(out, arch, metadata, plans, overwrite, progress)
    summary.file_bytes = out.stat().st_size
    summary.seconds = time.perf_counter() - t0
    return summary


def _check_destination(out: Path, overwrite: bool) -> None:
    from .safe_write import refuse_non_regular

    refuse_non_regular(out, WeightsError)  # a link, a folder, a FIFO: never written through
    if out.exists() and not overwrite:
        raise WeightsError(f"{out}: exists (pass --overwrite to replace it)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise WeightsError(f"{out}: the folder {parent} does not exist")


def _check_supported(config: ModelConfig, form, folder: Path) -> None:
    """What twice loads but llama.cpp's architecture cannot express is refused here: the
    family's own checks (its form's `check`), then a window, an activation or an output
    bias the architecture has no place for."""
    form.check(config, folder)
    if not form.window and config.sliding_window is not None \
            and config.sliding_window < config.max_position_embeddings:
        # llama.cpp's llama (Mistral, Mixtral), qwen2, qwen3 and their MoE architectures have no
        # window: the file would be another model once a prompt outgrows the window
        raise UnsupportedModelError(f"{folder}: {config.model_type} with a sliding window of {config.sliding_window:,} "
                                    f"tokens has no GGUF form (llama.cpp's {form.arch} architecture has no window); "
                                    "--quantize TYPE on generate, chat, batch or serve quantizes it in memory and "
                                    "keeps the window")
    if config.hidden_act not in form.activations:
        raise UnsupportedModelError(f"{folder}: activation {config.hidden_act!r} has no GGUF form for "
                                    f"{config.model_type} (llama.cpp's {form.arch} uses {form.activations[0]})")
    if config.o_bias and not form.o_bias:
        raise UnsupportedModelError(f"{folder}: an output-projection bias has no GGUF form for {config.model_type}")


# -- metadata ------------------------------------------------------------------------------


def _model_metadata(config: ModelConfig, raw: dict, form, mixture: str, name: str) -> list[tuple[str, str, Any]]:
    """(key, GGUF value type, value) for general.* and ARCH.*, as convert_hf_to_gguf writes them:
    the sizes every architecture has, the keys the llama-like ones share, then the family's own
    (its form's `write`; one of the shared keys there replaces it)."""
    import gguf

    arch = form.arch
    kv: list[tuple[str, str, Any]] = [
        ("general.type", "string", "model"),
        ("general.name", "string", name),
        ("general.file_type", "uint32", FILE_TYPES[mixture]),
        ("general.quantization_version", "uint32", gguf.GGML_QUANT_VERSION),
        (f"{arch}.vocab_size", "uint32", config.vocab_size),
        (f"{arch}.context_length", "uint32", config.max_position_embeddings),
        (f"{arch}.embedding_length", "uint32", config.hidden_size),
        (f"{arch}.feed_forward_length", "uint32", config.intermediate_size),
        (f"{arch}.block_count", "uint32", config.num_hidden_layers),
        (f"{arch}.attention.head_count", "uint32", config.num_attention_heads),
        (f"{arch}.attention.head_count_kv", "uint32", config.num_key_value_heads),
    ]
    if form.shared_keys:
        kv += _shared_metadata(config, raw, arch)
    own = form.write(config, raw, arch)
    replaced = {key for key, _, _ in own}
    return [e for e in kv if e[0] not in replaced] + own


def _shared_metadata(config: ModelConfig, raw: dict, arch: str) -> list[tuple[str, str, Any]]:
    """The RMSNorm epsilon, the head size where it is not hidden / heads, the RoPE base and its
    linear or YaRN scaling (llama3's and longrope's are tensors: _settings_tensors)."""
    kv: list[tuple[str, str, Any]] = [(f"{arch}.attention.layer_norm_rms_epsilon", "float32", config.rms_norm_eps)]
    if raw.get("head_dim") is not None or config.head_dim * config.num_attention_heads != config.hidden_size:
        kv += [(f"{arch}.attention.key_length", "uint32", config.head_dim),
               (f"{arch}.attention.value_length", "uint32", config.head_dim)]
    rope = config.rope_parameters or {}
    kv.append((f"{arch}.rope.freq_base", "float32", float(rope.get("rope_theta", 10000.0))))
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        kv += [(f"{arch}.rope.scaling.type", "string", "linear"),
               (f"{arch}.rope.scaling.factor", "float32", float(rope["factor"]))]
    elif kind == "yarn":
        # llama.cpp derives the attention factor (0.1 · ln(factor) + 1) and rounds the ramp's ends
        # outwards as transformers does by default; a config that sets them otherwise has no form
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if rope.get(key) is not None:
                raise UnsupportedModelError(f"yarn RoPE scaling with {key} {rope[key]!r} has no GGUF form (llama.cpp "
                                            "derives the attention factor from the factor alone)")
        if rope.get("truncate", True) is not True:
            raise UnsupportedModelError("yarn RoPE scaling with truncate false has no GGUF form (llama.cpp rounds the "
                                        "ramp's ends)")
        kv += [(f"{arch}.rope.scaling.type", "string", "yarn"),
               (f"{arch}.rope.scaling.factor", "float32", float(rope.get("factor") or 1.0)),
               (f"{arch}.rope.scaling.original_context_length", "uint32",
                int(rope["original_max_position_embeddings"]))]
        for key, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if rope.get(key) is not None:
                kv.append((f"{arch}.rope.scaling.{gguf_key}", "float32", float(rope[key])))
    return kv


def _tokenizer_metadata(folder: Path, config: ModelConfig) -> list[tuple[str, str, Any]]:
    """tokenizer.ggml.* for a tokenizer.json: byte-level BPE as convert_hf_to_gguf's
    _set_vocab_gpt2 and gguf.SpecialVocab write it ("gpt2"), or SentencePiece-style BPE (byte
    fallback, spaces as "▁") as the "llama" tokenizer (_spm_metadata)."""
    from .files import MAX_JSON_BYTES, read_json
    from .tokenizer import Tokenizer

    tok = Tokenizer(folder)
    path = folder / "tokenizer.json"
    data = read_json(path, TokenizerError, MAX_JSON_BYTES)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise UnsupportedModelError(f"{path}: a {kind or 'non-BPE'} tokenizer cannot be written as GGUF; "
                                    "supported: byte-level BPE (GGUF's \"gpt2\" tokenizer) and SentencePiece-style "
                                    "BPE with byte fallback (\"llama\")")
    if model.get("byte_fallback"):
        return _spm_metadata(tok, data, model, path, config)
    pre = _pre_name(data.get("pre_tokenizer"), bool(model.get("ignore_merges")), path)

    size = config.vocab_size
    reverse, added = _id_table(data, model, path, size)
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(_USER_DEFINED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(_CONTROL if added[i].get("special") else _USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(_NORMAL)
    merges = []
    for merge in model.get("merges") or []:
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) and p and " " not in p for p in pair):
            raise TokenizerError(f"{path}: merge {merge!r} is not two tokens without spaces")
        merges.append(f"{pair[0]} {pair[1]}")

    kv: list[tuple[str, str, Any]] = [
        ("tokenizer.ggml.model", "string", "gpt2"),
        ("tokenizer.ggml.pre", "string", pre),
        ("tokenizer.ggml.tokens", "strings", tokens),
        ("tokenizer.ggml.token_type", "int32s", types),
        ("tokenizer.ggml.merges", "strings", merges),
    ]
    return kv + _special_metadata(tok, config, size)


def _special_metadata(tok, config: ModelConfig, size: int) -> list[tuple[str, str, Any]]:
    """The special token ids, whether encoding adds BOS/EOS, and the chat template."""
    kv: list[tuple[str, str, Any]] = []
    ids = {}
    for key, special in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"),
                         ("unknown_token_id", "unk_token"), ("padding_token_id", "pad_token")):
        value = tok.token_id(tok.special_tokens.get(special))
        if value is None and key in ("bos_token_id", "eos_token_id"):
            from_config = config.bos_token_id if key == "bos_token_id" else next(iter(config.eos_token_id), None)
            value = from_config
        if value is not None and 0 <= value < size:
            ids[key] = value
            kv.append((f"tokenizer.ggml.{key}", "uint32", value))
    add_bos, add_eos = _adds_specials(tok, ids.get("bos_token_id"), ids.get("eos_token_id"))
    kv += [("tokenizer.ggml.add_bos_token", "bool", add_bos), ("tokenizer.ggml.add_eos_token", "bool", add_eos)]
    if tok.chat_template:
        kv.append(("tokenizer.chat_template", "string", tok.chat_template))
    return kv


def _id_table(data: dict, model: dict, path: Path, size: int) -> tuple[dict[int, str], dict[int, dict]]:
    """id → token text over the vocabulary and the added tokens, and the added tokens by id."""
    added = {}
    for entry in data.get("added_tokens") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), int) and isinstance(entry.get("content"), str):
            added[entry["id"]] = entry
    reverse: dict[int, str] = {}
    for token, index in model["vocab"].items():
        if isinstance(index, int) and not isinstance(index, bool):
            reverse[index] = token
    for index, entry in added.items():
        reverse[index] = entry["content"]
    largest = max(reverse, default=-1)
    if largest >= size:
        raise TokenizerError(f"{path}: token id {largest:,} does not fit the model's vocab_size {size:,}")
    return reverse, added


_SPACE = "\u2581"  # "▁"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _spm_space_prefix(data: dict, path: Path) -> bool:
    """Whether the tokenizer.json's SentencePiece pipeline puts "▁" in front of the text
    (llama.cpp's tokenizer.ggml.add_space_prefix), from the forms transformers writes:
    normalizer Prepend("▁") + Replace(" ", "▁") (Llama 2, Mistral), Replace alone (Gemma),
    or a Metaspace pre-tokenizer that does not split; anything else would split or normalize
    text in a way llama.cpp's "llama" tokenizer does not, and is refused. (llama.cpp, like
    sentencepiece itself, prepends the space to every text; Metaspace's prepend_scheme "first"
    does not where the text already begins with a space: such texts encode as sentencepiece
    encodes them once in GGUF.)"""
    def is_replace(n):
        return (isinstance(n, dict) and n.get("type") == "Replace" and n.get("pattern") == {"String": " "}
                and n.get("content") == _SPACE)

    normalizer, pre = data.get("normalizer"), data.get("pre_tokenizer")
    steps = normalizer.get("normalizers") if isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" \
        else [normalizer] if normalizer is not None else []
    prepend = [n for n in steps if isinstance(n, dict) and n.get("type") == "Prepend" and n.get("prepend") == _SPACE]
    others = [n for n in steps if not is_replace(n) and n not in prepend]
    no_op_split = (isinstance(pre, dict) and pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}
                   and pre.get("behavior") == "MergedWithPrevious" and not pre.get("invert")
                   and any(is_replace(n) for n in steps))  # Gemma's: no spaces are left to split on
    metaspace = (isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("replacement") == _SPACE
                 and not pre.get("split", True) and not steps)
    if others or not (pre is None or no_op_split or metaspace) or not (steps or metaspace):
        raise UnsupportedModelError(f"{path}: a SentencePiece-style tokenizer with normalizer {show(normalizer)} and "
                                    f"pre-tokenizer {show(pre)} cannot be written as GGUF (llama.cpp's \"llama\" "
                                    "tokenizer only replaces spaces with \"▁\" and may prepend one)")
    if metaspace:
        return pre.get("prepend_scheme", "always") in ("first", "always")
    return bool(prepend)


def _spm_metadata(tok, data: dict, model: dict, path: Path, config: ModelConfig) -> list[tuple[str, str, Any]]:
    """tokenizer.ggml.* of the "llama" (SentencePiece) kind for a BPE tokenizer.json with byte
    fallback: the tokens in id order with their types (byte tokens BYTE, the unknown token,
    special added tokens CONTROL, other added ones USER_DEFINED, ids without a token
    [PAD<id>] UNUSED, as convert_hf_to_gguf's _set_vocab_sentencepiece writes them) and scores
    that rank the merges as the file does: a token's score is minus the rank of the first merge
    that makes it (llama.cpp merges the best-scoring pair; twice's reader rebuilds the merges
    from the scores, gguf_tokenizer.merges_from_scores), tokens no merge makes far below."""
    size = config.vocab_size
    space_prefix = _spm_space_prefix(data, path)
    reverse, added = _id_table(data, model, path, size)
    rank: dict[str, int] = {}
    for i, merge in enumerate(model.get("merges") or []):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
            raise TokenizerError(f"{path}: merge {merge!r} is not two tokens")
        rank.setdefault(pair[0] + pair[1], i)
    unk = model.get("unk_token") or tok.special_tokens.get("unk_token")
    tokens, scores, types = [], [], []
    for i in range(size):
        text = reverse.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            scores.append(-1e9)
            types.append(_UNUSED)
            continue
        tokens.append(text)
        scores.append(-float(rank[text]) if text in rank else -1e9)
        if text == unk:
            types.append(_UNKNOWN)
        elif i in added:
            types.append(_CONTROL if added[i].get("special") else _USER_DEFINED)
        elif _BYTE_TOKEN.fullmatch(text):
            types.append(_BYTE)
        else:
            types.append(_NORMAL)
    kv: list[tuple[str, str, Any]] = [
        ("tokenizer.ggml.model", "string", "llama"),
        ("tokenizer.ggml.tokens", "strings", tokens),
        ("tokenizer.ggml.scores", "float32s", scores),
        ("tokenizer.ggml.token_type", "int32s", types),
        ("tokenizer.ggml.add_space_prefix", "bool", space_prefix),
    ]
    return kv + _special_metadata(tok, config, size)


def _adds_specials(tok, bos: int | None, eos: int | None) -> tuple[bool, bool]:
    """Whether encoding with special tokens puts BOS in front / EOS at the end, as the
    tokenizer itself does it (its post-processor), so llama.cpp encodes the same way."""
    plain = tok.hf.encode("a", add_special_tokens=False).ids
    full = tok.hf.encode("a", add_special_tokens=True).ids
    if len(full) <= len(plain):
        return False, False
    add_bos = bos is not None and full[0] == bos and full[1 : 1 + len(plain)] == plain
    add_eos = eos is not None and full[-1] == eos and full[-1 - len(plain) : -1] == plain
    return add_bos, add_eos


def _pre_name(pre: Any, ignore_merges: bool, path: Path) -> str:
    """tokenizer.ggml.pre for a tokenizer.json pre-tokenizer: the names llama.cpp's loader knows
    for the same splitting (checked by structure; an unknown one is refused rather than
    written as a name that would split text differently in llama.cpp)."""
    def byte_level(step, regex: bool) -> bool:
        return (isinstance(step, dict) and step.get("type") == "ByteLevel" and not step.get("add_prefix_space", False)
                and bool(step.get("use_regex", True)) == regex)

    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    steps = steps if isinstance(steps, list) else [steps]
    if len(steps) == 1 and byte_level(steps[0], True):
        return "gpt-2"
    if len(steps) == 2 and byte_level(steps[1], True) and isinstance(steps[0], dict) \
            and steps[0].get("type") == "Digits" and steps[0].get("individual_digits"):
        return "smollm"
    if len(steps) == 2 and byte_level(steps[1], False) and isinstance(steps[0], dict) and steps[0].get("type") == "Split":
        split = steps[0]
        pattern = split.get("pattern") or {}
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if split.get("behavior") == "Isolated" and not split.get("invert"):
            if regex == _QWEN2_SPLIT:
                return "qwen2"
            if regex == _LLAMA3_SPLIT:  # llama.cpp's llama3 takes a word whole when it is a token
                return "llama-bpe" if ignore_merges else "smaug-bpe"
    raise UnsupportedModelError(f"{path}: its pre-tokenizer matches none llama.cpp knows by name (supported: GPT-2's "
                                "byte-level regex, SmolLM's digits + byte-level, Qwen2's and Llama 3's split patterns)")


# -- tensors -------------------------------------------------------------------------------

_IGNORED = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# Tensors that hold settings, not weights (RoPE tables llama.cpp keeps as tensors).
_SETTINGS_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from HF's rotate-half
    order (first half, second half) to interleaved pairs, for ggml's RoPE (the inverse of
    weights/gguf.py's _unpermute_rows)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def _plan(folder: Path, config: ModelConfig, form, mixture: str) -> list[TensorPlan]:
    """Every output tensor, in llama.cpp's order, with its type checked to fit its rows."""
    from twice.core.models import meta_model

    from .checkpoint import checkpoint_files, iter_tensors

    files = checkpoint_files(folder, config)
    arch, targets = form.arch, meta_model(config).placements()
    layers = config.num_hidden_layers
    found: dict[str, TensorPlan] = {}
    stacked: dict[str, dict[int, tuple]] = {}  # stacked expert tensor → expert → (hf, file)
    unknown: list[str] = []
    for hf, tf in iter_tensors(files):
        if hf.endswith(_IGNORED):
            continue
        name = gguf_name(hf, config.model_type, layers)
        if name is None:
            unknown.append(hf)
            continue
        expert = re.search(r"\.experts\.(\d+)\.", hf)
        if expert and name.endswith("_exps.weight"):
            stacked.setdefault(name, {})[int(expert[1])] = (hf, tf)
            continue
        if name == "output.weight" and config.tie_word_embeddings:
            continue  # the head is the embedding: llama.cpp uses token_embd when output is absent
        if name in found:
            continue  # GPT-2's names with and without "transformer.": the loader checks they agree
        shape = tuple(tf.shape(hf))
        transform = None
        if form.permuted_qk and name.endswith((".attn_q.weight", ".attn_q.bias")):
            transform = ("permute", config.num_attention_heads)
        elif form.permuted_qk and name.endswith((".attn_k.weight", ".attn_k.bias")):
            transform = ("permute", config.num_key_value_heads)
        elif hf in targets and targets[hf][0].transpose:  # GPT-2's Conv1D [in, out]: [out, in] in the file
            transform = ("transpose", 0)
            shape = shape[::-1]
        elif form.norm_shift and hf.endswith("norm.weight"):
            transform = ("shift", form.norm_shift)  # gemma's (1 + w) norms hold w + 1 in llama.cpp's files
        found[name] = TensorPlan(name, shape, "F32", _reader(tf, hf, transform), source=hf)
    for name, by_expert in stacked.items():
        found[name] = _stacked_plan(name, by_expert, config, folder)
    if unknown:
        shown = ", ".join(unknown[:3]) + (f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else "")
        raise UnsupportedModelError(f"{folder}: tensors with no GGUF counterpart in {arch}: {shown}")
    for required in ("token_embd.weight", "output_norm.weight"):
        if required not in found:
            raise WeightsError(f"{folder}: the checkpoint has no tensor for {required}")
    if not config.tie_word_embeddings and "output.weight" not in found:
        raise WeightsError(f"{folder}: the checkpoint has no lm_head.weight (and config.json does not tie it)")
    extra = [p for p in (_rope_freqs(config, form),) if p] + _longrope_factors(config, form)
    plans = [found[n] for n in ("token_embd.weight", "position_embd.weight") if n in found] + extra
    plans += [p for n, p in sorted(found.items(), key=lambda kv: _layer_order(kv[0])) if n.startswith("blk.")]
    plans += [found[n] for n in ("output_norm.weight", "output_norm.bias", "output.weight") if n in found]
    choose = _type_chooser(mixture, arch, config, "output.weight" not in found, folder)
    for p in plans:
        p.type_name = choose(p)
    return plans


def _stacked_plan(name: str, by_expert: dict[int, tuple], config: ModelConfig, folder: Path) -> TensorPlan:
    """llama.cpp's stacked expert tensor ([experts, rows, cols]) from the per-expert ones."""
    experts = config.options.experts
    if sorted(by_expert) != list(range(experts)):
        missing = sorted(set(range(experts)) - set(by_expert))
        raise WeightsError(f"{folder}: {name} needs all {experts} experts; the checkpoint lacks expert {missing[0]}")
    shapes = {tuple(tf.shape(hf)) for hf, tf in by_expert.values()}
    if len(shapes) != 1:
        raise WeightsError(f"{folder}: the experts of {name} differ in shape")
    shape = (experts, *shapes.pop())
    readers = [_reader(tf, hf, None) for hf, tf in (by_expert[e] for e in range(experts))]
    return TensorPlan(name, shape, "F32", lambda: torch.stack([r() for r in readers]), source=by_expert[0][0])


def _layer_order(name: str) -> tuple[int, str]:
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m[1]) if m else -1, name)


def _reader(tf, hf: str, transform) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        from .checkpoint import all_finite

        tensor = tf.read(hf)
        if not all_finite(tensor):
            raise WeightsError(f"{tf.path}: tensor {hf!r} contains NaN or infinite values")
        tensor = tensor.to(torch.float32)
        if transform and transform[0] == "permute":
            tensor = _permute(tensor, transform[1])
        elif transform and transform[0] == "transpose":
            tensor = tensor.t()
        elif transform and transform[0] == "shift":
            tensor = tensor + transform[1]
        return tensor
    return read


def _rope_freqs(config: ModelConfig, form) -> TensorPlan | None:
    """Llama 3.1-style RoPE as llama.cpp stores it: the per-frequency divisors, rope_freqs.weight."""
    rope = config.rope_parameters or {}
    if rope.get("rope_type") != "llama3":
        return None
    if "llama3" not in form.rope_tensors:
        raise UnsupportedModelError(f"llama3 RoPE scaling has no GGUF form for {form.arch}")
    from .gguf import _llama3_divisors, llama3_rope_from_divisors

    divisors = _llama3_divisors(rope, float(rope["rope_theta"]), config.head_dim).astype(np.float32)
    if llama3_rope_from_divisors(divisors.astype(np.float64), float(rope["rope_theta"]), config.head_dim) is None:
        raise UnsupportedModelError(  # a file that its own reader would refuse is not written
            f"llama3 RoPE scaling (factor {rope['factor']:g}, low_freq_factor {rope['low_freq_factor']:g}, "
            f"high_freq_factor {rope['high_freq_factor']:g}, original context "
            f"{rope['original_max_position_embeddings']}) has no GGUF form that reads back: a GGUF keeps only "
            "its frequency divisors, and these match no llama3 settings within float32's precision")
    values = torch.from_numpy(divisors)
    return TensorPlan("rope_freqs.weight", tuple(values.shape), "F32", lambda: values, source="rope_parameters")


def _longrope_factors(config: ModelConfig, form) -> list[TensorPlan]:
    """longrope's per-pair factors as llama.cpp keeps them: rope_factors_long/short.weight."""
    rope = config.rope_parameters or {}
    if rope.get("rope_type") != "longrope":
        return []
    if "longrope" not in form.rope_tensors:
        raise UnsupportedModelError(f"longrope RoPE scaling has no GGUF form for {form.arch}")
    plans = []
    for name, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
        values = torch.tensor(rope[key], dtype=torch.float32)
        plans.append(TensorPlan(name, tuple(values.shape), "F32", lambda v=values: v, source=f"rope_parameters.{key}"))
    return plans


def _keeps_float(p: TensorPlan) -> bool:
    """llama.cpp never quantizes 1-D tensors, norms, biases or position embeddings."""
    return (len(p.shape) < 2 or p.name.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight",  # + MoE routers
                                                 "ffn_gate_inp_shexp.weight"))  # ([1, hidden]: 1-D to ggml)
            or p.name == "position_embd.weight" or p.name in _SETTINGS_TENSORS)


def _type_chooser(mixture: str, arch: str, config: ModelConfig, tied: bool, where: Any) -> Callable[[TensorPlan], str]:
    """The type of each tensor: llama.cpp's mixture rules (core/quant/mixes.py), with its
    fallback for rows that are not whole 256-value blocks. Where not even the fallback's
    32-value blocks divide a row (llama.cpp would then write F16, or refuse a plain 32-value
    type), the mixture cannot hold the model: one line."""
    from twice.core import quant
    from twice.core.quant import mixes

    base = mixes.MIXTURES[mixture]
    n_gqa = config.num_attention_heads // config.num_key_value_heads

    def choose(p: TensorPlan) -> str:
        if _keeps_float(p):
            return "F32"
        if not quant.codec(base).quantized:
            return base
        n = p.shape[-1]
        kind = mixes.tensor_type(mixture, p.name, config.num_hidden_layers, p.shape, arch,
                                 tied_embeddings=tied, n_gqa=n_gqa)
        if not quant.codec(kind).quantized:
            tried = [base] + [t for t in (mixes.FALLBACK.get(base),) if t]
            sizes = " or ".join(f"{t} ({quant.codec(t).block_size})" for t in tried)
            raise UnsupportedModelError(
                f"{where}: tensor {p.name} (rows of {n} values) cannot be stored as {mixture}: rows must be whole "
                f"blocks of {sizes} values; choose f16, bf16 or f32 for this model")
        if not _can_quantize(kind):
            raise UnsupportedModelError(f"quantizing to {kind} (for --type {mixture}) is not available in this "
                                        "version of twice")
        return kind

    return choose


def memory_types(config: ModelConfig, mixture: str, shapes: dict[str, tuple[int, int]],
                 where: str = "--quantize") -> dict[str, str]:
    """--quantize in memory: the type `twice quantize --type mixture` would write for each
    matrix, by its checkpoint (Hugging Face) name and its (rows, row length) shape; matrices
    that stay float (position embeddings) are "F32", and a tied head (the embedding) is left
    out. The same rules, fallbacks and one-line refusals as the file."""
    mixture = canonical_mixture(mixture)
    arch = _form(config.model_type, where, memory=True).arch
    tied = config.tie_word_embeddings
    choose = _type_chooser(mixture, arch, config, tied, where)
    types: dict[str, str] = {}
    for hf, shape in shapes.items():
        name = gguf_name(hf, config.model_type, config.num_hidden_layers)
        if name is None or (name == "output.weight" and tied):
            continue
        types[hf] = choose(TensorPlan(name, tuple(int(d) for d in shape), "F32", lambda: None, source=hf))
    return types


def _can_quantize(type_name: str) -> bool:
    from twice.core import quant

    codec = quant.codec(type_name)
    return codec.name == "F32" or codec.quantize_blocks is not None


def _quantize(x: torch.Tensor, type_name: str) -> np.ndarray:
    """float32 rows → the type's bytes (uint8 rows; F32 as it is) by twice's quantizers
    (core/quant: llama.cpp's reference quantizers, bit for bit gguf's where gguf has them)."""
    from twice.core import quant

    if type_name == "F32":
        return x.contiguous().numpy()
    return quant.quantize(x, type_name).numpy()


def _encode(p: TensorPlan) -> np.ndarray:
    """The tensor's bytes in its type, converted a chunk of rows at a time."""
    values = p.read()
    if tuple(values.shape) != p.shape:
        raise WeightsError(f"tensor {p.source} has shape {list(values.shape)}, expected {list(p.shape)}")
    rows = values.reshape(-1, p.shape[-1]) if values.dim() > 1 else values.reshape(1, -1)
    step = max(1, _CHUNK_VALUES // max(1, rows.shape[1]))
    try:
        if rows.shape[0] <= step:
            return _quantize(rows, p.type_name).reshape(-1)
        parts = [_quantize(rows[i : i + step], p.type_name).reshape(-1) for i in range(0, rows.shape[0], step)]
    except ValueError as e:  # values the type cannot hold (past fp16's range): the quantizer's one line
        raise WeightsError(f"tensor {p.source} ({p.name}): {e}") from None
    return np.concatenate(parts)


# -- the file ------------------------------------------------------------------------------


def _write_file(out: Path, arch: str, metadata: list, plans: list[TensorPlan], overwrite: bool,
                progress: Progress | None) -> None:
    import gguf

    from .safe_write import atomic_file

    with atomic_file(out, wait=False, what="this GGUF file", error=WeightsError) as tmp:
        if out.exists() and not overwrite:  # it appeared while we planned
            raise WeightsError(f"{out}: exists (pass --overwrite to replace it)")
        writer = _writer(tmp, arch)
        try:
            for key, kind, value in metadata:
                _add(writer, key, kind, value)
            for p in plans:
                codec_type = gguf.GGMLQuantizationType[p.type_name]
                writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=codec_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for index, p in enumerate(plans, 1):
                if progress:
                    progress(index, len(plans), p)
                data = _encode(p)
                if data.nbytes != p.nbytes:  # a quantizer that returned the wrong size: never a broken file
                    raise WeightsError(f"tensor {p.name}: {p.type_name} data is {data.nbytes} bytes, expected {p.nbytes}")
                writer.write_tensor_data(data)
                del data
            writer.flush()
            for f in writer.fout or []:
                os.fsync(f.fileno())
        except OSError as e:
            raise WeightsError(f"{out}: cannot write the GGUF file ({e.strerror or e})") from None
        finally:
            writer.close()


def _writer(path: Path, arch: str):
    """gguf's writer, its metadata arrays packed whole: it packs them element by element
    in Python (~1.5 s for a 150k-token vocabulary's tokens, types, scores and merges); the
    bytes are the same (tests/test_gguf_write.py compares them)."""
    import struct

    import gguf

    class Writer(gguf.GGUFWriter):
        _ARRAYS = {gguf.GGUFValueType.INT32: "<i4", gguf.GGUFValueType.FLOAT32: "<f4", gguf.GGUFValueType.BOOL: "?"}

        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if (vtype != gguf.GGUFValueType.ARRAY or self.endianess != gguf.GGUFEndian.LITTLE or not val
                    or (sub_type != gguf.GGUFValueType.STRING and sub_type not in self._ARRAYS)):
                return super()._pack_val(val, vtype, add_vtype, sub_type)
            head = (struct.pack("<I", vtype) if add_vtype else b"") + struct.pack("<IQ", sub_type, len(val))
            if sub_type == gguf.GGUFValueType.STRING:
                items = [v.encode("utf-8") if isinstance(v, str) else v for v in val]
                return head + b"".join(struct.pack("<Q", len(b)) + b for b in items)
            return head + np.asarray(val, dtype=self._ARRAYS[sub_type]).tobytes()

    return Writer(path, arch)


def _add(writer, key: str, kind: str, value) -> None:
    import gguf

    if kind == "string":
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    elif kind == "uint32":
        writer.add_uint32(key, int(value))
    elif kind == "float32":
        writer.add_float32(key, float(value))
    elif kind == "bool":
        writer.add_bool(key, bool(value))
    elif kind == "bools":
        writer.add_key_value(key, [bool(v) for v in value], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    elif kind in ("strings", "int32s", "float32s") and not value:
        return  # GGUF has no empty arrays (a tokenizer without merges)
    elif kind == "strings":
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    elif kind == "int32s":
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    elif kind == "float32s":
        writer.add_key_value(key, [float(v) for v in value], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.FLOAT32)
    else:  # pragma: no cover - a programming error
        raise ValueError(kind)


__all__ = ["FILE_TYPES", "memory_types", "Summary", "TensorPlan", "canonical_mixture", "write_gguf",
           "TwiceError"]

