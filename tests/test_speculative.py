"""Speculative decoding (core/speculative.py, issue 16): exactness, rollback, sampling's
distribution, prompt lookup, adaptive K, and the CLI's bad inputs. Tiny random models in
float32; a draft is another tiny model with the same tokenizer (a different seed)."""

from __future__ import annotations

import pytest
import torch

import tiny
from clirun import one_error_line, run_inprocess
from twice.core.cache import KVCache
from twice.core.engine import Done, Engine, GenerationSettings, Request
from twice.core.sampling import Sampler, SamplingParams
from twice.core.speculative import Adaptive, Lookup, verify
from twice.weights.load import load

PROMPT = "def f(x):\n    return x * 2  # code"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tokenizer):
    """family -> folder of a second tiny model of that family (seed 1: it disagrees)."""
    root = tmp_path_factory.mktemp("drafts")
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = tiny.make_model(root / family, family, tokenizer, seed=1)
        return built[family]

    return get


@pytest.fixture(scope="module")
def loaded(model_dirs, drafts):
    cache = {}

    def get(kind: str, family: str = "llama", weights=None):
        key = (kind, family, weights)
        if key not in cache:
            folder = model_dirs(family) if kind == "target" else drafts(family)
            cache[key] = load(str(folder), device="cpu", dtype="float32", weights=weights)
        return cache[key]

    return get


def generate(engine, text=PROMPT, **kw):
    kw.setdefault("max_new_tokens", 24)
    kw.setdefault("ignore_eos", True)
    events = list(engine.generate(Request(text=text), GenerationSettings(**kw)))
    assert isinstance(events[-1], Done)
    return events[-1].result


def engine(m, draft=None):
    return Engine(m.model, m.tokenizer, m.eos_token_ids, draft=draft.model if draft is not None else None)


# -- exactness ---------------------------------------------------------------------------
FAMILIES = [("llama", None), ("qwen3", None), ("gpt2", None), ("llama", "q8_0")]


@pytest.mark.parametrize("family,weights", FAMILIES)
def test_greedy_output_is_identical(loaded, family, weights):
    _greedy_identity(loaded, family, weights, (1, 4, 8))


@pytest.mark.slow
@pytest.mark.parametrize("family,weights", FAMILIES)
def test_greedy_output_is_identical_at_every_k(loaded, family, weights):
    _greedy_identity(loaded, family, weights, range(1, 9))


def _greedy_identity(loaded, family, weights, ks):
    target, other = loaded("target", family, weights), loaded("draft", family)
    plain = generate(engine(target)).token_ids
    for k in ks:
        own = generate(engine(target, target), draft_tokens=k)  # the model as its own draft
        assert own.token_ids == plain, k
        assert own.speculation["acceptance_rate"] == 1.0 and own.speculation["proposals"] > 0
        bad = generate(engine(target, other), draft_tokens=k)  # a draft that disagrees
        assert bad.token_ids == plain, k
        assert bad.speculation["accepted"] < bad.speculation["proposals"]
        assert generate(engine(target), draft_tokens=k, lookup=True).token_ids == plain, k
    adaptive = generate(engine(target, other))
    assert adaptive.token_ids == plain and adaptive.speculation["draft_tokens"] == "adaptive"


def test_greedy_with_repetition_penalty_is_identical(loaded):
    target, other = loaded("target"), loaded("draft")
    s = SamplingParams(repetition_penalty=1.5)
    plain = generate(engine(target), sampling=s).token_ids
    assert generate(engine(target, target), sampling=s, draft_tokens=4).token_ids == plain
    assert generate(engine(target, other), sampling=s, draft_tokens=3).token_ids == plain


def test_max_new_tokens_and_stops_inside_an_accepted_run(loaded):
    target = loaded("target")
    plain = generate(engine(target), max_new_tokens=20)
    for n in (1, 2, 5, 9):
        r = generate(engine(target, target), max_new_tokens=n, draft_tokens=8)
        assert r.token_ids == plain.token_ids[:n] and r.finish_reason == "length"
    # A stop string that appears mid-way: generation ends at that token, as without speculation.
    stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
    want = generate(engine(target), max_new_tokens=20, stop=(stop,))
    got = generate(engine(target, target), max_new_tokens=20, stop=(stop,), draft_tokens=8)
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason) \
        and got.finish_reason == "stop"
    # An end-of-turn token inside an accepted run.
    eos = plain.token_ids[6]
    e1, e2 = engine(target), engine(target, target)
    e1.eos = e2.eos = frozenset({eos})
    want, got = generate(e1, max_new_tokens=20, ignore_eos=False), generate(e2, max_new_tokens=20, ignore_eos=False,
                                                                            draft_tokens=8)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "eos"


