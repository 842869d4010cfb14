"""The HTTP face of `twice serve`: OpenAI-compatible endpoints over the engine's scheduler.

FastAPI routes parse and check each request (bounded JSON, typed fields, one-line
reasons), hand it to the scheduler's thread (`Worker`) through a queue, and turn the
events that come back through another queue into OpenAI's response shapes (a JSON body,
or server-sent events). This module never touches tensors: the worker thread owns the
scheduler (core/scheduler.py), which owns the model and the KV cache.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). Errors: {"error": {"message", "type", "param", "code"}}
with a 4xx/5xx status. Safety: an API key (every endpoint but /health, compared in
constant time), a 4 MiB body limit, at most `max_queue` requests waiting (429 with
Retry-After), no field names a file or a model to load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request as HttpRequest

from twice.core.errors import PromptError

MAX_BODY = 4 * 2**20  # bytes of a request body
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
RETRY_AFTER = 1  # seconds, with a 429
ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}

# The request fields: used, accepted but without effect (said in the README), refused unless
# at their default. Anything else is an unknown field: 400 (a typo must not pass silently).
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
          "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "user",
          "logprobs", "ignore_eos", "logit_bias", "response_format", "metadata", "store", "service_tier"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls", "functions", "function_call", "modalities", "audio",
                        "prediction", "reasoning_effort", "web_search_options"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
# A message's fields (OpenAI's; name, refusal and an empty tool_calls / audio are accepted
# without effect) and a content part's.
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"}
PART_FIELDS = {"type", "text"}


def _only(obj: dict, fields: set[str], where: str | None = None, param: str | None = None) -> None:
    """A 400 unknown_field for a key of `obj` (the body; `where` names a nested object: a
    message, a content part, stream_options) outside `fields`: a typo never passes silently."""
    from twice.core.fields import first_unknown

    if (unknown := first_unknown(obj, fields)) is not None:
        raise ApiError(400, f"unknown field {json.dumps(unknown)[:80]}{f' in {where}' if where else ''} (it takes: "
                            f"{', '.join(sorted(fields))})", code="unknown_field", param=param or unknown[:80])


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, " ".join(message.split()), type, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        """The body as ASCII JSON: a message or param quoting the request (a key holding a lone
        surrogate) is escaped, where UTF-8 could not encode it."""
        return json.dumps(self.body()).encode()


def error_body(status: int, message: str, type: str = "invalid_request_error", code: str | None = None) -> dict:
    return ApiError(status, message, type, code).body()


# -- the scheduler's thread ---------------------------------------------------------------
@dataclass
class Snapshot:
    """What /metrics and the queue limit read, published by the worker after each step."""

    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_allocated: int = 0
    counters: dict = field(default_factory=dict)


class Worker:
    """The thread that owns the scheduler: takes submissions and cancellations from a
    queue, steps the scheduler while it has work, and hands each request's events to its
    sink (a callable, run on this thread: it must only pass the event on)."""

    def __init__(self, scheduler=None):
        self.scheduler = scheduler  # or built by `start(build)` on this worker's thread
        self._build = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[int, object] = {}
        self.snapshot = Snapshot()
        self.pending = 0  # submissions in the inbox (the queue limit counts them)
        self._lock = threading.Lock()  # for `pending`, changed by both threads
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="twice-scheduler", daemon=True)

    def start(self, build=None):
        """Start the thread; with `build` (a callable returning the scheduler), it first runs
        build there and this returns the scheduler (or raises build's error). Loading the
        model on the thread that steps it keeps the process's OpenMP threads in one pool:
        libgomp gives every thread that starts parallel work its own pool, and once the pools
        together hold more threads than there are cores it stops spinning at barriers and
        sleeps in futex calls instead (hundreds per step). A native step on a second thread
        after a load on the main one ran 5x slower (SmolLM2, 2 threads on 2 cores: ~13 ms
        against ~2.5 ms; scripts/bench_serve.py at 1 client 0.2x sequential)."""
        self._build = build
        self.thread.start()
        if build is not None:
            return self._ready.result()
        return self.scheduler

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what runs and end the thread."""
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout)

    def submit(self, request, settings, sink, **kw) -> concurrent.futures.Future:
        """Queue a request; the future gets its id (or the TwiceError that refused it)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self.pending += 1
        self.inbox.put(("submit", request, settings, kw, sink, future))
        return future

    def cancel(self, seq_id: int) -> None:
        self.inbox.put(("cancel", seq_id))

    def cancel_all(self) -> None:
        """Cancel every request in flight (the drain's deadline): each ends with a Done whose
        finish is "cancelled", which its reply turns into a 503 `draining`."""
        self.inbox.put(("cancel_all",))

    @property
    def queued(self) -> int:
        return self.snapshot.waiting + self.pending

    def _loop(self) -> None:
        from twice.core.errors import TwiceError

        if self._build is not None:
            try:
                self.scheduler = self._build()
            except BaseException as e:  # noqa: BLE001 - the caller's thread raises it
                self._ready.set_exception(e)
                return
            self._ready.set_result(self.scheduler)
        s = self.scheduler
        while True:
            block = not s.has_work
            try:
                commands = [self.inbox.get(block=block)] if block else []
            except queue.Empty:
                commands = []
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command[0] == "submit":
                    _, request, settings, kw, sink, future = command
                    with self._lock:
                        self.pending -= 1
                    try:
                        seq_id = s.submit(request, settings, **kw)
                    except TwiceError as e:
                        future.set_exception(e)
                        continue
                    except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the server
                        future.set_exception(e)
                        continue
                    self.sinks[seq_id] = sink
                    future.set_result(seq_id)
                elif command[0] == "cancel":
                    s.cancel(command[1])
                elif command[0] == "cancel_all":
                    for seq_id in list(self.sinks):
                        s.cancel(seq_id)
            if self._stop.is_set():
                for seq_id in list(self.sinks):
                    s.cancel(seq_id)
                if not s.has_work:
                    self._publish()
                    for sink in self.sinks.values():
                        sink(None)
                    return
            if not s.has_work:
                self._publish()
                continue
            try:
                events = s.step()
            except Exception as e:  # noqa: BLE001 - out of memory, a bug: every request in flight ends with it
                self._dispatch(s.take_salvaged())
                message = str(e) if isinstance(e, TwiceError) else f"{type(e).__name__}: {e}"
                for sink in self.sinks.values():
                    sink(ApiError(500 if not isinstance(e, TwiceError) else 503, message, "server_error",
                                  "engine_error"))
                self.sinks.clear()
                self.scheduler = s = s.__class__(s.engine, s.max_batch, s.prefill_chunk, s.prefix_reuse,
                                                 s.prefix_min, s.retained_most, s.decode_prefill)
                self._publish()
                continue
            self._publish()  # first: a client that has its token sees the rows that step left running
            self._dispatch(events)

    def _dispatch(self, events) -> None:
        from twice.core.engine import Done, TokenEvent

        for event in events:
            if not isinstance(event, (TokenEvent, Done)):
                continue  # notices (a clamped max_tokens): the reply's finish_reason says it
            sink = self.sinks.get(event.row)
            if sink is not None:
                sink(event)
            if isinstance(event, Done):
                self.sinks.pop(event.row, None)

    def _publish(self) -> None:
        s = self.scheduler
        used, allocated = s.cache_bytes()
        self.snapshot = Snapshot(len(s.running), s.waiting_count, used, allocated, s.counters.to_dict())


# -- metrics ----------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics in a registry of this server's own (several servers may share a process)."""

    def __init__(self, worker: Worker):
        from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        disable_created_metrics()  # no *_created series beside every counter
        self.registry = CollectorRegistry()
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.requests = Counter("twice_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.latency = Histogram("twice_request_seconds", "Request latency (arrival to last byte)", ["endpoint"],
                                 buckets=latency, registry=self.registry)
        self.ttft = Histogram("twice_time_to_first_token_seconds", "Arrival to the first token's text",
                              buckets=latency, registry=self.registry)
        self.itl = Histogram("twice_inter_token_seconds", "Time between a request's successive tokens",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                             registry=self.registry)

        class _State:
            def collect(self_inner):
                snap = worker.snapshot
                c = snap.counters
                for name, help_text, value in (
                        ("twice_running_requests", "Requests decoding in the batch", snap.running),
                        ("twice_waiting_requests", "Requests waiting or prefilling", snap.waiting + worker.pending),
                        ("twice_kv_cache_bytes_used", "KV cache bytes holding live rows' tokens", snap.kv_used),
                        ("twice_kv_cache_bytes_allocated", "KV cache bytes allocated", snap.kv_allocated),
                        ("twice_prefill_tokens_per_second", "Prompt tokens computed per second of prefill",
                         c.get("prefill_tokens", 0) / c["prefill_seconds"] if c.get("prefill_seconds") else 0.0),
                        ("twice_decode_tokens_per_second", "Tokens generated per second of decode steps",
                         c.get("decode_tokens", 0) / c["decode_seconds"] if c.get("decode_seconds") else 0.0)):
                    g = GaugeMetricFamily(name, help_text)
                    g.add_metric([], value)
                    yield g
                for name, key, help_text in (
                        ("twice_prefix_cache_hits", "prefix_hits", "Requests whose prompt start was copied"),
                        ("twice_prefix_cache_tokens", "prefix_tokens", "Prompt tokens copied instead of computed"),
                        ("twice_prompt_tokens", "prefill_tokens", "Prompt tokens computed"),
                        ("twice_generation_tokens", "decode_tokens", "Tokens generated by decode steps"),
                        ("twice_joined_running", "joined_running", "Requests that joined a running batch"),
                        ("twice_cancelled", "cancelled", "Requests cancelled (client gone, drain)")):
                    m = CounterMetricFamily(name, help_text)
                    m.add_metric([], c.get(key, 0))
                    yield m

        self.registry.register(_State())

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# -- parsing requests ---------------------------------------------------------------------------
@dataclass
class Job:
    request: object  # engine.Request
    settings: object  # engine.GenerationSettings
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: none; k: chosen + top k
    presence: float
    frequency: float
    bias: dict  # logit_bias: token id -> the number added to its logit


class Parser:
    """Request bodies → Jobs, with the server's defaults (its sampling flags, the model's
    generation_config) where a request says nothing."""

    def __init__(self, engine, model_name: str, base_settings, context_length: int):
        self.engine, self.model_name, self.base, self.context_length = engine, model_name, base_settings, context_length

    def parse(self, body, chat: bool) -> Job:
        from twice.core.engine import GenerationSettings
        from twice.core.errors import TwiceError
        from twice.core.fields import Fields
        from twice.core.sampling import SamplingParams, logit_bias
        from twice.core.fields import unpaired_surrogate

        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}", code="invalid_body")
        allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
        _only(body, allowed)
        f = Fields(body, "request", PromptError)
        try:
            model = f.str("model", None, max_len=1024)
            if model is not None and model != self.model_name:
                raise ApiError(404, f"the model {json.dumps(model)[:120]} is not served here (this server serves "
                                    f"{json.dumps(self.model_name)}; GET /v1/models)", code="model_not_found",
                               param="model")
            if f.int("n", 1) != 1:
                raise ApiError(400, "n must be 1 (one choice per request)", param="n", code="unsupported")
            for key in ("tools", "functions"):
                if body.get(key):
                    raise ApiError(400, f"{key} (tool calling) is not supported", param=key, code="unsupported")
            if not chat:
                if f.bool("echo", False):
                    raise ApiError(400, "echo is not supported", param="echo", code="unsupported")
                if f.str("suffix", None) is not None:
                    raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported")
                if f.int("best_of", 1) != 1:
                    raise ApiError(400, "best_of must be 1", param="best_of", code="unsupported")
            request = self._chat_request(f) if chat else self._completion_request(f)
            max_tokens = f.int("max_completion_tokens", None, lo=1) if chat else None
            if max_tokens is None:
                max_tokens = f.int("max_tokens", None, lo=1)
            base = self.base
            top_k = f.int("top_k", None, lo=-1)
            sampling = SamplingParams(
                temperature=f.float("temperature", base.sampling.temperature, lo=0, hi=2),
                top_k=base.sampling.top_k if top_k is None else max(0, top_k),
                top_p=f.float("top_p", base.sampling.top_p, lo=0, hi=1, lo_open=True),
                min_p=f.float("min_p", base.sampling.min_p, lo=0, hi=1, hi_open=True),
                repetition_penalty=f.float("repetition_penalty", base.sampling.repetition_penalty, lo=0, hi=10,
                                           lo_open=True),
                seed=f.int("seed", base.sampling.seed, lo=0, hi=2**63 - 1))
            stop = body.get("stop")
            if stop is None:
                stops = base.stop
            elif isinstance(stop, str):
                stops = (stop,)
            elif isinstance(stop, list) and all(isinstance(x, str) for x in stop) and len(stop) <= MAX_STOPS:
                stops = tuple(stop)
            else:
                raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop")
            if any(x == "" for x in stops):  # as --stop "" and a batch line's: it would match nothing
                raise ApiError(400, "a stop string is empty (an empty text matches nothing; leave it out)",
                               param="stop", code="invalid_value")
            if any(len(x) > 1000 for x in stops):
                raise ApiError(400, "a stop string may be at most 1000 characters", param="stop")
            if any(unpaired_surrogate(x) is not None for x in stops):
                raise ApiError(400, "a stop string holds a lone surrogate (not UTF-8 text)", param="stop")
            stream = f.bool("stream", False)
            if body.get("stream_options") is not None and not stream:  # as OpenAI: it would be ignored
                raise ApiError(400, "stream_options is only allowed with \"stream\": true", param="stream_options",
                               code="invalid_value")
            options = Fields(f.dict("stream_options", {}), "request: stream_options", PromptError)
            _only(options.data, {"include_usage", "continuous_usage_stats"}, "stream_options", "stream_options")
            include_usage = options.bool("include_usage", False)
            logprobs = self._logprobs(f, chat)
            bias = logit_bias(body.get("logit_bias"), self.engine.config.vocab_size)
            presence = f.float("presence_penalty", 0.0, lo=-2, hi=2)
            frequency = f.float("frequency_penalty", 0.0, lo=-2, hi=2)
            ignore_eos = f.bool("ignore_eos", False)
            f.str("user", None, max_len=1 << 16)
            constraint = self._constraint(f)
            settings = GenerationSettings(max_new_tokens=max_tokens or base.max_new_tokens, sampling=sampling,
                                          stop=stops, ignore_eos=ignore_eos, prefill_chunk=base.prefill_chunk,
                                          **({"constraint": constraint} if constraint is not None else {}))
        except ApiError:
            raise
        except TwiceError as e:
            message = _strip_source(str(e))
            # Fields' messages begin with the key they are about ("stream_options: include_usage ...")
            field = message.split(" ", 1)[0].rstrip(":")
            missing = getattr(e, "missing_key", None) is not None  # OpenAI's code for a required field left out
            raise ApiError(400, message, code="missing_required_parameter" if missing else "invalid_value",
                           param=field if field.split(".", 1)[0] in allowed else None) from None
        return Job(request, settings, stream, include_usage, logprobs, presence, frequency, bias)

    def _chat_request(self, f):
        from twice.core.engine import Request

        messages = f.list("messages", max_len=10_000)
        if not messages:
            raise ApiError(400, "messages must hold at least one message", param="messages")
        if self.engine.tokenizer.chat_template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions", code="no_chat_template")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ApiError(400, f"messages[{i}] must be an object, got {_kind(m)}", param="messages")
            _only(m, MESSAGE_FIELDS, f"messages[{i}]", "messages")
            for key in ("tool_calls", "function_call", "audio"):
                if m.get(key):
                    raise ApiError(400, f"messages[{i}].{key} is not supported (no tool calling or audio)",
                                   param="messages", code="unsupported")
            role = m.get("role")
            if role not in ROLES:
                raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                                    f"{json.dumps(role)[:60]}", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                       param="messages", code="unsupported")
                    _only(part, PART_FIELDS, f"messages[{i}].content[{j}]", "messages")
                    parts.append(part["text"])
                content = "".join(parts)
            if content is None and role == "assistant":
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts, got "
                                    f"{_kind(content)}", param="messages")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        return Request(messages=out)

    def _completion_request(self, f):
        from twice.core.engine import Request

        prompt = f.data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return Request(text=prompt)
        vocab = self.engine.config.vocab_size
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
            return Request(ids=list(prompt))
        if prompt is None:
            raise ApiError(400, "prompt is missing", param="prompt", code="missing_required_parameter")
        if isinstance(prompt, list):  # say which part of the list is wrong, not only that it is a list
            if not prompt:
                raise ApiError(400, "prompt is an empty list (there is nothing to complete)", param="prompt",
                               code="invalid_prompt")
            if all(isinstance(p, (str, list)) for p in prompt):
                raise ApiError(400, f"prompt holds {len(prompt)} prompts; this server completes one prompt per "
                                    "request (send one request each)", param="prompt", code="unsupported")
            i, bad = next((i, t) for i, t in enumerate(prompt) if isinstance(t, bool) or not isinstance(t, int))
            raise ApiError(400, f"prompt[{i}] must be a token id (an integer), got {_kind(bad)} "
                                f"{json.dumps(bad)[:40]}", param="prompt", code="invalid_value")
        raise ApiError(400, f"prompt must be a string, a list of token ids, or a list of one of those, got "
                            f"{_kind(prompt)}", param="prompt")

    def _logprobs(self, f, chat: bool) -> int | None:
        if chat:
            if not f.bool("logprobs", False):
                if f.data.get("top_logprobs") is not None:
                    raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                                   code="invalid_value")
                return None
            return f.int("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        return f.int("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)

    def _constraint(self, f):
        """response_format: text (nothing), or json_object / json_schema through core/constraints.py
        (structured output) where it is installed."""
        fmt = f.dict("response_format", None)
        if fmt is None or fmt.get("type") == "text":
            return None
        try:
            from twice.core import constraints
        except ImportError:
            raise ApiError(400, "response_format other than text is not supported by this build",
                           param="response_format", code="unsupported") from None
        from twice.core.errors import TwiceError

        try:  # the spec only: the scheduler's thread builds the matcher for the model (Scheduler.submit)
            return constraints.constraint_from_response_format(fmt)
        except TwiceError as e:
            raise ApiError(400, str(e), param="response_format", code="invalid_schema") from None


