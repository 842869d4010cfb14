"""Rebuilding a GGUF file's tokenizer as a `tokenizers` pipeline.

Two kinds of vocabulary are found in GGUF files (`tokenizer.ggml.model`):

* "gpt2": byte-level BPE. The vocabulary and merges go in as they are, with the
  pre-tokenizer its `tokenizer.ggml.pre` name stands for (a name we do not know is refused).
* "llama": SentencePiece (Llama 2, Mistral, TinyLlama, ...). Tokens carry scores, a
  character outside the vocabulary becomes its UTF-8 bytes as the tokens <0x00>..<0xFF>, a
  space is spelled "▁", and a "▁" goes before the text (`tokenizer.ggml.add_space_prefix`,
  default true). llama.cpp encodes a text by merging, again and again, the adjacent pair
  whose concatenation is the vocabulary entry with the best score, over the whole run of
  text at once; that is BPE whose merges are every split of every token into two tokens,
  best score first (what transformers derives too), with byte fallback.

  Where llama.cpp (and SentencePiece itself) and transformers' own GGUF conversion differ,
  this follows llama.cpp, the program these files are made for: the "▁" goes before every
  run of text, also one that follows a special or user-defined token and one that already
  starts with a space (" hi" is "▁▁hi", as SentencePiece encodes it); transformers'
  Metaspace(prepend_scheme="first") puts it only at the very start of the input, and not
  before a leading space. The prefix comes from a Prepend normalizer, which `tokenizers`
  applies to each run of text between added tokens, as Llama 2's and Mistral's own
  tokenizer.json files do.

Control (and unknown) tokens become special added tokens, user-defined ones plain added
tokens, both matched whole in the text before the model sees it; BOS/EOS go in the
post-processor when the file asks for them (`tokenizer.ggml.add_bos_token`, whose default
is llama.cpp's: true for SentencePiece and llama3 vocabularies, false otherwise)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twice.core.errors import UnsupportedModelError, WeightsError
from twice.core.fields import show

from .gguf_metadata import flag, require, string_list, token_id

SUPPORTED_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}

# llama.cpp's token types (llama_token_type / gguf.TokenType).
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
# llama.cpp's special ids for a SentencePiece vocabulary whose file names none.
_SPM_DEFAULT_IDS = {"bos_token": 1, "eos_token": 2, "unk_token": 0}

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
# The names of the files we run: SmolLM2 "smollm", Qwen2.5(-Coder) "qwen2", Llama 3 "llama-bpe",
# GPT-2 "gpt-2" (tests/test_gguf_tokenizer.py checks each against transformers).
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "smaug-bpe": _LLAMA3_REGEX_ONLY, "dbrx": _LLAMA3_REGEX_ONLY,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


def build_tokenizer(metadata: dict, config: dict, src: Path):
    """A `tokenizers.Tokenizer` and the tokenizer_config.json that goes with it.

    `config` is the model's config.json as a dict (vocab_size, max_position_embeddings and the
    bos/eos/pad token ids are read from it). Raises UnsupportedModelError for a kind of
    vocabulary or a pre-tokenizer we cannot rebuild, WeightsError for a malformed one; each
    message is one line that names the file."""
    model = _tokenizer_model(metadata, src)
    spec = _pre_tokenizer_spec(metadata, src) if model == "gpt2" else None
    tokens = string_list(metadata, "tokenizer.ggml.tokens", src)
    types = metadata.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        count = len(types) if isinstance(types, list) else "no list of"
        raise WeightsError(f"{src}: tokenizer.ggml.token_type has {count} entries for {len(tokens)} tokens")
    if len(tokens) > config["vocab_size"]:
        raise WeightsError(f"{src}: {len(tokens)} tokens do not fit the model's vocab_size {config['vocab_size']}")

    ids = {
        "bos_token": config.get("bos_token_id"),
        "eos_token": config.get("eos_token_id"),
        "unk_token": token_id(metadata, "unknown_token_id", config["vocab_size"], src),
        "pad_token": config.get("pad_token_id"),
    }
    if model == "llama":
        for name, default in _SPM_DEFAULT_IDS.items():
            if ids[name] is None and default < len(tokens):
                ids[name] = default
    names = {name: tokens[i] for name, i in ids.items() if isinstance(i, int) and 0 <= i < len(tokens)}

    if model == "llama":
        add_space_prefix = flag(metadata, "tokenizer.ggml.add_space_prefix", True, src)
        scores = _scores(metadata, len(tokens), src)
        tokenizer = _spm_tokenizer(tokens, scores, names.get("unk_token"), add_space_prefix, src)
        default_bos, byte_level = True, False
    else:
        merges = _merge_pairs(string_list(metadata, "tokenizer.ggml.merges", src), src)
        tokenizer = _bpe_tokenizer(tokens, merges, spec, src)
        default_bos, byte_level = spec.add_bos, True
    _add_whole_tokens(tokenizer, tokens, types, special_ids={i for i in ids.values() if isinstance(i, int)})

    add_bos = flag(metadata, "tokenizer.ggml.add_bos_token", default_bos, src)
    add_eos = flag(metadata, "tokenizer.ggml.add_eos_token", False, src)
    for wanted, name in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if wanted and name not in names:  # llama.cpp refuses such a file too
            raise WeightsError(f"{src}: tokenizer.ggml.add_{name} is true, but the file names no "
                               f"{name[:3]} token among its {len(tokens)} tokens")
    tokenizer.post_processor = _post_processor(
        names.get("bos_token") if add_bos else None, ids["bos_token"],
        names.get("eos_token") if add_eos else None, ids["eos_token"], byte_level,
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


def _tokenizer_model(metadata: dict, src: Path) -> str:
    model = require(metadata, "tokenizer.ggml.model", src)
    if not isinstance(model, str) or model not in SUPPORTED_TOKENIZER_MODELS:
        supported = ", ".join(f"{name} ({kind})" for name, kind in SUPPORTED_TOKENIZER_MODELS.items())
        raise UnsupportedModelError(f"{src}: tokenizer model {show(model)} is not supported; supported: {supported}")
    return model


def _pre_tokenizer_spec(metadata: dict, src: Path) -> _PreTokenizer:
    """The pre-tokenizer of a byte-level vocabulary, refusing one we cannot rebuild."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{src}: pre-tokenizer {show(pre)} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[pre]


