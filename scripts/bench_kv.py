"""Issue 17's KV targets in one run: SmolLM2 (the default model) decode at 4096 tokens of context,
batch 1, and at 1024 tokens, batch 16, for each KV cache type (core/benchmark_kv.py; one prefill
of 4096 random tokens serves both: the batch rows take its first 1024 columns).

    .venv/bin/python scripts/bench_kv.py [--model M] [--dtype bfloat16] [--threads 1] [--json out.json]
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
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load(a.model, None, "cpu", a.dtype)
    say = lambda m: print(m, flush=True)  # noqa: E731
    one = bk.prefill(loaded.model, 4096 + 16, 4096, say)
    kinds = tuple(a.kv_dtype or ("auto", "q8_0", "q4_0"))
    runs = {"batch 1 x 4096": bk.sweep(loaded.model, [4096], kinds, 1, 16, a.repeats, say, prefilled=one),
            "batch 16 x 1024": bk.sweep(loaded.model, [1024], kinds, 16, 16, a.repeats, say, prefilled=one)}
    for name, points in runs.items():
        print(f"\n{loaded.name} {a.dtype}, {a.threads} thread(s): {name}")
        for x in points:
            print(f"  {x.kv_dtype:9s} KV {x.kv_bytes / 2**20:7.1f} MiB  {x.decode_tokens_per_s:8.1f} tok/s  "
                  f"step {x.step_s * 1000:7.2f} ms  KV share {100 * x.kv_share:3.0f}%  {x.speedup:.2f}x  {x.path}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: [x.to_dict() for x in v] for k, v in runs.items()}, f, indent=1)


if __name__ == "__main__":
    main()
