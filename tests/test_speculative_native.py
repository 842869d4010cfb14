"""The verify pass through the native decode step (issue 16, items 3 and 5): K + 1 tokens
as "virtual rows" of ONE decode.c call (NativeDecoder.verify) give bit for bit the logits of
K + 1 sequential native steps, so greedy speculation equals plain native greedy on quantized
models too; and what drafting costs is decided before it is paid (speculative.Plan).
Tiny random models, one torch thread."""

from __future__ import annotations

import pytest
import torch

import tiny
from test_speculative import PROMPT, engine, generate  # the engine runners (the same prompt)
from twice.core import kernels, speculative
from twice.core.cache import KVCache
from twice.core.engine import GenerationSettings, Request
from twice.core.native_decode import NativeDecoder, supported
from twice.weights.load import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")

REPEATS = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def loaded(model_dirs, tmp_path_factory, tokenizer):
    cache, drafts = {}, {}
    root = tmp_path_factory.mktemp("native-drafts")

    def get(family: str = "llama", weights=None, draft: bool = False):
        key = (family, weights, draft)
        if key not in cache:
            if draft:
                if family not in drafts:
                    drafts[family] = tiny.make_model(root / family, family, tokenizer, seed=1)
                folder = drafts[family]
            else:
                folder = model_dirs(family)
            cache[key] = load(str(folder), device="cpu", dtype="float32", weights=weights)
        return cache[key]

    return get


def _prefilled(m, rows: int = 1, capacity: int = 64, starts=None):
    cache = KVCache(m.config, rows, capacity, torch.float32, "cpu")
    with torch.inference_mode():
        m.model(torch.tensor([list(range(3, 20))] * rows), cache)
    if starts is not None:
        cache.starts = torch.tensor(starts)
    return cache


# -- the logits ----------------------------------------------------------------------------
@pytest.mark.parametrize("family,weights", [("llama", None), ("llama", "q8_0"), ("qwen3", "q4_k_m"),
                                            ("gemma3", None), ("gemma3", "q8_0"), ("mistral", "q4_k_m")])
def test_verify_equals_sequential_native_steps_bit_for_bit(loaded, family, weights):
    m = loaded(family, weights)
    assert supported(m.model)
    native = NativeDecoder(m.model)
    tokens = [42, 7, 99, 5, 13, 60, 21, 8, 77]  # K + 1 = 9 (mistral's window of 12 is crossed at 26)
    a, b = _prefilled(m), _prefilled(m)
    with torch.inference_mode():
        steps = torch.cat([native(torch.tensor([[t]]), a) for t in tokens])
        one = native.verify(torch.tensor(tokens), b)
    assert torch.equal(one, steps)
    assert a.length == b.length == 17 + len(tokens)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)  # the same keys/values, written once each


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_verify_equals_steps_on_a_block_kv_cache(loaded, kv):
    """--kv-dtype q8_0 / q4_0: every virtual row's keys/values are quantized once when written,
    before any row attends, as each step's are."""
    m = loaded("qwen3-hd128", "q8_0")
    native = NativeDecoder(m.model)

    def cache():
        c = KVCache(m.config, 1, 64, torch.float32, "cpu", kv_dtype=kv)
        with torch.inference_mode():
            m.model(torch.tensor([list(range(3, 20))]), c)
        return c

    a, b = cache(), cache()
    assert native.supports(a)
    with torch.inference_mode():
        steps = torch.cat([native(torch.tensor([[t]]), a) for t in (9, 8, 7, 6, 5)])
        one = native.verify(torch.tensor([9, 8, 7, 6, 5]), b)
    assert torch.equal(one, steps) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_verify_with_two_threads_equals_steps(loaded):
    m = loaded("llama", "q8_0")
    native = NativeDecoder(m.model)
    a, b = _prefilled(m), _prefilled(m)
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            steps = torch.cat([native(torch.tensor([[t]]), a) for t in (4, 5, 6, 7)])
            one = native.verify(torch.tensor([4, 5, 6, 7]), b)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, steps)


def test_virtual_rows_of_one_row_of_a_padded_cache(loaded):
    """decode_step's cache_rows/columns: three input rows all reading and writing cache row 1
    of a two-row left-padded cache give that row's logits of three batch steps; row 0's
    columns are left alone."""
    m = loaded("qwen3", "q8_0")
    native = NativeDecoder(m.model)
    a, b = _prefilled(m, rows=2, starts=[0, 4]), _prefilled(m, rows=2, starts=[0, 4])
    before = b.k[:, 0].clone()
    tokens = [11, 12, 13]
    with torch.inference_mode():
        steps = torch.stack([native(torch.tensor([[9], [t]]), a)[1] for t in tokens])
        c = b.length
        one = native._step(torch.tensor(tokens), b, c, c + 3, torch.ones(3, dtype=torch.int64),
                           torch.arange(c, c + 3, dtype=torch.int64))
    assert torch.equal(one, steps)
    assert torch.equal(b.k[:, 1, :, :c + 3], a.k[:, 1, :, :c + 3])
    assert torch.equal(b.k[:, 0], before)


