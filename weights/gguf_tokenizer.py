"""Rebuilding a GGUF file's tokenizer as a `tokenizers` pipeline: byte-level BPE ("gpt2")
vocabularies and merges, with the pre-tokenizer its `tokenizer.ggml.pre` name stands for,
special (control) and user-defined tokens, and BOS/EOS in the post-processor when the file
asks for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twice.core.errors import UnsupportedModelError, WeightsError

from .gguf_metadata import flag, require, string_list, token_id

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer split patterns, as llama.cpp (llama-vocab.cpp) and transformers use them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How one `tokenizer.ggml.pre` name splits text, and the defaults llama.cpp gives it."""

    kind: str  # "gpt2": GPT-2's byte-level regex; "digits": single digits, then GPT-2's; "split": `pattern`
    pattern: str | None = None
    ignore_merges: bool = False  # take a word whole when it is in the vocabulary (llama3)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2 = _PreTokenizer("gpt2")
_DIGITS = _PreTokenizer("digits")
_LLAMA3 = _PreTokenizer("split", _LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_LLAMA3_REGEX_ONLY = _PreTokenizer("split", _LLAMA3_SPLIT)
_QWEN2 = _PreTokenizer("split", _QWEN2_SPLIT)
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "smaug-bpe": _LLAMA3_REGEX_ONLY, "dbrx": _LLAMA3_REGEX_ONLY,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


def _pre_tokenizer(spec: _PreTokenizer):
    from tokenizers import Regex, pre_tokenizers

    if spec.kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if spec.kind == "digits":  # what SmolLM's and StarCoder's own tokenizer.json say
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def build_tokenizer(metadata: dict, config: dict, src: Path):
    """A `tokenizers.Tokenizer` and the tokenizer_config.json that goes with it."""
    spec = _tokenizer_spec(metadata, src)
    tokens = string_list(metadata, "tokenizer.ggml.tokens", src)
    merges = _merge_pairs(string_list(metadata, "tokenizer.ggml.merges", src), src)
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise WeightsError(f"{src}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if len(tokens) > config["vocab_size"]:
        raise WeightsError(f"{src}: {len(tokens)} tokens do not fit the model's vocab_size {config['vocab_size']}")

    ids = {
        "bos_token": config.get("bos_token_id"),
        "eos_token": config.get("eos_token_id"),
        "unk_token": token_id(metadata, "unknown_token_id", config["vocab_size"], src),
        "pad_token": config.get("pad_token_id"),
    }
    names = {name: tokens[i] for name, i in ids.items() if i is not None and i < len(tokens)}
    tokenizer = _bpe_tokenizer(tokens, merges, spec, src)
    _add_whole_tokens(tokenizer, tokens, types, special_ids=set(ids.values()))

    add_bos = flag(metadata, "tokenizer.ggml.add_bos_token", spec.add_bos, src)
    add_eos = flag(metadata, "tokenizer.ggml.add_eos_token", False, src)
    tokenizer.post_processor = _post_processor(
        names.get("bos_token") if add_bos else None, ids["bos_token"],
        names.get("eos_token") if add_eos else None, ids["eos_token"],
    )

    tokenizer_config: dict[str, Any] = {
        # the generic class: it takes tokenizer.json as it is, where a model-specific one may
        # rebuild parts of the pipeline its own way
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tokenizer_config["chat_template"] = template
    return tokenizer, tokenizer_config


def _tokenizer_spec(metadata: dict, src: Path) -> _PreTokenizer:
    """The pre-tokenizer for this file's vocabulary, refusing vocabularies we cannot rebuild."""
    model = require(metadata, "tokenizer.ggml.model", src)
    if model not in SUPPORTED_TOKENIZER_MODELS:
        hint = " (a sentencepiece vocabulary)" if model == "llama" else ""
        raise UnsupportedModelError(
            f"{src}: tokenizer model {model!r}{hint} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{src}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[pre]


def _bpe_tokenizer(tokens: list[str], merges: list[tuple[str, str]], spec: _PreTokenizer, src: Path):
    """Byte-level BPE over the file's vocabulary. The tokens are already spelled in GPT-2's
    byte alphabet (a space is "Ġ"), so they go in as they are."""
    from tokenizers import Tokenizer, decoders, models

    # A repeated token keeps its first id (a dict cannot hold both); the later id stays unused.
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                         ignore_merges=spec.ignore_merges)
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise WeightsError(f"{src}: the tokenizer vocabulary and merges do not fit together ({e})") from None
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(spec)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _add_whole_tokens(tokenizer, tokens: list[str], types: list[int], special_ids: set) -> None:
    """Tokens matched whole in the text, before BPE sees it, under their existing ids.

    Control tokens (and the named bos/eos/unk/pad) become special: decoding with
    skip_special_tokens drops them. User-defined ones (like `<think>`) are matched whole too,
    as llama.cpp does, but stay ordinary text."""
    from tokenizers import AddedToken

    special, user = [], []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind == _TOKEN_CONTROL or index in special_ids:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _TOKEN_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _merge_pairs(merges: list[str], src: Path) -> list[tuple[str, str]]:
    """llama.cpp stores each merge as "left right"; byte-level tokens never contain a space."""
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise WeightsError(f"{src}: tokenizer merge {merge!r} is not two tokens separated by one space")
        pairs.append((parts[0], parts[1]))
    return pairs


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None):
    """ByteLevel offsets (as HF's byte-level tokenizer.json files have), plus BOS/EOS when the
    file asks for them, so that plain `tokenizers` users get them too, not only transformers."""
    from tokenizers import processors

    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos is None and eos is None:
        return byte_level

    def sequence(piece: str, type_id: int) -> list[str]:
        return [f"{bos}:{type_id}"] * (bos is not None) + [f"${piece}:{type_id}"] + [f"{eos}:{type_id}"] * (eos is not None)

    specials = {token: token_id for token, token_id in ((bos, bos_id), (eos, eos_id)) if token is not None}
    template = processors.TemplateProcessing(
        single=sequence("A", 0), pair=sequence("A", 0) + sequence("B", 1), special_tokens=list(specials.items())
    )
    return processors.Sequence([byte_level, template])


# -- output folder -------------------------------------------------------------------------
