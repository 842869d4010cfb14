"""The draft plan and the online back-off of core/speculative.py (issue 16), with injected
costs and acceptances: no model runs and no time is measured. A fake clock replaces the
module's perf_counter; the fake target's plain step, verify pass and the fake draft's steps
advance it by the costs a test gives, so the Speculator's own timing code measures exactly
those. The target's text is token 1000 + position; the draft guesses it right or wrong as the
test says."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from twice.cli.report import speculation_line, speculation_rows
from twice.core import speculative
from twice.core.speculative import Adaptive, Speculator, expected_tokens, predict, predict_run

PROMPT = list(range(40))


def truth(position: int) -> int:
    return 1000 + position


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeEngine:
    device = "cpu"

    def __init__(self, clock: Clock, step: float):
        self.clock, self.step, self.next = clock, step, None

    def _step(self, ids, cache, sampler):
        self.clock.advance(self.step)
        return torch.tensor([self.next])


class FakeDraft(speculative.Draft):
    """A draft whose step costs `c`, whose prefill costs `prefill` a token, and whose guesses
    are right where right(pass, j) says."""

    def __init__(self, clock: Clock, c: float, prefill: float, right):
        self.clock, self.c, self.prefill, self.right = clock, c, prefill, right
        self.ids, self.cache, self.measured_step = [], None, None
        self.last_catch_up, self.last_catch_up_seconds = 0, 0.0
        self.prefill_rate, self.fast = None, None
        self.acceptance_counts = (*speculative.DRAFT_PRIOR, 0.0)
        self.calls = 0  # propose calls
        self.prefills = 0  # propose calls that fed more than a catch-up

    def step_seconds(self) -> float:
        self.clock.advance(self.c)
        self.measured_step = self.c
        return self.c

    def propose(self, seq, k, sampler, row):
        reused = min(speculative.common_prefix(self.ids, seq), len(seq) - 1)
        n = len(seq) - reused
        cost = n * self.prefill if n > speculative.CATCH_UP_NATIVE else self.c  # one native call
        self.prefills += n > speculative.CATCH_UP_NATIVE
        self.clock.advance(cost)
        self.last_catch_up, self.last_catch_up_seconds = n, cost
        self.clock.advance((k - 1) * self.c)
        guesses = [truth(len(seq) + j) if self.right(self.calls, j) else -1 for j in range(k)]
        self.calls += 1
        self.ids = list(seq) + guesses[:-1]
        return guesses, None

    def rollback(self, seq):
        self.ids = self.ids[:speculative.common_prefix(self.ids, seq)]


class Run(Speculator):
    """The Speculator with the target's verify pass injected: v(K) = step · (1 + slope · K)."""

    def __init__(self, proposer, clock: Clock, step: float, slope: float, fixed_k=None):
        super().__init__(proposer, fixed_k)
        self.clock, self.v = clock, lambda k: step * (1 + slope * k)

    def _verify(self, engine, seq, cache, sampler, guesses, q):
        kept = 0
        while kept < len(guesses) and guesses[kept] == truth(len(seq) + kept):
            kept += 1
        seconds = self.v(len(guesses))
        self.clock.advance(seconds)
        return [truth(len(seq) + j) for j in range(kept + 1)], kept, seconds


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(speculative, "time", SimpleNamespace(perf_counter=c))
    return c


def generate(clock, draft, *, step=1.0, slope=0.05, prefill=0.1, tokens=64, prompt=PROMPT):
    """decode()'s loop over a Speculator with injected costs: (the speculator, the rounds' K,
    the measured speed-up over plain steps)."""
    spec = Run(draft, clock, step, slope)
    spec.prefill_per_token = prefill
    engine = FakeEngine(clock, step)
    seq = list(prompt) + [truth(len(prompt))]
    start, ks, notices = clock.t, [], 0  # ks: the guesses verified in each round
    while len(seq) - len(prompt) < tokens:
        room = tokens - (len(seq) - len(prompt)) - 1
        engine.next = truth(len(seq))
        before = spec.stats.proposed
        out, _ = spec.round(engine, seq, None, None, room)
        ks.append(spec.stats.proposed - before)
        notices += spec.notice is not None
        spec.notice = None
        assert out == [truth(len(seq) + j) for j in range(len(out))]  # the target's own tokens, always
        seq += out
    assert notices <= 1
    generated = len(seq) - len(prompt) - 1  # after the first token (the prefill's)
    return spec, ks, generated * step / (clock.t - start)


