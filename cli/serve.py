"""`twice serve`: an OpenAI-compatible HTTP server over the engine's scheduler.

The model loads once; a worker thread owns the scheduler (core/scheduler.py: requests
join and leave one running batch); uvicorn serves the FastAPI app of cli/serve_http.py,
which talks to that thread through queues and never touches tensors. SIGTERM (or Ctrl-C)
drains: no new connections, requests in flight get up to --drain-seconds to finish (then
they are cancelled), exit 0.
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Annotated, Optional

import typer

from twice.core.errors import UsageError

from . import options as o
from .app import app

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
DRAIN_GRACE = 5.0  # seconds past --drain-seconds for the cancelled requests' replies


@app.command()
def serve(
    model: o.Model = None,
    revision: o.Revision = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    dequantize: o.Dequantize = False,
    quantize: o.Quantize = None,
    host: Annotated[str, typer.Option(help="Address to listen on. Default 127.0.0.1 (this machine only); "
                                           "another address warns when there is no --api-key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: a free one, printed).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="TWICE_API_KEY", show_default=False,
        help="Require Authorization: Bearer KEY on every endpoint but /health (also TWICE_API_KEY).")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Most requests decoded together (rows of the "
                                                               "KV cache).")] = 8,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Most requests waiting for a row; beyond it, "
                                                               "429 with Retry-After (0: none waits; a "
                                                               "request that finds a free row always runs).")] = 64,
    drain_seconds: Annotated[float, typer.Option("--drain-seconds", help="On SIGTERM, how long requests in "
                                                                        "flight may take to finish.")] = 30.0,
    cors: Annotated[Optional[list[str]], typer.Option("--cors", help="Allow browser requests from this origin "
                                                                    "(repeatable; '*' for any). Default: off.")] = None,
    model_name: Annotated[Optional[str], typer.Option("--model-name", help="The model id clients see and send. "
                                                                          "Default: the model's name.")] = None,
    no_prefix_cache: Annotated[bool, typer.Option("--no-prefix-cache", help="Never copy a shared prompt start "
                                                                            "from another request's cache.")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens per reply when a request "
                                                                               "gives no max_tokens.")] = 512,
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    repetition_penalty: o.RepPenalty = None,
    seed: o.Seed = None,
    prefill_chunk: Annotated[int, typer.Option(help="Prompt tokens prefilled per scheduler step, over all "
                                                    "joining requests (the longest a prompt delays the "
                                                    "others' next token).")] = 512,
    threads: o.Threads = None,
    compile: o.Compile = False,
    kv_dtype: o.KvDtype = "auto",
):
    """Serve the model over an OpenAI-compatible HTTP API (chat and text completions)."""
    o.check_flags(max_new_tokens, prefill_chunk, temperature, top_k, top_p, min_p, repetition_penalty, seed,
                  None, threads)
    o.check_kv_dtype(kv_dtype)
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    if max_batch < 1 or max_batch > 1024:
        raise UsageError(f"--max-batch must be in 1..1024, got {max_batch}")
    if max_queue < 0:
        raise UsageError(f"--max-queue must be at least 0, got {max_queue}")
    if not drain_seconds >= 0:
        raise UsageError(f"--drain-seconds must be at least 0, got {drain_seconds}")
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise UsageError("--api-key (or TWICE_API_KEY) must be a non-empty key without spaces")
    weights = o.weights_choice(dequantize, quantize)
    sock = _listen(host, port)  # before the model loads: a busy port fails at once
    o.apply_threads(threads)
    try:
        _serve(sock, host, api_key, max_batch, max_queue, drain_seconds, cors, model_name, not no_prefix_cache,
               model, revision, device, dtype, weights, compile, prefill_chunk, kv_dtype,
               (max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed))
    finally:
        sock.close()


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host}: not an address this machine can listen on ({e})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _say(message: str) -> None:
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def _serve(sock, host, api_key, max_batch, max_queue, drain_seconds, cors, model_name, prefix_reuse, model,
           revision, device, dtype, weights, compile, prefill_chunk, kv_dtype, sampling_flags) -> None:
    import uvicorn

    from twice.core.engine import Engine, GenerationSettings
    from twice.core.scheduler import Scheduler
    from twice.weights.load import load

    from .serve_http import Parser, ServerConfig, State, Worker, create_app

    built = {}

    def build():  # on the worker's thread (Worker.start: one OpenMP pool for loading and stepping)
        built["loaded"] = loaded = load(model, revision, device, dtype, weights=weights)
        engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids, compile=compile, kv_dtype=kv_dtype)
        scheduler = Scheduler(engine, max_batch=max_batch, prefill_chunk=prefill_chunk, prefix_reuse=prefix_reuse)
        o.settle_loaded()
        return scheduler

    worker = Worker()
    engine, loaded = worker.start(build).engine, built["loaded"]
    try:
        max_new, temperature, top_k, top_p, min_p, repetition_penalty, seed = sampling_flags
        sampling = o.sampling_params(loaded.generation.sampling, temperature, top_k, top_p, min_p, repetition_penalty,
                                     seed)
        base = GenerationSettings(max_new_tokens=max_new, sampling=sampling)
        if (compiled := o.compile_note(engine, compile)) is not None:
            _say(f"note: {compiled}")
        name = model_name or loaded.name
        state = State(worker, Parser(engine, name, base, engine.context_length),
                      ServerConfig(name, api_key=api_key, max_queue=max_queue, cors=list(cors) if cors else None))
        if host not in LOCAL_HOSTS and api_key is None:
            _say(f"note: listening on {host} without an API key: anyone who can reach this address can use the "
                 "model (--api-key or TWICE_API_KEY)")
        # uvicorn cancels the tasks still running at its graceful timeout (their clients then get a
        # bare 500): the worker cancels the requests at --drain-seconds instead, and their replies
        # (503 `draining`) get DRAIN_GRACE more seconds to be written.
        config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=drain_seconds + DRAIN_GRACE, log_config=None)
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: drain, and exit 0 (uvicorn would re-raise the signal)
                if not state.draining:
                    state.draining = True
                    _say(f"draining: finishing requests in flight (at most {drain_seconds:g} s)")
                    deadline = threading.Timer(drain_seconds, worker.cancel_all)
                    deadline.daemon = True
                    deadline.start()
                if self.should_exit:
                    self.force_exit = True
                self.should_exit = True

            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:
                    cache = f", {engine.kv_dtype} KV cache" if engine.kv_dtype else ""
                    _say(f"listening on http://{shown}:{bound[1]} (model {name}, {engine.decode_path} step{cache}, "
                         f"at most {max_batch} requests together)")

        Server(config).run(sockets=[sock])
    finally:
        worker.stop(timeout=max(5.0, drain_seconds))
    _say("stopped")
