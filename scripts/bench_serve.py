"""Benchmark `twice serve` and `twice batch`'s refilling against what came before.

1. Serving: N concurrent streaming clients (1, 4, 16, 32) against a real `twice serve`
   (started here on a free port), each sending requests of mixed prompt and output lengths
   (eos ignored, so lengths are as asked). Reported per N: aggregate generated tokens/s
   (all tokens ÷ the wall time of the level), TTFT p50/p99 (request sent → first token's
   text), inter-token latency p50/p99 (gaps between a stream's successive tokens).
   Baseline: the same requests one after another through Engine.generate (what
   `twice generate` does per prompt, without its process start): aggregate tokens/s.
2. Batch: the same mixed-length prompts through Engine.generate_batch in fixed batches
   (rows drop out as they finish; the old `twice batch`) and through the scheduler with
   that many rows (a finished row's place goes to the next prompt; `twice batch` now).

  .venv/bin/python scripts/bench_serve.py                     # SmolLM2-135M-Instruct, the issue's levels
  .venv/bin/python scripts/bench_serve.py --model DIR --clients 1,4 --requests 8 --max-tokens 8,32 --quick

Run it on a quiet machine: every number is a wall-clock rate. Prints a table and, with
--json FILE, writes every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

TWICE = [sys.executable, "-c", "from twice.cli.app import main; main()"]
TOPICS = ["the history of the printing press", "how a refrigerator works", "why the sky is blue",
          "the rules of chess", "photosynthesis", "how to bake bread", "the water cycle", "black holes",
          "the French revolution", "how vaccines work", "plate tectonics", "the invention of the telephone"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def workload(n: int, max_tokens: tuple[int, int], seed: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs: prompts of 1 to 4 topic sentences, outputs uniform in the range."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        parts = [f"Tell me about {rng.choice(TOPICS)}." for _ in range(rng.randint(1, 4))]
        out.append((f"Request {i}: " + " ".join(parts), rng.randint(*max_tokens)))
    return out


class Server:
    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([*TWICE, "serve", *args, "--port", "0"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.url = None
        for line in self.proc.stderr:
            if line.startswith("listening on "):
                self.url = line.split()[2]
                break
            sys.stderr.write(line)
        if self.url is None:
            raise SystemExit("the server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(120)


async def client_level(url: str, model: str, jobs: list[tuple[str, int]], clients: int) -> dict:
    import httpx

    ttft, itl, tokens = [], [], [0]
    queue = list(jobs)

    async def one_client(http):
        while queue:
            prompt, n = queue.pop(0)
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            sent = time.perf_counter()
            last = None
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    if choice["finish_reason"] is not None and not choice["text"]:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        itl.append(now - last)
                    last = now
            usage_tokens = n
            tokens[0] += usage_tokens

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        await asyncio.gather(*(one_client(http) for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(jobs), "tokens": tokens[0], "wall_s": wall,
            "tokens_per_s": tokens[0] / wall, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99)}


def sequential(engine, jobs) -> dict:
    from twice.core.engine import Done, GenerationSettings, Request

    t0, tokens = time.perf_counter(), 0
    for prompt, n in jobs:
        for e in engine.generate(Request(text=prompt), GenerationSettings(max_new_tokens=n, ignore_eos=True),
                                 reuse_cache=False):
            if isinstance(e, Done):
                tokens += e.result.generated_tokens
    wall = time.perf_counter() - t0
    return {"requests": len(jobs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def batch_compare(engine, jobs, size: int) -> dict:
    from twice.core.engine import Done, GenerationSettings, Request
    from twice.core.scheduler import Scheduler

    ids = [engine.tokenize(Request(text=p)) for p, _ in jobs]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for _, n in jobs]
    order = sorted(range(len(jobs)), key=lambda i: len(ids[i]))  # as twice batch sorts
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
            "refills": s.counters.joined_running, "relayouts": s.counters.relayouts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: 2 per client, at least 8)")
    ap.add_argument("--max-tokens", default="16,128", help="output lengths: uniform in LO,HI")
    ap.add_argument("--batch-size", type=int, default=16, help="rows for the batch comparison")
    ap.add_argument("--batch-prompts", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="skip the sequential baseline's larger levels")
    ap.add_argument("--json", default=None, help="write every number to this file")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    lo, hi = (int(x) for x in args.max_tokens.split(","))

    from twice.core.device import set_threads
    from twice.core.engine import Engine
    from twice.weights.load import load
    from twice.weights.resolve import default_model

    model = args.model or str(default_model())
    if args.threads:
        set_threads(args.threads)
    flags = ["-m", model, "--dtype", args.dtype, "--max-batch", str(max(levels)), "--max-queue", "1000"]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    report: dict = {"model": model, "cpu_count": os.cpu_count(), "serve": [], "max_tokens": [lo, hi]}
    server = Server(flags)
    try:
        asyncio.run(client_level(server.url, model, workload(2, (4, 8), 99), 1))  # warm-up
        for n in levels:
            jobs = workload(args.requests or max(8, 2 * n), (lo, hi), seed=n)
            report["serve"].append(asyncio.run(client_level(server.url, model, jobs, n)))
    finally:
        server.stop()
    loaded = load(model, None, "cpu", args.dtype)
    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids)
    base_jobs = workload(args.requests or max(8, 2 * min(levels)), (lo, hi), seed=0)
    if args.quick:
        base_jobs = base_jobs[:8]
    report["sequential"] = sequential(engine, base_jobs)
    report["batch"] = batch_compare(engine, workload(args.batch_prompts, (lo, hi * 2), seed=7), args.batch_size)

    seq = report["sequential"]["tokens_per_s"]
    print(f"model {model}  ({os.cpu_count()} CPUs; output lengths {lo}..{hi}, eos ignored)")
    print(f"sequential generate: {seq:,.1f} tok/s over {report['sequential']['requests']} requests")
    print(f"{'clients':>7} {'requests':>8} {'tok/s':>9} {'vs seq':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}")
    for r in report["serve"]:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['tokens_per_s']:>9,.1f} {r['tokens_per_s'] / seq:>6.2f}x "
              f"{r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p99_s'] * 1e3:>7.0f}ms {r['itl_p50_s'] * 1e3:>6.1f}ms "
              f"{r['itl_p99_s'] * 1e3:>6.1f}ms")
    b = report["batch"]
    print(f"batch of {b['batch_size']} rows, {b['prompts']} prompts: shrinking {b['shrinking_tokens_per_s']:,.1f} tok/s, "
          f"refilling {b['refilling_tokens_per_s']:,.1f} tok/s ({b['speedup']:.2f}x; {b['refills']} refills, "
          f"{b['relayouts']} cache layouts)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
