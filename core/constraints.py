"""Structured output: a per-request constraint on the tokens a row may generate.

A `ConstraintSpec` says what the output must be: a JSON schema, any JSON object, a
regular expression, or a grammar (Lark or GBNF). `build(engine, spec)` turns it into a
`Constraint` for one request: a matcher of llguidance (the token-level constraint engine
llama.cpp, vLLM and SGLang use) over the model's tokenizer. Each step the engine (and the
scheduler) asks the row's constraint for `mask()` — a bool tensor over the model's
vocabulary, True = allowed — and sets the logits of every other token to -inf before
sampling; after sampling it calls `advance(token)`. `is_finished` is true once the grammar
can take no more tokens (the row then stops, finish_reason "stop"). EOS is allowed only
where the grammar accepts what was generated; ids past the tokenizer's vocabulary (a
padded embedding matrix) are never allowed. A row cut by max_tokens ends "length" with
the output cut mid-structure.

The spec and its validation import neither torch nor the tokenizer (the CLI checks a
schema file before the model loads); a mask needs torch and is built lazily. llguidance's
tokenizer (its token trie, ~0.2 s for a 49k vocabulary) is built once per tokenizer and
kept beside it.

An invalid or unsatisfiable schema, regex or grammar is a one-line ConstraintError (the
CLI's exit 2, the server's 400).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

from .errors import PromptError
from .fields import describe_json_error, first_unknown, loads, show

KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
MAX_SPEC_BYTES = 1 << 20  # a schema, regex or grammar: at most 1 MiB of text
# Whitespace the JSON grammars allow between tokens: bounded, so that a model cannot loop
# on blanks forever (llguidance's default is any run of them), yet pretty-printed JSON fits.
JSON_WHITESPACE = r"(\x20|\n[\x20\t]{0,20})?"


class ConstraintError(PromptError):
    """A JSON schema, regex or grammar that cannot constrain generation (invalid or unsatisfiable)."""


# -- the spec --------------------------------------------------------------------------
@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must be. `source` holds the JSON schema (as JSON text), the regex or
    the grammar text; "json_object" needs none. `name` says where it came from (a file,
    "response_format") for messages."""

    kind: str
    source: str = ""
    name: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"a constraint is one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.source.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
            raise ConstraintError(f"{self._where()}is over {MAX_SPEC_BYTES >> 20} MiB")

    def _where(self) -> str:
        return f"{self.name}: " if self.name else ""

    def grammar(self) -> str:
        """The llguidance grammar (a JSON string) for this spec; ConstraintError if the
        text cannot even be read (bad JSON, a GBNF grammar that does not convert)."""
        import llguidance

        options = {"whitespace_pattern": JSON_WHITESPACE}
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=options)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            return llguidance.grammar_from(self.kind, self.source)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"{self._where()}{_first_lines(str(e))}") from None

    def to_dict(self) -> dict:
        """The spec as the --json settings report it."""
        out = {"type": self.kind}
        if self.kind == "json_schema":
            out["json_schema"] = json.loads(self.source)
        elif self.kind == "regex":
            out["regex"] = self.source
        elif self.kind in ("lark", "gbnf"):
            out["grammar"] = self.source
        if self.name:
            out["source"] = self.name
        return out


def json_schema(schema, name: str = "") -> ConstraintSpec:
    """A JSON-schema spec from a parsed schema (a dict, or true/false) or its JSON text."""
    if isinstance(schema, (bytes, str)):
        text = schema.decode("utf-8", "replace") if isinstance(schema, bytes) else schema
        try:
            schema = loads(text, max_bytes=MAX_SPEC_BYTES)
        except ValueError as e:
            why = describe_json_error(e)
            raise ConstraintError(f"{name + ': ' if name else ''}the JSON schema is not valid JSON ({why})") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{name + ': ' if name else ''}a JSON schema must be an object, got "
                              f"{type(schema).__name__}")
    if schema is False:
        raise ConstraintError(f"{name + ': ' if name else ''}the JSON schema false can never be satisfied")
    if schema is True:  # JSON Schema's "anything", which llguidance takes only as an object
        schema = {}
    return ConstraintSpec("json_schema", json.dumps(schema), name)