# -- the plan judges at a realistic acceptance ----------------------------------------------------
def test_a_prefill_that_only_a_perfect_draft_would_repay_is_never_paid(clock):
    """c = 0.3 steps, v(K) = 1 + 0.1 K, a 40-token prompt whose draft prefill is ~5 steps, 32
    tokens: with every guess kept the best K saves ~17 steps (the old plan drafted), at the
    prior's 60% the best (K = 1, 1.14x) saves ~3.9: less than the prefill, so the draft never runs."""
    draft = FakeDraft(clock, c=0.3, prefill=0.42 * 0.3, right=lambda p, j: True)
    spec, ks, _ = generate(clock, draft, slope=0.1, prefill=0.42, tokens=32)
    s = spec.stats
    assert draft.calls == 0 and draft.prefills == 0  # never prefilled
    assert s.off.startswith("drafting off: a draft step costs 0.30 of a target step")
    assert "at the expected 60% acceptance" in s.off and "less than the draft's prefill of 44 tokens" in s.off
    assert s.probe_passes == len(speculative.CHEAP_PROBES) and s.proposed == 0
    a = spec.adaptive
    assert a.unpaid(31, spec._catch_up(PROMPT + [1]), acceptance=1.0) is None  # judged at 100%: it would draft
    best, k = a.best_case(acceptance=0.6)
    assert k == 1 and best == pytest.approx(1.6 / 1.4)


def test_a_draft_that_cannot_pay_at_the_expected_acceptance_is_off_before_any_probe(clock):
    """A draft step at 0.7 target steps: even with every verify pass as cheap as a step (its
    lower bound) the best K at the prior's 60% is K = 1 at 1.6 / 1.7 = 0.94x: no probe runs."""
    draft = FakeDraft(clock, c=0.7, prefill=0.1, right=lambda p, j: True)
    spec, _, speedup = generate(clock, draft, tokens=32)
    assert spec.stats.probe_passes == 0 and draft.calls == 0
    assert "at least 1.00 steps (at the expected 60% acceptance" in spec.stats.off
    assert speedup == pytest.approx(31 / (31 + 0.7))  # only the dummy step was paid


# -- the back-off ---------------------------------------------------------------------------------
def test_low_acceptance_stops_drafting_within_four_passes_and_for_good(clock):
    """Draft 0.2 steps, verify 1 + 0.1 K: the prior's 60% pays (K = 1: 1.6 / 1.3 = 1.23x), so
    the draft is prefilled and drafts. Every guess wrong: K = 1 pays while a > 0.3; the posterior
    (2.4, 4) decayed by 0.95 a pass plus one rejection a pass is 47.5%, 39%, 32.7%, then 28%
    after the fourth pass: off, and never restarted (plain steps only, the draft never called)."""
    draft = FakeDraft(clock, c=0.2, prefill=0.01, right=lambda p, j: False)
    spec, ks, speedup = generate(clock, draft, slope=0.1)
    s = spec.stats
    assert draft.prefills == 1 and s.verify_passes == 4 and draft.calls == 4
    assert s.off is not None and "at 28% acceptance, measured over 4 recent guesses" in s.off
    a = spec.adaptive
    x = 0.95 ** 4
    assert a.acceptance == pytest.approx(2.4 * x / (4 * x + (1 - x) / 0.05))
    drafted = [i for i, k in enumerate(ks) if k]
    assert len(drafted) == 4 and not any(ks[drafted[-1] + 1:])  # after the fourth pass: plain steps only
    assert s.k_used[0] == 64 - 1 - s.probe_tokens - 4  # every other token from a plain step
    # The next request starts from that evidence: drafting does not restart, not even a prefill.
    calls = draft.calls
    again, _, _ = generate(clock, draft, slope=0.1)
    assert draft.calls == calls and again.stats.off is not None and again.stats.probe_passes <= 2
    # What it cost: the dummy step, two probes, the prefill and four failed passes.
    assert speedup > 0.9


