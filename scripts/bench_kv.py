"""Issue 17's KV targets in one run: SmolLM2 (the default model) decode at 4096 tokens of context,
batch 1, and at 1024 tokens, batch 16, for each KV cache type (core/benchmark_kv.py; one prefill
of 4096 random tokens serves both: the batch rows take its first 1024 columns).

Each is also timed at --floor tokens (16), where attention costs next to nothing: that step is
what a step pays besides reading the cache (the weights' products, norms, sampling), so no
cache type can be faster than the first type by more than step(first, N) ÷ step(floor) — the
ceiling printed under each table.

    .venv/bin/python scripts/bench_kv.py [--model M] [--dtype bfloat16] [--threads 1] [--json out.json]

--prefill: instead, the eager prefill on a block cache (prompts longer than the native step's
prefill), its attention reading the blocks as stored (prefill.c) against attending to a decoded
copy of the cache's columns (what it did before), in paired rounds: a fresh 2,048-token prompt,
and a 512-token chat turn after 4,096 cached tokens.
"""

from __future__ import annotations

import argparse
import json

import torch

from twice.core import benchmark_kv as bk
from twice.weights.load import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-dtype", action="append", default=None)
    p.add_argument("--floor", type=int, default=16, help="a context where attention costs next to nothing")
    p.add_argument("--json", default=None)
    p.add_argument("--prefill", action="store_true", help="block attention in prefill vs a decoded copy, paired")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load(a.model, None, "cpu", a.dtype)
    if a.prefill:
        return prefill_ab(loaded, a)
    say = lambda m: print(m, flush=True)  # noqa: E731
    one = bk.prefill(loaded.model, 4096 + 16, 4096, say)
    kinds = tuple(a.kv_dtype or ("auto", "q8_0", "q4_0"))
    runs = {"batch 1 x 4096": bk.sweep(loaded.model, [a.floor, 4096], kinds, 1, 16, a.repeats, say, prefilled=one),
            "batch 16 x 1024": bk.sweep(loaded.model, [a.floor, 1024], kinds, 16, 16, a.repeats, say, prefilled=one)}
    report = {}
    for name, points in runs.items():
        top = max(x.context for x in points)
        at_top = [x for x in points if x.context == top]
        floor_s = min(x.step_s for x in points if x.context == a.floor)
        ceiling = at_top[0].step_s / floor_s
        print(f"\n{loaded.name} {a.dtype}, {a.threads} thread(s): {name}")
        for x in at_top:
            print(f"  {x.kv_dtype:9s} KV {x.kv_bytes / 2**20:7.1f} MiB  {x.decode_tokens_per_s:8.1f} tok/s  "
                  f"step {x.step_s * 1000:7.2f} ms  KV share {100 * x.kv_share:3.0f}%  {x.speedup:.2f}x  {x.path}")
        print(f"  ceiling: a step at {a.floor} tokens takes {floor_s * 1000:.2f} ms (fastest type), so no cache type "
              f"can beat {at_top[0].kv_dtype} here by more than {ceiling:.2f}x")
        report[name] = {"points": [x.to_dict() for x in points], "floor_context": a.floor, "floor_step_s": floor_s,
                        "ceiling": ceiling}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def prefill_ab(loaded, a) -> None:
    """Paired rounds of the eager prefill on a block cache, the blocks read as stored (A) or
    decoded into a copy first (B: attention.attend_blocks declining)."""
    import statistics
    import time

    from twice.core import attention
    from twice.core.cache import KVCache

    model, real = loaded.model, attention.attend_blocks
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (1, 4096 + 512), generator=g)
    cases = {"fresh 2048": (0, 2048), "turn 512 after 4096": (4096, 512)}
    report = {}
    for kv in a.kv_dtype or ("q8_0", "q4_0"):
        for name, (cached, new) in cases.items():
            cache = KVCache(model.config, 1, cached + new, loaded.dtype, "cpu", kv_dtype=kv)
            with torch.inference_mode():
                for begin in range(0, cached, 512):  # the cached part, once
                    model(ids[:, begin:begin + 512], cache)
            times = {"blocks": [], "decoded": []}
            for r in range(a.repeats + 1):
                for side in ("blocks", "decoded") if r % 2 else ("decoded", "blocks"):
                    attention.attend_blocks = real if side == "blocks" else (lambda *args: None)
                    cache.length = cached
                    t = time.perf_counter()
                    with torch.inference_mode():
                        model(ids[:, cached:cached + new], cache)
                    if r:  # round 0 warms up
                        times[side].append(time.perf_counter() - t)
            attention.attend_blocks = real
            ratios = [d / b for b, d in zip(times["blocks"], times["decoded"])]
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{kv} {name}: blocks {med['blocks'] * 1000:.0f} ms, decoded copy {med['decoded'] * 1000:.0f} ms, "
                  f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)
            report[f"{kv} {name}"] = {"blocks_s": times["blocks"], "decoded_s": times["decoded"], "ratios": ratios}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