def grammar_kind(text: str, filename: str = "") -> str:
    """"lark" or "gbnf" for a grammar file: its extension (.lark; .gbnf, .ebnf), else its
    content (GBNF rules are written `name ::= ...`)."""
    lower = filename.lower()
    if lower.endswith(".lark"):
        return "lark"
    if lower.endswith((".gbnf", ".ebnf")):
        return "gbnf"
    return "gbnf" if "::=" in text else "lark"


# The fields of each form of spec_from_dict's dict (OpenAI's response_format and ours).
_SPEC_FIELDS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"},
                "regex": {"type", "regex", "pattern"}, "grammar": {"type", "grammar", "syntax"},
                "lark": {"type", "grammar", "syntax"}, "gbnf": {"type", "grammar", "syntax"}}


def _only(d: dict, fields: set[str], where: str) -> None:
    if (unknown := first_unknown(d, fields)) is not None:
        raise ConstraintError(f"{where}: unknown field {show(unknown)[:80]} (it takes {', '.join(sorted(fields))})")


def spec_from_dict(d: dict, where: str = "constraint") -> ConstraintSpec | None:
    """A spec from its dict form: {"type": "json_schema", "json_schema": SCHEMA} (or OpenAI's
    {"name", "schema", "strict"} object in its place), {"type": "json_object"},
    {"type": "regex", "regex": TEXT}, {"type": "grammar", "grammar": TEXT, "syntax":
    "lark"|"gbnf"} (syntax from the text if absent), {"type": "lark"|"gbnf", "grammar": TEXT};
    {"type": "text"}: None (no constraint)."""
    if not isinstance(d, dict):
        raise ConstraintError(f"{where} must be an object, got {_kind(d)}")
    kind = d.get("type")
    if kind in _SPEC_FIELDS:  # a typo never passes silently
        _only(d, _SPEC_FIELDS[kind], where)
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", "", where)
    if kind == "json_schema":
        body = d.get("json_schema")
        if isinstance(body, dict) and isinstance(body.get("schema"), (dict, bool)):
            _only(body, {"name", "description", "schema", "strict"}, f"{where}.json_schema")
            body = body["schema"]  # OpenAI's {"name": ..., "schema": {...}, "strict": true}
        elif isinstance(body, dict) and "name" in body and "schema" not in body and "type" not in body:
            raise ConstraintError(f"{where}.json_schema.schema is missing (the JSON schema itself)")
        if body is None:
            raise ConstraintError(f"{where}.json_schema is missing (the JSON schema)")
        return json_schema(body, f"{where}.json_schema")
    if kind == "regex":
        text = d.get("regex", d.get("pattern"))
        if not isinstance(text, str):
            raise ConstraintError(f"{where}.regex must be a string, got {_kind(text)}")
        return ConstraintSpec("regex", text, f"{where}.regex")
    if kind in ("grammar", "lark", "gbnf"):
        text = d.get("grammar")
        if not isinstance(text, str):
            raise ConstraintError(f"{where}.grammar must be a string, got {_kind(text)}")
        syntax = d.get("syntax", kind if kind != "grammar" else None)
        if syntax is None:
            syntax = grammar_kind(text)
        if syntax not in ("lark", "gbnf"):
            raise ConstraintError(f"{where}.syntax must be \"lark\" or \"gbnf\", got {show(syntax)}")
        return ConstraintSpec(syntax, text, f"{where}.grammar")
    raise ConstraintError(f"{where}.type must be one of \"text\", \"json_object\", \"json_schema\", \"regex\", "
                          f"\"grammar\", got {show(kind)}")


