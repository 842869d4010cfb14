"""Choosing the next token: repetition penalty, temperature, top-k, top-p, min-p.

The order is transformers' (penalty on raw logits, then temperature, top-k, top-p, min-p).
Sampling draws with the exponential trick (argmax of p / Exp(1) noise), which equals a
categorical draw but needs no cumulative sums, from a per-row torch.Generator so a seed
reproduces the same tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy
import torch

from . import kernels
from .errors import PromptError


FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        def bad(what: str):
            raise PromptError(what)

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top-k must be a whole number >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            bad(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p < 1):
            bad(f"min-p must be in [0, 1), got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad(f"repetition penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            bad(f"seed must be in [0, 2^63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


LOGIT_BIAS_MOST = 100.0  # as OpenAI's logit_bias: -100 bans a token in effect, +100 all but forces it


def logit_bias(value, vocab_size: int) -> dict[int, float]:
    """An OpenAI `logit_bias` object (token id, as a decimal string → a number in [-100, 100],
    added to that token's logit before sampling) checked against the vocabulary; PromptError
    naming the entry otherwise. {} for none."""
    if value is None:
        return {}
    from .fields import show

    if not isinstance(value, dict):
        raise PromptError(f"logit_bias must be an object of token ids to numbers, got {show(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")):
            raise PromptError(f"logit_bias: the key {show(key)} is not a token id (a whole number such as \"123\")")
        token = int(key) if len(key) < 12 else vocab_size
        if token >= vocab_size:
            raise PromptError(f"logit_bias: token id {show(key)} is outside the vocabulary (0..{vocab_size - 1})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or abs(bias) > LOGIT_BIAS_MOST:
            raise PromptError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got "
                              f"{show(bias)}")
        if bias:
            out[token] = float(bias)
    return out


def apply_masks(logits: torch.Tensor, masks: list) -> torch.Tensor:
    """Logits [B, V] with each row's disallowed tokens at -inf: `masks[b]` is None (the row
    is free) or a bool tensor, True = allowed; ids past its length are disallowed. A copy
    where any row is masked (the caller's logits stay as they were). On the CPU the copy
    and the fill run in numpy on the logits' bits (one thread: torch's elementwise ops on a
    49k vocabulary cost milliseconds each in thread-pool wake-ups on a busy machine)."""
    if all(m is None for m in masks):
        return logits
    v = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.element_size() in _SAME_SIZE_INT:
        ints = _SAME_SIZE_INT[logits.element_size()]
        raw = logits.detach().contiguous().view(ints).numpy().copy()
        minus_inf = int(torch.tensor(float("-inf"), dtype=logits.dtype).view(ints))
        for b, m in enumerate(masks):
            if m is not None:
                allowed = numpy.zeros(v, dtype=numpy.bool_)
                n = min(v, m.shape[-1])
                allowed[:n] = m.cpu().numpy()[:n]
                numpy.putmask(raw[b], ~allowed, minus_inf)
        return torch.from_numpy(raw).view(logits.dtype)
    out = logits.clone()
    for b, m in enumerate(masks):
        if m is None:
            continue
        m = m.to(out.device)
        if m.shape[-1] != v:
            full = torch.zeros(v, dtype=torch.bool, device=out.device)
            full[: min(v, m.shape[-1])] = m[:v]
            m = full
        out[b].masked_fill_(~m, float("-inf"))
    return out


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class Sampler:
    """Samples one token per live row; rows may carry different parameters."""

    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], vocab_size: int, device):
        self.params = list(params)
        self.vocab_size = vocab_size
        self.generators = []
        for p in self.params:
            g = None
            if not p.greedy:
                g = torch.Generator(device=device)
                g.manual_seed(p.seed if p.seed is not None else random.getrandbits(63))
            self.generators.append(g)
        self.all_greedy = all(p.greedy and p.repetition_penalty == 1.0 for p in self.params)
        self.seen = None
        if any(p.repetition_penalty != 1.0 for p in self.params):
            # Tokens of each row's prompt and output so far, as a [B, V] mask (duplicates are irrelevant).
            self.seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
            for row, ids in enumerate(prompts):
                if ids:
                    self.seen[row, torch.tensor(ids, device=device)] = True

    def __call__(self, logits: torch.Tensor, masks: list | None = None) -> torch.Tensor:
        """logits [B, V] → token ids [B] (on the logits' device). `masks`: per row None or
        the tokens allowed (structured output, core/constraints.py; see apply_masks)."""
        if masks is not None:
            logits = apply_masks(logits, masks)
        if self.all_greedy:
            chosen = kernels.argmax(logits)  # torch's CPU argmax costs 2% of a batch-16 step
            return chosen if chosen is not None else logits.argmax(dim=-1)
        return torch.stack([self._one(row, logits[row]) for row in range(logits.shape[0])])

    def _one(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        x = self._penalized(row, logits)
        if self.params[row].greedy:
            return x.argmax()
        probs, candidates = self._filtered(row, x)
        chosen = self.draw(row, probs)
        return chosen if candidates is None else candidates[chosen]

    def _penalized(self, row: int, logits: torch.Tensor, extra: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """The row's logits as float32 after its repetition penalty; `extra` tokens count as
        seen too (speculative decoding's proposals before this position)."""
        p = self.params[row]
        x = logits.float()
        if p.repetition_penalty != 1.0:
            seen = self.seen[row]
            if extra:
                seen = seen.clone()
                seen[torch.tensor(list(extra), device=seen.device)] = True
            x = torch.where(seen, torch.where(x < 0, x * p.repetition_penalty, x / p.repetition_penalty), x)
        return x

    def _filtered(self, row: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(probabilities after temperature, top-k, top-p and min-p, the token ids they are of:
        None = the whole vocabulary) from penalized logits `x` of a sampling row."""
        p = self.params[row]
        candidates = None
        if p.top_k and p.top_k < x.shape[-1]:
            # Everything after top-k runs on the k candidates instead of the whole vocabulary:
            # the same distribution (the rest have probability 0; dividing by the temperature
            # keeps the order, so it can come after), but a dozen vocabulary-wide ops a token
            # (division, sort, cumsum, scatter, noise) become ops on k values — on a busy
            # machine each vocabulary-wide op cost milliseconds of thread-pool wake-ups. Ties
            # at the k-th value keep every tied token, as transformers' top-k does.
            values, candidates = torch.topk(x, min(p.top_k + 1, x.shape[-1]))
            if values[-1] == values[p.top_k - 1]:  # a tie straddles the cut: keep all of it
                kth = values[p.top_k - 1]
                candidates = (x >= kth).nonzero().squeeze(-1)
                x = x[candidates]
            else:
                candidates, x = candidates[: p.top_k], values[: p.top_k]
        # The largest logit subtracted first: a tiny temperature (1e-38) then sends the others to
        # -inf and leaves the largest at 0 (greedy, as its limit is), where x / T alone would
        # overflow to inf and the softmax to NaN. A temperature below float32's smallest normal
        # number (1e-300) would become 0 in the division (0 / 0: NaN): it divides as that number.
        x = (x - x.max()) / max(p.temperature, FLOAT32_TINY)
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Drop a token when the tokens ranked above it already reach top_p; the first always
            # stays (a top_p below float32's smallest number would otherwise drop it too).
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
            drop_sorted[0] = False
            probs = probs.masked_fill(drop_sorted.scatter(0, order, drop_sorted), 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs, candidates

    def draw(self, row: int, probs: torch.Tensor) -> torch.Tensor:
        """An index drawn from (unnormalized) probabilities `probs` with the row's generator."""
        noise = torch.empty_like(probs).exponential_(1.0, generator=self.generators[row])
        return (probs / noise).argmax()

    def uniform(self, row: int) -> float:
        """A uniform draw in [0, 1) from the row's generator (speculative acceptance)."""
        g = self.generators[row]
        return float(torch.rand((), generator=g, device=g.device))

    def pick(self, row: int, logits: torch.Tensor, extra: list[int] | tuple[int, ...] = ()) -> int:
        """A greedy row's token from `logits` [V], `extra` tokens counted as seen (the
        repetition penalty), as `__call__` would choose it."""
        if self.all_greedy:
            return int(self(logits.unsqueeze(0))[0])
        return int(self._penalized(row, logits, extra).argmax())

    def distribution(self, row: int, logits: torch.Tensor, extra: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """A sampling row's next-token probabilities over the whole vocabulary [V] (float32,
        summing to 1): its whole processing, exactly as `__call__` samples from, with `extra`
        tokens counted as seen (speculative decoding: the proposals before this position)."""
        probs, candidates = self._filtered(row, self._penalized(row, logits, extra))
        probs = probs / probs.sum()
        if candidates is None:
            return probs
        full = torch.zeros(logits.shape[-1], dtype=probs.dtype, device=probs.device)
        full[candidates] = probs
        return full

    def observe(self, tokens: torch.Tensor) -> None:
        """Record the tokens just chosen (for the repetition penalty)."""
        if self.seen is not None:
            self.seen[torch.arange(tokens.shape[0], device=tokens.device), tokens] = True

    def keep_rows(self, rows: list[int]) -> None:
        self.params = [self.params[r] for r in rows]
        self.generators = [self.generators[r] for r in rows]
        if self.seen is not None:
            self.seen = self.seen[torch.tensor(rows, device=self.seen.device)]
