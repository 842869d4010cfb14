"""core/scheduler.py: rows join and leave a running batch; each request gets what it gets alone."""

import pytest
import torch

from twice.core import kernels
from twice.core.engine import Done, Engine, GenerationSettings, Request
from twice.core.errors import PromptError
from twice.core.sampling import SamplingParams
from twice.core.scheduler import Scheduler, Token
from twice.weights.load import load

native = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")

PROMPTS = [list(range(3, 8)), list(range(10, 29)), list(range(40, 51)), list(range(60, 62)),
           list(range(70, 84)), list(range(5, 40)), [9] * 3]
NEW = [14, 6, 11, 16, 9, 5, 12]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def llama(model_dirs):
    m = load(str(model_dirs("llama-hd64")), device="cpu", dtype="float32")
    return Engine(m.model, m.tokenizer, m.eos_token_ids)


def _alone(engine, prompts, settings):
    return [list(engine.generate(Request(ids=p), s, reuse_cache=False))[-1].result for p, s in zip(prompts, settings)]


def _served(scheduler, prompts, settings, **kw):
    ids = [scheduler.submit(p, s, **kw) for p, s in zip(prompts, settings)]
    done, tokens = {}, {i: [] for i in ids}
    for event in scheduler.run():
        if isinstance(event, Token):
            tokens[event.row].append(event.token_id)
        elif isinstance(event, Done):
            done[event.row] = event.result
    assert all(tokens[i] == done[i].token_ids for i in ids)
    return [done[i] for i in ids]


@native
@pytest.mark.parametrize("max_batch", [1, 2, 3, 8])
def test_each_request_gets_its_tokens_alone_as_rows_join_and_leave(llama, max_batch):
    """Seven prompts of 2 to 35 tokens, 5 to 16 new tokens, through batches of 1 to 8 rows:
    rows finish at different steps and waiting prompts take their places (some longer
    than the columns so far, so the cache is laid out again): greedy tokens are each
    prompt's alone, bit for bit."""
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in NEW]
    want = [r.token_ids for r in _alone(llama, PROMPTS, settings)]
    s = Scheduler(llama, max_batch=max_batch, prefix_reuse=False)
    got = _served(s, PROMPTS, settings)
    assert [r.token_ids for r in got] == want
    c = s.counters
    assert c.finished == len(PROMPTS) and c.most_running == min(max_batch, len(PROMPTS))
    if max_batch < len(PROMPTS) and max_batch > 1:
        assert c.joined_running > 0
    assert not s.has_work and s.cache is None  # every row left at the end


@native
def test_a_long_prompt_is_prefilled_in_chunks_between_the_others_decode_steps(llama):
    """A 40-token prompt arriving while two rows decode, with a 16-token chunk: it takes
    three steps to prefill, during which the running rows keep producing a token per step,
    then joins; its tokens are those of generate with --prefill-chunk 16."""
    s = Scheduler(llama, max_batch=4, prefill_chunk=16, prefix_reuse=False)
    short = [GenerationSettings(max_new_tokens=12, ignore_eos=True)] * 2
    a = [s.submit(p, st) for p, st in zip(PROMPTS[:2], short)]
    per_step = []
    while len(s.running) < 2:
        s.step()
    long = list(range(100, 140))
    b = s.submit(long, GenerationSettings(max_new_tokens=5, ignore_eos=True))
    done = {}
    while s.has_work:
        events = s.step()
        per_step.append(sum(isinstance(e, Token) and e.row in a for e in events))
        done.update({e.row: e.result for e in events if isinstance(e, Done)})
    assert per_step[:4] == [2, 2, 2, 2]  # the long prompt's prefill (16, 16, 8) never stalled them
    want = _alone(llama, [long], [GenerationSettings(max_new_tokens=5, ignore_eos=True, prefill_chunk=16)])[0]
    assert done[b].token_ids == want.token_ids
    assert s.counters.joined_running == 2 and s.counters.prefill_tokens == 5 + 19 + 40  # the 19 joined the 5 too


@native
def test_a_shared_prefix_is_copied_not_prefilled(llama):
    """Prompts that start with the same 30 tokens (a system prompt): the second copies the
    first's columns and computes only its own tail; its tokens are those of generate's own
    session reuse (the same computation as a chat's next turn)."""
    system = list(range(200, 230))
    p1, p2 = system + [1, 2, 3], system + [7, 8, 9, 10]
    st = GenerationSettings(max_new_tokens=8, ignore_eos=True)
    s = Scheduler(llama, max_batch=4)
    first = s.submit(p1, st)
    s.step()
    second = s.submit(p2, st)
    done = {e.row: e.result for e in s.run() if isinstance(e, Done)}
    assert s.counters.prefix_hits == 1 and s.counters.prefix_tokens == 30
    assert done[second].reused_tokens == 30
    list(llama.generate(Request(ids=p1), st, reuse_cache=False))
    again = list(llama.generate(Request(ids=p1[:30] + p2[30:]), st))[-1].result
    assert again.reused_tokens == 30
    assert done[second].token_ids == again.token_ids
    assert done[first].token_ids == _alone(llama, [p1], [st])[0].token_ids
    # a finished row stays a prefix source: a third request later reuses it too
    third = s.submit(system + [5], st)
    done = {e.row: e.result for e in s.run() if isinstance(e, Done)}
    assert done[third].reused_tokens == 30 and s.counters.prefix_hits == 2