def constraint_from_response_format(response_format) -> ConstraintSpec | None:
    """OpenAI's `response_format` ({"type": "text"} / {"type": "json_object"} /
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; also the
    "regex" and "grammar" forms of spec_from_dict) as a validated spec, or None for text.
    ConstraintError (one line, the server's 400) when it cannot constrain anything."""
    if response_format is None:
        return None
    spec = spec_from_dict(response_format, "response_format")
    if spec is not None:
        validate(spec)
    return spec


# -- validation and building -------------------------------------------------------------
def validate(spec: ConstraintSpec, lltokenizer=None) -> str:
    """The spec's llguidance grammar, checked (compiled once, without a tokenizer unless
    given); ConstraintError with llguidance's reason when it is invalid or unsatisfiable."""
    import llguidance

    grammar = spec.grammar()
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer)
    if failed:
        raise ConstraintError(f"{spec._where()}{_describe(spec, messages[0] if messages else 'invalid')}")
    return grammar


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lltokenizer(tokenizer, eos_ids=()):
    """llguidance's tokenizer for our Tokenizer (its Hugging Face tokenizers pipeline,
    `tokenizer.hf`), built once and kept beside it."""
    import llguidance

    eos = sorted(set(eos_ids)) or [0]  # no EOS at all: a stand-in the masks never allow
    key = tuple(eos)
    per = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in per:
        hf = getattr(tokenizer, "hf", None)
        if hf is None:
            raise ConstraintError("structured output needs the model's tokenizer.json (this tokenizer has none)")
        try:
            per[key] = llguidance.LLTokenizer(hf.to_str(), eos_token=list(eos))
        except Exception as e:  # noqa: BLE001 - llguidance raises plain ValueError/RuntimeError
            raise ConstraintError(f"llguidance cannot read this tokenizer ({_first_lines(str(e))})") from None
    return per[key]


def build(engine, spec: ConstraintSpec | None, *rest) -> "Constraint | None":
    """The constraint of one request on `engine`'s model (its tokenizer, vocabulary, EOS
    ids); None for no spec. Also takes `build(spec, tokenizer, vocab_size[, eos_ids])`
    (then EOS is the tokenizer's own)."""
    if isinstance(engine, ConstraintSpec) or engine is None:
        spec, tokenizer, vocab_size, *eos = engine, spec, *rest
        return None if spec is None else Constraint(spec, tokenizer, vocab_size, eos[0] if eos else None)
    if spec is None:
        return None
    return Constraint(spec, engine.tokenizer, engine.config.vocab_size, tuple(engine.eos), engine.device)


def for_settings(engine, settings) -> "Constraint | None":
    """The constraint `settings.constraint` asks for, or None."""
    spec = getattr(settings, "constraint", None)
    return None if spec is None else build(engine, spec)


