"""Quantizer speed: twice's torch quantizers (core/quant) against their C port
(core/kernels/quantize.c), in M values/s per type, on 1 and 2 threads, in paired alternating
rounds (torch, C, torch, C, ...: a change of machine load hits both), with the load average.

    .venv/bin/python scripts/bench_quantize.py [--values 1048576] [--rounds 3] [--threads 1,2]
        [--types q8_0,q4_k,...] [--json OUT.json]

Both sides quantize the same random float32 values (normal, scale 0.02, as weights are) and the
bytes are checked equal once per type. "2 threads" is the quantizers' own parallelism (the C
one's OpenMP runs, the torch one's Python worker threads), measured as if the cores were free
(quantize() itself uses no more threads than the load average leaves free).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from twice.core import quant

TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]


def _load() -> str:
    try:
        return "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "?"


def _time(fn, min_seconds: float = 0.3) -> float:
    """Seconds per call: the best of repeated calls filling at least min_seconds."""
    best = float("inf")
    spent = 0.0
    calls = 0
    while spent < min_seconds or calls < 2:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best = min(best, dt)
        spent += dt
        calls += 1
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=1 << 20, help="values per C call (torch: a quarter of them for the K types)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lib = quant.native_library()
    if lib is None:
        print("no native kernels here (no C compiler, or TWICE_NATIVE_KERNELS=0)", file=sys.stderr)
        return 1
    quant._free_cores = lambda: os.cpu_count() or 1  # measure the quantizers, not the load policy
    threads = [int(t) for t in args.threads.split(",")]
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"load before: {_load()}   cpu: {os.cpu_count()} cores   values: {args.values}")
    print(f"{'type':6} {'thr':>3} {'torch M/s':>10} {'C M/s':>9} {'C/torch':>8}   load")
    for name in args.types.split(","):
        c = quant.codec(name)
        n_c = max(1, args.values // c.block_size)
        # the slow torch K quantizers get fewer values (per-value speed is what is reported)
        n_t = max(1, n_c // 4) if c.block_size == 256 else n_c
        x = (torch.randn(n_c, c.block_size, generator=gen) * 0.02).contiguous()
        xt = x[:n_t].contiguous()
        ref = c.quantize_blocks(xt)
        got = quant._quantize_native(c, xt, 1)
        if not torch.equal(ref, got):
            print(f"{name}: C bytes differ from torch's", file=sys.stderr)
            return 1
        for t in threads:
            torch_s, c_s = [], []
            saved = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for _ in range(args.rounds):
                    torch_s.append(_time(lambda: quant._quantize_parts(c, xt, t)) / xt.numel())
                    c_s.append(_time(lambda: quant._quantize_native(c, x, t)) / x.numel())
            finally:
                torch.set_num_threads(saved)
            tm, cm = 1e-6 / min(torch_s), 1e-6 / min(c_s)
            load = _load()
            rows.append({"type": c.name, "threads": t, "torch_mvals_s": tm, "c_mvals_s": cm, "speedup": cm / tm,
                         "load": load})
            print(f"{c.name:6} {t:3d} {tm:10.2f} {cm:9.1f} {cm / tm:7.1f}x   {load}", flush=True)
    print(f"load after: {_load()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "values": args.values, "rounds": args.rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
