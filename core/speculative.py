"""Speculative decoding: something cheap proposes the next tokens, the model verifies them
all in one forward pass.

A decode step reads every weight to produce one token; a forward of K + 1 tokens reads them
once for all K + 1 positions. So a proposer guesses K tokens, the target runs ONE pass over
[last token, guess 1 .. guess K], and keeps the longest run of guesses it agrees with plus
one token of its own: between 1 and K + 1 tokens a pass. Where the native step runs the
target (native_decode), the pass is NativeDecoder.verify: ONE decode.c call with K + 1
"virtual rows" of the one cache row, whose logits are bit for bit those of K + 1 sequential
native steps (its matrix kernels are batch invariant), so greedy speculation gives exactly
plain greedy's tokens on quantized models too. Elsewhere the eager layers run it
(`model(ids, cache, all_logits=True)`; block weights through the integer kernel for up to
64 rows), equal to the eager step up to the last bits.

Proposers:
- `Draft`: a second, smaller model with its own KV cache (same token ids as the target).
- `Lookup`: prompt lookup (n-gram drafting, llama.cpp's ngram-simple, transformers'
  prompt_lookup_num_tokens): the longest n-gram (n = 3, 2, 1) that ends the text so far and
  occurred before, in the prompt or the generated text; its most recent earlier occurrence's
  continuation is the guess. No second model; free to compute.

Acceptance (`verify`):
- greedy: a guess is kept while it equals the target's argmax at its position; the target's
  argmax after the last kept guess is the extra token. Identical tokens to decoding without
  speculation (bit for bit through the native verify; through the eager pass up to the last
  bits of a K + 1-token pass against a one-token step).
- sampling (Leviathan et al. 2023, Chen et al. 2023): keep guess d with probability
  min(1, p(d) / q(d)); on rejection draw from norm(max(0, p − q)) and stop; after K kept
  guesses draw the extra token from p. p and q are the target's and the proposer's
  distributions after the row's whole processing (repetition penalty, temperature, top-k,
  top-p, min-p: sampling.Sampler.distribution), so the kept tokens follow exactly the
  distribution decoding without speculation samples from. A deterministic proposer (lookup)
  has q one-hot. Every draw comes from the row's seeded generator: a seed reproduces a run.

Rollback: after a pass, the target's cache is truncated to the tokens kept (KVCache.length;
the columns beyond are dead and overwritten by the next writes), and the draft's cache to the
longest prefix it shares with the text. A chat turn after a speculative turn reuses the cache
exactly as after a plain one.

How many tokens to propose (`Adaptive`): from the acceptance rate a (a Beta prior's mean,
updated by every pass: a kept guess counts as a success, the first rejected one of a pass as a
failure; the guesses after it are never judged; LOOKUP_PRIOR, DRAFT_PRIOR), the measured time of a draft step c, of a verify pass v(K) (a line fitted to
the sizes measured) and of a plain decode step s, the expected tokens of a pass with K guesses
are (1 − a^(K+1)) / (1 − a) (Leviathan et al.), so the rate is that over K·c + v(K); K in 1..8
maximizes it, or no drafting where the best rate is below 1 / s. While not drafting, a pass
with guesses is retried after 8, 16, ..., 128 plain steps to see whether things changed.
`draft_tokens` fixes K.

A draft model with adaptive K is planned before it runs (Speculator): the probes' verify
passes take free guesses (lookup's, padded), the draft's step is timed once on a dummy cache,
and where no K pays at the acceptance the draft is expected to have (the prior's mean, never
100%: or what the draft's last requests measured), or what it saves over the tokens left does
not repay the draft's prefill (estimated from the target's prefill rate), drafting is off for
the request: the draft is never prefilled, and one Notice says why. Once drafting, the
prefill is paid: after every pass the posterior acceptance decides, and as soon as no K is
expected faster than plain steps drafting stops for good (plain steps would leave the draft
behind and bring no evidence that it would pay again). `predict` is the speed-up the
standard formula gives for the whole request (--json `predicted_speedup`), with the draft's
prefill, catch-ups and dummy step counted.

This module never prints; the engine yields its events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .errors import PromptError, TwiceError
from .prefix import common_prefix

MAX_DRAFT_TOKENS = 32  # --draft-tokens above this: refused
ADAPTIVE_MAX = 8  # adaptive K stays in 1..8
PROBES = (3, 6)  # the first verify sizes measured (two points for the cost line)
# The Speculator's probes: small, since a probe that is not accepted costs v(K) - s (the
# 1.5B Q4_K_M: ~0.2 steps at K = 1 against ~1.5 at K = 6); the line through them is refined
# by every later pass.
CHEAP_PROBES = (1, 3)
RETRY_FIRST, RETRY_MOST = 8, 128  # plain steps before trying guesses again (doubling)
DECAY = 0.95  # weight of the past in the acceptance counts, per pass
EMA = 0.3  # weight of a new time measurement
CATCH_UP_NATIVE = 16  # a draft's catch-up of at most this many tokens: priced as that many draft steps
# Where the native step runs a draft, what it feeds (its prefill, its catch-ups) goes through the
# native virtual rows (NativeDecoder.prefill, native_decode.PREFILL_CHUNK a call): the 0.5B
# Q4_K_M's prefill of 81 tokens, 1 thread, took 1.6-2.2 s so against 3.0-4.3 s through the eager
# layers, 0.21-0.29 of a draft step a token: NATIVE_ROW_SHARE prices a prefill at least that before
# the draft has measured its own (Draft.prefill_rate).
NATIVE_ROW_SHARE = 0.3
STEADY_CATCH_UP = 2  # a draft's catch-up after a verify pass: its last guess and the model's token
MARGIN = 1.05  # drafting is chosen only where it is expected this much faster than plain steps
# Acceptance priors: Beta pseudo-counts (kept, judged guesses), updated by every pass (Adaptive).
# Lookup: 1/2 worth one judged guess (its guesses are free, a probe that fails costs little).
# A draft: what a plan judges the draft's prefill and each K at before any draft pass has run
# (never 100%: see the module doc), worth four judged guesses so that a few passes of evidence
# outweigh it. Measured per-position acceptance of Qwen2.5-Coder-0.5B drafting the 1.5B (Q4_K_M,
# greedy, K = 3, 64 tokens, scripts/bench_speculative.py's prompts): prose 0.60, code writing
# 0.86, a code edit 1.00; the prior takes the lowest (a prefill paid for nothing costs more
# than a drafting chance missed).
LOOKUP_PRIOR = (0.5, 1.0)
DRAFT_PRIOR = (2.4, 4.0)  # mean 0.6


class DraftError(TwiceError):
    """A draft model that cannot serve this target (vocabularies disagree)."""


def check_draft_tokens(k: int | None) -> None:
    if k is not None and not (isinstance(k, int) and 1 <= k <= MAX_DRAFT_TOKENS):
        raise PromptError(f"--draft-tokens must be between 1 and {MAX_DRAFT_TOKENS} (default: adaptive), got {k}")


def check_vocabularies(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """The draft proposes token ids the target reads as the same tokens: every token both
    tokenizers have must have the same id in both, and every id the target's tokenizer makes
    must be one the draft has. A larger draft vocabulary (padding, extra tokens) is fine."""
    t, d = target_tokenizer.hf.get_vocab(with_added_tokens=True), draft_tokenizer.hf.get_vocab(with_added_tokens=True)
    for token, i in t.items():
        j = d.get(token)
        if j is not None and j != i:
            raise DraftError(f"the draft model's tokenizer gives {token!r} the id {j:,}, the model's gives it {i:,}: "
                             "a draft must share the model's vocabulary")
    largest = max(t.values(), default=-1)
    if largest >= draft_vocab:
        raise DraftError(f"the draft model's vocabulary has {draft_vocab:,} ids, the model's tokenizer uses ids up to "
                         f"{largest:,}: a draft must share the model's vocabulary")
    missing = [token for token in t if token not in d]
    if missing:
        raise DraftError(f"the draft model's tokenizer lacks {len(missing):,} of the model's tokens (e.g. "
                         f"{missing[0]!r}): a draft must share the model's vocabulary")


# -- statistics ------------------------------------------------------------------------
@dataclass
class SpeculationStats:
    proposer: str  # "draft" | "lookup"
    proposed: int = 0  # guesses verified
    accepted: int = 0  # of those, kept
    passes: int = 0  # target forward passes after the first token (verify passes + plain steps)
    verify_passes: int = 0
    tokens: int = 0  # tokens those passes produced
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_seconds: float = 0.0
    fixed_k: int | None = None
    k_used: dict = field(default_factory=dict)  # K -> passes with that many guesses (0: plain steps)
    probe_passes: int = 0  # verify passes of free guesses that measured v(K) before the draft ran (Plan)
    probe_seconds: float = 0.0
    probe_tokens: int = 0  # tokens the probe passes yielded
    rejected: int = 0  # verify passes that rejected a guess (judged guesses = accepted + rejected)
    plan_seconds: float = 0.0  # the draft's dummy step (Draft.step_seconds), part of draft_seconds
    catch_up_seconds: float = 0.0  # the draft's prefill and catch-ups longer than STEADY_CATCH_UP, part of draft_seconds
    catch_up_tokens: int = 0
    off: str | None = None  # why drafting stopped for good ("drafting off: ..."), said once

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    @property
    def mean_accepted_run(self) -> float:
        """Guesses kept per verify pass."""
        return self.accepted / self.verify_passes if self.verify_passes else 0.0

    @property
    def judged(self) -> int:
        """Guesses whose fate says something of the acceptance: the kept ones and, per pass,
        the first rejected one (the guesses after it are never judged)."""
        return self.accepted + self.rejected

    @property
    def plain_steps(self) -> int:
        return self.k_used.get(0, 0)

    def to_dict(self, decode_seconds: float = 0.0, generated: int = 0) -> dict:
        n = generated - 1
        without = decode_seconds - self.draft_seconds
        d = {
            "proposer": self.proposer,
            "draft_tokens": self.fixed_k if self.fixed_k is not None else "adaptive",
            "proposals": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_run": self.mean_accepted_run,
            "target_passes": self.passes,
            "verify_passes": self.verify_passes,
            "tokens_per_target_pass": self.tokens_per_pass,
            "draft_s": self.draft_seconds,
            "verify_s": self.verify_seconds,
            "plain_step_s": self.plain_seconds,
            "k_used": {str(k): v for k, v in sorted(self.k_used.items())},
            "probe_passes": self.probe_passes,
            "probe_s": self.probe_seconds,
            "drafting_off": self.off,
            "judged": self.judged,
            "catch_up_s": self.catch_up_seconds,
            "catch_up_tokens": self.catch_up_tokens,
            "plan_s": self.plan_seconds,
            "probe_tokens": self.probe_tokens,
            "decode_tokens_per_s": n / decode_seconds if n > 0 and decode_seconds > 0 else None,
            "decode_tokens_per_s_without_draft": n / without if n > 0 and without > 0 else None,
        }
        d["prediction"] = pred = predict_run(d)
        d["predicted_speedup"] = pred["speedup"] if pred else None
        return d


def predict_run(spec: dict, step: float | None = None) -> dict | None:
    """`predict` for a request from its counts (SpeculationStats.to_dict's keys): the
    acceptance per judged guess, the draft's steady cost per guess (its time less the prefill,
    the long catch-ups and the dummy step, which count apart), the mean verify pass. step: the
    plain decode step it is judged against (default: this request's own plain steps' mean;
    None, no prediction, when it had none and no step is given)."""
    k_used = {int(k): n for k, n in spec["k_used"].items()}
    plain = k_used.pop(0, 0)
    if step is None:
        step = spec["plain_step_s"] / plain if plain else None
    if not step:
        return None
    proposed, judged = spec["proposals"], spec.get("judged", 0)
    fixed = spec.get("plan_s", 0.0) + spec.get("catch_up_s", 0.0)
    draft = spec["draft_s"] - fixed
    return predict(step, plain_steps=plain, probe_tokens=spec.get("probe_tokens", 0),
                   probe_seconds=spec.get("probe_s", 0.0), k_used=k_used,
                   acceptance=spec["accepted"] / judged if judged else 0.0,
                   draft_per_guess=draft / proposed if proposed else 0.0,
                   verify_per_pass=spec["verify_s"] / spec["verify_passes"] if spec["verify_passes"] else 0.0,
                   catch_up_seconds=fixed + (draft if not proposed else 0.0))


# -- choosing K ------------------------------------------------------------------------
def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify pass with k guesses yields when each guess is kept with probability a."""
    a = min(max(a, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def predicted_speedup(a: float, k: int, draft_step: float, verify: float, step: float) -> float:
    """The standard formula: tokens per pass over the pass's cost, against one token a step."""
    return expected_tokens(a, k) * step / (k * draft_step + verify)


def predict(step: float, *, plain_steps: int = 0, probe_tokens: int = 0, probe_seconds: float = 0.0,
            k_used: dict | None = None, acceptance: float = 0.0, draft_per_guess: float = 0.0,
            verify_per_pass: float = 0.0, catch_up_seconds: float = 0.0) -> dict:
    """The speed-up over plain decoding the standard formula predicts for a whole request,
    with what a steady-state formula leaves out:

        tokens  = plain steps + probe tokens + Σ_K passes_K · (1 − a^(K+1)) / (1 − a)
        seconds = plain steps · s + probe seconds + Σ_K passes_K · (K · c + v)
                  + catch-up (the draft's prefill, its catch-ups after plain steps, its dummy step)
        speed-up = tokens · s / seconds

    a: the acceptance per judged guess, c: the draft's steady cost per guess (its steps and
    the 1–2 token catch-up of each pass), v: a verify pass, s: a plain step. Returns the terms
    and the speed-up (1.0 for a request with no tokens after the first)."""
    k_used = k_used or {}
    passes = sum(k_used.values())
    guesses = sum(k * n for k, n in k_used.items())
    tokens = plain_steps + probe_tokens + sum(n * expected_tokens(acceptance, k) for k, n in k_used.items())
    seconds = (plain_steps * step + probe_seconds + guesses * draft_per_guess + passes * verify_per_pass
               + catch_up_seconds)
    return {"speedup": tokens * step / seconds if seconds > 0 else 1.0, "step_s": step, "acceptance": acceptance,
            "mean_k": guesses / passes if passes else 0.0, "draft_s_per_guess": draft_per_guess,
            "verify_s_per_pass": verify_per_pass, "catch_up_s": catch_up_seconds, "expected_tokens": tokens,
            "seconds": seconds}


class Adaptive:
    """Chooses the number of guesses for the next pass from measured costs (module doc)."""

    def __init__(self, fixed: int | None = None, most: int = ADAPTIVE_MAX, probes: tuple[int, ...] = PROBES,
                 prior: tuple[float, float] = LOOKUP_PRIOR):
        self.fixed, self.most, self.probes = fixed, most, probes
        self.step: float | None = None  # plain decode step, seconds
        self.draft: float | None = None  # one draft token, seconds
        self.verify: dict[int, float] = {}  # guesses -> verify pass seconds
        # Acceptance counts: a Beta prior's pseudo-counts (kept, judged), plus every pass's, decayed.
        self.kept, self.judged = prior
        self.evidence = 0.0  # judged guesses seen (decayed like the counts): 0 = the prior alone
        # Drafting is chosen where it is expected MARGIN faster than plain steps; once drafting,
        # kept while faster at all (`hold`, the Speculator's for a draft: a plain step makes a
        # draft fall behind, and catching up costs).
        self.hold = MARGIN
        self.plain_run = 0
        self.retry = RETRY_FIRST
        self.probing = False  # the last choose() was a probe (a first measurement or a retry), not a paying K
        self.full = 0  # K of the last pass if it kept every guess, else 0 (then one more is tried: see choose)

    @property
    def acceptance(self) -> float:
        return self.kept / self.judged

    def verify_cost(self, k: int) -> float:
        """v(k): a least-squares line over the measured sizes (through the plain step when
        only one size is measured)."""
        points = sorted(self.verify.items())
        if len(points) == 1 and self.step is not None:
            points = [(0, self.step)] + points
        if len(points) == 1:
            return points[0][1]
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = max(sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0, 0.0)  # never cheaper with more
        # A pass over k + 1 tokens costs at least a plain step (noise in the fit must not say otherwise).
        return max(my + slope * (k - mx), self.step or 0.0, 1e-9)

    def rate(self, k: int) -> float:
        """Expected tokens per second of passes with k guesses (0: plain steps)."""
        if k == 0:
            return 1.0 / self.step if self.step else 0.0
        return expected_tokens(self.acceptance, k) / (k * (self.draft or 0.0) + self.verify_cost(k))

    def best(self) -> int:
        return max(range(1, self.most + 1), key=self.rate)

    def choose(self) -> int:
        self.probing = False
        if self.fixed is not None:
            return self.fixed
        if self.step is None:
            return 0  # measure a plain step first
        for k in self.probes:
            if k not in self.verify and k <= self.most:
                self.probing = True
                return k
        k = self.best()
        if self.full >= k and self.full < self.most and self.rate(self.full + 1) > self.hold * self.rate(0):
            # Every guess of the last pass was kept: try one more, so the verify-cost line is measured
            # beyond the probes (two noisy points can make a steep line that keeps K at 1 forever).
            k = self.full + 1
        if self.rate(k) > self.hold * self.rate(0):
            self.retry = RETRY_FIRST
            return k
        if self.plain_run >= self.retry:  # look again: the text may have changed (the wait
            self.probing = True  # doubles once a pass has looked: record_pass)
            return k
        return 0

    def record_plain(self, seconds: float) -> None:
        self.step = seconds if self.step is None else (1 - EMA) * self.step + EMA * seconds
        self.plain_run += 1

    def record_pass(self, k: int, kept: int, rejected: bool, draft_seconds: float, verify_seconds: float,
                    steady: bool = True) -> None:
        """A verify pass of k guesses; the draft's cost per guess is draft_seconds / k (all of
        proposing: its steps, its catch-up of the last pass's tokens, the picking), except
        after a long catch-up (not steady: a prefill, which says nothing of a guess's cost)."""
        if self.probing and self.plain_run >= self.retry:  # a retry looked: the next one waits twice as long
            self.retry = min(2 * self.retry, RETRY_MOST)
        self.plain_run = 0
        self.full = k if kept == k else 0
        if steady:
            per = draft_seconds / k
            self.draft = per if self.draft is None else (1 - EMA) * self.draft + EMA * per
        self.record_verify(k, verify_seconds)
        self.kept = DECAY * self.kept + kept
        self.judged = DECAY * self.judged + kept + (1 if rejected else 0)
        self.evidence = DECAY * self.evidence + kept + (1 if rejected else 0)

    def record_verify(self, k: int, seconds: float) -> None:
        old = self.verify.get(k)
        self.verify[k] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def best_case(self, optimistic: bool = False, acceptance: float = 1.0) -> tuple[float, int]:
        """(speed-up over plain steps, K) at the given acceptance (default: every guess kept)
        and the measured costs (or, optimistic, with every verify pass as cheap as one plain
        step, its lower bound): below 1, drafting at that acceptance cannot pay."""
        step, c = self.step or 0.0, self.draft or 0.0

        def verify(k: int) -> float:
            return step if optimistic else self.verify_cost(k)

        return max((expected_tokens(acceptance, k) * step / (k * c + verify(k)), k) for k in range(1, self.most + 1))

    def unpaid(self, tokens_left: int | None = None, catch_up: tuple[int, float] = (0, 0.0),
               optimistic: bool = False, acceptance: float = 1.0, margin: float = 1.0) -> str | None:
        """The one-line reason drafting does not pay at any K (module doc), or None: at the
        `acceptance` (the Speculator's: the prior's mean before any draft pass, then the
        posterior's) a pass is slower than plain steps, or what drafting saves over the
        `tokens_left` does not repay catch_up = (tokens, seconds), the draft's prefill of the
        text it lacks. optimistic: before any verify pass is measured, each taken as one plain
        step (if even that does not pay, no probe is needed to know). margin: the speed-up
        drafting must be expected to beat (MARGIN to start drafting, 1 to go on)."""
        if self.step is None or (not optimistic and any(k not in self.verify for k in self.probes if k <= self.most)):
            return None
        best, k = self.best_case(optimistic, acceptance)
        n, seconds = catch_up
        saved = (tokens_left or 0) * self.step * (1.0 - 1.0 / best) if best > 1.0 else 0.0
        if best > margin and (tokens_left is None or saved >= seconds):
            return None
        v = 1.0 if optimistic else self.verify_cost(k) / self.step
        if acceptance >= 1.0:
            at = "at best, every proposal kept"
        elif self.evidence < 0.5:
            at = f"at the expected {100 * acceptance:.0f}% acceptance"
        else:
            at = f"at {100 * acceptance:.0f}% acceptance, measured over {self.evidence:.0f} recent guesses"
        words = (f"drafting off: a draft step costs {(self.draft or 0.0) / self.step:.2f} of a target step, a verify "
                 f"pass of {k + 1} {'at least ' if optimistic else ''}{v:.2f} steps ({at}, "
                 f"{best:.2f}x the model alone")
        if best > margin and tokens_left is not None:
            words += (f", saving ~{saved:.1f} s over {tokens_left} tokens, less than the draft's prefill of {n} "
                      f"tokens, ~{seconds:.1f} s")
        elif best > 1.0:
            words += f", under the {margin:.2f}x drafting must be expected to beat"
        return words + ")"


# -- proposers -------------------------------------------------------------------------
class Lookup:
    """Prompt lookup: guesses from the most recent earlier occurrence of the longest
    n-gram (3, 2, 1 tokens) that ends the text. An index of n-gram → latest start (with at
    least one token after it) grows with the text; a text that is not an extension of the
    indexed one (a new chat turn that edits the past) is indexed anew."""

    name = "lookup"
    deterministic = True
    N = (3, 2, 1)
    PROBE_N = 2  # a probe (adaptive K not yet paying) needs a match of at least this many tokens

    def __init__(self):
        self.seq: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def _extend(self, seq: list[int]) -> None:
        old = len(self.seq)
        if len(seq) < old or seq[:old] != self.seq:
            self.seq, self.index, old = [], {}, 0
        # Starts i whose n-gram has a next token: i + n < len(seq); new ones are those with
        # i + n >= old (they had no next token before).
        for n in self.N:
            for i in range(max(0, old - n), len(seq) - n):
                self.index[tuple(seq[i:i + n])] = i
        self.seq = list(seq)

    def propose(self, seq: list[int], k: int, sampler, row: int, smallest: int = 1) -> tuple[list[int], None]:
        """Up to k guesses from the longest match of at least `smallest` tokens."""
        self._extend(seq)
        for n in self.N:
            if len(seq) <= n or n < smallest:
                continue
            i = self.index.get(tuple(seq[-n:]))
            if i is not None:
                return seq[i + n:i + n + k], None
        return [], None

    def reset(self) -> None:
        self.seq, self.index = [], {}


class Draft:
    """A second model proposing by decoding greedily (or sampling, with the target's
    processing) from its own KV cache, which keeps the longest prefix of the text it
    shares with the previous call."""

    name = "draft"
    deterministic = False

    def __init__(self, model, native: bool = True, compile: bool = False):
        from .fastpath import CompiledDecoder
        from .fastpath import supported as compiled_supported
        from .native_decode import NativeDecoder
        from .native_decode import supported as native_supported

        self.model = model
        # Its fast step as the target's is chosen: native, else compiled when asked (a GPU's
        # draft: eager steps there are launch-bound, slower than the target's recorded ones).
        self.fast = (NativeDecoder(model) if native and native_supported(model)
                     else CompiledDecoder(model) if compile and compiled_supported(model) else None)
        self.compiled = isinstance(self.fast, CompiledDecoder)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.context = model.config.max_position_embeddings
        self.cache: KVCache | None = None
        self.ids: list[int] = []  # the tokens whose keys/values the cache holds
        self.measured_step: float | None = None  # one step on a short dummy cache (step_seconds)
        self.last_catch_up = 0  # tokens the last propose call fed before its first guess
        self.last_catch_up_seconds = 0.0  # and the time that took
        self.prefill_rate: float | None = None  # seconds a token of its prefills (catch-ups > CATCH_UP_NATIVE)
        # The acceptance counts (kept, judged, evidence) the next request's plan starts from:
        # the prior, then what this draft's passes accepted (Speculator keeps them up to date).
        self.acceptance_counts: tuple[float, float, float] = (*DRAFT_PRIOR, 0.0)

    def reset(self) -> None:
        self.cache, self.ids = None, []

    @torch.inference_mode()
    def step_seconds(self) -> float:
        """One draft step's time, measured once (the faster of two steps on a short dummy
        cache, never touching the draft's own cache): what a proposal costs before the draft
        has run at all, so that a draft that cannot pay is never prefilled."""
        if self.measured_step is None:
            # a compiled draft: as long as its own cache, so the same compiled step (Engine warmed it)
            size = (self.cache.capacity if self.cache is not None else self._bucket(8)) if self.compiled else 8
            cache = KVCache(self.model.config, 1, size, self.dtype, self.device, kv_heads=self.model.kv_heads)
            self._warm(cache)
            times = []
            for _ in range(2):
                t = time.perf_counter()
                self._logits([0], cache)
                times.append(time.perf_counter() - t)
            self.measured_step = min(times)
        return self.measured_step

    def _bucket(self, needed: int) -> int:
        """Columns for `needed`: steps of 64, or the compiled step's buckets; at most the draft's context."""
        from .fastpath import CAPACITY_BUCKET

        step = CAPACITY_BUCKET if self.compiled else 64
        return min(-(-needed // step) * step, self.context)

    def _warm(self, cache: KVCache) -> None:
        """A compiled draft compiled for this cache (steps and passes of several tokens)."""
        if self.compiled and self.fast.supports(cache):
            self.fast.warmup(cache, verify=True)

    def ready(self, needed: int) -> bool:
        """Its cache holds `needed` tokens and more guesses, and its step is compiled for it (or
        cannot serve it: a cache cut to a context that is no whole number of buckets)."""
        c = self.cache
        if not self.compiled:
            return True
        if c is None or self._bucket(needed + MAX_DRAFT_TOKENS) > c.capacity:
            return False
        return not self.fast.supports(c) or (self.fast.is_warm(c) and self.fast.is_warm(c, 2))

    def warm(self, needed: int) -> float:
        """A compiled draft's cache made for `needed` tokens (and a pass of guesses after them)
        and its step compiled for it, before the request's clock starts (Engine reports compile
        time on its own); returns the seconds."""
        if not self.compiled:
            return 0.0
        t = time.perf_counter()
        self._room(needed + MAX_DRAFT_TOKENS)
        self._warm(self.cache)
        return time.perf_counter() - t

    def eager(self) -> None:
        """Step with the eager layers from now on (the compiled step could not be built)."""
        self.fast, self.compiled = None, False

    def _room(self, needed: int) -> int:
        """Columns the cache can have for `needed` (at most the draft's context)."""
        want = self._bucket(needed)
        if self.cache is None:
            self.cache = KVCache(self.model.config, 1, want, self.dtype, self.device, kv_heads=self.model.kv_heads)
        else:
            self.cache.grow(want)
        return self.cache.capacity

    def _logits(self, tokens: list[int], cache: KVCache | None = None) -> torch.Tensor:
        """Feed tokens at the cache's end; the last position's logits [V] float32. Where the
        native step runs the draft, several tokens (a catch-up, a prefill) go through its
        virtual rows, NativeDecoder.prefill (the draft's proposals need not equal the eager
        layers' bit for bit: the target verifies them)."""
        cache = cache if cache is not None else self.cache
        fast = self.fast if self.fast is not None and self.fast.supports(cache) else None
        if fast is not None and self.compiled and not fast.is_warm(cache, len(tokens)):
            fast = None  # a shape it was not compiled for: eager, never a compile mid-request
        if fast is not None and len(tokens) == 1:
            out = fast(torch.tensor([tokens], device=self.device), cache)
        elif fast is not None and cache.length + len(tokens) <= cache.capacity:
            # several tokens: the native step's virtual rows, or one compiled pass
            out = (fast.verify(torch.tensor(tokens, dtype=torch.int64), cache)[-1:] if self.compiled
                   else fast.prefill(torch.tensor(tokens, dtype=torch.int64), cache))
        else:
            out = self.model(torch.tensor([tokens], device=self.device), cache)
        return out[0].float()

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, sampler, row: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to k guesses after `seq`, and (sampling) their distributions q [k, V]."""
        capacity = self._room(len(seq) + k - 1)
        k = min(k, capacity - len(seq) + 1)
        if k < 1:
            return [], None
        reused = min(common_prefix(self.ids, seq), len(seq) - 1)
        self.ids = self.ids[:reused]
        self.cache.truncate(reused)
        vocab = sampler.vocab_size
        self.last_catch_up = len(seq) - reused
        t = time.perf_counter()
        logits = self._logits(seq[reused:])
        self.last_catch_up_seconds = time.perf_counter() - t
        if self.last_catch_up > CATCH_UP_NATIVE:
            rate = self.last_catch_up_seconds / self.last_catch_up
            self.prefill_rate = rate if self.prefill_rate is None else (1 - EMA) * self.prefill_rate + EMA * rate
        self.ids = list(seq)
        greedy = sampler.params[row].greedy
        guesses: list[int] = []
        qs = []
        for j in range(k):
            logits = _fit(logits, vocab)
            if greedy:
                guesses.append(sampler.pick(row, logits, guesses))
            else:
                q = sampler.distribution(row, logits, guesses)
                qs.append(q)
                guesses.append(int(sampler.draw(row, q)))
            if j + 1 < k:
                logits = self._logits([guesses[-1]])
                self.ids.append(guesses[-1])
        return guesses, (torch.stack(qs) if qs else None)

    def rollback(self, seq: list[int]) -> None:
        """Keep only the cached prefix `seq` starts with (the rejected guesses leave)."""
        keep = common_prefix(self.ids, seq)
        self.ids = self.ids[:keep]
        if self.cache is not None:
            self.cache.truncate(keep)


def _fit(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft's logits over the target's vocabulary (a larger draft vocabulary is cut;
    a smaller one's missing ids can never be guessed)."""
    if logits.shape[-1] == vocab:
        return logits
    if logits.shape[-1] > vocab:
        return logits[..., :vocab]
    pad = torch.full((*logits.shape[:-1], vocab - logits.shape[-1]), float("-inf"), dtype=logits.dtype,
                     device=logits.device)
    return torch.cat([logits, pad], dim=-1)


# -- verification ----------------------------------------------------------------------
def verify(sampler, row: int, logits: torch.Tensor, guesses: list[int],
           q: torch.Tensor | None) -> tuple[list[int], int]:
    """The tokens a verify pass yields and how many guesses were kept. `logits` [K+1, V]:
    the target's at [last, guess 1 .. guess K]; q [K, V] the proposer's distributions (None:
    a deterministic proposer, q one-hot)."""
    k = len(guesses)
    if sampler.params[row].greedy:
        if sampler.all_greedy:  # one argmax over all positions
            picks = sampler(logits).tolist()
        else:
            picks = [sampler.pick(row, logits[j], guesses[:j]) for j in range(k + 1)]
        n = 0
        while n < k and picks[n] == guesses[n]:
            n += 1
        return guesses[:n] + [picks[n]], n
    for j, d in enumerate(guesses):
        p = sampler.distribution(row, logits[j], guesses[:j])
        qd = float(q[j, d]) if q is not None else 1.0
        if sampler.uniform(row) * qd < float(p[d]):  # kept with probability min(1, p(d)/q(d))
            continue
        if q is not None:
            residual = torch.clamp(p - q[j].to(p.dtype), min=0.0)
        else:
            residual = p.clone()
            residual[d] = 0.0
        if not float(residual.sum()) > 0.0:  # p = q up to rounding: rejection had probability 0
            residual = p
        return guesses[:j] + [int(sampler.draw(row, residual))], j
    p = sampler.distribution(row, logits[k], guesses)
    return guesses + [int(sampler.draw(row, p))], k


def verifier(engine, cache: KVCache, count: int):
    """The engine's fast step when it runs the target on this cache and verifies `count`
    more tokens in one pass: the native step (NativeDecoder.verify) or the compiled one once
    its pass of several tokens is compiled (CompiledDecoder.verify; Engine warms it for a
    speculative request), else None (the eager layers verify)."""
    from .native_decode import NativeDecoder

    fast = engine.fast
    if fast is None or not engine._fast_ready(cache) or cache.length + count > cache.capacity:
        return None
    return fast if isinstance(fast, NativeDecoder) or fast.is_warm(cache, count) else None


def verify_logits(engine, cache: KVCache, ids: list[int]) -> torch.Tensor:
    """The target's logits [len(ids), V] at ids, fed at the cache's end in ONE pass: the
    native step's virtual rows where it runs the target (bit for bit its sequential steps,
    so greedy output equals plain greedy on quantized models too), the compiled pass where
    that runs it, else the eager layers."""
    fast = verifier(engine, cache, len(ids))
    if fast is not None:
        return fast.verify(torch.tensor(ids, dtype=torch.int64), cache)
    return engine.model(torch.tensor([ids], device=engine.device), cache, all_logits=True)[0]


# -- the decode loop -------------------------------------------------------------------
class Speculator:
    """One proposer, its K controller and statistics, serving Engine.generate.

    A draft model (adaptive K) is planned before it runs: after the first plain step, the
    verify passes at the probe sizes take free guesses (prompt lookup's, padded with the last
    token: a deterministic proposer, exact like any other) to measure v(K), and the draft's
    step is timed once on a dummy cache. When no K pays even with every guess kept
    (Adaptive.unpaid), drafting is off for the request: the draft is never prefilled and
    never catches up, and one Notice says why. The same check runs after every draft pass
    with the measured costs."""

    def __init__(self, proposer, fixed_k: int | None):
        self.proposer = proposer
        drafted = isinstance(proposer, Draft)
        counts = proposer.acceptance_counts if drafted else (*LOOKUP_PRIOR, 0.0)
        self.adaptive = Adaptive(fixed_k, probes=CHEAP_PROBES, prior=counts[:2])
        self.adaptive.evidence = counts[2]
        self.stats = SpeculationStats(proposer.name, fixed_k=fixed_k)
        self.planning = fixed_k is None and drafted
        self.free = Lookup() if self.planning else None
        self.notice: str | None = None  # set once when drafting turns off (decode yields it)
        self.prefill_per_token = 0.0  # the target's prefill seconds per prompt token (decode sets it)

    def _catch_up(self, seq: list[int]) -> tuple[int, float]:
        """(tokens, estimated seconds) of the draft's prefill of what of `seq` it lacks: at
        the rate its own prefills measured (Draft.prefill_rate), else the target's prefill
        rate times the draft's cost relative to a target step, and where the native step runs
        the draft at least NATIVE_ROW_SHARE of a draft step a token."""
        n = len(seq) - min(common_prefix(self.proposer.ids, seq), len(seq) - 1)
        c = self.adaptive.draft or 0.0
        if n <= CATCH_UP_NATIVE:
            return n, n * c
        rate = getattr(self.proposer, "prefill_rate", None)
        if rate is None:
            ratio = c / self.adaptive.step if self.adaptive.step else 1.0
            rate = self.prefill_per_token * ratio
            if getattr(self.proposer, "fast", None) is not None:
                rate = max(rate, NATIVE_ROW_SHARE * c)
        return n, n * rate

    def _plain(self, engine, seq: list[int], cache: KVCache, sampler, draft_seconds: float = 0.0):
        s = self.stats
        t = time.perf_counter()
        chosen = engine._step(torch.tensor([[seq[-1]]], device=engine.device), cache, sampler)
        token = int(chosen[0])
        seconds = time.perf_counter() - t
        self.adaptive.record_plain(seconds)
        s.passes, s.tokens, s.plain_seconds = s.passes + 1, s.tokens + 1, s.plain_seconds + seconds
        s.draft_seconds += draft_seconds
        s.k_used[0] = s.k_used.get(0, 0) + 1
        return [token], seconds + draft_seconds

    def _verify(self, engine, seq: list[int], cache: KVCache, sampler, guesses: list[int], q):
        start = cache.length
        t = time.perf_counter()
        with torch.inference_mode(), engine._out_of_memory(cache, f"verifying {len(guesses)} proposed tokens at "
                                                                  f"{cache.length} tokens"):
            logits = verify_logits(engine, cache, [seq[-1], *guesses])
            tokens, kept = verify(sampler, 0, logits, guesses, q)
            cache.truncate(start + 1 + kept)
            for tok in tokens:
                sampler.observe(torch.tensor([tok], device=engine.device))
        return tokens, kept, time.perf_counter() - t

    def _stop(self, reason: str) -> None:
        self.stats.off = self.notice = reason

    def round(self, engine, seq: list[int], cache: KVCache, sampler, room: int) -> tuple[list[int], float]:
        """One target pass after `seq` (the cache holds all of it but its last token), with
        at most `room` guesses: (the tokens it yields, seconds)."""
        if self.stats.off is not None:
            return self._plain(engine, seq, cache, sampler)
        k = min(self.adaptive.choose(), room)
        s = self.stats
        if k > 0 and self.planning:
            if self.adaptive.draft is None:  # the draft's step, timed once; then the bound needing no probe
                t = time.perf_counter()
                self.adaptive.draft = self.proposer.step_seconds()
                seconds = time.perf_counter() - t
                s.draft_seconds, s.plan_seconds = s.draft_seconds + seconds, s.plan_seconds + seconds
                if (reason := self.adaptive.unpaid(room + 1, self._catch_up(seq), optimistic=True,
                                                   acceptance=self.adaptive.acceptance, margin=MARGIN)) is not None:
                    self.planning, self.free = False, None
                    self._stop(reason)
                    return self._plain(engine, seq, cache, sampler)
            if any(p not in self.adaptive.verify for p in self.adaptive.probes if p <= self.adaptive.most):
                guesses, _ = self.free.propose(seq, k, sampler, 0)
                guesses = (guesses + [seq[-1]] * k)[:k]
                tokens, _, seconds = self._verify(engine, seq, cache, sampler, guesses, None)
                self.adaptive.record_verify(len(guesses), seconds)
                s.passes, s.tokens = s.passes + 1, s.tokens + len(tokens)
                s.probe_passes, s.probe_seconds = s.probe_passes + 1, s.probe_seconds + seconds
                s.probe_tokens += len(tokens)
                return tokens, seconds
            self.planning, self.free = False, None
            if (reason := self.adaptive.unpaid(room + 1, self._catch_up(seq), acceptance=self.adaptive.acceptance,
                                               margin=MARGIN)) is not None:
                self._stop(reason)
                return self._plain(engine, seq, cache, sampler)
            self.adaptive.hold = 1.0  # drafting: kept while it is expected faster at all
            k = min(self.adaptive.choose(), room)
        guesses, q, draft_seconds = [], None, 0.0
        t0 = time.perf_counter()
        if k > 0:
            if isinstance(self.proposer, Lookup):  # a 1-token match is too weak a hint to pay a probe for
                smallest = Lookup.PROBE_N if self.adaptive.probing else 1
                guesses, q = self.proposer.propose(seq, k, sampler, 0, smallest)
            else:
                guesses, q = self.proposer.propose(seq, k, sampler, 0)
            draft_seconds = time.perf_counter() - t0
        if not guesses:
            return self._plain(engine, seq, cache, sampler, draft_seconds)
        tokens, kept, verify_seconds = self._verify(engine, seq, cache, sampler, guesses, q)
        drafted = isinstance(self.proposer, Draft)
        steady = not drafted or self.proposer.last_catch_up <= STEADY_CATCH_UP
        if drafted:
            self.proposer.rollback(seq + tokens)
            if not steady:  # a prefill, or a catch-up after plain steps: its own term of the prediction
                s.catch_up_seconds += self.proposer.last_catch_up_seconds
                s.catch_up_tokens += self.proposer.last_catch_up
        self.adaptive.record_pass(len(guesses), kept, kept < len(guesses), draft_seconds, verify_seconds,
                                  steady=steady)
        s.proposed, s.accepted, s.rejected = s.proposed + len(guesses), s.accepted + kept, \
            s.rejected + (kept < len(guesses))
        s.passes, s.verify_passes, s.tokens = s.passes + 1, s.verify_passes + 1, s.tokens + len(tokens)
        s.draft_seconds, s.verify_seconds = s.draft_seconds + draft_seconds, s.verify_seconds + verify_seconds
        s.k_used[len(guesses)] = s.k_used.get(len(guesses), 0) + 1
        if drafted:
            a = self.adaptive
            self.proposer.acceptance_counts = (a.kept, a.judged, a.evidence)  # the next request's prior
            # The prefill is paid: drafting goes on while the posterior acceptance says the
            # passes to come are faster than plain steps, and stops for good once it is not
            # (a plain step would leave the draft behind; no evidence comes while not drafting).
            if a.fixed is None and (reason := a.unpaid(room + 1, acceptance=a.acceptance)) is not None:
                self._stop(reason)
        return tokens, draft_seconds + verify_seconds


def decode(engine, row, cache: KVCache, sampler, logits: torch.Tensor, start: float, prefill_seconds: float,
           speculator: Speculator):
    """Engine.generate's decode loop with speculation (one row, the session cache): the
    same events as the plain loop, several tokens per target pass. A stop string or an
    end-of-turn token inside a kept run ends generation at that token; max_new_tokens is
    never exceeded (a pass proposes at most the tokens left less one)."""
    from .engine import Done, Notice, TokenEvent

    with torch.inference_mode():
        chosen = sampler(logits)
        sampler.observe(chosen)
    pending = [int(chosen[0])]
    step_seconds = prefill_seconds
    speculator.prefill_per_token = prefill_seconds / max(1, len(row.ids) - row.reused)
    while True:
        now = time.perf_counter()
        for token in pending:
            text = engine._accept(row, token, now, step_seconds)
            yield TokenEvent(row.index, token, text, len(row.generated) - 1, step_seconds, now - start,
                             engine.cache_stats(cache), speculator.stats)
            if row.finish:
                break
        seq = row.ids + row.generated
        if row.finish:
            # As after a plain decode: the cache holds the text but its last token.
            cache.truncate(len(seq) - 1)
            engine.cached_ids = seq[:cache.length]
            result = engine._result(row, cache, start, prefill_seconds, 0)
            result.speculation = speculator.stats.to_dict(result.decode_seconds, result.generated_tokens)
            yield Done(row.index, result)
            return
        room = row.max_new - len(row.generated) - 1
        pending, seconds = speculator.round(engine, seq, cache, sampler, room)
        if speculator.notice is not None:
            yield Notice(speculator.notice)
            speculator.notice = None
        engine.cached_ids = (seq + pending)[:cache.length]
        step_seconds = seconds / len(pending)