def test_high_acceptance_keeps_drafting_and_k_grows(clock):
    draft = FakeDraft(clock, c=0.05, prefill=0.01, right=lambda p, j: True)
    spec, ks, speedup = generate(clock, draft)
    s = spec.stats
    assert s.off is None and draft.prefills == 1
    assert s.accepted == s.proposed > 0 and s.rejected == 0
    assert max(int(k) for k in s.k_used) == speculative.ADAPTIVE_MAX
    assert s.k_used.get(0, 0) <= 2  # the first step (the plan's measurement), perhaps the last (no room)
    assert speedup > 3
    # The evidence carries to the next request: it drafts again at once.
    again, _, _ = generate(clock, draft)
    assert again.stats.off is None and again.stats.verify_passes > 0


def test_mediocre_acceptance_drafts_on_while_it_pays(clock):
    """Right 3 guesses in 4 (a = 0.75 per judged guess), cheap costs: faster than plain, on."""
    draft = FakeDraft(clock, c=0.05, prefill=0.01, right=lambda p, j: (p + j) % 4 != 3)
    spec, _, speedup = generate(clock, draft)
    assert spec.stats.off is None and speedup > 1.2


# -- the prediction -------------------------------------------------------------------------------
def test_predicted_speedup_by_hand():
    p = predict(0.1, plain_steps=3, probe_tokens=2, probe_seconds=0.25, k_used={3: 4, 2: 1}, acceptance=0.5,
                draft_per_guess=0.04, verify_per_pass=0.15, catch_up_seconds=0.6)
    tokens = 3 + 2 + 4 * (1 - 0.5 ** 4) / 0.5 + 1 * (1 - 0.5 ** 3) / 0.5  # 14.25
    seconds = 3 * 0.1 + 0.25 + (4 * 3 + 2) * 0.04 + 5 * 0.15 + 0.6  # 2.46
    assert tokens == pytest.approx(14.25) and seconds == pytest.approx(2.46)
    assert p["speedup"] == pytest.approx(tokens * 0.1 / seconds)  # 0.579
    assert p["expected_tokens"] == pytest.approx(tokens) and p["mean_k"] == pytest.approx(14 / 5)
    assert predict(0.1)["speedup"] == 1.0  # nothing generated after the first token


def test_predict_run_counts_the_prefill_catch_up_and_dummy_step_apart():
    spec = {"k_used": {"0": 3, "3": 4, "2": 1}, "plain_step_s": 0.3, "proposals": 14, "accepted": 7, "judged": 12,
            "draft_s": 0.56 + 0.5 + 0.1, "catch_up_s": 0.5, "plan_s": 0.1, "verify_s": 0.75, "verify_passes": 5,
            "probe_s": 0.25, "probe_tokens": 2}
    p = predict_run(spec)
    a = 7 / 12
    tokens = 5 + 4 * expected_tokens(a, 3) + expected_tokens(a, 2)
    assert p["draft_s_per_guess"] == pytest.approx(0.04) and p["catch_up_s"] == pytest.approx(0.6)
    assert p["speedup"] == pytest.approx(tokens * 0.1 / 2.46)
    assert predict_run(spec, step=0.2)["step_s"] == 0.2
    assert predict_run({**spec, "k_used": {"3": 4}}) is None  # no plain step and none given
    off = {**spec, "k_used": {"0": 30}, "plain_step_s": 3.0, "proposals": 0, "accepted": 0, "judged": 0,
           "draft_s": 0.1, "catch_up_s": 0.0, "verify_s": 0.0, "verify_passes": 0}
    assert predict_run(off)["speedup"] == pytest.approx(32 * 0.1 / (3.0 + 0.25 + 0.1))  # drafting off


