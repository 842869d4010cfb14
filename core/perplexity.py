"""Perplexity of a text under a model: how well the model predicts it, token by token.

The definition (`twice perplexity`, and what the README's quality table reports):

* the text is encoded once, without special tokens;
* only its first `max_tokens` tokens are kept, if a limit is given;
* the tokens are cut into windows of `context` tokens that do not overlap (the last one may
  be shorter);
* each window is scored on its own, in a fresh KV cache, with the tokenizer's BOS token
  prepended where the tokenizer adds one by default (`bos_prefix`);
* every window token that has a preceding token in its window is scored: with a BOS, all
  of them; without, all but the window's first;
* perplexity = exp(mean negative log-likelihood over the scored tokens).

Log-probabilities are taken in float32 (log-softmax of the logits, whatever the model's
dtype) and the negative log-likelihoods summed in float64, so a long text loses nothing to
the sum. `score` yields a `WindowScored` after each window (for a progress bar) and the
`PerplexityResult` last; it never prints. torch is imported only where the scoring starts,
so the CLI checks its flags with this module's own rules without importing torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .errors import DeviceError, PromptError

DEFAULT_CONTEXT = 512
# Rows of logits turned into float32 log-probabilities at once: bounds the temporary to
# rows × vocabulary × 4 bytes (256 × 151,936 × 4 = 148 MiB for Qwen2.5's vocabulary).
_ROWS = 256
# A probe text for what the tokenizer adds around a text by default.
_PROBE = "Hello world"


def bos_prefix(tokenizer) -> tuple[int, ...]:
    """The ids the tokenizer puts before a text by default (its post-processor's BOS; empty
    for byte-level BPE models such as GPT-2, Qwen2 and SmolLM2): those of
    `encode(text, add_special_tokens=True)` before the text's own ids. Whatever it adds
    after the text (an EOS) is not used."""
    plain = list(tokenizer.encode(_PROBE, add_special_tokens=False))
    full = list(tokenizer.encode(_PROBE, add_special_tokens=True))
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[:start])
    return ()  # the special tokens change the text's own ids: nothing is known to be a prefix


def windows(n_tokens: int, context: int, prefix: int = 0) -> list[tuple[int, int]]:
    """[start, stop) of each window over `n_tokens` tokens: `context` tokens each, not
    overlapping, the last one shorter where `context` does not divide `n_tokens`. A window
    with nothing to score (a last window of one token, without a BOS before it) is left out."""
    if context < 1:
        raise ValueError("context must be at least 1")
    spans = [(start, min(start + context, n_tokens)) for start in range(0, n_tokens, context)]
    return [(a, b) for a, b in spans if scored_in(b - a, prefix) > 0]


def scored_in(length: int, prefix: int) -> int:
    """Tokens scored in a window of `length` text tokens with `prefix` BOS tokens before them:
    every text token that has a preceding token in the window."""
    return length if prefix else max(0, length - 1)


@dataclass(frozen=True)
class WindowScored:
    """One more window done: counts and the sum of negative log-likelihoods so far."""

    window: int  # windows done, 1-based
    windows: int
    tokens: int  # tokens scored so far
    nll_sum: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens) if self.tokens else float("nan")


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float  # exp(mean negative log-likelihood)
    mean_nll: float  # nats per scored token
    tokens: int  # tokens scored
    windows: int
    context: int  # text tokens per window
    text_tokens: int  # tokens the whole text encodes to
    tokens_used: int  # those kept (the first --max-tokens)
    prefix: tuple[int, ...]  # the BOS ids put before each window (empty: none)
    seconds: float  # scoring, from the first window's start to the last one's end (synchronized)
    window_nll: tuple[float, ...] = field(default=(), repr=False)  # each window's NLL sum

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def check_settings(context: int | None = None, max_tokens: int | None = None) -> None:
    """What can be refused before a model loads (one-line PromptError)."""
    if context is not None and context < 2:
        raise PromptError(f"--context must be at least 2 tokens (a window needs a token to predict from), "
                          f"got {context}")
    if max_tokens is not None and max_tokens < 2:
        raise PromptError("--max-tokens must be at least 2 (one token to predict from, one to score), "
                          f"got {max_tokens}")


def choose_context(context: int | None, model_context: int, prefix: int) -> int:
    """The window size: `context` as given (it and the BOS must fit the model's positions),
    or DEFAULT_CONTEXT, cut to what the model holds."""
    room = model_context - prefix
    if context is None:
        return max(1, min(DEFAULT_CONTEXT, room))
    check_settings(context=context)
    if context > room:
        with_bos = f" plus the BOS token ({context + prefix:,} positions)" if prefix else ""
        raise PromptError(f"--context {context:,}{with_bos} is more than the model's context of {model_context:,} "
                          f"tokens; use --context {room:,} or less")
    return context


def score(model, ids: Sequence[int], context: int, prefix: Sequence[int] = (), max_tokens: int | None = None,
          dtype=None, device=None, kv_dtype: str | None = None) -> Iterator[WindowScored | PerplexityResult]:
    """Score `ids` (the text's tokens) window by window; yields a WindowScored per window
    and the PerplexityResult last. `dtype`/`device`: the cache's (default: the model's
    first parameter's); `kv_dtype` the cache's element type (core/cache.py: q8_0 scores with a
    quantized cache)."""
    check_settings(context=context, max_tokens=max_tokens)
    prefix = tuple(int(i) for i in prefix)
    if context + len(prefix) > model.config.max_position_embeddings:
        raise PromptError(f"windows of {context:,} tokens (+{len(prefix)} BOS) do not fit the model's context of "
                          f"{model.config.max_position_embeddings:,}")
    text_tokens = len(ids)
    used = list(ids[:max_tokens] if max_tokens is not None else ids)
    spans = windows(len(used), context, len(prefix))
    if not spans:
        need = "1 with the BOS token" if prefix else "2 without a BOS token"
        after = " (after --max-tokens)" if len(used) < text_tokens else ""
        raise PromptError(f"the text is {_tokens(len(used))}{after}; scoring needs at least {need}")
    import torch

    if dtype is None or device is None:
        first = next(model.parameters())
        dtype, device = dtype or first.dtype, device or first.device
    scored, total, per_window = 0, 0.0, []
    start = time.perf_counter()
    for k, (a, b) in enumerate(spans, 1):
        nll, n = _window_nll(model, list(prefix) + used[a:b], len(prefix), dtype, device, kv_dtype)
        scored += n
        total += nll
        per_window.append(nll)
        yield WindowScored(k, len(spans), scored, total)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    mean = total / scored
    yield PerplexityResult(math.exp(mean), mean, scored, len(spans), context, text_tokens, len(used), prefix,
                           seconds, tuple(per_window))


def _window_nll(model, seq: list[int], prefix: int, dtype, device, kv_dtype=None) -> tuple[float, int]:
    """The sum (float64) of -log p(token | tokens before it in `seq`) over the scored tokens,
    and how many they are, in a fresh cache. Position i's logits predict token i + 1."""
    import torch

    from .cache import KVCache

    first = max(prefix, 1)  # the first scored position in seq
    with torch.inference_mode():
        x = torch.tensor([seq], dtype=torch.long, device=device)
        try:
            cache = KVCache(model.config, 1, len(seq), dtype, device, kv_heads=model.kv_heads, kv_dtype=kv_dtype)
            logits = model(x, cache, all_logits=True)[0]  # [T, V]
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
            # On the CPU torch reports a failed allocation as a plain RuntimeError.
            if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) \
                    and "can't allocate memory" not in str(e):
                raise
            raise DeviceError(f"out of memory on {device} scoring a window of {len(seq):,} tokens; "
                              "lower --context") from None
        targets = x[0, first:]
        total = torch.zeros((), dtype=torch.float64, device=device)
        for r in range(0, targets.shape[0], _ROWS):
            rows = logits[first - 1 + r: first - 1 + r + _ROWS].float()
            logp = torch.log_softmax(rows, dim=-1).gather(1, targets[r: r + _ROWS, None])[:, 0]
            total -= logp.double().sum()
        return float(total), int(targets.shape[0])


def weight_summary(model) -> dict:
    """The model's weight storage (types, matrix bytes, bits per weight) for the --json
    object: core/qweight.py's `weight_formats`, the one description of it."""
    from .qweight import weight_formats

    return weight_formats(model)


def _tokens(n: int) -> str:
    return f"{n:,} token" + ("" if n == 1 else "s")