def _add_whole_tokens(tokenizer, tokens: list[str], types: list[int], special_ids: set) -> None:
    """Tokens matched whole in the text, before the model sees it, under their existing ids.

    Control and unknown tokens (and the named bos/eos/unk/pad) become special: decoding with
    skip_special_tokens drops them. User-defined ones (like `<think>`) are matched whole too,
    as llama.cpp does, but stay ordinary text."""
    from tokenizers import AddedToken

    special, user = [], []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if not token:
            continue
        if kind in (_TOKEN_CONTROL, _TOKEN_UNKNOWN) or index in special_ids:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _TOKEN_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None, byte_level: bool):
    """BOS/EOS when the file asks for them, so that plain `tokenizers` users get them too, not
    only transformers; byte-level vocabularies also get ByteLevel offsets, as HF's byte-level
    tokenizer.json files have."""
    import json

    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    if bos is not None or eos is not None:
        def sequence(piece: str, type_id: int) -> list[dict]:
            return ([{"SpecialToken": {"id": bos, "type_id": type_id}}] * (bos is not None)
                    + [{"Sequence": {"id": piece, "type_id": type_id}}]
                    + [{"SpecialToken": {"id": eos, "type_id": type_id}}] * (eos is not None))

        specials = {token: {"id": token, "ids": [i], "tokens": [token]}
                    for token, i in ((bos, bos_id), (eos, eos_id)) if token is not None}
        # Built from its serialized form: the string form ("<s>:0 $A:0") cannot hold a token
        # with a colon in it.
        template = processors.TemplateProcessing(single="$A:0")
        template.__setstate__(json.dumps({
            "type": "TemplateProcessing", "single": sequence("A", 0),
            "pair": sequence("A", 0) + sequence("B", 1), "special_tokens": specials,
        }).encode())
        steps.append(template)
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)


# -- SentencePiece ("llama") ----------------------------------------------------------------


def _scores(metadata: dict, count: int, src: Path) -> list[float]:
    key = "tokenizer.ggml.scores"
    scores = require(metadata, key, src)
    if not isinstance(scores, list) or len(scores) != count:
        got = f"{len(scores)} entries" if isinstance(scores, list) else "no list"
        raise WeightsError(f"{src}: {key} has {got} for {count} tokens")
    for index, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise WeightsError(f"{src}: {key}[{index}] must be a finite number, got {show(score)}")
    return scores


def _spm_tokenizer(tokens: list[str], scores: list[float], unk: str | None, add_space_prefix: bool, src: Path):
    """SentencePiece as llama.cpp runs it (module docstring): no pre-tokenizer (the merges see
    each run of text whole), spaces as "▁" and the prefix space from the normalizer, BPE over
    the merges the scores imply, a character outside the vocabulary as its UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = _spm_vocab(tokens, src)
    try:
        bpe = models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores, vocab), unk_token=unk,
                         fuse_unk=True, byte_fallback=True)
    except Exception as e:  # tokenizers raises a bare Exception
        raise WeightsError(f"{src}: the tokenizer vocabulary cannot be built ({str(e).splitlines()[0][:200]})") from None
    tokenizer = Tokenizer(bpe)
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the prefix space goes again (llama.cpp drops it from the first token)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _spm_vocab(tokens: list[str], src: Path) -> dict[str, int]:
    """Token -> id. llama.cpp refuses a vocabulary that holds a token twice (its text-to-id
    map would lose one of them), and names an empty token [EMPTY_<id>]."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        token = token or f"[EMPTY_{index}]"
        first = vocab.setdefault(token, index)
        if first != index:
            raise WeightsError(f"{src}: tokenizer token {show(token)} appears twice (ids {first} and {index})")
    return vocab


def merges_from_scores(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, ranked by the token's score, best first. Ties are ordered as transformers'
    `generate_merges` orders them (longer left part first, then longer right part, then by
    token id), so that both rebuild the same pipeline. llama.cpp breaks a tie between equal
    scores by position in the text instead, which no ranked list can express; real
    vocabularies give the tokens that merges make distinct scores."""
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores):
        local = []
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    local.append((vocab[left], vocab[right], left, right))
        if len(local) > 1:
            local.sort()  # by the ids of the two parts
        found.extend((score, len(left), len(right), left, right) for _, _, left, right in local)
    # a stable sort on the key alone (not on the strings) keeps the order above within ties
    found.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for *_, left, right in found]


# -- byte-level BPE ("gpt2") ----------------------------------------------------------------


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


def _merge_pairs(merges: list[str], src: Path) -> list[tuple[str, str]]:
    """llama.cpp stores each merge as "left right"; byte-level tokens never contain a space."""
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise WeightsError(f"{src}: tokenizer merge {show(merge)} is not two tokens separated by one space")
        pairs.append((parts[0], parts[1]))
    return pairs