@native
def test_cancel_frees_the_row_within_one_step(llama):
    s = Scheduler(llama, max_batch=2, prefix_reuse=False)
    st = GenerationSettings(max_new_tokens=50, ignore_eos=True)
    a, b = s.submit(PROMPTS[0], st), s.submit(PROMPTS[1], st)
    c = s.submit(PROMPTS[2], GenerationSettings(max_new_tokens=4, ignore_eos=True))
    for _ in range(3):
        s.step()
    assert len(s.running) == 2 and s.waiting_count == 1
    s.cancel(a)
    events = s.step()
    cancelled = [e.result for e in events if isinstance(e, Done) and e.row == a]
    assert cancelled and cancelled[0].finish_reason == "cancelled"
    assert not any(isinstance(e, Token) and e.row == a for e in events)
    done = {e.row: e.result for e in s.run() if isinstance(e, Done)}
    assert done[c].token_ids == _alone(llama, [PROMPTS[2]], [GenerationSettings(max_new_tokens=4, ignore_eos=True)])[0].token_ids
    assert s.counters.cancelled == 1 and b in done


@native
def test_per_request_sampling_seeds_stops_and_logprobs(llama):
    """Sampling rows beside greedy ones: a seeded row's tokens are those of generate with
    that seed; stop strings and max tokens end rows as generate's do; logprobs are the
    log-softmax of the model's logits (the greedy token's is the top one)."""
    sampled = GenerationSettings(max_new_tokens=10, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0.9, top_k=20, seed=7))
    greedy = GenerationSettings(max_new_tokens=7, ignore_eos=True)
    want = _alone(llama, PROMPTS[:3], [sampled, greedy, sampled])
    s = Scheduler(llama, max_batch=2, prefix_reuse=False)
    ids = [s.submit(p, st, logprobs=3) for p, st in zip(PROMPTS[:3], [sampled, greedy, sampled])]
    tokens = {i: [] for i in ids}
    done = {}
    for e in s.run():
        if isinstance(e, Token):
            tokens[e.row].append(e)
        elif isinstance(e, Done):
            done[e.row] = e.result
    assert [done[i].token_ids for i in ids] == [r.token_ids for r in want]
    for t in tokens[ids[1]]:
        assert t.top_logprobs[0][0] == t.token_id and t.logprob == pytest.approx(t.top_logprobs[0][1])
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
    text = want[1].text
    if len(text) > 3:
        stop = text[2:4]
        s2 = Scheduler(llama)
        r = s2.submit(PROMPTS[1], GenerationSettings(max_new_tokens=7, ignore_eos=True, stop=(stop,)))
        res = [e.result for e in s2.run() if isinstance(e, Done)][0]
        alone = _alone(llama, [PROMPTS[1]], [GenerationSettings(max_new_tokens=7, ignore_eos=True, stop=(stop,))])[0]
        assert (res.text, res.finish_reason) == (alone.text, alone.finish_reason) and r == 0


def test_bad_requests_are_refused_at_submit(llama):
    s = Scheduler(llama)
    with pytest.raises(PromptError, match="empty"):
        s.submit([], GenerationSettings())
    with pytest.raises(PromptError, match="context"):
        s.submit([1] * (llama.context_length + 5), GenerationSettings())
    with pytest.raises(PromptError, match="at least 1 row"):
        Scheduler(llama, max_batch=0)
    assert not s.has_work


def test_the_eager_step_serves_the_batch_too(model_dirs):
    """GPT-2 (no native step): rows join and leave through the eager layers' masks."""
    m = load(str(model_dirs("gpt2")), device="cpu", dtype="float32")
    engine = Engine(m.model, m.tokenizer, m.eos_token_ids)
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in NEW[:5]]
    want = _alone(engine, PROMPTS[:5], settings)
    got = _served(Scheduler(engine, max_batch=2, prefix_reuse=False), PROMPTS[:5], settings)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_constraint_masks_the_row(llama):
    """A constraint object (core/constraints.py's interface: mask() / advance(token)) limits
    its row's tokens; the other rows are untouched."""

    class Only:
        def __init__(self, allowed):
            self.allowed_ids, self.seen = allowed, []

        def mask(self):
            m = torch.zeros(llama.config.vocab_size, dtype=torch.bool)
            m[self.allowed_ids] = True
            return m

        def advance(self, token):
            self.seen.append(token)

    only = Only([5, 6, 7])
    s = Scheduler(llama, max_batch=2)
    st = GenerationSettings(max_new_tokens=6, ignore_eos=True)
    a = s.submit(PROMPTS[0], st, constraint=only)
    b = s.submit(PROMPTS[1], st)
    done = {e.row: e.result for e in s.run() if isinstance(e, Done)}
    assert set(done[a].token_ids) <= {5, 6, 7} and only.seen == done[a].token_ids
    assert done[b].token_ids == _alone(llama, [PROMPTS[1]], [st])[0].token_ids