class Constraint:
    """One request's matcher. `mask()` → bool [vocab_size] (True = allowed), `advance(token)`
    → whether the row must stop now, `is_finished`. A token the mask forbade (it cannot be
    sampled; a caller that forces one) puts the matcher in error: `error` says why and
    the row is finished."""

    def __init__(self, spec: ConstraintSpec, tokenizer, vocab_size: int, eos_ids=None, device="cpu"):
        import llguidance
        import numpy

        self.spec, self.vocab_size, self.device = spec, vocab_size, device
        if eos_ids is None:  # the tokenizer's own EOS
            eos_ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        self.tokenizer = lltokenizer(tokenizer, eos_ids)
        grammar = validate(spec)
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"{spec._where()}{_describe(spec, self.matcher.get_error())}")
        n = self.tokenizer.vocab_size
        self._words = numpy.zeros((n + 31) // 32, dtype=numpy.uint32)  # llguidance writes its bitmask here
        self._n = min(n, vocab_size)
        self._no_eos = not eos_ids  # the model has no EOS: llguidance's stand-in id is never allowed
        self._eos_ids = list(self.tokenizer.eos_tokens)
        self.error: str | None = None
        self.tokens = 0
        # A grammar whose language is empty (a regex like [^\s\S], a rule that only recurses)
        # passes validation yet allows no first token, not even EOS: refused here, before the
        # request runs, instead of ending at once with an empty "stop".
        self._first = self.mask()  # kept for the first step's mask(): the same state, not computed twice
        if self.error is not None or (self.matcher.is_stopped() and not self.matcher.is_accepting()):
            why = f" ({_first_lines(self.error)})" if self.error else ""
            raise ConstraintError(f"{spec._where()}the {_WHAT[spec.kind]} can never be satisfied: it allows no "
                                  f"output at all{why}")

    def mask(self):
        """The tokens allowed next: bool [vocab_size] on the CPU (ids beyond the tokenizer's
        vocabulary: False). Unpacked with numpy, on one thread: torch's elementwise ops wake
        its thread pool, which on a busy CPU costs milliseconds per op."""
        import numpy
        import torch

        if self.tokens == 0 and getattr(self, "_first", None) is not None:
            return self._first  # no token taken since __init__ computed it
        m, w = self.matcher, self._words
        m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        out = numpy.zeros(self.vocab_size, dtype=numpy.bool_)
        out[: self._n] = numpy.unpackbits(w.view(numpy.uint8), bitorder="little")[: self._n]
        if self._no_eos:
            out[[e for e in self._eos_ids if e < self.vocab_size]] = False
        if not out.any():  # an error state (never for a sound grammar): stop at once rather than sample garbage
            self.error = self.error or m.get_error() or "the grammar allows no token here"
            out[self._eos_ids[0] if self._eos_ids and self._eos_ids[0] < self.vocab_size else 0] = True
        return torch.from_numpy(out)

    allowed = mask

    def advance(self, token: int) -> bool:
        """Take the sampled token; True when the row must stop (the grammar is complete, or
        the token was not allowed)."""
        self.tokens += 1
        if not self.matcher.consume_token(int(token)):
            self.error = self.error or self.matcher.get_error() or f"token {token} is not allowed here"
        return self.is_finished

    @property
    def is_finished(self) -> bool:
        return self.error is not None or self.matcher.is_stopped()

    def failure(self) -> str:
        """What stopped a row whose matcher failed (`error` set), as one line."""
        return (f"{self.spec._where()}structured output stopped after {self.tokens} "
                f"token{'s' if self.tokens != 1 else ''}: the constraint engine failed ({_first_lines(self.error)})")

    @property
    def accepting(self) -> bool:
        """What was generated is complete (EOS would be allowed)."""
        return self.matcher.is_accepting()


# -- helpers -----------------------------------------------------------------------------
_WHAT = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "lark": "Lark grammar", "gbnf": "GBNF grammar"}


def _describe(spec: ConstraintSpec, message: str) -> str:
    text = _first_lines(message)
    what = _WHAT[spec.kind]
    if text.lower().startswith("unsatisfiable"):
        return f"the {what} can never be satisfied ({text})"
    return f"invalid {what} ({text})"


def _first_lines(message: str, limit: int = 300) -> str:
    """llguidance's messages can span lines (a caret under the regex): the first line and
    any `error:` line, as one line."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    keep = lines[:1]
    for ln in lines[1:]:  # "Error: X" lines, less one that only repeats what is kept
        if ln.lower().startswith("error") and ln[len("error"):].lstrip(": ") not in keep:
            keep.append(ln)
    text = " ".join(keep) or "invalid"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def masks(rows) -> list | None:
    """Each row's mask for the next token (None for a free row), or None when no row of
    the batch is constrained: rows are engine._Row objects (their `constraint`)."""
    if all(getattr(r, "constraint", None) is None for r in rows):
        return None
    return [None if r.constraint is None else r.constraint.mask() for r in rows]
