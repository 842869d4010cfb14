"""The tokenizer of a model folder: tokenizer.json, tokenizer_config.json, the chat
template (rendered by chat_template.py, in jinja2's sandbox), and streaming text that
never splits a UTF-8 character.

Sizes before tokens: `Tokenizer.fewest_tokens(text)` is a sound lower bound on the tokens a
text encodes to, from its length alone (see `TextBound`), so a text that cannot fit a
context is refused (`encode(..., limit=)`) before the expensive step: tokenizing 10 MB
takes seconds and gigabytes, the bound microseconds."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream
from tokenizers.pre_tokenizers import ByteLevel as ByteLevelPre

from twice.core.errors import PromptError, TokenizerError
from twice.core.fields import unpaired_surrogate

from .chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate
from .files import MAX_JSON_BYTES, read_json, read_limited


def _token_text(value) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class PromptTooLong(PromptError):
    """A text refused before it was tokenized: it encodes to at least `at_least` tokens,
    more than the `limit` that can be used."""

    def __init__(self, at_least: int, limit: int):
        self.at_least, self.limit = at_least, limit
        super().__init__(f"the text is at least {at_least:,} tokens, more than the {limit:,} that fit")


# Normalizers that never make a text shorter; NFC/NFKC compose at most this many characters
# into one (the longest canonical / compatibility decomposition of any character: 4 and 18
# in Unicode 15, unchanged since early versions: decompositions are stable).
_GROWING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
_COMPOSING = {"NFC": 4, "NFKC": 18}
# Pre-tokenizers that split or map text but drop none of it.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts",
                                     "FixedLength", "Split"})


@dataclass(frozen=True)
class TextBound:
    """How much text one token can stand for, from the tokenizer's parts: with `units` =
    UTF-8 bytes (`in_bytes`, a byte-level tokenizer with no normalizer) or characters, a
    text encodes to at least ceil(units / per_token) tokens, where `per_token` is the longest
    vocabulary entry (its string is what it covers after normalization: one character per
    byte for byte-level BPE, '▁' for a space...) or added token. A normalizer that composes
    (NFC, NFKC) can shrink a text at most `shrink`-fold, and leaves an ASCII character that is
    not followed by a non-ASCII one as it is (`ascii_exact`): of n characters, a ASCII and m
    not, at least max(n / shrink, a - m + 2m / shrink) remain.

    There is no bound (`Tokenizer.text_bound` is None) where a part can make much text into
    one token or none: WordPiece and WordLevel (a whole unknown word is one [UNK]), BPE whose
    unknown characters are fused into one token or dropped (no byte alphabet, no byte
    fallback, no unknown token), normalizers and pre-tokenizers that delete text
    (Strip, BertNormalizer, a regex Replace, Whitespace, Split "removed"), added tokens that
    swallow the whitespace beside them (lstrip/rstrip)."""

    per_token: int
    in_bytes: bool = False
    shrink: int = 1
    ascii_exact: bool = False

    def units(self, text: str) -> tuple[int, int]:
        """(numerator, denominator) of a lower bound on the text's size after normalization."""
        n = len(text)
        if self.in_bytes:
            return len(text.encode("utf-8", "surrogatepass")), 1
        if self.shrink == 1:
            return n, 1
        if not self.ascii_exact:
            return n, self.shrink
        ascii_count = n if text.isascii() else len(text.encode("ascii", "ignore"))
        others = n - ascii_count
        return max(n, self.shrink * (ascii_count - others) + 2 * others), self.shrink

    def fewest_tokens(self, text: str) -> int:
        num, den = self.units(text)
        return -(-num // (den * self.per_token))

    def tail_chars(self, tokens: int) -> int:
        """A number of characters that surely encodes to at least `tokens` tokens."""
        return tokens * self.per_token * self.shrink


def _shrink_factor(normalizer: dict | None) -> tuple[int, bool] | None:
    """(the most a normalizer can shrink a text, whether TextBound.ascii_exact holds), or
    None if it can delete text."""
    if normalizer is None:
        return 1, False
    kind = normalizer.get("type")
    if kind == "Sequence":
        steps = normalizer.get("normalizers") or []
        total, exact = 1, False
        for i, step in enumerate(steps):
            factor = _shrink_factor(step)
            if factor is None:
                return None
            total *= factor[0]
            exact = exact or (i == 0 and factor[1])
        # The ASCII count is exact only if the one shrinking step comes first.
        shrinking = [st for st in steps if _shrink_factor(st)[0] > 1]
        return total, exact and len(shrinking) == 1
    if kind in _GROWING_NORMALIZERS:
        return 1, False
    if kind in _COMPOSING:
        return _COMPOSING[kind], True
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(literal, str) and literal and isinstance(content, str) and content:
            return max(1, -(-len(literal) // len(content))), False
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, regex Replace, ...


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers") or [])
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers") or [])
    return pre_tokenizer.get("type") == "ByteLevel"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet (each byte as a printable character), inverted: printable
    Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def text_bound(hf: HFTokenizer) -> TextBound | None:
    """The TextBound of a loaded tokenizer, or None where its parts admit none."""
    shrink = _shrink_factor(_state(hf.normalizer))
    pre = _state(hf.pre_tokenizer)
    if shrink is None or not _keeps_text(pre):
        return None
    added = hf.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip for t in added):
        return None
    vocab = hf.get_vocab(with_added_tokens=False)
    model = type(hf.model).__name__
    all_bytes = all(f"<0x{b:02X}>" in vocab for b in range(256))
    if model == "BPE":
        # A character outside the vocabulary becomes its bytes (byte-level BPE, byte
        # fallback), else the unknown token (one per character unless fused), else nothing.
        byte_alphabet = _has_byte_level(pre) and all(c in vocab for c in ByteLevelPre.alphabet())
        if not (byte_alphabet or (hf.model.byte_fallback and all_bytes)) and \
                (hf.model.unk_token is None or hf.model.fuse_unk):
            return None
    elif model == "Unigram":
        state = json.loads(hf.model.__getstate__())
        if state.get("unk_id") is not None and not (state.get("byte_fallback") and all_bytes):
            return None  # Unigram fuses runs of unknown characters into one token
    else:  # WordPiece, WordLevel: one [UNK] for a whole unknown word, however long
        return None
    longest = max(map(len, vocab), default=1)
    longest = max([longest, 4] + [len(t.content.encode("utf-8")) for t in added])  # 4: an unknown character
    in_bytes = _has_byte_level(pre) and hf.normalizer is None
    return TextBound(per_token=longest, in_bytes=in_bytes, shrink=shrink[0], ascii_exact=shrink[1])


class TextStream:
    """Incremental detokenization of one sequence: each `step` returns the new text
    (never a broken UTF-8 character), and `finish` whatever was held back, so that the
    concatenation of all pieces equals the text the ids add after `context` (the prompt's
    last ids): decode(context + ids) less decode(context). The context matters for
    SentencePiece decoders, which drop the leading space of a text's first token: without it
    a completion of "Once upon a" would begin "time" instead of " time" (the text Hugging
    Face's pipeline returns, which decodes the prompt with the completion and cuts the prompt
    off)."""

    CONTEXT = 4  # prompt ids kept: enough for a SentencePiece word start or a pending byte sequence

    def __init__(self, tokenizer: "Tokenizer", context: Sequence[int] = ()):
        self._tok = tokenizer
        self._context = [int(i) for i in list(context)[-self.CONTEXT:]]
        self._base = tokenizer.decode(self._context) if self._context else ""
        if self._context and self._base.endswith("\ufffd"):  # an unfinished character: start clean instead
            self._context, self._base = [], ""
        self._stream = DecodeStream(self._context, skip_special_tokens=True) if self._context \
            else DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self._stream.step(self._tok.hf, token_id) or ""
        self.text += piece
        return piece

    def finish(self) -> str:
        """Text still held back (an incomplete character at the very end decodes to U+FFFD,
        exactly as a full decode renders it)."""
        full = self._tok.decode(self._context + self.ids)
        if not full.startswith(self._base + self.text):  # cannot happen for a consistent decoder
            raise TokenizerError("incremental detokenization diverged from the full decode")
        rest = full[len(self._base) + len(self.text):]
        self.text = full[len(self._base):]
        return rest


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    """(size, modification time in ns, inode) of a file, None if it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


class Tokenizer:
    def __init__(self, folder: Path, shown_as: Path | None = None):
        self.folder = folder
        # The GGUF file a described folder was written from: the chat template's messages name
        # it (the user never saw the cache folder's tokenizer_config.json).
        self.shown_as = shown_as
        path = folder / "tokenizer.json"
        if not path.exists():  # a FIFO or device is refused by read_limited, never opened blocking
            raise TokenizerError(f"{folder}: no tokenizer.json (twice reads fast-tokenizer files only)")
        raw = read_limited(path, MAX_JSON_BYTES, TokenizerError)
        self._read_as = _file_identity(path)  # for `digest`, hashed only when a prompt cache asks
        try:
            self.hf = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0][:200]})") from None
        # As transformers does for every call that does not ask for them: no truncation (which
        # would silently cut a long prompt's end) and no padding from tokenizer.json.
        self.hf.no_truncation()
        self.hf.no_padding()
        config_path = folder / "tokenizer_config.json"
        self.config = read_json(config_path, TokenizerError) if config_path.exists() else {}
        self.chat_template = self._find_chat_template()
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(self.config.get(name))) is not None
        }

    @cached_property
    def digest(self) -> str:
        """SHA-256 of tokenizer.json as it was read: what a prompt cache's model fingerprint takes
        of the tokenizer (serializing the pipeline again costs tens of ms; hashing the file, a few,
        and only runs with a prompt cache ask). The file is read again if it is unchanged since
        (size, modification time, inode); if it changed, the loaded pipeline's serialization."""
        path = self.folder / "tokenizer.json"
        try:
            if _file_identity(path) == self._read_as:
                return hashlib.sha256(read_limited(path, MAX_JSON_BYTES, TokenizerError)).hexdigest()
        except (OSError, TokenizerError):
            pass
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()

    # -- basic encode/decode -----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @cached_property
    def text_bound(self) -> TextBound | None:
        """How much text a token can stand for (None: no sound bound for this tokenizer).
        Worked out on first use (reading the vocabulary takes ~60 ms)."""
        return text_bound(self.hf)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, from its length (0 where none is known)."""
        if len(text) < 2**12:  # never worth the bound's set-up: such a text tokenizes in microseconds
            return 0
        bound = self.text_bound
        return 0 if bound is None else bound.fewest_tokens(text)

    def tail(self, text: str, tokens: int) -> str:
        """The end of `text` that surely encodes to at least `tokens` tokens (the whole text
        if no bound is known)."""
        bound = self.text_bound
        return text if bound is None else text[-bound.tail_chars(tokens):]

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """The token ids of `text`. With `limit`, a text that surely encodes to more than
        `limit` tokens raises PromptTooLong before it is tokenized."""
        if limit is not None and (at_least := self.fewest_tokens(text)) > limit:
            raise PromptTooLong(at_least, limit)
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # tokenizers refuses a str holding an unpaired surrogate ("TextInputSequence must be str")
            if (where := unpaired_surrogate(text)) is None:
                raise
            raise PromptError(f"the text holds an unpaired surrogate (U+{ord(text[where]):04X}) at character "
                              f"{where}, which is not valid Unicode") from None
        except Exception as e:  # tokenizers' own failures are plain Exceptions (a Unigram model without unk_id)
            reason = " ".join(str(e).split()) or type(e).__name__
            raise PromptError(f"the tokenizer cannot encode this text ({reason[:200]})") from None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for by itself: a token holding part of a
        character (byte-level BPE's pieces of an emoji, SentencePiece's `<0xE2>`) gives its own
        bytes, where decoding it alone gives U+FFFD. Special tokens: their text."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.hf.id_to_token(token_id) or ""
        if self._byte_level_decoder:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return text.encode("utf-8")

    @cached_property
    def _byte_level_decoder(self) -> bool:
        return _has_byte_level(_state(self.hf.decoder))

    def stream(self, context: Sequence[int] = ()) -> TextStream:
        """A TextStream for ids that follow `context` (the prompt's ids, of which it keeps the last few)."""
        return TextStream(self, context)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.hf.token_to_id(text)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens.get("eos_token"))

    # -- chat template -----------------------------------------------------------------
    def _find_chat_template(self) -> str | None:
        jinja_file = self.folder / "chat_template.jinja"
        if jinja_file.exists():
            try:
                return read_limited(jinja_file, MAX_JSON_BYTES, TokenizerError).decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"{jinja_file}: cannot read ({e})") from None
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{self.folder / 'tokenizer_config.json'}: chat_template must be a string")
        return template or None

    @property
    def chat_template_source(self) -> Path | str:
        """The file the chat template came from (for messages)."""
        if self.shown_as is not None:
            return f"{self.shown_as}: tokenizer.chat_template"
        jinja_file = self.folder / "chat_template.jinja"
        return jinja_file if jinja_file.exists() else self.folder / "tokenizer_config.json"

    @cached_property
    def _compiled_template(self) -> ChatTemplate:
        return ChatTemplate(self.chat_template, self.chat_template_source, self.special_tokens,
                            self.folder / "tokenizer_config.json")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError(f"{self.shown_as or self.folder}: the tokenizer has no chat template (use --raw)")
        return self._compiled_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    limit: int | None = None) -> list[int]:
        # The template writes the special tokens itself (as transformers does, no second BOS).
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False, limit=limit)
