"""Benchmark `twice serve` against sequential `twice generate` and llama.cpp's server, and
`twice batch`'s refilling against the old shrinking batches.

1. Serving: N concurrent streaming clients (1, 4, 16, 32) against a real `twice serve`
   (started here on a free port), each client sending requests one after another from one
   shared list of mixed prompt lengths (1 to 12 topic sentences, ~10..110 tokens) and
   output lengths (uniform in --max-tokens; eos ignored, so every request writes what it
   asks for). Reported per N: aggregate generated tokens/s (all tokens ÷ the level's wall
   time), TTFT p50/p99 (request sent → its first token's text), inter-token latency
   p50/p99 (gaps between a stream's successive chunks), the load average before and after.
   Every level's requests are the first R of one list (R = 2 per client, at least 8), so
   the levels and the baselines all serve the same requests.
2. Sequential: the same requests one after another through Engine.generate in this
   process (what `twice generate` does per prompt, without its process start and model
   load, both of which would only slow the baseline), same threads, once per round beside
   the servers' levels (each request's median time): each level's speed-up is over the
   sequential time of exactly its requests.
3. Peer (`--peer`, on by default when the model is a GGUF file, the default model
   included): llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, from
   --peer-python's venv) on the same GGUF file with the same threads, driven by the same
   client code and requests (`min_tokens` stands for ignore_eos: it holds back the eos
   token until max_tokens). That server runs one request at a time (one llama context
   behind a lock; it has no n_parallel / continuous batching: concurrent clients queue,
   `--interrupt_requests False` so a new request does not cut the running one off).
4. Batch: mixed-length prompts through Engine.generate_batch in fixed batches (rows drop
   out as they finish; the old `twice batch`) and through the scheduler with that many rows
   (a finished row's place goes to the next prompt; `twice batch` now).

Rounds (--rounds K): each level runs K times, twice and the peer alternating (which goes
first swaps every round), the sequential baseline once a round (first in odd rounds, last
in even ones), and the median round is reported, so a load change hits all three.

  .venv/bin/python scripts/bench_serve.py --threads 1 --json serve-smollm2.json     # the full run
  .venv/bin/python scripts/bench_serve.py --threads 1 --json serve-qwen.json \\
      --model ~/.cache/twice/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m-*.gguf
  .venv/bin/python scripts/bench_serve.py --quick                                  # a smoke run

--quick: levels 1,4, 8 requests, outputs 8..24, 4 sequential requests, a small batch
comparison, one round. Run the full one on a quiet machine: every number is a wall-clock
rate. Prints a table and, with --json FILE, writes every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

TWICE = [sys.executable, "-c", "from twice.cli.app import main; main()"]
TOPICS = ["the history of the printing press", "how a refrigerator works", "why the sky is blue",
          "the rules of chess", "photosynthesis", "how to bake bread", "the water cycle", "black holes",
          "the French revolution", "how vaccines work", "plate tectonics", "the invention of the telephone"]
PEER_PYTHON = "/work/peer-venv/bin/python"


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def workload(n: int, max_tokens: tuple[int, int], seed: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs: prompts of 1 to 12 topic sentences, outputs uniform in
    the range. workload(m) starts with workload(n) for m > n (one generator, drawn in order)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        parts = [f"Tell me about {rng.choice(TOPICS)}." for _ in range(rng.randint(1, 12))]
        out.append((f"Request {i}: " + " ".join(parts), rng.randint(*max_tokens)))
    return out


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


class Server:
    """A server process: `twice serve` (port 0: it prints the port) or the peer's."""

    def __init__(self, name: str, argv: list[str], url: str | None = None):
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = url
        self.log: list[str] = []
        if url is None:  # twice serve: the line says where
            for line in self.proc.stderr:
                if line.startswith("listening on "):
                    self.url = line.split()[2]
                    break
                self.log.append(line)
            if self.url is None:
                raise SystemExit(f"{name} did not start:\n" + "".join(self.log[-20:]))
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr], daemon=True).start()
        if url is not None:
            self._wait_ready()

    def _wait_ready(self, timeout: float = 600) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}):\n" + "".join(self.log[-20:]))
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a starting process, not synchronizing a test
        raise SystemExit(f"{self.name} did not answer within {timeout:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def twice_server(model: str | None, dtype: str, threads: int | None, max_batch: int) -> Server:
    flags = ["--dtype", dtype, "--max-batch", str(max_batch), "--max-queue", "1000", "--port", "0"]
    if model:
        flags += ["-m", model]
    if threads:
        flags += ["--threads", str(threads)]
    return Server("twice serve", [*TWICE, "serve", *flags])


def peer_server(python: str, gguf: str, threads: int | None, context: int) -> Server:
    port = free_port()
    t = str(threads or os.cpu_count())
    argv = [python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", t, "--n_threads_batch", t, "--n_ctx", str(context), "--interrupt_requests", "False",
            "--logits_all", "False", "--verbose", "False"]
    return Server("llama.cpp server", argv, url=f"http://127.0.0.1:{port}")


async def client_level(url: str, model: str, jobs: list[tuple[str, int]], clients: int, peer: bool) -> dict:
    """`clients` streaming clients over the jobs (each takes the next one when done)."""
    import httpx

    ttft, itl, tokens, short, errors = [], [], [0], [0], []
    queue = list(jobs)

    async def one_client(http):
        while queue:
            prompt, n = queue.pop(0)
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
            if model:
                body["model"] = model
            body.update({"min_tokens": n} if peer else {"ignore_eos": True})
            sent, last, chunks, finish = time.perf_counter(), None, 0, None
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # the stream ended with an error object
                        errors.append(chunk["error"].get("message", str(chunk["error"])))
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue
                    finish = choices[0].get("finish_reason") or finish
                    if not choices[0].get("text"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        itl.append(now - last)
                    last, chunks = now, chunks + 1
            # finish "length": it wrote max_tokens tokens; else (an end token the peer let
            # through) the chunks it sent, one a token
            tokens[0] += n if finish == "length" else chunks
            short[0] += finish != "length"

    before = load_average()
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=clients + 4)) as http:
        await asyncio.gather(*(one_client(http) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(jobs), "tokens": tokens[0], "ended_early": short[0], "wall_s": wall,
            "tokens_per_s": tokens[0] / wall, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99), "load_before": before,
            "load_after": load_average(), "errors": len(errors), "first_error": errors[0] if errors else None}