@native
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_block_caches_keep_each_requests_tokens_through_layouts_in_place(model_dirs, kv):
    """The same as rows join, leave and the cache is laid out again in its own memory
    (KVCache.relaid on uint8 blocks, a burst after the batch emptied reusing the last cache):
    each request's greedy tokens are its own alone on that cache type, bit for bit."""
    m = load(str(model_dirs("llama-hd64")), device="cpu", dtype="float32")
    engine = Engine(m.model, m.tokenizer, m.eos_token_ids, kv_dtype=kv)
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in NEW]
    want = [r.token_ids for r in _alone(engine, PROMPTS, settings)]
    s = Scheduler(engine, max_batch=3, prefix_reuse=False)
    first = [s.submit(p, st) for p, st in zip(PROMPTS[:2], settings[:2])]  # 5 and 19 tokens
    done = {}
    for _ in range(3):  # running, laid out for them alone
        done.update({e.row: e.result.token_ids for e in s.step() if isinstance(e, Done)})
    later = [s.submit(p, st) for p, st in zip(PROMPTS[2:], settings[2:])]  # a 35-token prompt among them
    done.update({e.row: e.result.token_ids for e in s.run() if isinstance(e, Done)})
    assert [done[i] for i in first + later] == want
    assert s.counters.relayouts > 1 and s.cache is None
    assert [r.token_ids for r in _served(s, PROMPTS[:3], settings[:3])] == want[:3]  # the spare cache


@native
def test_free_rows_are_neither_computed_nor_compacted(llama, monkeypatch):
    """The native step runs only the live rows of the batch cache, so a finished row's place
    costs nothing: it stays (no compaction copying the cache) until every row is done, and
    every request still gets its own tokens."""
    new = [3, 5, 7, 9, 11, 13, 15, 17]
    prompts = [list(range(3 + i, 9 + i)) for i in range(8)]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in new]
    want = [r.token_ids for r in _alone(llama, prompts, settings)]
    computed = []
    step = type(llama.fast).__call__

    def counting(self, tokens, cache, rows=None):
        computed.append(cache.batch if rows is None else len(rows))
        return step(self, tokens, cache, rows=rows)

    monkeypatch.setattr(type(llama.fast), "__call__", counting)
    s = Scheduler(llama, max_batch=8, prefix_reuse=False)
    ids = [s.submit(p, st) for p, st in zip(prompts, settings)]
    done, batches = {}, []
    while s.has_work:
        live = sum(1 for x in s.slots if x is not None and x.state == "running")
        before = len(computed)
        for event in s.step():
            if isinstance(event, Done):
                done[event.row] = event.result.token_ids
        if len(computed) > before and live:
            batches.append((len(s.slots) or 8, live, computed[-1]))
    assert [done[i] for i in ids] == want
    assert all(rows == 8 for rows, _, _ in batches), batches  # never compacted
    assert [n for _, _, n in batches if n < 8] and all(n == live for _, live, n in batches if live < 8), batches


def test_the_eager_step_compacts_once_a_quarter_of_the_batch_is_free(model_dirs):
    """Where the step computes every row (the eager layers), finished rows stay in the batch
    (computed, never read) until a quarter of it is free, then leave in one compaction."""
    m = load(str(model_dirs("llama-hd64")), device="cpu", dtype="float32")
    engine = Engine(m.model, m.tokenizer, m.eos_token_ids)
    engine.fast = None
    new = [3, 5, 7, 9, 11, 13, 15, 17]
    prompts = [list(range(3 + i, 9 + i)) for i in range(8)]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in new]
    want = [r.token_ids for r in _alone(engine, prompts, settings)]
    s = Scheduler(engine, max_batch=8, prefix_reuse=False)
    ids = [s.submit(p, st) for p, st in zip(prompts, settings)]
    done, batches = {}, []
    while s.has_work:
        for event in s.step():
            if isinstance(event, Done):
                done[event.row] = event.result.token_ids
        live = sum(1 for x in s.slots if x is not None and x.state == "running")
        batches.append((len(s.slots), live))
    assert [done[i] for i in ids] == want
    assert all(4 * live > 3 * rows or rows == live for rows, live in batches if rows and live), batches
    assert (8, 7) in batches  # one free row of 8: not yet compacted
    assert (6, 6) in batches and (8, 6) not in batches  # two (a quarter): compacted in that step