def test_verify_refuses_what_does_not_fit(loaded):
    m = loaded("llama")
    native = NativeDecoder(m.model)
    cache = _prefilled(m, capacity=20)
    with pytest.raises(ValueError, match="do not fit"):
        native.verify(torch.tensor([1, 2, 3, 4]), cache)
    assert cache.length == 17
    with pytest.raises(ValueError, match="outside the vocabulary"):
        native.verify(torch.tensor([1, 10 ** 6]), cache)
    with pytest.raises(ValueError, match="outside the cache"):
        native._step(torch.tensor([1]), cache, 17, 18, torch.tensor([1]), torch.tensor([17]))
    with pytest.raises(ValueError, match="batch-1"):
        native.verify(torch.tensor([1]), _prefilled(m, rows=2))
    assert cache.length == 17


# -- greedy identity through the engine ---------------------------------------------------------
@pytest.fixture
def counted(monkeypatch):
    """Calls of NativeDecoder.verify (the native verify pass ran) and of the eager verify."""
    calls = {"native": 0}
    real = NativeDecoder.verify

    def verify(self, tokens, cache):
        calls["native"] += 1
        return real(self, tokens, cache)

    monkeypatch.setattr(NativeDecoder, "verify", verify)
    return calls


@pytest.mark.parametrize("family,weights", [("llama", "q4_k_m"), ("gemma3", "q8_0")])
def test_greedy_speculation_equals_plain_native_greedy_on_quantized_models(loaded, counted, family, weights):
    target, other = loaded(family, weights), loaded(family, draft=True)
    plain_engine = engine(target)
    assert plain_engine.decode_path == "native"
    plain = generate(plain_engine).token_ids
    for k in (1, 3, 8):
        own = generate(engine(target, target), draft_tokens=k)
        assert own.token_ids == plain and own.speculation["acceptance_rate"] == 1.0, k
        bad = generate(engine(target, other), draft_tokens=k)
        assert bad.token_ids == plain, k
        assert generate(engine(target), draft_tokens=k, lookup=True).token_ids == plain, k
    assert counted["native"] > 0
    looked = generate(engine(target), text=REPEATS, lookup=True, draft_tokens=4)
    assert looked.token_ids == generate(engine(target), text=REPEATS).token_ids
    assert looked.speculation["accepted"] > 0


def test_rollback_then_continue_equals_plain(loaded):
    """Native verify passes, rejected guesses truncated: the cache is the plain run's bit for
    bit, and a second turn on top reuses it and gives the plain run's tokens."""
    target, other = loaded("llama", "q8_0"), loaded("llama", draft=True)
    plain, spec = engine(target), engine(target, other)
    a, b = generate(plain), generate(spec, draft_tokens=4)
    assert a.token_ids == b.token_ids and b.speculation["accepted"] < b.speculation["proposals"]
    n = plain.cache.length
    assert spec.cached_ids == plain.cached_ids and spec.cache.length == n
    assert torch.equal(spec.cache.k[:, :, :, :n], plain.cache.k[:, :, :, :n])
    assert torch.equal(spec.cache.v[:, :, :, :n], plain.cache.v[:, :, :, :n])
    follow = PROMPT + a.text + " and again"
    a2, b2 = generate(plain, text=follow), generate(spec, text=follow, draft_tokens=4)
    assert a2.token_ids == b2.token_ids and b2.reused_tokens == a2.reused_tokens > 0


# -- drafting that cannot pay is not paid for ----------------------------------------------------
def test_unpaid_says_when_no_k_pays_even_with_every_guess_kept():
    a = speculative.Adaptive()
    a.record_plain(1.0)
    assert a.unpaid() is None  # the verify costs are not measured yet
    for k in speculative.PROBES:
        a.record_verify(k, 1.0 + 0.5 * k)  # v(K) = 1 + K/2 steps
    a.draft = 0.75
    reason = a.unpaid()
    assert reason.startswith("drafting off: a draft step costs 0.75 of a target step, a verify pass of ")
    a.draft = 0.1  # cheap drafts: at best (K + 1) / (0.1 K + 1 + K / 2) > 1
    assert a.unpaid() is None and a.unpaid(100, (50, 20.0)) is None
    best, _ = a.best_case()
    assert best > 1.0
    reason = a.unpaid(10, (200, 60.0))  # ten tokens cannot repay a minute of prefill
    assert "less than the draft's prefill of 200 tokens" in reason