def sequential(engine, jobs) -> list[dict]:
    """Each request alone through Engine.generate (as `twice generate` runs it): its tokens and seconds."""
    from twice.core.engine import Done, GenerationSettings, Request

    out = []
    for prompt, n in jobs:
        t0 = time.perf_counter()
        tokens = 0
        for e in engine.generate(Request(text=prompt), GenerationSettings(max_new_tokens=n, ignore_eos=True),
                                 reuse_cache=False):
            if isinstance(e, Done):
                tokens = e.result.generated_tokens
        out.append({"tokens": tokens, "seconds": time.perf_counter() - t0, "load": load_average()})
    return out


def sequential_rate(runs: list[dict], k: int) -> tuple[float, bool]:
    """tokens/s of the first k requests one after another (measured: exact; else the rate
    over the measured ones, and False)."""
    part = runs[:k]
    return sum(r["tokens"] for r in part) / sum(r["seconds"] for r in part), len(part) >= k


def batch_compare(engine, jobs, size: int) -> dict:
    from twice.core.engine import Done, GenerationSettings, Request
    from twice.core.scheduler import Scheduler

    ids = [engine.tokenize(Request(text=p)) for p, _ in jobs]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for _, n in jobs]
    order = sorted(range(len(jobs)), key=lambda i: len(ids[i]))  # as twice batch sorts
    before = load_average()
    t0, tokens = time.perf_counter(), 0
    for k in range(0, len(order), size):
        rows = order[k:k + size]
        for e in engine.generate_batch([Request(ids=ids[i]) for i in rows], [settings[i] for i in rows]):
            if isinstance(e, Done):
                tokens += e.result.generated_tokens
    shrinking = time.perf_counter() - t0
    s = Scheduler(engine, max_batch=size, prefix_reuse=False)
    t0, tokens2 = time.perf_counter(), 0
    for i in order:
        s.submit(ids[i], settings[i])
    for e in s.run():
        if isinstance(e, Done):
            tokens2 += e.result.generated_tokens
    refilling = time.perf_counter() - t0
    return {"batch_size": size, "prompts": len(jobs), "tokens": tokens, "shrinking_tokens_per_s": tokens / shrinking,
            "refilling_tokens_per_s": tokens2 / refilling, "speedup": shrinking / refilling * tokens2 / max(tokens, 1),
            "refills": s.counters.joined_running, "relayouts": s.counters.relayouts, "load_before": before,
            "load_after": load_average()}


