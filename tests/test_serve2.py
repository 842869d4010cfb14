"""core/scheduler.py's second pass (issue 18): requests tokenized off the scheduler's thread
(Scheduler.prepare, what `twice serve` runs on its request threads) and a relaid cache with
headroom for the requests still waiting (fewer layouts), each request still getting the
tokens it gets alone."""

import threading

import pytest

from test_scheduler import _one_thread, llama  # noqa: F401  (its module fixtures: one thread, the engine)
from twice.core import kernels
from twice.core.engine import Done, GenerationSettings, Request
from twice.core.errors import PromptError
from twice.core.scheduler import Prepared, Scheduler, Token

native = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")


def _alone(engine, prompt, settings):
    return list(engine.generate(Request(ids=prompt), settings, reuse_cache=False))[-1].result.token_ids


def _drain(scheduler, before=()):
    """Run the scheduler to the end: {request id: its token ids} (events of steps taken
    before: `before`)."""
    tokens, done = {}, {}
    for event in [*before, *scheduler.run()]:
        if isinstance(event, Token):
            tokens.setdefault(event.row, []).append(event.token_id)
        elif isinstance(event, Done):
            done[event.row] = event.result.token_ids
    assert all(tokens[i] == done[i] for i in done)
    return done


@native
def test_a_relaid_cache_leaves_room_for_the_requests_still_waiting(llama):
    """Two rows, three requests: the third (a prompt longer than the first two, a longer
    output) waits for a row. The first layout already reaches its prompt length and output,
    so when the short row finishes it takes that row without a second layout (before: a
    prompt longer than the columns so far meant laying the cache out again). Every request
    gets its tokens alone, bit for bit."""
    prompts = [list(range(3, 8)), list(range(10, 15)), list(range(20, 60))]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (20, 3, 30)]
    want = [_alone(llama, p, st) for p, st in zip(prompts, settings)]
    s = Scheduler(llama, max_batch=2, prefix_reuse=False)
    ids = [s.submit(p, st) for p, st in zip(prompts, settings)]
    done = _drain(s)
    assert [done[i] for i in ids] == want
    assert s.counters.relayouts == 1 and s.counters.joined_running == 1


@native
def test_prepared_on_another_thread_while_the_batch_steps(llama):
    """Scheduler.prepare runs on a thread of its own while the scheduler steps a running
    row (as the server's request threads tokenize); the prepared request, submitted, gets
    the tokens the same ids submitted directly get, and its tokenizing time is its own."""
    s = Scheduler(llama, max_batch=4, prefix_reuse=False)
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    first = s.submit(list(range(3, 9)), settings)
    events = s.step()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(p=s.prepare(Request(text="hello world, again"), settings)))
    t.start()
    while t.is_alive() and s.has_work:
        events += s.step()
    t.join()
    prepared = out["p"]
    assert isinstance(prepared, Prepared) and prepared.ids == llama.tokenize(Request(text="hello world, again"))
    second = s.submit(prepared, settings)
    done = _drain(s, events)
    assert done[second] == _alone(llama, prepared.ids, settings)
    assert done[first] == _alone(llama, list(range(3, 9)), settings)


def test_prepare_refuses_what_submit_refuses_and_queues_nothing(llama):
    """An empty prompt and one longer than the context: PromptError from prepare (one line,
    naming the lengths), nothing submitted, no work."""
    s = Scheduler(llama, max_batch=2)
    settings = GenerationSettings(max_new_tokens=4)
    with pytest.raises(PromptError, match="empty"):
        s.prepare([], settings)
    too_long = [5] * (llama.context_length + 1)
    with pytest.raises(PromptError) as e:
        s.prepare(too_long, settings)
    assert str(llama.context_length) in str(e.value) and "\n" not in str(e.value)
    assert s.counters.submitted == 0 and not s.has_work


def test_prepare_builds_the_matcher_off_the_scheduler_thread(llama):
    """A structured-output request's matcher is built by prepare (the request thread: the
    first one per tokenizer also builds its token trie), and the submitted row follows it:
    a regex's output full-matches. A bad spec: ConstraintError from prepare, nothing queued."""
    pytest.importorskip("llguidance")
    import re

    from twice.core import constraints as c

    s = Scheduler(llama, max_batch=2, prefix_reuse=False)
    settings = GenerationSettings(max_new_tokens=16, constraint=c.ConstraintSpec("regex", "[a-c]{3}x"))
    prepared = s.prepare(list(range(3, 9)), settings)
    assert isinstance(prepared.constraint, c.Constraint)
    row = s.submit(prepared, settings)
    results = {e.row: e.result for e in s.run() if isinstance(e, Done)}
    assert re.fullmatch("[a-c]{3}x", results[row].text), results[row].text
    bad = GenerationSettings(max_new_tokens=4, constraint=c.ConstraintSpec("regex", "[a-c"))
    with pytest.raises(c.ConstraintError):
        s.prepare(list(range(3, 9)), bad)
    assert s.counters.submitted == 1 and not s.has_work


@native
def test_while_rows_decode_a_step_prefills_about_one_short_prompt(llama):
    """Prefill budget while others decode (decode_prefill, 50 tokens here): three 40-token
    prompts arriving while a row decodes join one a step (the running row waits for one
    prompt's prefill per step, not for all three); with nothing running the three prefill in
    one step (prefill_chunk's budget). Every request gets its tokens alone."""
    settings = GenerationSettings(max_new_tokens=10, ignore_eos=True)
    prompts = [list(range(100 + 40 * k, 140 + 40 * k)) for k in range(3)]
    want = [_alone(llama, p, settings) for p in [list(range(3, 9))] + prompts]
    s = Scheduler(llama, max_batch=4, prefix_reuse=False, decode_prefill=50)
    first = s.submit(list(range(3, 9)), settings)
    events = s.step()
    later = [s.submit(p, settings) for p in prompts]
    running = []
    for _ in range(3):
        events += s.step()
        running.append(len(s.running))
    assert running == [2, 3, 4]
    done = _drain(s, events)
    assert [done[i] for i in [first, *later]] == want
    s = Scheduler(llama, max_batch=4, prefix_reuse=False, decode_prefill=50)
    ids = [s.submit(p, settings) for p in prompts]
    events = s.step()
    assert len(s.running) == 3
    done = _drain(s, events)
    assert [done[i] for i in ids] == want[1:]