def _off_run(target, other):
    e = engine(target, other)
    events = list(e.generate(Request(text=PROMPT), GenerationSettings(max_new_tokens=24, ignore_eos=True)))
    notes = [ev.message for ev in events if type(ev).__name__ == "Notice"]
    assert len(notes) == 1 and notes[0].startswith("drafting off: a draft step costs ")
    result = events[-1].result
    assert result.speculation["drafting_off"] == notes[0] and result.speculation["proposals"] == 0
    assert e.draft.cache is None and e.draft.ids == []  # never prefilled
    return result


def test_a_draft_that_cannot_pay_is_never_prefilled(loaded, monkeypatch):
    """A draft step at 100 target steps: not even verify passes as cheap as a step would
    pay, so no probe runs; verify passes measured at 1000 s (a free draft): the two probes
    of free guesses measure that, and drafting is off after them. Either way the draft never
    runs, one Notice says why, the JSON carries it, and the tokens are the model's own."""
    target, other = loaded("llama", "q8_0"), loaded("llama", draft=True)
    plain = generate(engine(target)).token_ids
    with monkeypatch.context() as m:
        m.setattr(speculative.Draft, "step_seconds", lambda self: 100.0)
        r = _off_run(target, other)
        assert r.token_ids == plain and r.speculation["probe_passes"] == 0 and "at least 1.00 steps" in \
            r.speculation["drafting_off"]
    with monkeypatch.context() as m:
        m.setattr(speculative.Draft, "step_seconds", lambda self: 0.0)
        real = speculative.Adaptive.record_verify
        m.setattr(speculative.Adaptive, "record_verify", lambda self, k, seconds: real(self, k, 1000.0))
        r = _off_run(target, other)
        assert r.token_ids == plain and r.speculation["probe_passes"] == len(speculative.PROBES)
    # A fixed --draft-tokens is the user's choice: no plan, the draft runs.
    fixed = generate(engine(target, other), draft_tokens=2)
    assert fixed.token_ids == plain and fixed.speculation["proposals"] > 0 and fixed.speculation["drafting_off"] is None


# -- cheaper lookup probes -------------------------------------------------------------------------
def test_lookup_probes_need_a_two_token_match():
    look = speculative.Lookup()
    assert look.propose([5, 6, 7, 8, 6], 4, None, 0)[0] == [7, 8, 6]  # a 1-token match, once drafting pays
    assert look.propose([5, 6, 7, 8, 6], 4, None, 0, smallest=2)[0] == []  # not worth a probe
    assert look.propose([5, 6, 7, 8, 5, 6], 4, None, 0, smallest=2)[0] == [7, 8, 5, 6]


def test_a_retry_that_found_nothing_to_verify_waits_no_longer_and_one_that_failed_waits_twice_as_long():
    a = speculative.Adaptive()
    a.record_plain(1.0)
    for k in speculative.PROBES:
        assert a.choose() == k and a.probing
        a.record_pass(k, 0, True, draft_seconds=0.0, verify_seconds=1.5 + 0.2 * k)
    for _ in range(8):
        assert a.choose() == 0 and not a.probing
        a.record_plain(1.0)
    assert a.choose() > 0 and a.probing  # after 8 plain steps: a retry
    a.record_plain(1.0)  # nothing to propose (no match): a plain step
    k = a.choose()
    assert k > 0 and a.probing  # still retrying: the wait was not used up
    a.record_pass(k, 0, True, draft_seconds=0.0, verify_seconds=1.6)
    for _ in range(16):  # the failed retry doubled the wait
        assert a.choose() == 0
        a.record_plain(1.0)
    assert a.choose() > 0


def test_a_pass_that_kept_everything_tries_one_more_guess():
    a = speculative.Adaptive(probes=(1, 3))
    a.record_plain(1.0)
    a.record_pass(1, 1, False, draft_seconds=0.0, verify_seconds=1.05)
    a.record_pass(3, 3, False, draft_seconds=0.0, verify_seconds=3.0)  # a noisy, steep point: the fit says K=1
    a.full = 0
    assert a.choose() == 1
    a.record_pass(1, 1, False, draft_seconds=0.0, verify_seconds=1.05)
    assert a.choose() == 2  # all kept: one more
    a.record_pass(2, 1, True, draft_seconds=0.0, verify_seconds=1.1)
    assert a.choose() <= 2