def _strip_source(message: str) -> str:
    return message.removeprefix("request: ")


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


# -- responses ------------------------------------------------------------------------------------
def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Reply:
    """Builds one request's OpenAI objects as its tokens arrive."""

    def __init__(self, chat: bool, model: str, tokenizer, logprobs: int | None):
        self.chat, self.model, self.tokenizer, self.logprobs = chat, model, tokenizer, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.text: list[str] = []
        self.offset = 0  # characters of visible text so far (completions' text_offset)

    def token(self, token: int) -> tuple[str, bytes]:
        """A token as OpenAI's logprobs show it: its text, or for a token holding part of a
        character (an emoji's bytes split over tokens) `bytes:\\xNN...`, and its own bytes."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def logprob_entry(self, event):
        """(token, bytes, logprob, [(token, bytes, logprob)], visible characters it added)."""
        if self.logprobs is None:
            return None
        top = [(*self.token(t), lp) for t, lp in event.top_logprobs]
        return (*self.token(event.token_id), event.logprob, top, len(event.text))

    def logprobs_object(self, entries: list):
        if self.logprobs is None:
            return None
        if self.chat:
            def one(text, raw, lp):
                return {"token": text, "logprob": lp, "bytes": list(raw)}

            return {"content": [{**one(t, raw, lp), "top_logprobs": [one(*alt) for alt in top]}
                                for t, raw, lp, top, _ in entries]}
        offsets = []
        for *_, shown in entries:
            offsets.append(self.offset)
            self.offset += shown
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[2] for e in entries],
                "top_logprobs": [{t: lp for t, _, lp in e[3]} for e in entries], "text_offset": offsets}

    def choice(self, text: str, finish: str | None, entries: list, delta: bool, first: bool = False) -> dict:
        c: dict = {"index": 0}
        if self.chat:
            if delta:
                c["delta"] = ({"role": "assistant", "content": text} if first else ({"content": text} if text else {}))
            else:
                c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self.logprobs_object(entries) if entries or not delta else None
        c["finish_reason"] = finish
        return c

    def envelope(self, choices: list, usage: dict | None = None, chunk: bool = False) -> dict:
        out = {"id": self.id, "object": self.object + (".chunk" if chunk and self.chat else ""),
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not chunk:
            out["usage"] = usage
        if chunk and usage is None and self.chat:
            out.pop("usage", None)
        return out


# -- the app ----------------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int = 64
    cors: list[str] | None = None
    max_body: int = MAX_BODY


class State:
    def __init__(self, worker: Worker, parser: Parser, config: ServerConfig):
        self.worker, self.parser, self.config = worker, parser, config
        self.metrics = Metrics(worker)
        self.draining = False
        self.created = int(time.time())


def create_app(state: State):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    # No trailing-slash redirects: Starlette builds their Location from the client's Host header.
    app = FastAPI(title="twice", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    config = state.config

    def error_response(e: ApiError) -> Response:
        return Response(e.json_bytes(), status_code=e.status, headers=e.headers, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, message, code=code))

    @app.exception_handler(ApiError)
    async def _api_error(request, exc):
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                                       "internal_error"))

    async def read_body(request: HttpRequest):
        from twice.core.fields import describe_json_error, loads, unique_keys

        from starlette.requests import ClientDisconnect

        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # read as JSON it would be "not UTF-8", or worse, taken as it is
            raise ApiError(415, f"content-encoding {json.dumps(encoding)[:60]} is not supported: send the body "
                                "uncompressed", code="unsupported_encoding")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > config.max_body:
                    raise ApiError(413, f"the request body is more than the {config.max_body:,} bytes allowed",
                                   code="body_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # the client went away mid-upload: nobody to answer
            raise ApiError(499, "client closed the request", code="client_closed") from None
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the request body is not UTF-8", code="invalid_json") from None
        try:
            return loads(text, object_pairs_hook=unique_keys)  # {"max_tokens": 2, "max_tokens": 3}: which?
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON: {describe_json_error(e)}",
                           code="invalid_json") from None

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD wherever GET works (HTTP's rule)
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])  # HEAD wherever GET works (HTTP's rule)
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": state.created,
                                            "owned_by": "twice"}]}

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD wherever GET works (HTTP's rule)
    async def metrics():
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    def check_queue():
        worker = state.worker  # its snapshot: the scheduler itself belongs to the worker's thread
        would_wait = worker.snapshot.running + worker.queued >= worker.scheduler.max_batch
        if would_wait and worker.queued >= config.max_queue:
            raise ApiError(429, f"too many requests waiting ({config.max_queue}, --max-queue); retry later",
                           "rate_limit_error", "queue_full", headers={"Retry-After": str(RETRY_AFTER)})

    async def complete(request: HttpRequest, chat: bool):
        arrived = time.perf_counter()
        if state.draining:
            raise ApiError(503, "the server is shutting down", "server_error", "draining")
        body = await read_body(request)
        job = state.parser.parse(body, chat)
        check_queue()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(event):
            loop.call_soon_threadsafe(events.put_nowait, event)

        from twice.core.errors import TwiceError

        try:
            # Tokenized here, on a thread of the pool, not on the scheduler's thread between
            # two steps (a long prompt would hold up every running row's next token).
            prepared = await loop.run_in_executor(None, state.worker.scheduler.prepare, job.request, job.settings)
            check_queue()  # again: others may have queued while this one was tokenized
            future = state.worker.submit(prepared, job.settings, sink, logprobs=job.logprobs,
                                         presence_penalty=job.presence, frequency_penalty=job.frequency,
                                         logit_bias=job.bias, submitted=arrived)
            seq_id = await asyncio.wrap_future(future)
        except ApiError:
            raise
        except TwiceError as e:  # the scheduler refused it (prompt too long, empty, a bad schema, ...)
            raise ApiError(400, str(e), code="invalid_prompt") from None
        reply = Reply(chat, config.model_name, state.parser.engine.tokenizer, job.logprobs)
        if job.stream:
            return StreamingResponse(stream(reply, job, seq_id, events, arrived, request),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(reply, job, seq_id, events, arrived, request)

    def observe_token(event, last: list):
        now = time.perf_counter()
        if event.index == 0:
            state.metrics.ttft.observe(event.elapsed)
        elif last[0] is not None:
            state.metrics.itl.observe(now - last[0])
        last[0] = now

    async def next_event(events, request, seq_id, poll: bool):
        while True:
            try:
                event = await (asyncio.wait_for(events.get(), 1.0) if poll else events.get())
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    state.worker.cancel(seq_id)
                    raise ApiError(499, "client closed the request", code="client_closed") from None
                continue
            if isinstance(event, ApiError):
                raise event
            if event is None:
                raise ApiError(503, "the server is shutting down", "server_error", "draining")
            return event

    def unfinished(r) -> ApiError | None:
        """The error a reply that could not be finished gets instead of a finish_reason:
        cancelled by the drain, or its grammar's engine failed part way (the request's
        grammar is the cause, so a 400: the same request fails the same way)."""
        if r.finish_reason == "cancelled" and state.draining:
            return ApiError(503, "the server shut down before the reply was done", "server_error", "draining")
        if r.finish_reason == "error":
            return ApiError(400, r.error, "invalid_request_error", "constraint_failed")
        return None

    async def collect(reply: Reply, job: Job, seq_id: int, events, arrived: float, request):
        from twice.core.engine import Done

        entries, last = [], [None]
        while True:
            event = await next_event(events, request, seq_id, poll=True)
            if isinstance(event, Done):
                break
            observe_token(event, last)
            entry = reply.logprob_entry(event)
            if entry is not None:
                entries.append(entry)
        r = event.result
        if (failed := unfinished(r)) is not None:
            raise failed
        body = reply.envelope([reply.choice(r.text, FINISH.get(r.finish_reason, "stop"), entries, delta=False)],
                              usage=_usage(r.prompt_tokens, r.generated_tokens))
        state.metrics.latency.labels("/v1/chat/completions" if reply.chat else "/v1/completions").observe(
            time.perf_counter() - arrived)
        return JSONResponse(body)

    async def stream(reply: Reply, job: Job, seq_id: int, events, arrived: float, request):
        from twice.core.engine import Done

        def sse(obj) -> bytes:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

        finished = False
        try:
            last, first = [None], True
            if reply.chat:
                yield sse(reply.envelope([reply.choice("", None, [], delta=True, first=True)], chunk=True))
                first = False
            while True:
                try:
                    event = await next_event(events, request, seq_id, poll=False)
                except ApiError as e:
                    yield b"data: " + e.json_bytes() + b"\n\n"
                    finished = True
                    return
                if isinstance(event, Done):
                    r = event.result
                    finished = True
                    if (failed := unfinished(r)) is not None:
                        yield b"data: " + failed.json_bytes() + b"\n\n"
                        return
                    yield sse(reply.envelope([reply.choice("", FINISH.get(r.finish_reason, "stop"), [], delta=True)],
                                             chunk=True))
                    if job.include_usage:
                        yield sse(reply.envelope([], usage=_usage(r.prompt_tokens, r.generated_tokens), chunk=True))
                    yield b"data: [DONE]\n\n"
                    state.metrics.latency.labels("/v1/chat/completions" if reply.chat else "/v1/completions").observe(
                        time.perf_counter() - arrived)
                    return
                observe_token(event, last)
                entry = reply.logprob_entry(event)
                if not event.text and entry is None:
                    continue
                yield sse(reply.envelope([reply.choice(event.text, None, [entry] if entry else [], delta=True,
                                                       first=first)], chunk=True))
                first = False
        finally:
            if not finished:  # the client went away (or the server is stopping): free the row
                state.worker.cancel(seq_id)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    app.add_middleware(Guard, state=state)
    if config.cors:  # outermost: a preflight is answered before the key is asked for
        app.add_middleware(_cors_middleware(), allow_origins=config.cors, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


def _cors_middleware():
    """Starlette's CORS middleware, its refused preflight (plain text "Disallowed CORS
    origin") answered in the error shape every other refusal has."""
    from fastapi.middleware.cors import CORSMiddleware
    from starlette.responses import Response

    class CORS(CORSMiddleware):
        def preflight_response(self, request_headers):
            answer = super().preflight_response(request_headers)
            if answer.status_code != 400:
                return answer
            headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
            error = ApiError(400, f"{answer.body.decode(errors='replace')} (allowed: {', '.join(self.allow_origins)})",
                             code="cors_refused", headers=headers)
            return Response(error.json_bytes(), status_code=400, headers=error.headers, media_type="application/json")

    return CORS


ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Guard:
    """ASGI middleware (pure, so streams and disconnects pass through untouched): the API
    key (constant-time comparison; /health and CORS preflights need none), the declared
    body size, and the request counter by endpoint and status."""

    def __init__(self, app, state: State):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        config, path = self.state.config, scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        status = [500]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        error = None
        if config.api_key is not None and path != "/health" and scope["method"] != "OPTIONS":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode())):
                error = ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if error is None and length is not None and (not length.isdigit() or int(length) > config.max_body):
            error = ApiError(413, f"the request body is {length[:20]} bytes, more than the {config.max_body:,} "
                                  "allowed", code="body_too_large")
        try:
            if error is not None:
                body = error.json_bytes()
                extra = [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
                await counted({"type": "http.response.start", "status": error.status,
                               "headers": [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(body)).encode()), *extra]})
                await send({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, counted)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()
