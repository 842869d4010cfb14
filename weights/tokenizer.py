"""The tokenizer of a model folder: tokenizer.json, tokenizer_config.json, the chat
template (rendered by chat_template.py, in jinja2's sandbox), and streaming text that
never splits a UTF-8 character."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from twice.core.errors import TokenizerError

from .chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate
from .files import MAX_JSON_BYTES, read_json, read_limited


def _token_text(value) -> str | None:
    """Special tokens appear as plain strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class TextStream:
    """Incremental detokenization of one sequence: each `step` returns the new text
    (never a broken UTF-8 character), and `finish` whatever was held back, so that the
    concatenation of all pieces equals `decode(all ids)` exactly."""

    def __init__(self, tokenizer: "Tokenizer"):
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
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
        full = self._tok.decode(self.ids)
        if not full.startswith(self.text):  # cannot happen for a consistent decoder; keep the invariant anyway
            raise TokenizerError("incremental detokenization diverged from the full decode")
        rest = full[len(self.text):]
        self.text = full
        return rest


class Tokenizer:
    def __init__(self, folder: Path):
        self.folder = folder
        path = folder / "tokenizer.json"
        if not path.exists():  # a FIFO or device is refused by read_limited, never opened blocking
            raise TokenizerError(f"{folder}: no tokenizer.json (twice reads fast-tokenizer files only)")
        raw = read_limited(path, MAX_JSON_BYTES, TokenizerError)
        try:
            self.hf = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0][:200]})") from None
        config_path = folder / "tokenizer_config.json"
        self.config = read_json(config_path, TokenizerError) if config_path.exists() else {}
        self.chat_template = self._find_chat_template()
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(self.config.get(name))) is not None
        }

    # -- basic encode/decode -----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self) -> TextStream:
        return TextStream(self)

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
    def chat_template_source(self) -> Path:
        """The file the chat template came from (for messages)."""
        jinja_file = self.folder / "chat_template.jinja"
        return jinja_file if jinja_file.exists() else self.folder / "tokenizer_config.json"

    @cached_property
    def _compiled_template(self) -> ChatTemplate:
        return ChatTemplate(self.chat_template, self.chat_template_source, self.special_tokens,
                            self.folder / "tokenizer_config.json")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError(f"{self.folder}: the tokenizer has no chat template (use --raw)")
        return self._compiled_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes the special tokens itself (as transformers does, no second BOS).
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