def median_round(rounds: list[dict]) -> dict:
    """The round with the median tokens/s (its own TTFT/ITL with it), plus every round's rate."""
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in rounds]
    return out


def peer_file(model: str | None) -> str | None:
    """The GGUF file the model is (the default model: its Q4_1 file), else None."""
    if model is None:
        from twice.weights.resolve import default_gguf

        return str(default_gguf())
    return model if model.lower().endswith(".gguf") and Path(model).is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct Q4_1, as "
                                                  "`twice generate` runs it)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="both servers and the baseline (default: all)")
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 per client, at least 8)")
    ap.add_argument("--max-tokens", default="16,128", help="output lengths: uniform in LO,HI")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each level (the median is reported)")
    ap.add_argument("--sequential", type=int, default=0,
                    help="requests measured one by one (default: the largest level's; --quick: 4)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows for the batch comparison (0: skip it)")
    ap.add_argument("--batch-prompts", type=int, default=64)
    ap.add_argument("--peer", choices=["auto", "llama.cpp", "none"], default="auto",
                    help="auto: llama.cpp's server when the model is a GGUF file and --peer-python has it")
    ap.add_argument("--peer-python", default=PEER_PYTHON, help="a python with llama-cpp-python[server]")
    ap.add_argument("--quick", action="store_true", help="a smoke run: levels 1,4, 8 requests, outputs 8..24")
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args()
    if args.quick:
        args.clients = "1,4" if args.clients == "1,4,16,32" else args.clients
        args.requests = args.requests or 8
        args.max_tokens = "8,24" if args.max_tokens == "16,128" else args.max_tokens
        args.sequential = args.sequential or 4
        args.batch_prompts, args.batch_size = min(args.batch_prompts, 8), min(args.batch_size, 4)
    levels = [int(x) for x in args.clients.split(",")]
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    per_level = {n: args.requests or max(8, 2 * n) for n in levels}
    jobs = workload(max(per_level.values()), (lo, hi), seed=1)

    from twice.core.device import set_threads
    from twice.core.engine import Engine
    from twice.weights.load import load

    model = args.model
    gguf = peer_file(model)
    use_peer = args.peer == "llama.cpp" or (args.peer == "auto" and gguf is not None and Path(args.peer_python).exists())
    if use_peer and gguf is None:
        raise SystemExit("--peer llama.cpp needs the model as a GGUF file")
    if args.threads:
        set_threads(args.threads)
    report: dict = {"model": model or "default (SmolLM2-135M-Instruct Q4_1)", "gguf": gguf, "cpu_count": os.cpu_count(),
                    "threads": args.threads, "max_tokens": [lo, hi], "rounds": args.rounds, "levels": levels,
                    "serve": [], "peer": [], "load_start": load_average()}
    loaded = load(model, None, "cpu", args.dtype)  # the baseline's engine, in this process
    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids)
    k = args.sequential or max(per_level.values())
    sequential(engine, workload(2, (4, 8), 99)[:1])  # warm-up
    seq_rounds: list[list[dict]] = []
    servers = {"twice": twice_server(model, args.dtype, args.threads, max(levels))}
    try:
        if use_peer:
            servers["llama.cpp"] = peer_server(args.peer_python, gguf, args.threads, 4096)
        warm = workload(2, (4, 8), 99)
        for name, server in servers.items():  # first requests build kernels / page the weights in
            asyncio.run(client_level(server.url, "", warm, 1, peer=name != "twice"))
        results: dict = {name: {n: [] for n in levels} for name in servers}
        for r in range(args.rounds):
            if r % 2 == 1:  # the baseline first in odd rounds, last in even ones
                seq_rounds.append(sequential(engine, jobs[:k]))
            for n in levels:
                names = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in names:
                    res = asyncio.run(client_level(servers[name].url, "", jobs[:per_level[n]], n,
                                                   peer=name != "twice"))
                    results[name][n].append(res)
                    print(f"round {r + 1} {name} {n} clients: {res['tokens_per_s']:.1f} tok/s "
                          f"(load {res['load_before']}->{res['load_after']})", file=sys.stderr, flush=True)
                    if res["errors"]:
                        print(f"  {res['errors']} streams ended with an error, the first: {res['first_error']}",
                              file=sys.stderr, flush=True)
            if r % 2 == 0:
                seq_rounds.append(sequential(engine, jobs[:k]))
            rate, _ = sequential_rate(seq_rounds[-1], k)
            print(f"round {r + 1} sequential: {rate:.1f} tok/s (load {seq_rounds[-1][0]['load']}->"
                  f"{seq_rounds[-1][-1]['load']})", file=sys.stderr, flush=True)
        report["serve"] = [median_round(results["twice"][n]) for n in levels]
        if use_peer:
            report["peer"] = [median_round(results["llama.cpp"][n]) for n in levels]
    finally:
        for server in servers.values():
            server.stop()
    # each request's median time over the rounds
    runs = [{"tokens": rs[0]["tokens"], "seconds": statistics.median(x["seconds"] for x in rs),
             "load": statistics.median(x["load"] for x in rs)} for rs in zip(*seq_rounds)]
    report["sequential"] = {"requests": len(runs), "runs": runs, "rounds": seq_rounds}
    for level in report["serve"] + report["peer"]:
        rate, exact = sequential_rate(runs, level["requests"])
        level["sequential_tokens_per_s"], level["sequential_exact"] = rate, exact
        level["vs_sequential"] = level["tokens_per_s"] / rate
    if args.batch_size:
        report["batch"] = batch_compare(engine, workload(args.batch_prompts, (lo, hi * 2), seed=7), args.batch_size)
    report["load_end"] = load_average()

    print(f"model {report['model']}  ({os.cpu_count()} CPUs, threads {args.threads or 'all'}; outputs {lo}..{hi} "
          f"tokens, eos ignored; median of {args.rounds} round(s))")
    seq_all, _ = sequential_rate(runs, len(runs))
    print(f"sequential generate: {seq_all:,.1f} tok/s over {len(runs)} requests "
          f"(load {runs[0]['load'] if runs else '-'}..{runs[-1]['load'] if runs else '-'})")
    print(f"{'server':>9} {'clients':>7} {'reqs':>5} {'tok/s':>8} {'vs seq':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'load':>11}")
    for name, rows in (("twice", report["serve"]), ("llama.cpp", report["peer"])):
        for r in rows:
            mark = "" if r["sequential_exact"] else "~"
            print(f"{name:>9} {r['clients']:>7} {r['requests']:>5} {r['tokens_per_s']:>8,.1f} "
                  f"{mark + format(r['vs_sequential'], '.2f'):>6}x {r['ttft_p50_s'] * 1e3:>7.0f}ms "
                  f"{r['ttft_p99_s'] * 1e3:>7.0f}ms {r['itl_p50_s'] * 1e3:>6.1f}ms {r['itl_p99_s'] * 1e3:>6.1f}ms "
                  f"{r['load_before']:>5}-{r['load_after']:<5}")
    if any(not r["sequential_exact"] for r in report["serve"] + report["peer"]):
        print("~: over the sequential rate of the first requests measured (--sequential)")
    if report["peer"]:
        for t, p in zip(report["serve"], report["peer"]):
            print(f"{t['clients']} clients: twice / llama.cpp server = {t['tokens_per_s'] / p['tokens_per_s']:.2f}x")
    b = report.get("batch")
    if b:
        print(f"batch of {b['batch_size']} rows, {b['prompts']} prompts: shrinking {b['shrinking_tokens_per_s']:,.1f} "
              f"tok/s, refilling {b['refilling_tokens_per_s']:,.1f} tok/s ({b['speedup']:.2f}x; {b['refills']} refills, "
              f"{b['relayouts']} cache layouts; load {b['load_before']}-{b['load_after']})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
