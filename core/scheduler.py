"""Iteration-level scheduling (Orca, vLLM): a waiting queue and a running batch over one KV cache.

`Scheduler(engine)` serves many requests at once. Each `step()`:
1. cancelled requests leave (a running one frees its row in this step);
2. waiting requests start their prefill, each in a one-row cache of its own, at most
   `prefill_chunk` tokens (512) per step over all of them, `decode_prefill` (128) while
   other rows decode (a chunk is never split, so a prompt is cut at the same places
   whatever else runs; at least one chunk a step), so a long prompt delays the others'
   next token by one chunk's time, not its whole length, and a burst of joining short
   prompts by about one prompt's time a step, not all of theirs at once;
   a prompt that starts with tokens some cached row holds (a shared system prompt) copies
   those columns instead of computing them (prefix reuse);
3. a prompt whose prefill is done samples its first token and takes a free row of the
   batch cache (its columns copied in), joining the running batch mid-flight;
4. one decode step runs every row together (the native CPU step where it applies: one
   weight read for all rows; else the eager layers), each row sampled with its own
   settings, seed, stop strings and constraint.

Rows of different lengths in one cache. The cache keeps its layout: one shared column
counter, every row right-aligned to it, row b's tokens in columns [starts[b], length)
(positions = column - start, which the native step, the eager masks and RoPE already
read). A joining prompt of L tokens is copied into columns [length - L, length) of a free
row, so it needs no per-row lengths in the kernels and no copy of the other rows. Only when
no row is free, or the prompt is longer than the columns so far, or the cache has no room
left, is the cache laid out again: live rows only, shifted left so that the oldest row
starts at column 0 (or right, to make room for a longer prompt), capacity for every
row's remaining tokens. That copy of the columns in use is the cost of a join that grows
the batch; a finished row whose place a waiting request takes costs nothing. With the
native step a layout also keeps rows for the requests already waiting or prefilling, and a
free row is neither computed nor written (the step runs the live rows only), so finished
rows simply stay until the batch is empty. A new layout is built in the old cache's memory
where it fits (KVCache.relaid: a fresh 100 MB cache costs 80-170 ms of page faults on a
2-core VM). With the eager layers every row is computed: a finished row stays (computing a
throw-away token per step) while requests wait or prefill, and finished rows leave when
none do.

Results: with the native step each row's arithmetic is independent of its neighbours
(batch invariance), and a prompt is prefilled alone at its own length, so a greedy
request gets exactly the tokens `Engine.generate` gives it alone (a prompt longer than
`prefill_chunk`: those of `generate` with that --prefill-chunk). A prefix copied from
another row is what `generate`'s own session reuse does for a chat's next turn: the same
computation as a second call, which may differ from a fresh prefill in the last bits.

The scheduler never prints and is not thread-safe: one thread calls submit/cancel/step
(the server's worker thread; cli/batch.py's loop).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import kernels
from .cache import KVCache
from .device import synchronize
from .engine import (CAPACITY_ROUNDING, Done, Engine, Failed, GenerationSettings, Notice, Request, TokenEvent,
                     _dropped, _Row)
from .errors import PromptError, TwiceError
from .prefix import common_prefix
from .sampling import Sampler

PREFILL_CHUNK = 512  # prompt tokens prefilled per step, over all joining requests
DECODE_PREFILL = 128  # ... while other rows decode (they wait for it: ~0.3-1 s of a CPU core), a chunk at least
PREFIX_MIN = 16  # shortest shared prefix worth copying
RETAINED = 4  # finished rows whose columns are kept as prefix sources
HEADROOM = 4  # a relaid cache gets need/HEADROOM more columns than its rows need (see _relayout)


@dataclass(frozen=True)
class Token(TokenEvent):
    """A generated token of request `row` (the scheduler's request id), with its log
    probability under the model (log-softmax of the raw logits) when asked for."""

    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class Counters:
    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    joined_running: int = 0  # requests that joined while other rows were decoding
    prefix_hits: int = 0  # requests whose prompt start was copied from a cached row
    prefix_tokens: int = 0  # prompt tokens copied instead of prefilled
    prefill_tokens: int = 0  # prompt tokens computed
    decode_tokens: int = 0  # tokens generated by decode steps (first tokens come from prefill)
    steps: int = 0  # decode steps
    relayouts: int = 0  # times the batch cache was laid out again
    most_running: int = 0  # the largest batch decoded together
    prefill_seconds: float = 0.0  # spent in prefill passes
    decode_seconds: float = 0.0  # spent in decode steps (sampling included)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Seq:
    id: int
    row: _Row
    sampler: Sampler
    constraint: object | None
    logprobs: int | None  # None: none; k: the chosen token's and the top k
    presence: float
    frequency: float
    t_submit: float
    state: str = "waiting"  # waiting | prefill | ready | running | done
    own: KVCache | None = None  # the one-row prefill cache
    done_tokens: int = 0  # prompt tokens in `own`
    logits: torch.Tensor | None = None  # the last prefill chunk's
    prefill_seconds: float = 0.0
    slot: int | None = None
    last: int = 0  # the token to feed next
    counts: torch.Tensor | None = None  # generated-token counts (presence/frequency penalties)
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias: token ids, the values added
    cancelled: bool = False
    pending_logprobs: tuple | None = None  # (log-softmax row, top pairs) of the step being sampled

    @property
    def cached(self) -> list[int]:
        """Tokens whose keys/values the cache holds for this row (the last generated one is fed next)."""
        return self.row.ids + self.row.generated[:-1]


@dataclass(frozen=True)
class Prepared:
    """A request tokenized and checked by Scheduler.prepare, for submit."""

    ids: list[int]
    cut: int  # characters cut from the text's start before tokenizing (truncate="left")
    dropped: int  # tokens dropped from the start (truncate="left")
    max_new: int  # max new tokens, clamped to the context
    seconds: float  # spent tokenizing
    constraint: object | None = None  # the matcher settings.constraint asks for (one request's: submit it once)


@dataclass
class _Retained:
    tokens: list[int]
    cache: KVCache  # one row, columns [0, len(tokens))


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK,
                 prefix_reuse: bool = True, prefix_min: int = PREFIX_MIN, retained: int = RETAINED,
                 decode_prefill: int = DECODE_PREFILL):
        if max_batch < 1:
            raise PromptError(f"the batch must hold at least 1 row, got {max_batch}")
        if prefill_chunk < 1:
            raise PromptError(f"the prefill chunk must be at least 1 token, got {prefill_chunk}")
        self.engine, self.max_batch, self.prefill_chunk = engine, max_batch, prefill_chunk
        self.decode_prefill = max(1, decode_prefill)
        self.prefix_reuse, self.prefix_min, self.retained_most = prefix_reuse, max(1, prefix_min), retained
        self.counters = Counters()
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.prefilling: list[_Seq] = []  # started, in submission order
        self.ready: collections.deque[_Seq] = collections.deque()  # prefilled, first token out, waiting for a row
        self.slots: list[_Seq | None] = []  # the batch cache's rows (None or a finished seq: free)
        self.cache: KVCache | None = None
        self._spare: KVCache | None = None  # the last batch cache, once every row finished
        self.retained: collections.deque[_Retained] = collections.deque()
        self.seqs: dict[int, _Seq] = {}
        self._ids = itertools.count()
        self._notices: list[Notice] = []  # said at the next step
        self.salvaged: list[object] = []

    # -- the public surface --------------------------------------------------------------
    def prepare(self, request: Request | list[int], settings: GenerationSettings) -> Prepared:
        """Tokenize a request, check its length (PromptError: empty, too long, a failing
        chat template) and build its structured-output matcher (ConstraintError: a bad
        schema; the first one per tokenizer also builds its token trie, ~1.5 s). It reads only the engine's tokenizer and config, never the cache or
        the scheduler's state, so another thread may call it while this one steps (the
        server tokenizes on its request threads, not between the batch's steps); `submit`
        takes the result as it is."""
        engine, t = self.engine, time.perf_counter()
        if not isinstance(request, Request):
            request = Request(ids=list(request))
        ids, cut = engine._tokenize(request, settings)
        ids, dropped = engine._truncate(ids, settings)
        max_new = engine._check_length(ids, settings)
        constraint = None
        if settings.constraint is not None:  # a bad spec: ConstraintError here, nothing queued
            from .constraints import build
            constraint = build(engine, settings.constraint)
        return Prepared(ids, cut, dropped, max_new, time.perf_counter() - t, constraint)

    def submit(self, request: Request | list[int] | Prepared, settings: GenerationSettings, constraint=None,
               logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               submitted: float | None = None, logit_bias: dict[int, float] | None = None) -> int:
        """Queue a request; returns its id (the `row` of its events). A prompt that cannot be
        served (empty, longer than the context, a failing chat template) raises TwiceError
        here, before it is queued (a `Prepared` request was checked by `prepare` already, with
        these settings). `submitted`: when the request started (TTFT counts from it).
        `logit_bias`: token id → a number added to its logit before sampling (sampling.logit_bias
        checks one)."""
        engine = self.engine
        t = submitted if submitted is not None else time.perf_counter()
        prepared = request if isinstance(request, Prepared) else self.prepare(request, settings)
        ids, cut, dropped, max_new = prepared.ids, prepared.cut, prepared.dropped, prepared.max_new
        if constraint is None:  # structured output named in the settings (built by prepare)
            constraint = prepared.constraint
        seq_id = next(self._ids)
        if dropped or cut:
            self._notices.append(Notice(f"dropped the first {_dropped(dropped, cut)} to fit the context of "
                                        f"{engine.context_length} (--truncate left)", row=seq_id, context=True))
        if max_new < settings.max_new_tokens:
            self._notices.append(Notice(f"max new tokens lowered from {settings.max_new_tokens} to {max_new} to fit "
                                        f"the model's context of {engine.context_length} tokens", row=seq_id,
                                        context=True))
        tokenize = prepared.seconds if prepared is not request else 0.0
        row = _Row(seq_id, ids, settings, max_new, engine.tokenizer.stream(ids), tokenize or time.perf_counter() - t, 0)
        row.constraint = constraint  # Engine._accept advances it and ends the row when it is complete
        sampler = Sampler([settings.sampling], [ids], engine.config.vocab_size, engine.device)
        seq = _Seq(seq_id, row, sampler, constraint, logprobs, float(presence_penalty), float(frequency_penalty), t)
        if logit_bias:
            seq.bias = (torch.tensor(list(logit_bias), dtype=torch.int64, device=engine.device),
                        torch.tensor([list(logit_bias.values())], dtype=torch.float32, device=engine.device))
        self.seqs[seq_id] = seq
        self.waiting.append(seq)
        self.counters.submitted += 1
        return seq_id

    def cancel(self, seq_id: int) -> None:
        """Cancel a request: it leaves at the next step (a running row is freed there)."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            seq.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.ready or self.running or self._notices)

    @property
    def running(self) -> list[_Seq]:
        return [s for s in self.slots if s is not None and s.state == "running"]

    @property
    def waiting_count(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.ready)

    def cache_bytes(self) -> tuple[int, int]:
        """(bytes in use: every live row's filled columns, bytes allocated), the batch cache
        and the prefill caches."""
        used = allocated = 0
        if self.cache is not None:
            per = self.cache.bytes_per_token
            used += sum(per * (self.cache.length - self._start(i)) for i, s in enumerate(self.slots)
                        if s is not None and s.state == "running")
            allocated += self.cache.bytes_held
        if self._spare is not None:
            allocated += self._spare.bytes_held
        for s in self.prefilling + list(self.ready):
            if s.own is not None:
                used += s.own.bytes_per_token * s.own.length
                allocated += s.own.bytes_allocated
        for r in self.retained:
            allocated += r.cache.bytes_allocated
        return used, allocated

    def run(self) -> Iterator[object]:
        """Step until every submitted request is done, yielding the events. A step that
        raises (out of memory) yields what it had done before the error is raised."""
        while self.has_work:
            try:
                events = self.step()
            except BaseException:
                yield from self.take_salvaged()
                raise
            yield from events

    def step(self) -> list[object]:
        """One iteration: cancellations, prefill chunks, joins, one decode step. Returns the
        events (Token, Done, Failed, Notice) in order."""
        events: list[object] = self._notices
        self._notices = []
        try:
            self._cancel(events)
            self._prefill(events)
            self._join()
            if self.running:
                self._decode(events)
            self._free_rows()
        except BaseException:
            self.salvaged = events  # what the step did before it failed (rows that finished: their results)
            raise
        return events

    def take_salvaged(self) -> list[object]:
        """The events a step that raised had produced before it failed (then none)."""
        events, self.salvaged = self.salvaged, []
        return events

    # -- cancellation ---------------------------------------------------------------------
    def _cancel(self, events: list) -> None:
        for queue in (self.waiting, self.ready):
            for seq in [s for s in queue if s.cancelled]:
                queue.remove(seq)
                self._finish(seq, "cancelled", events)
        for seq in [s for s in self.prefilling if s.cancelled]:
            self.prefilling.remove(seq)
            self._finish(seq, "cancelled", events)
        for seq in self.running:
            if seq.cancelled:
                self._finish(seq, "cancelled", events)

    # -- prefill --------------------------------------------------------------------------
    def _prefill(self, events: list) -> None:
        """Start waiting requests and run prefill chunks, at most `prefill_chunk` tokens
        this step (`decode_prefill` while rows decode; at least one chunk). Requests start
        while there will be a row for them."""
        rows_free = self.max_batch - len(self.running) - len(self.ready)
        while self.waiting and len(self.prefilling) < rows_free:
            seq = self.waiting.popleft()
            self._start_prefill(seq)
            self.prefilling.append(seq)
        # While rows decode, they wait for this step's prefill: at most `decode_prefill`
        # tokens then (a whole chunk at least), else `prefill_chunk`.
        budget = min(self.prefill_chunk, self.decode_prefill) if self.running else self.prefill_chunk
        ran = False
        for seq in list(self.prefilling):
            while seq.done_tokens < len(seq.row.ids) and ((n := self._chunk_size(seq)) <= budget or not ran):
                budget, ran = budget - n, True
                self._prefill_chunk(seq, n)
            if seq.done_tokens < len(seq.row.ids):
                break  # a whole chunk or none; the next step goes on (in submission order)
            self.prefilling.remove(seq)
            self._first_token(seq, events)

    def _chunk_size(self, seq: _Seq) -> int:
        chunk = min(seq.row.settings.prefill_chunk or self.prefill_chunk, self.prefill_chunk)
        return min(chunk, len(seq.row.ids) - seq.done_tokens)

    def _start_prefill(self, seq: _Seq) -> None:
        engine, ids = self.engine, seq.row.ids
        seq.state = "prefill"
        seq.own = KVCache(engine.config, 1, len(ids), engine.dtype, engine.device, kv_heads=engine.model.kv_heads,
                          kv_dtype=engine.kv_dtype)
        if not self.prefix_reuse:
            return
        best, source = 0, None
        for tokens, cache, row, start in self._prefix_sources():
            n = common_prefix(tokens, ids)
            if n > best:
                best, source = n, (cache, row, start)
        best = min(best, len(ids) - 1)  # at least one token runs, for the logits
        if best < self.prefix_min or source is None:
            return
        cache, row, start = source
        seq.own.k[:, 0, :, :best] = cache.k[:, row, :, start:start + best]
        seq.own.v[:, 0, :, :best] = cache.v[:, row, :, start:start + best]
        seq.own.length = seq.done_tokens = seq.row.reused = best
        self.counters.prefix_hits += 1
        self.counters.prefix_tokens += best

    def _prefix_sources(self):
        for i, s in enumerate(self.slots):
            if s is not None and s.state == "running":
                yield s.cached, self.cache, i, self._start(i)
        for r in self.retained:
            yield r.tokens, r.cache, 0, 0

    def _prefill_chunk(self, seq: _Seq, n: int) -> None:
        engine = self.engine
        begin = seq.done_tokens
        t0 = time.perf_counter()
        tokens = torch.tensor([seq.row.ids[begin:begin + n]], device=engine.device)
        seq.logits = engine._prefill(tokens, seq.own, None)
        synchronize(engine.device)
        seq.prefill_seconds += time.perf_counter() - t0
        self.counters.prefill_seconds += time.perf_counter() - t0
        seq.done_tokens += n
        self.counters.prefill_tokens += n

    def _first_token(self, seq: _Seq, events: list) -> None:
        token = self._sample_rows([seq], seq.logits)[0]
        seq.logits = None
        self._emit(seq, token, seq.prefill_seconds, events)
        if seq.row.finish:
            self._finish(seq, seq.row.finish, events)
        else:
            seq.state = "ready"
            seq.last = token
            self.ready.append(seq)

    # -- joining the batch ---------------------------------------------------------------
    def _start(self, slot: int) -> int:
        return int(self.cache.starts[slot])

    def _join(self) -> None:
        """Prefilled requests take free rows; the cache is laid out again when no free row
        fits them (none free, a prompt longer than the columns so far, no room left)."""
        if not self.ready:
            return
        if self.running:
            self.counters.joined_running += len(self.ready)
        cache = self.cache
        placed = []
        for seq in list(self.ready):
            slot = self._free_slot()
            if slot is None or cache is None:
                break
            n = seq.own.length
            if n > cache.length or cache.length + self._remaining(seq) > cache.capacity:
                break
            self._place(seq, slot, cache.length - n)
            placed.append(seq)
        for seq in placed:
            self.ready.remove(seq)
        if self.ready:
            self._relayout(list(self.ready))
            self.ready.clear()

    def _free_slot(self) -> int | None:
        for i, s in enumerate(self.slots):
            if s is None or s.state != "running":
                return i
        return None

    def _remaining(self, seq: _Seq) -> int:
        """Columns the row may still write: one per token it may yet generate after its first."""
        return seq.row.max_new - len(seq.row.generated)

    def _place(self, seq: _Seq, slot: int, first: int) -> None:
        n = seq.own.length
        end = first + n
        self.cache.k[:, slot, :, first:end] = seq.own.k[:, 0, :, :n]
        self.cache.v[:, slot, :, first:end] = seq.own.v[:, 0, :, :n]
        self.cache.starts[slot] = first
        self.slots[slot] = seq
        seq.slot, seq.state, seq.own = slot, "running", None

    def _relayout(self, joining: list[_Seq]) -> None:
        """A new batch cache: the running rows (shifted so that the oldest starts at column 0,
        or later to make room for a longer prompt) and the joining ones, capacity for every
        row's remaining tokens. Headroom for the requests still waiting or prefilling: the
        columns so far reach their longest prompt and the capacity their largest output, and
        a quarter more of that output, so that they join into free rows later without another
        layout (a column left of a row's start costs no compute on the native step: it reads
        from the row's start; it costs memory, rows x columns)."""
        engine, old = self.engine, self.cache
        keep = [(i, s) for i, s in enumerate(self.slots) if s is not None and s.state == "running"]
        lo = min((self._start(i) for i, _ in keep), default=0)
        span = (old.length - lo) if keep else 0
        later = list(self.waiting) + self.prefilling
        length = max([span] + [s.own.length for s in joining] + [len(s.row.ids) for s in later])
        rows = len(keep) + len(joining)
        if self._steps_rows():  # free rows cost nothing: room for the requests known to come
            rows = max(rows, min(self.max_batch, rows + len(later)))
        need = max([self._remaining(s) for _, s in keep] + [self._remaining(j) for j in joining]
                   + [s.row.max_new for s in later])
        capacity = length + max(need, 1)
        capacity = max(capacity, min(capacity + need // HEADROOM, engine.context_length))
        capacity = -(-capacity // CAPACITY_ROUNDING) * CAPACITY_ROUNDING
        shift = length - span - lo  # old column c goes to c + shift
        moves = [(i, self._start(i), self._start(i) + shift) for i, _ in keep]
        if old is None and self._spare is None:
            cache = KVCache(engine.config, rows, capacity, engine.dtype, engine.device,
                            kv_heads=engine.model.kv_heads, kv_dtype=engine.kv_dtype)
        else:  # in the old (or last) cache's memory where it fits
            cache = (old or self._spare).relaid(moves, old.length if old else 0, rows, capacity)
            self._spare = None
        cache.starts = torch.zeros(rows, dtype=torch.int64, device=engine.device)
        cache.length = length
        slots: list[_Seq | None] = []
        for new, ((_, _, at), (_, s)) in enumerate(zip(moves, keep)):
            cache.starts[new] = at
            s.slot = new
            slots.append(s)
        self.cache, self.slots = cache, slots + [None] * (rows - len(keep))
        for k, seq in enumerate(joining):
            self._place(seq, len(keep) + k, length - seq.own.length)
        self.counters.relayouts += 1

    def _steps_rows(self) -> bool:
        """Whether the decode step runs only the live rows of the batch cache (the native
        step), so that a free row costs memory, not compute."""
        return bool(getattr(self.engine.fast, "steps_rows", False))

    def _free_rows(self) -> None:
        """Finished rows leave the batch when no request waits to take their place."""
        if self.cache is None or self.waiting or self.prefilling or self.ready:
            return
        live = [i for i, s in enumerate(self.slots) if s is not None and s.state == "running"]
        if live and self._steps_rows():
            return  # free rows cost no compute: compacting would only copy the cache
        if 4 * len(live) > 3 * len(self.slots):  # fewer than a quarter free (none, too)
            # Compacting copies the whole cache (~2x a 16-row step of SmolLM2) to save one row's
            # share of each later step: done once a quarter of the rows is free, not per row
            # (a free row costs compute, never a result: every row's tokens are its own).
            return
        if not live:  # its memory serves the next layout (no page faults then)
            self._spare, self.cache, self.slots = self.cache, None, []
            return
        self.cache.keep_rows(live)
        self.slots = [self.slots[i] for i in live]
        for new, s in enumerate(self.slots):
            s.slot = new

    # -- decoding ------------------------------------------------------------------------
    @torch.inference_mode()
    def _decode(self, events: list) -> None:
        engine, cache = self.engine, self.cache
        if cache.length >= cache.capacity:  # rows outlived their room (should not happen): lay out again
            self._relayout([])
            cache = self.cache
        live = [(i, s) for i, s in enumerate(self.slots) if s is not None and s.state == "running"]
        self.counters.most_running = max(self.counters.most_running, len(live))
        feed = [s.last if s is not None and s.state == "running" else 0 for s in self.slots]
        tokens = torch.tensor(feed, device=engine.device).unsqueeze(1)
        t = time.perf_counter()
        rows = [i for i, _ in live]
        with engine._out_of_memory(cache, f"decoding {cache.batch} rows at {cache.length} tokens"):
            if engine._fast_ready(cache) and self._steps_rows() and len(rows) < cache.batch:
                logits = engine.fast(tokens[rows], cache, rows=rows)  # the live rows only
            elif engine._fast_ready(cache):
                logits = engine.fast(tokens, cache)
            else:
                logits = engine.model(tokens, cache)
        chosen = self._sample_rows([s for _, s in live], logits[rows] if len(rows) != logits.shape[0] else logits)
        seconds = time.perf_counter() - t
        self.counters.decode_seconds += seconds
        self.counters.steps += 1
        self.counters.decode_tokens += len(live)
        stats = engine.cache_stats(cache)  # one step, one cache: the same for every row's event
        for (_, seq), token in zip(live, chosen):
            self._emit(seq, token, seconds, events, stats)
            seq.last = token
            if seq.row.finish:
                self._finish(seq, seq.row.finish, events)

    def _sample_rows(self, seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
        """Each row's next token under its own settings; greedy rows with nothing to adjust
        share one argmax over the batch (as Engine's sampler does)."""
        plain = [not (s.constraint or s.presence or s.frequency or s.logprobs is not None or s.bias is not None)
                 and s.sampler.all_greedy for s in seqs]
        out: list[int] = [0] * len(seqs)
        if all(plain):
            chosen = kernels.argmax(logits)
            chosen = chosen if chosen is not None else logits.argmax(dim=-1)
            return [int(x) for x in chosen.tolist()]
        for r, seq in enumerate(seqs):
            x = logits[r:r + 1]
            if seq.logprobs is not None:
                lp = torch.log_softmax(x[0].float(), dim=-1)
                top = ()
                if seq.logprobs:
                    values, ids = torch.topk(lp, min(seq.logprobs, lp.shape[-1]))
                    top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
                seq.pending_logprobs = (lp, top)
            if seq.presence or seq.frequency:
                x = x.float()
                if seq.counts is not None:
                    x = x - seq.frequency * seq.counts - seq.presence * (seq.counts > 0)
            if seq.bias is not None:  # out of place: x may be a view of the batch's logits
                x = x.float().index_add(1, seq.bias[0], seq.bias[1])
            if seq.constraint is not None:
                x = _apply_constraint(seq.constraint, x)
            token = seq.sampler(x)
            seq.sampler.observe(token)
            out[r] = int(token[0])
        return out

    def _emit(self, seq: _Seq, token: int, step_seconds: float, events: list, stats=None) -> None:
        engine = self.engine
        if seq.presence or seq.frequency:
            if seq.counts is None:
                seq.counts = torch.zeros(engine.config.vocab_size, dtype=torch.float32, device=engine.device)
            seq.counts[token] += 1
        now = time.perf_counter()
        text = engine._accept(seq.row, token, now, step_seconds)
        lp, top = None, ()
        if seq.pending_logprobs is not None:
            row, top = seq.pending_logprobs
            lp, seq.pending_logprobs = float(row[token]), None
        events.append(Token(seq.id, token, text, len(seq.row.generated) - 1, step_seconds, now - seq.t_submit,
                            stats or engine.cache_stats(self.cache or seq.own), logprob=lp, top_logprobs=top))

    def _finish(self, seq: _Seq, reason: str, events: list) -> None:
        seq.row.finish = seq.row.finish or reason
        if reason == "cancelled":
            seq.row.finish = "cancelled"
            self.counters.cancelled += 1
        else:
            self.counters.finished += 1
        cache = self.cache if seq.state == "running" else seq.own
        if seq.state == "running":
            self._retain(seq)
        result = self.engine._result(seq.row, cache or seq.own, seq.t_submit, seq.prefill_seconds, 0)
        seq.state = "done"
        seq.own = None
        self.seqs.pop(seq.id, None)
        events.append(Done(seq.id, result))

    def _retain(self, seq: _Seq) -> None:
        """Keep a finished row's columns as a prefix source for later requests (a client's
        next turn, the same system prompt again), up to `retained` rows."""
        if not (self.prefix_reuse and self.retained_most) or seq.slot is None:
            return
        tokens = seq.cached
        if len(tokens) < self.prefix_min:
            return
        if any(common_prefix(r.tokens, tokens) == len(tokens) for r in self.retained):
            return
        engine, start = self.engine, self._start(seq.slot)
        n = len(tokens)
        own = KVCache(engine.config, 1, n, engine.dtype, engine.device, kv_heads=engine.model.kv_heads,
                      kv_dtype=engine.kv_dtype)
        own.k[:, 0, :, :n] = self.cache.k[:, seq.slot, :, start:start + n]
        own.v[:, 0, :, :n] = self.cache.v[:, seq.slot, :, start:start + n]
        own.length = n
        self.retained.appendleft(_Retained(tokens, own))
        while len(self.retained) > self.retained_most:
            self.retained.pop()


def _apply_constraint(constraint, logits: torch.Tensor) -> torch.Tensor:
    """Mask a constrained row's logits [1, V]: tokens the constraint does not allow get -inf.
    The constraint answers `mask()` (or `allowed()`) with a bool tensor over the vocabulary
    (True = allowed) or the allowed token ids."""
    get = getattr(constraint, "mask", None) or getattr(constraint, "allowed")
    allowed = get()
    v = logits.shape[-1]
    if not isinstance(allowed, torch.Tensor):
        allowed = torch.tensor(list(allowed), dtype=torch.int64)
    allowed = allowed.to(logits.device)
    if allowed.dtype == torch.bool:
        mask = torch.zeros(v, dtype=torch.bool, device=logits.device)
        n = min(v, allowed.shape[-1])
        mask[:n] = allowed.reshape(-1)[:n]
    else:
        mask = torch.zeros(v, dtype=torch.bool, device=logits.device)
        mask[allowed[allowed < v]] = True
    return logits.float().masked_fill(~mask, float("-inf"))


__all__ = ["Scheduler", "Prepared", "Token", "Counters", "Done", "Failed", "Notice", "PREFILL_CHUNK", "TwiceError"]