# -- rollback ----------------------------------------------------------------------------
def test_rollback_leaves_both_caches_as_without_speculation(loaded):
    target, other = loaded("target"), loaded("draft")
    plain, spec = engine(target), engine(target, other)
    a, b = generate(plain), generate(spec, draft_tokens=5)
    assert a.token_ids == b.token_ids
    assert spec.cached_ids == plain.cached_ids and spec.cache.length == plain.cache.length == len(plain.cached_ids)
    n = plain.cache.length
    torch.testing.assert_close(spec.cache.k[:, :, :, :n], plain.cache.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(spec.cache.v[:, :, :, :n], plain.cache.v[:, :, :, :n], atol=1e-5, rtol=1e-5)
    # The draft's cache holds a prefix of the text, equal to the draft run over that prefix alone.
    d = spec.draft
    assert d.cache.length == len(d.ids) and d.ids == spec.cached_ids[:len(d.ids)] and len(d.ids) > 0
    fresh = KVCache(other.config, 1, len(d.ids), torch.float32, "cpu")
    with torch.inference_mode():
        other.model(torch.tensor([d.ids]), fresh)
    m = len(d.ids)
    torch.testing.assert_close(d.cache.k[:, :, :, :m], fresh.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d.cache.v[:, :, :, :m], fresh.v, atol=1e-5, rtol=1e-5)
    # The next turn reuses the cache exactly as after a plain turn.
    follow = PROMPT + a.text + " and again"
    a2, b2 = generate(plain, follow), generate(spec, follow, draft_tokens=5)
    assert a2.token_ids == b2.token_ids and a2.reused_tokens == b2.reused_tokens > 0


# -- sampling ----------------------------------------------------------------------------
CHI2_CRITICAL = {5: 20.515, 7: 24.322}  # chi-square at significance 0.001


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0  # never a token the target gives no probability
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("deterministic", [False, True])
def test_speculative_sampling_follows_the_target_distribution(deterministic):
    """The first token a verify pass yields, over many seeds, is distributed as the target's
    processed distribution p (temperature, top-k, repetition penalty), whatever q proposes."""
    vocab, k, trials = 8, 2, 1500
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(k + 1, vocab, generator=g) * 2
    q_logits = torch.randn(k + 1, vocab, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_k=6, repetition_penalty=1.3, seed=0)
    sampler = Sampler([params], [[1, 2]], vocab, "cpu")
    p0 = sampler.distribution(0, p_logits[0])
    counts = torch.zeros(vocab)
    for seed in range(trials):
        sampler.generators[0].manual_seed(seed)
        guesses, qs = [], []
        for j in range(k):
            if deterministic:  # a lookup-like proposer: fixed guesses, q one-hot
                guesses.append([3, 5][j])
            else:
                q = sampler.distribution(0, q_logits[j], guesses)
                qs.append(q)
                guesses.append(int(sampler.draw(0, q)))
        tokens, kept = verify(sampler, 0, p_logits, guesses, None if deterministic else torch.stack(qs))
        assert len(tokens) == kept + 1 and tokens[:kept] == guesses[:kept]
        counts[tokens[0]] += 1
    stat, df = _chi2(counts, p0)
    assert stat < CHI2_CRITICAL[df], (stat, df, counts, p0 * trials)


def test_sampled_speculation_is_reproducible(loaded):
    target, other = loaded("target"), loaded("draft")
    s = SamplingParams(temperature=1.0, top_k=20, seed=7)
    a = generate(engine(target, other), sampling=s, draft_tokens=3)
    b = generate(engine(target, other), sampling=s, draft_tokens=3)
    assert a.token_ids == b.token_ids and a.speculation["proposals"] > 0
    c = generate(engine(target, target), sampling=s, draft_tokens=3)  # p = q: every guess is kept
    assert c.speculation["acceptance_rate"] > 0.9


# -- prompt lookup -----------------------------------------------------------------------
def test_lookup_proposes_the_latest_continuation_of_the_longest_ngram():
    look = Lookup()
    assert look.propose([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3], 3, None, 0)[0] == [4, 5, 9]
    assert look.propose([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 1, 2, 3, 4], 2, None, 0)[0] == [7, 1]  # latest 3-gram
    assert look.propose([5, 6, 7, 8, 6], 4, None, 0)[0] == [7, 8, 6]  # down to one token
    assert look.propose([5, 6, 7, 8], 4, None, 0)[0] == []  # an edit of the past: index rebuilt; no match


def test_lookup_on_a_prompt_that_repeats_itself_proposes_and_accepts(loaded):
    target = loaded("target")
    plain = engine(target)
    first = generate(plain, max_new_tokens=16)
    text = (PROMPT + first.text) * 3 + PROMPT  # the model's own continuation, repeated
    want = generate(engine(target), text, max_new_tokens=16)
    got = generate(engine(target), text, max_new_tokens=16, lookup=True)
    assert got.token_ids == want.token_ids
    s = got.speculation
    assert s["proposals"] > 0 and s["accepted"] > 0 and s["tokens_per_target_pass"] > 1


# -- adaptive K --------------------------------------------------------------------------
def test_adaptive_k_backs_off_when_drafting_does_not_pay_and_drafts_when_it_does():
    slow = Adaptive()
    slow.record_plain(1.0)
    for k in (3, 6):
        assert slow.choose() == k  # the probes
        slow.record_pass(k, 0, True, draft_seconds=0.75 * k, verify_seconds=1.1 + 0.05 * k)
    assert slow.choose() == 0
    for _ in range(7):
        slow.record_plain(1.0)
        assert slow.choose() == 0
    slow.record_plain(1.0)
    assert slow.choose() > 0  # after 8 plain steps it looks again
    fast = Adaptive()
    fast.record_plain(1.0)
    for k in (3, 6):
        assert fast.choose() == k
        fast.record_pass(k, k, False, draft_seconds=0.0, verify_seconds=1.0 + 0.02 * k)
    assert fast.choose() == 8
    assert Adaptive(fixed=5).choose() == 5


# -- the CLI -----------------------------------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--lookup", "--draft-tokens", "0"], "--draft-tokens must be between 1 and 32"),
    (["--lookup", "--draft-tokens", "33"], "--draft-tokens must be between 1 and 32"),
    (["--draft-tokens", "4"], "--draft-tokens needs --draft MODEL or --lookup"),
    (["--lookup", "--tp", "2"], "--lookup does not work with --tp"),
    (["--draft", "DRAFT", "--tp", "2"], "--draft does not work with --tp"),
    (["--draft", "DRAFT", "--lookup"], "--draft and --lookup exclude each other"),
])
@pytest.mark.parametrize("command", ["generate", "batch"])
def test_cli_refuses_bad_speculation_flags(model_dirs, drafts, capsys, tmp_path, args, words, command):
    args = [str(drafts("llama")) if a == "DRAFT" else a for a in args]
    first = ["generate", "hello"] if command == "generate" else ["batch", str(tmp_path / "in.txt")]
    (tmp_path / "in.txt").write_text("hello\n")
    r = run_inprocess([*first, "-m", str(model_dirs("llama")), *args], capsys)
    assert words in one_error_line(r)


