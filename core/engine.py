"""The generation loop: tokenize, prefill once, decode token by token, stop.

`Engine.generate` serves one sequence and keeps its KV cache between calls: a later
prompt that starts with the same tokens (the next turn of a chat) prefills only what it
adds. `Engine.generate_batch` serves several prompts at once with one cache of batch rows
(left-padded to a shared column), dropping rows from the computation as they finish.

Both are generators of events (`PrefillStart`, `TokenEvent`, `Done`, `Notice`); the engine
never prints. Timings follow the definitions in DESIGN.md: TTFT runs from the request's
start (tokenization included) until the first token's text is available; decode tok/s
is (generated - 1) / (time of last token - time of first token).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .cache import KVCache, kv_format
from .device import DTYPE_NAMES, peak_memory_bytes, reset_peak_memory, synchronize
from .errors import DeviceError, PromptError, TwiceError
from .prefix import common_prefix
from .fastpath import CompiledDecoder, bucketed
from .fastpath import supported as compiled_supported
from .native_decode import NativeDecoder
from .qweight import weight_formats
from .native_decode import supported as native_supported
from .model import CausalLM
from .sampling import Sampler, SamplingParams
from . import constraints, speculative
from .stopping import StopMatcher

CAPACITY_ROUNDING = 64  # session caches grow in steps of this many tokens


# -- requests and settings -------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One prompt: raw text, chat messages (rendered with the chat template), or token ids."""

    text: str | None = None
    messages: list[dict] | None = None
    ids: list[int] | None = None


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    prefill_chunk: int | None = None  # prefill at most this many tokens per forward pass
    truncate: str | None = None  # "left": drop the start of a prompt that does not fit the context
    # Speculative decoding (speculative.py): prompt lookup proposes (else the Engine's draft
    # model, if it has one); draft_tokens fixes the guesses per pass (None: adaptive).
    lookup: bool = False
    draft_tokens: int | None = None
    # Structured output (core/constraints.py): a ConstraintSpec the row's tokens must follow.
    constraint: object | None = None

    def __post_init__(self):
        speculative.check_draft_tokens(self.draft_tokens)
        if self.truncate not in (None, "left"):
            raise PromptError(f"truncate must be 'left' (or not given), got {self.truncate!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise PromptError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise PromptError(f"prefill chunk must be at least 1 token, got {self.prefill_chunk}")


# -- events ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheStats:
    bytes_per_token: int  # one token of one row, K and V, all layers
    bytes_in_use: int
    bytes_allocated: int
    tokens: int  # columns filled
    capacity: int  # columns allocated
    batch: int
    context_length: int
    kv_dtype: str = ""  # the cache's element type as --kv-dtype names it (float32, bfloat16, q8_0, ...)
    element_bytes: tuple[int, int] = (0, 1)  # bytes per values: (34, 32) for q8_0, (2, 1) for bfloat16

    @property
    def bytes_per_element(self) -> float:
        """Real bytes per cached value (q8_0: 34/32 = 1.0625)."""
        return self.element_bytes[0] / self.element_bytes[1]

    @property
    def element_words(self) -> str:
        """The bytes per element as the formulas show it: "2", or "34/32" for q8_0."""
        b, n = self.element_bytes
        return str(b) if n == 1 else f"{b}/{n}"

    @property
    def bytes_full_context(self) -> int:
        """What one sequence's cache would take at the model's full context length."""
        return self.bytes_per_token * self.context_length


@dataclass(frozen=True)
class PrefillStart:
    rows: int
    prompt_tokens: int  # all prompt tokens (over rows)
    reused_tokens: int  # of those, already in the cache from an earlier call
    cache: CacheStats

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens


@dataclass(frozen=True)
class TokenEvent:
    row: int
    token_id: int
    text: str  # new visible text (may be empty while a character is incomplete)
    index: int  # 0 for the first generated token
    step_seconds: float  # wall time of the step that produced it (prefill for index 0)
    elapsed: float  # seconds since the request started
    cache: CacheStats
    speculation: speculative.SpeculationStats | None = None  # live counts while speculating


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not an error (a setting was clamped)."""

    message: str
    row: int | None = None  # the batch row it is about, if any
    context: bool = False  # about the model's context being too short for the request


@dataclass
class GenerationResult:
    row: int
    text: str
    token_ids: list[int]
    finish_reason: str  # eos | stop | length | context | cancelled | error (see `error`)
    prompt_tokens: int
    reused_tokens: int
    tokenize_seconds: float
    prefill_seconds: float
    ttft_seconds: float
    decode_seconds: float
    step_seconds: list[float]  # per decode step (tokens 2..n)
    cache: CacheStats
    peak_memory_bytes: int
    weight_bytes: int
    device: str
    dtype: str
    prefill_batch_tokens: int = 0  # tokens in the prefill pass this row was part of
    compile_seconds: float = 0.0  # torch.compile time spent before this request (not in TTFT)
    decode_path: str = "eager"  # decode step: native (kernels/decode.c) | compiled | eager
    batch_invariant: bool = False  # a batch row's tokens are bit for bit its prompt's alone (Engine.batch_invariant)
    weight_format: dict = field(default_factory=dict)  # qweight.weight_formats: types, bits per weight
    active_weight_bytes: int = 0  # weights one decode step reads (a mixture of experts: its chosen experts'); 0: all
    speculation: dict | None = None  # speculative.SpeculationStats.to_dict, when speculating
    error: str | None = None  # finish_reason "error": why the row could not go on (its grammar failed)

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prefill_tokens_per_second(self) -> float:
        new = self.prefill_batch_tokens or (self.prompt_tokens - self.reused_tokens)
        return new / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """None without a decode step (one token, or none): no rate, rather than a 0.0 that
        reads as a measured stall."""
        n = self.generated_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else None

    def bytes_read_per_token(self) -> int:
        """Weights (those a step reads: a mixture of experts' chosen experts) plus the mean KV
        cache read per decode step (one row)."""
        weights = self.active_weight_bytes or self.weight_bytes
        if self.generated_tokens <= 1:
            return weights
        first = self.prompt_tokens
        last = self.prompt_tokens + self.generated_tokens - 1
        return weights + self.cache.bytes_per_token * (first + last) // 2

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            **({"error": self.error} if self.error is not None else {}),
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "generated_tokens": self.generated_tokens,
            "decode_path": self.decode_path,
            "timings": {
                "compile_s": self.compile_seconds,
                "tokenize_s": self.tokenize_seconds,
                "prefill_s": self.prefill_seconds,
                "ttft_s": self.ttft_seconds,
                "decode_s": self.decode_seconds,
                "prefill_tokens_per_s": self.prefill_tokens_per_second,
                "decode_tokens_per_s": self.decode_tokens_per_second,
                "step_s": self.step_seconds,
            },
            "cache": {
                "bytes_per_token": self.cache.bytes_per_token,
                "bytes_in_use": self.cache.bytes_in_use,
                "bytes_allocated": self.cache.bytes_allocated,
                "bytes_full_context": self.cache.bytes_full_context,
                "tokens": self.cache.tokens,
                "capacity": self.cache.capacity,
                "batch": self.cache.batch,
                "kv_dtype": self.cache.kv_dtype,
                "bytes_per_element": self.cache.bytes_per_element,
            },
            "peak_memory_bytes": self.peak_memory_bytes,
            "weight_bytes": self.weight_bytes,
            "active_weight_bytes": self.active_weight_bytes or self.weight_bytes,
            "weights": self.weight_format,
            "device": self.device,
            "dtype": self.dtype,
            **({"speculation": self.speculation} if self.speculation is not None else {}),
        }


@dataclass(frozen=True)
class Done:
    row: int
    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    """A batch row that cannot be served (its prompt is empty or too long, its chat
    template fails); the other rows go on."""

    row: int
    message: str


Event = PrefillStart | TokenEvent | Notice | Done | Failed


# -- per-row bookkeeping ---------------------------------------------------------------
class _Row:
    def __init__(self, index: int, ids: list[int], settings: GenerationSettings, max_new: int, stream,
                 tokenize_seconds: float, reused: int):
        self.index, self.ids, self.settings, self.max_new = index, ids, settings, max_new
        self.clamped = max_new < settings.max_new_tokens
        self.stream, self.stop = stream, StopMatcher(settings.stop)
        self.tokenize_seconds, self.reused = tokenize_seconds, reused
        self.compile_seconds = 0.0
        self.generated: list[int] = []
        self.steps: list[float] = []
        self.pieces: list[str] = []
        self.t_first = self.t_last = 0.0
        self.finish: str | None = None
        self.constraint = None  # constraints.Constraint of a structured-output row


def _element_bytes(fmt) -> tuple[int, int]:
    """(bytes, values) of one block of a cache format: (34, 32) q8_0, (2, 1) bfloat16."""
    return (fmt.bytes_per_values(fmt.block), fmt.block)


def numerics(model: CausalLM, kv_dtype: str | None) -> dict:
    """What besides the model and the sampling settings decides a row's tokens: the dtype it
    computes in, the KV cache's element type (`kv_dtype` as --kv-dtype gives it, "auto"
    resolved) and the weights' storage types (as stored, --quantize, --dequantize), as
    `twice batch` records them on each result line so that --resume never mixes two of them."""
    dtype = next(model.parameters()).dtype
    return {"dtype": DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
            "kv_dtype": kv_format(kv_dtype, dtype, model.config.head_dim).name,
            "weights": ",".join(weight_formats(model)["types"])}


def _dropped(tokens: int, chars: int) -> str:
    """What truncate="left" dropped, for its notice."""
    if not chars:
        return f"{tokens} prompt tokens"
    return f"{chars:,} characters and then {tokens} tokens of the prompt"


class Engine:
    def __init__(self, model: CausalLM, tokenizer, eos_token_ids: tuple[int, ...] | list[int] = (),
                 compile: bool = False, native: bool = True, draft: CausalLM | None = None,
                 kv_dtype: str | None = None):
        self.model = model
        # A draft model for speculative decoding (speculative.Draft: its own KV cache).
        self.draft = speculative.Draft(draft, native=native, compile=compile) if draft is not None else None
        # The decode step: native (one C call per step, llama family on the CPU, any batch,
        # used wherever it applies), else compiled when asked (fastpath.py, batch 1), else
        # None = eager everywhere. (Neither under tensor parallelism: its all-reduces run in the
        # eager layers.)
        self.fast: NativeDecoder | CompiledDecoder | None = None
        if native and native_supported(model):
            self.fast = NativeDecoder(model)
        elif compile and compiled_supported(model):
            self.fast = CompiledDecoder(model)
        self.decode_path = ("native" if isinstance(self.fast, NativeDecoder)
                            else "compiled" if self.fast else "eager")
        self.tokenizer = tokenizer
        self.config = model.config
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.eos = frozenset(eos_token_ids)
        # The KV cache's element type (--kv-dtype; cache.py): checked here, in one line.
        self.kv_format = kv_format(kv_dtype, self.dtype, self.config.head_dim)
        self.kv_dtype = None if kv_dtype in (None, "auto") else kv_dtype
        self.context_length = self.config.max_position_embeddings
        self.weight_bytes = model.weight_bytes()
        self.active_weight_bytes = model.active_weight_bytes()
        self.weight_format = weight_formats(model)
        self.cache: KVCache | None = None  # the session cache of `generate`
        self.cached_ids: list[int] = []  # the tokens whose keys/values it holds

    # -- public API ----------------------------------------------------------------------
    def tokenize(self, request: Request, settings: GenerationSettings | None = None) -> list[int]:
        """The request's token ids. A text (or rendered chat) that surely cannot fit the
        context is refused before it is tokenized (see _tokenize)."""
        return self._tokenize(request, settings)[0]

    def reset(self) -> None:
        """Forget the session cache (the next call prefills from scratch)."""
        self.cache, self.cached_ids = None, []
        if self.draft is not None:
            self.draft.reset()

    def cache_stats(self, cache: KVCache | None = None) -> CacheStats:
        cache = cache or self.cache
        if cache is None:
            per_value = self.kv_format.bytes_per_values(self.config.head_dim)  # K or V of one head
            per_token = 2 * self.config.num_hidden_layers * self.config.num_key_value_heads * per_value
            per_token //= self.model.shard.world
            return CacheStats(per_token, 0, 0, 0, 0, 0, self.context_length, self.kv_format.name,
                              _element_bytes(self.kv_format))
        return CacheStats(cache.bytes_per_token, cache.bytes_in_use, cache.bytes_allocated, cache.length,
                          cache.capacity, cache.batch, self.context_length, cache.kv_dtype, _element_bytes(cache.format))

    def generate(self, request: Request, settings: GenerationSettings, reuse_cache: bool = True) -> Iterator[Event]:
        """Generate for one prompt; reuse the cached prefix shared with the previous call."""
        start = time.perf_counter()
        reset_peak_memory(self.device)
        ids, cut = self._tokenize(request, settings)
        tokenize_seconds = time.perf_counter() - start
        ids, dropped = self._truncate(ids, settings)
        if dropped or cut:
            yield Notice(f"dropped the first {_dropped(dropped, cut)} to fit the context of {self.context_length} "
                         f"(--truncate left)", context=True)
        max_new = self._check_length(ids, settings)
        reused = common_prefix(self.cached_ids, ids) if (reuse_cache and self.cache is not None) else 0
        reused = min(reused, len(ids) - 1)  # at least one token must run to produce logits
        needed = len(ids) + max_new - 1
        # cached_ids shrinks first: an interrupt anywhere below leaves it describing (a
        # prefix of) what the cache really holds.
        self.cached_ids = self.cached_ids[:reused]
        if self.cache is None or not reuse_cache:
            self.cache = None
            self.cache = KVCache(self.config, 1, self._capacity(needed), self.dtype, self.device,
                                 kv_heads=self.model.kv_heads, kv_dtype=self.kv_dtype)
        self.cache.truncate(reused)
        self.cache.grow(self._capacity(needed))
        speculator = self._speculator(settings)
        compile_seconds = yield from self._warm(self.cache, verify=speculator is not None)
        if speculator is not None and isinstance(speculator.proposer, speculative.Draft):
            compile_seconds += yield from self._warm_draft(speculator.proposer, needed)
        start += compile_seconds  # compiling is reported on its own, never as TTFT
        row = _Row(0, ids, settings, max_new, self.tokenizer.stream(ids), tokenize_seconds, reused)
        row.compile_seconds = compile_seconds
        row.constraint = constraints.for_settings(self, settings)
        if row.clamped:
            yield Notice(f"max new tokens lowered from {settings.max_new_tokens} to {max_new} "
                         f"to fit the model's context of {self.context_length} tokens", context=True)
        yield PrefillStart(1, len(ids), reused, self.cache_stats())
        sampler = Sampler([settings.sampling], [ids], self.config.vocab_size, self.device)
        t0 = time.perf_counter()
        logits = self._prefill(torch.tensor([ids[reused:]], device=self.device), self.cache, settings.prefill_chunk)
        synchronize(self.device)
        prefill_seconds = time.perf_counter() - t0
        self.cached_ids = list(ids)
        if speculator is not None:
            yield from speculative.decode(self, row, self.cache, sampler, logits, start, prefill_seconds, speculator)
            return
        yield from self._decode([row], self.cache, sampler, logits, start, prefill_seconds, track=True)

    def _speculator(self, settings: GenerationSettings) -> speculative.Speculator | None:
        """Who proposes tokens for `generate` (speculative.py), or None: decode plainly."""
        if settings.lookup and self.draft is not None:
            raise PromptError("--lookup and --draft exclude each other (choose one proposer)")
        if settings.constraint is not None and (settings.lookup or self.draft is not None):
            raise constraints.ConstraintError("structured output (--json-schema, --json-object, --regex, --grammar) "
                                              "does not work with speculative decoding (--draft, --lookup)")
        if settings.lookup:
            return speculative.Speculator(speculative.Lookup(), settings.draft_tokens)
        if self.draft is not None:
            return speculative.Speculator(self.draft, settings.draft_tokens)
        return None

    def generate_batch(self, requests: list[Request], settings: list[GenerationSettings]) -> Iterator[Event]:
        """Generate for several prompts together (greedy results equal running each alone).
        Rows are reported by their index in `requests`."""
        if len(requests) != len(settings) or not requests:
            raise ValueError("one GenerationSettings per request, at least one request")
        start = time.perf_counter()
        reset_peak_memory(self.device)
        rows: list[_Row] = []
        for i, (request, s) in enumerate(zip(requests, settings)):
            t = time.perf_counter()
            try:
                ids, cut = self._tokenize(request, s)
                ids, dropped = self._truncate(ids, s)
                if dropped or cut:
                    yield Notice(f"dropped the first {_dropped(dropped, cut)} to fit the context", row=i, context=True)
                max_new = self._check_length(ids, s)
                constraint = constraints.for_settings(self, s)
            except TwiceError as e:
                yield Failed(i, str(e))
                continue
            rows.append(_Row(i, ids, s, max_new, self.tokenizer.stream(ids), time.perf_counter() - t, 0))
            rows[-1].constraint = constraint
        if not rows:
            return
        if self.draft is not None or any(r.settings.lookup for r in rows):
            yield Notice("speculative decoding serves one sequence at a time (twice generate, twice chat); "
                         "this batch decodes without it")
        for row in rows:
            if row.clamped:
                yield Notice(f"max new tokens lowered from {row.settings.max_new_tokens} to {row.max_new} "
                             f"to fit the model's context of {self.context_length} tokens", row=row.index, context=True)
        width = max(len(r.ids) for r in rows)
        capacity = self._capacity(width + max(r.max_new for r in rows) - 1, session=False)
        cache = KVCache(self.config, len(rows), capacity, self.dtype, self.device, kv_heads=self.model.kv_heads,
                        kv_dtype=self.kv_dtype)
        pad = [width - len(r.ids) for r in rows]
        if any(pad):
            cache.starts = torch.tensor(pad, device=self.device)
        compile_seconds = yield from self._warm(cache)
        start += compile_seconds
        for row in rows:
            row.compile_seconds = compile_seconds
        total = sum(len(r.ids) for r in rows)
        yield PrefillStart(len(rows), total, 0, self.cache_stats(cache))
        sampler = Sampler([r.settings.sampling for r in rows], [r.ids for r in rows], self.config.vocab_size,
                          self.device)
        t0 = time.perf_counter()
        if self.batch_invariant:
            logits = self._prefill_rows([r.ids for r in rows], [r.settings for r in rows], cache)
        else:
            tokens = torch.tensor([[0] * p + r.ids for p, r in zip(pad, rows)], device=self.device)
            logits = self._prefill(tokens, cache, max((r.settings.prefill_chunk or width) for r in rows))
        synchronize(self.device)
        prefill_seconds = time.perf_counter() - t0
        yield from self._decode(rows, cache, sampler, logits, start, prefill_seconds, track=False, batch_tokens=total)

    @property
    def batch_invariant(self) -> bool:
        """Whether `generate_batch` gives every row bit for bit what `generate` gives its
        prompt alone (so greedy tokens are the same in bf16 too): with the native CPU step,
        whose arithmetic per row does not depend on the batch, and each prompt prefilled at
        its own length (`_prefill_rows`). PyTorch's kernels (the eager and compiled steps: no
        C compiler, GPT-2, tensor parallelism, a GPU) may reduce a row differently beside
        other rows, so there a row can differ from its prompt alone in the last bits."""
        return isinstance(self.fast, NativeDecoder)

    # -- internals -----------------------------------------------------------------------
    def _prefill_rows(self, prompts: list[list[int]], settings: list[GenerationSettings],
                      cache: KVCache) -> torch.Tensor:
        """Prefill a batch prompt by prompt, each exactly as `generate` prefills it alone (its
        own length, its own chunks, one row), into its columns of the left-padded `cache`;
        returns the last logits [rows, V]. One padded pass would change every prompt's
        length, and PyTorch's bf16 and fp32 products and attention reduce in an order that
        depends on it (and on the rows beside): rows would no longer equal their prompts
        alone. It costs prefill its batching (SmolLM2-135M, 8 chat prompts of 31–43 tokens,
        an AVX2 CPU, 1 thread: 1.5× the padded pass in float32, 2.2 s against 1.5 s; the same
        in bf16); decode, where a batch's time goes, stays batched."""
        width = max(map(len, prompts))  # the batch cache is empty; row i starts at width - len
        own = KVCache(self.config, 1, width, self.dtype, self.device, kv_heads=self.model.kv_heads,
                      kv_dtype=self.kv_dtype)
        last = []
        for i, (ids, s) in enumerate(zip(prompts, settings)):
            own.truncate(0)
            last.append(self._prefill(torch.tensor([ids], device=self.device), own, s.prefill_chunk))
            first = width - len(ids)
            cache.k[:, i, :, first:width] = own.k[:, 0, :, : len(ids)]
            cache.v[:, i, :, first:width] = own.v[:, 0, :, : len(ids)]
        cache.length = width
        return torch.cat(last)

    def _warm_draft(self, draft: speculative.Draft, needed: int) -> Iterator[Notice]:
        """A compiled draft made ready for the request (its cache, its compile); returns the
        seconds. Where it cannot be built, the draft steps with its eager layers, and says so."""
        if draft.ready(needed):
            return 0.0
        yield Notice("compiling the draft's decode step (once per cache size; cached on disk by torch.compile)")
        try:
            return draft.warm(needed)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the optional fast path falls back
            draft.eager()
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            yield Notice(f"the draft's compiled step is unavailable here ({type(e).__name__}: {reason}); "
                         "drafting with its eager layers")
            return 0.0

    def _warm(self, cache: KVCache, verify: bool = False) -> Iterator[Notice]:
        """Make the fast decode step ready for `cache` (compile it, record its GPU graph; with
        `verify`, a compiled step's pass of several tokens too: speculative decoding's);
        returns the seconds that took. If it cannot be built here (no compiler toolchain,
        a device that refuses the graph) decoding goes on with the eager layers, and says so."""
        if not (self.fast and self.fast.supports(cache)):
            return 0.0
        compiled = isinstance(self.fast, CompiledDecoder)
        if not self.fast.is_warm(cache) or (verify and compiled and not self.fast.is_warm(cache, 2)):
            yield Notice(f"compiling the decode step for a {cache.capacity}-token cache "
                         "(once per cache size; cached on disk by torch.compile)")
        try:
            return self.fast.warmup(cache, verify=True) if verify and compiled else self.fast.warmup(cache)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the optional fast path falls back
            if not isinstance(self.fast, CompiledDecoder):
                raise
            self.fast, self.decode_path = None, "eager"
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            yield Notice(f"the compiled decode step is unavailable here ({type(e).__name__}: {reason}); "
                         "decoding with the eager layers")
            return 0.0

    def _tokenize(self, request: Request, settings: GenerationSettings | None) -> tuple[list[int], int]:
        """(token ids, characters cut from the text's start before tokenizing). Sizes before
        tokens: a text that surely encodes to more tokens than the context holds (a sound
        bound from its length, Tokenizer.fewest_tokens) is refused before it is tokenized,
        which for megabytes of text takes seconds and gigabytes. With truncate="left" such
        a text is cut instead, to an end that still holds twice the tokens kept (so the
        tokens kept are those of the whole text but for the rare word whose pieces depend on
        what lies a whole context before it); only that end is tokenized."""
        if request.ids is not None:
            ids = list(request.ids)
            bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < self.config.vocab_size)]
            if bad:
                raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
            return ids, 0
        if request.messages is not None:
            # The template writes the special tokens itself (as transformers does, no second BOS).
            text, special = self.tokenizer.render_chat(request.messages), False
        else:
            text, special = request.text or "", True
        cut = 0
        if settings is not None and settings.truncate == "left" and \
                self.tokenizer.fewest_tokens(text) > (want := 2 * self._keep(settings)):
            # Only an end is tokenized: first one of 16 characters a token (more than most
            # text needs), else the end the bound guarantees to be long enough.
            for tail in (text[-16 * want:], self.tokenizer.tail(text, want)):
                ids = self.tokenizer.encode(tail, add_special_tokens=special)
                if len(ids) >= want:
                    break
            cut = len(text) - len(tail)
        else:
            if settings is None or settings.truncate != "left":
                room = self.context_length - 1  # leave room for at least one new token
                at_least = self.tokenizer.fewest_tokens(text)
                if at_least > room:
                    raise PromptError(
                        f"the prompt is at least {at_least} tokens but the model's context is "
                        f"{self.context_length}: at least {at_least - room} token{'s' if at_least - room != 1 else ''} too many (refused before "
                        "tokenizing; leave room for at least one new token)")
            ids = self.tokenizer.encode(text, add_special_tokens=special)
        if ids and max(ids) >= self.config.vocab_size:  # load() checks the tokenizer's size; this, a sparse vocabulary
            raise PromptError(f"the tokenizer gave token id {max(ids)}, outside the model's vocabulary "
                              f"(0..{self.config.vocab_size - 1}): the tokenizer does not belong to this model")
        return ids, cut

    def _keep(self, settings: GenerationSettings) -> int:
        """The prompt tokens truncate="left" keeps: the context less room for the new tokens
        (at most half the context)."""
        return self.context_length - min(settings.max_new_tokens, self.context_length // 2)

    def _truncate(self, ids: list[int], settings: GenerationSettings) -> tuple[list[int], int]:
        """With truncate="left", keep the end of a prompt too long for the context, leaving
        room for the new tokens (at most half the context): (ids, tokens dropped)."""
        if settings.truncate != "left":
            return ids, 0
        keep = self._keep(settings)
        if len(ids) <= keep:
            return ids, 0
        return ids[-keep:], len(ids) - keep

    def _check_length(self, ids: list[int], settings: GenerationSettings) -> int:
        if not ids:
            raise PromptError("the prompt is empty (it tokenizes to no tokens)")
        room = self.context_length - len(ids)
        if room < 1:
            raise PromptError(
                f"the prompt is {len(ids)} token{'s' if len(ids) != 1 else ''} but the model's context is "
                f"{self.context_length}: {1 - room} token{'s' if room != 0 else ''} too many (leave room for at "
                "least one new token)"
            )
        return min(settings.max_new_tokens, room)

    def _capacity(self, needed: int, session: bool = True) -> int:
        """Columns to allocate for `needed`: a whole bucket for the compiled step (it is
        specialized per bucket); else a session cache (which may grow) rounds up, a batch
        cache (used once) takes exactly what it needs."""
        if isinstance(self.fast, CompiledDecoder):
            return bucketed(needed)
        if not session:
            return needed
        rounded = -(-needed // CAPACITY_ROUNDING) * CAPACITY_ROUNDING
        return max(needed, min(rounded, self.context_length))

    @torch.inference_mode()
    def _prefill(self, tokens: torch.Tensor, cache: KVCache, chunk: int | None) -> torch.Tensor:
        """Tokens [B, T] at the cache's end; the last position's logits [B, V]. A short
        prompt of one row goes through the native step (NativeDecoder.prefill: the same bits
        however it is chunked); the rest through the eager layers, `chunk` tokens a pass."""
        if isinstance(self.fast, NativeDecoder) and self.fast.prefills(tokens, cache):
            with self._out_of_memory(cache, f"prefilling {tokens.shape[1]} tokens"):
                return self.fast.prefill(tokens, cache, chunk)
        chunk = chunk or tokens.shape[1]
        logits = None
        with self._out_of_memory(cache, f"prefilling {tokens.shape[0]} × {tokens.shape[1]} tokens"):
            for begin in range(0, tokens.shape[1], chunk):
                logits = self.model(tokens[:, begin : begin + chunk], cache)
        return logits

    @torch.inference_mode()
    def _step(self, tokens: torch.Tensor, cache: KVCache, sampler: Sampler, masks: list | None = None) -> torch.Tensor:
        with self._out_of_memory(cache, f"decoding {tokens.shape[0]} rows at {cache.length} tokens"):
            if self._fast_ready(cache) and cache.length < cache.capacity:
                logits = self.fast(tokens, cache)
            else:
                logits = self.model(tokens, cache)
            chosen = sampler(logits, masks)
            sampler.observe(chosen)
        return chosen

    def _fast_ready(self, cache: KVCache) -> bool:
        """The fast step serves this cache and was made ready for its shape at a request's
        start. A shape that appears only mid-request (a batch down to its last row) decodes
        with the eager layers rather than stalling the request to compile."""
        return bool(self.fast and self.fast.supports(cache) and self.fast.is_warm(cache))

    @contextmanager
    def _out_of_memory(self, cache: KVCache, doing: str):
        """Device out of memory → DeviceError (a one-line message saying what to lower);
        the session cache is dropped, since a failed pass leaves it half written."""
        try:
            yield
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            # On the CPU torch reports a failed allocation as a plain RuntimeError.
            if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) \
                    and "can't allocate memory" not in str(e):
                raise
            if cache is self.cache:
                self.reset()
            raise DeviceError(
                f"out of memory on {self.device} while {doing} (KV cache {cache.bytes_allocated / 2**20:.0f} MiB, "
                f"weights {self.weight_bytes / 2**20:.0f} MiB); lower --max-new-tokens, the batch size or "
                "--prefill-chunk, or use a smaller --dtype"
            ) from None

    def _decode(self, rows: list[_Row], cache: KVCache, sampler: Sampler, logits: torch.Tensor, start: float,
                prefill_seconds: float, track: bool, batch_tokens: int = 0) -> Iterator[Event]:
        with torch.inference_mode():
            chosen = sampler(logits, constraints.masks(rows))
            sampler.observe(chosen)
        ids = chosen.tolist()
        step_seconds = prefill_seconds
        live = list(rows)
        while True:
            now = time.perf_counter()
            finished: list[_Row] = []
            for row, token in zip(live, ids):
                text = self._accept(row, token, now, step_seconds)
                yield TokenEvent(row.index, token, text, len(row.generated) - 1, step_seconds, now - start,
                                 self.cache_stats(cache))
                if row.finish:
                    finished.append(row)
            for row in finished:
                result = self._result(row, cache, start, prefill_seconds, batch_tokens)
                yield Done(row.index, result)
            if finished:
                keep = [i for i, row in enumerate(live) if not row.finish]
                if not keep:
                    return
                live = [live[i] for i in keep]
                ids = [ids[i] for i in keep]
                cache.keep_rows(keep)
                sampler.keep_rows(keep)
            t = time.perf_counter()
            chosen = self._step(torch.tensor(ids, device=self.device).unsqueeze(1), cache, sampler,
                                constraints.masks(live))
            if track:
                self.cached_ids.extend(ids)
            ids = chosen.tolist()
            step_seconds = time.perf_counter() - t

    def _accept(self, row: _Row, token: int, now: float, step_seconds: float) -> str:
        """Record a generated token; return the text it makes visible; set row.finish."""
        if not row.generated:
            row.t_first = now
        else:
            row.steps.append(step_seconds)
        row.t_last = now
        row.generated.append(token)
        complete = row.constraint is not None and row.constraint.advance(token)  # the grammar took its last token
        # The constraint engine failed (a grammar too complex for its lexer, say): the row
        # ends, and says so, rather than a "stop" that calls unfinished output complete.
        failed = complete and row.constraint.error is not None
        is_eos = token in self.eos and not row.settings.ignore_eos
        text, stopped = row.stop.feed("" if is_eos else row.stream.step(token))
        if stopped and not failed:
            row.finish = "stop"
        elif failed or is_eos or complete or len(row.generated) >= row.max_new:
            row.finish = ("error" if failed else "eos" if is_eos else "stop" if complete
                          else ("context" if row.clamped else "length"))
            tail, stopped = row.stop.feed(row.stream.finish())
            text += tail
            if stopped:
                row.finish = "stop"
            else:
                text += row.stop.flush()
        row.pieces.append(text)
        return text

    def _result(self, row: _Row, cache: KVCache, start: float, prefill_seconds: float,
                batch_tokens: int) -> GenerationResult:
        return GenerationResult(
            row=row.index,
            text="".join(row.pieces),
            token_ids=list(row.generated),
            finish_reason=row.finish,
            prompt_tokens=len(row.ids),
            reused_tokens=row.reused,
            tokenize_seconds=row.tokenize_seconds,
            prefill_seconds=prefill_seconds,
            ttft_seconds=row.t_first - start,
            decode_seconds=row.t_last - row.t_first,
            step_seconds=list(row.steps),
            cache=self.cache_stats(cache),
            peak_memory_bytes=peak_memory_bytes(self.device),
            weight_bytes=self.weight_bytes,
            device=str(self.device),
            dtype=DTYPE_NAMES.get(self.dtype, str(self.dtype)),
            prefill_batch_tokens=batch_tokens,
            compile_seconds=row.compile_seconds,
            decode_path=self.decode_path if self._fast_ready(cache) else "eager",
            batch_invariant=self.batch_invariant and self._fast_ready(cache),
            weight_format=self.weight_format,
            active_weight_bytes=self.active_weight_bytes,
            error=row.constraint.failure() if row.finish == "error" else None,
        )