@pytest.mark.parametrize("right", [lambda p, j: True, lambda p, j: (p + j) % 4 != 3, lambda p, j: False],
                         ids=["all", "three-in-four", "none"])
def test_the_printed_prediction_agrees_with_the_measured_speedup(clock, right):
    """The issue's 15%: the engine's prediction (its own plain step, the request's acceptance
    and costs) against the speed-up the fake clock measured."""
    spec, _, measured = generate(clock, FakeDraft(clock, c=0.05, prefill=0.01, right=right))
    d = spec.stats.to_dict()
    assert d["predicted_speedup"] == pytest.approx(measured, rel=0.15)
    assert d["catch_up_tokens"] == len(PROMPT) + 4 and d["plan_s"] == pytest.approx(0.05)


def test_the_readouts_carry_the_prediction():
    s = speculative.SpeculationStats("draft")
    s.k_used, s.plain_seconds = {0: 4}, 0.4
    d = s.to_dict(0.5, 5)
    assert speculation_line(d).endswith(", predicted 1.00x")
    import io

    from rich.console import Console
    from rich.table import Table

    t = Table("section", "what", "value", "note")
    speculation_rows(t, d)
    out = io.StringIO()
    Console(file=out, width=300).print(t)
    assert "predicted speed-up" in out.getvalue() and "1.00x" in out.getvalue()


# -- Adaptive alone -------------------------------------------------------------------------------
def test_a_draft_keeps_drafting_below_the_start_margin_lookup_does_not():
    """Once drafting, a K expected 2% faster is kept (hold = 1): a plain step would leave the
    draft behind; before drafting (and for lookup) it needs the 5% margin."""
    a = Adaptive(probes=(1,), prior=(0.5, 1.0))
    a.record_plain(1.0)
    a.draft = 0.0
    a.record_verify(1, 1.5 / 1.02)  # (1 + 0.5) / v = 1.02x
    assert a.choose() == 0
    a.hold = 1.0
    assert a.choose() == 1


def test_after_a_full_pass_a_k_that_does_not_pay_falls_back_to_the_best():
    a = Adaptive(probes=(1, 2), prior=(0.9, 1.0))
    a.record_plain(1.0)
    a.draft = 0.0
    a.record_pass(1, 1, False, 0.0, 1.0)
    a.record_pass(2, 2, False, 0.0, 10.0)  # K = 2 is very slow
    a.full = 1
    assert a.choose() == 1  # not 2 (full + 1), which does not pay, and not a plain step


# -- the draft's prefill through the native virtual rows -----------------------------------------
def test_a_native_draft_prefills_in_chunks_and_measures_its_rate(model_dirs, one_thread, monkeypatch):
    """A 150-token text: fed as native calls of at most PREFILL_CHUNK rows (not the eager
    layers), the rate of that prefill kept for the next plan."""
    from twice.core.sampling import Sampler, SamplingParams
    from twice.weights.load import load

    m = load(str(model_dirs("llama")), device="cpu", dtype="float32")
    draft = speculative.Draft(m.model)
    assert draft.fast is not None
    sizes = []
    real = type(draft.fast).virtual_rows
    monkeypatch.setattr(type(draft.fast), "virtual_rows",
                        lambda self, ids, cache, last=None: (sizes.append(ids.numel()), real(self, ids, cache, last))[1])
    seq = [(7 * i) % 200 + 3 for i in range(150)]
    sampler = Sampler([SamplingParams()], [seq], m.config.vocab_size, "cpu")
    guesses, _ = draft.propose(seq, 3, sampler, 0)
    assert sizes == [64, 64, 22] and len(guesses) == 3
    assert draft.last_catch_up == 150 and draft.prefill_rate == pytest.approx(draft.last_catch_up_seconds / 150)