def test_cli_draft_that_fails_to_load_fails_before_the_model(tmp_path, capsys):
    r = run_inprocess(["generate", "hi", "-m", str(tmp_path / "no-model"), "--draft", str(tmp_path / "no-draft")],
                      capsys)
    assert "no-draft" in one_error_line(r)


def test_cli_refuses_a_draft_whose_vocabulary_disagrees(model_dirs, tmp_path, capsys):
    other = tiny.Tokenizer(tiny.models.BPE())  # trained on other text: other ids for the same tokens
    other.pre_tokenizer = tiny.pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.decoder = tiny.decoders.ByteLevel()
    trainer = tiny.trainers.BpeTrainer(vocab_size=tiny.VOCAB, special_tokens=list(reversed(tiny.SPECIAL)),
                                       initial_alphabet=tiny.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    other.train_from_iterator(["zzz yyy xxx " * 50], trainer)
    draft = tiny.make_model(tmp_path / "draft", "llama", other, seed=1)
    r = run_inprocess(["generate", "hi", "-m", str(model_dirs("llama")), "--draft", str(draft), "-n", "2"], capsys)
    assert "a draft must share the model's vocabulary" in one_error_line(r)


def test_cli_generate_with_a_draft_reports_and_matches(model_dirs, drafts, capsys):
    import json

    base = ["generate", PROMPT, "-m", str(model_dirs("llama")), "-n", "12", "--temperature", "0", "--raw", "--json"]
    plain = json.loads(run_inprocess(base, capsys).out)
    r = run_inprocess([*base, "--draft", str(drafts("llama")), "--draft-tokens", "3", "--timing"], capsys)
    assert r.code == 0, r.err
    spec = json.loads(r.out)
    assert spec["token_ids"] == plain["token_ids"]
    s = spec["speculation"]
    assert s["proposer"] == "draft" and s["proposals"] > 0 and s["draft_tokens"] == 3
    assert {"accepted", "acceptance_rate", "mean_accepted_run", "draft_s", "verify_s", "decode_tokens_per_s",
            "decode_tokens_per_s_without_draft", "tokens_per_target_pass"} <= set(s)
    assert spec["settings"]["draft"] and "acceptance rate" in r.err and "speculation" in r.err


def test_cli_notes_a_draft_larger_than_the_model(model_dirs, capsys):
    small, big = model_dirs("llama"), model_dirs("llama-hd64")
    assert load(str(big), device="cpu", dtype="float32").model.weight_bytes() > \
        load(str(small), device="cpu", dtype="float32").model.weight_bytes()
    r = run_inprocess(["generate", "hi", "-m", str(small), "--draft", str(big), "-n", "3", "--temperature", "0"],
                      capsys)
    assert r.code == 0, r.err
    assert "is larger than the model" in r.err
