#!/usr/bin/env python3
"""How close the native matrix kernels come to this CPU's limits, on a model's shapes.

Batch 1 decode is bound by memory bandwidth; a batch reads each weight once for all its
rows and becomes bound by the vector units instead. This script measures the multiply-add
peak (core/kernels/peak.c, registers only, as `twice bench` does) and then twice's `gemm`
kernel (core/kernels/gemv.c) on each projection of the model, the weights cycling through
copies larger than the caches, for 1, 4 and 16 rows:

    python scripts/kernel_bench.py                    # SmolLM2-135M shapes, 2 threads
    python scripts/kernel_bench.py --shape llama-3.2-1b --threads 8
    python scripts/kernel_bench.py --quant Q4_1,Q4_K,Q6_K,Q8_0,Q5_0   # quantized weights (qdot.c)

It reports GMAC/s, the share of the peak, and for one row the GB/s the weights stream at.
With --quant, the GGUF block kernels (q_gemm, activations prepared once per call) run on
--quant-shapes (out×in; default 576×1536 and 896×4864, SmolLM2's and Qwen2.5-0.5B's widths)
instead: GB/s of weight bytes as stored, GMAC/s, and each batch's rows/s against batch 1's,
beside the read bandwidth twice bench holds decode against (a torch sum over 512 MiB).
--against REV builds the quantized kernels (qdot*.c) of a git revision as well and times both
in paired alternating rounds (the machine's load moves both alike), printing the speedup:

    python scripts/kernel_bench.py --quant Q4_K,Q6_K,Q5_0,Q8_0 --quant-shapes 1536x8960,8960x1536 \
        --threads 1 --rows 1,4,16 --cpu-time --against eca8693

--x8 times the 32-value types' interleaved 8-row layout (core/quant/interleave.py) against
their rows as stored, in the same build, paired alternating rounds; "per row" is the call's
time over rows × the one-row call's (1/that is the batch's speedup per row):

    python scripts/kernel_bench.py --quant Q4_1,Q8_0,Q5_0 --quant-shapes 576x1536,1536x576,49152x576,896x4864 \
        --threads 1 --rows 1,4,16 --cpu-time --x8 --rounds 5

With --against as well, the x8 layout of this build against REV's (paired rounds), beside the
int8 multiply-add peak (core/kernels/peak.c):

    python scripts/kernel_bench.py --quant Q4_1,Q8_0 --quant-shapes 576x1536,49152x576 --threads 1 \
        --rows 1,4,16 --cpu-time --x8 --against HEAD --rounds 3

--step [MODEL] times a whole native decode step (default model: SmolLM2) at --rows, x8 against
rows as stored (two loads), paired rounds: the 16-row step over the 1-row step is what
`twice serve`'s batching can gain:

    python scripts/kernel_bench.py --step --threads 1 --rows 1,4,16 --cpu-time --rounds 5

With --against REV as well: the whole native library of REV (every kernel source) beside this
tree's, one load of the model, two decoders, paired rounds (--step-dtype: the activations';
--step-kv-dtype: the cache's, e.g. q8_0 with --position 1024 for the block attention):

    python scripts/kernel_bench.py --step qwen2.5-coder-0.5b-instruct-q4_k_m --threads 2 --rows 1,16 \
        --against HEAD --rounds 7 --step-dtype bfloat16

Needs a C compiler (as the kernels do); never run in CI.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from twice.core import kernels
from twice.core.benchmark import shape_config


def projections(shape: str) -> list[tuple[str, int, int]]:
    """(name, out, in) of one layer's fused projections and the head, as twice stores them."""
    c = shape_config(shape)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [("qkv", q + 2 * kv, c.hidden_size), ("o", c.hidden_size, q), ("gate_up", 2 * c.intermediate_size,
            c.hidden_size), ("down", c.hidden_size, c.intermediate_size), ("head", c.vocab_size, c.hidden_size)]


def time_gemm(lib, dtype: torch.dtype, out: int, n: int, rows: int, threads: int, repeats: int = 5) -> float:
    """Best seconds per call, weights cycling through copies that add up to ≥ 256 MiB."""
    el = torch.tensor([], dtype=dtype).element_size()
    copies = max(1, (256 << 20) // (out * n * el))
    ws = [torch.randn(out, n).to(dtype) for _ in range(min(copies, 64))]
    x = torch.randn(rows, n).to(dtype)
    y = torch.empty(rows, out)
    bf16 = int(dtype == torch.bfloat16)
    call = lambda w: lib.gemm(w.data_ptr(), x.data_ptr(), y.data_ptr(), out, n, rows, bf16, threads)  # noqa: E731
    for w in ws[:3]:
        call(w)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in ws:
            call(w)
        best = min(best, (time.perf_counter() - t) / len(ws))
    return best


def weight_copies(ggml_type: int, out: int, n: int) -> list[torch.Tensor]:
    """Copies (≥ 256 MiB together, at most 64) of one [out, n] matrix of random floats quantized
    to `ggml_type` (its x8 layout: ggml_type + X8, interleaved). Real blocks, not random bytes:
    random bytes make fp16 scales NaN, infinite or subnormal, which slows the float steps
    (Q4_K at 16 rows, Zen 4: ~135 against ~159 GMAC/s)."""
    from twice.core import quant
    from twice.core.quant import interleave

    base = ggml_type - interleave.X8 if ggml_type >= interleave.X8 else ggml_type
    c = quant.BY_GGML_TYPE[base]
    g = torch.Generator().manual_seed(0)
    data = quant.quantize(torch.randn(out, n, generator=g) * 0.02, c.name).reshape(out, -1).contiguous()
    if base != ggml_type:
        assert kernels.interleave_rows(data, base, n)
    copies = max(1, (256 << 20) // data.numel())
    return [data.clone() for _ in range(min(copies, 64))]


def time_quant(lib, ggml_type: int, out: int, n: int, rows: int, threads: int, repeats: int = 5,
               clock=time.perf_counter) -> tuple[float, float]:
    """Best seconds per q_gemm call and per q_prepare call, weights cycling through copies of
    ≥ 256 MiB (weight_copies)."""
    ws = weight_copies(ggml_type, out, n)
    x = torch.randn(rows, n)
    xq = torch.empty(rows * lib.q_act_bytes(ggml_type, n), dtype=torch.uint8)
    y = torch.empty(rows, out)
    prepare = lambda: lib.q_prepare(ggml_type, x.data_ptr(), n, rows, xq.data_ptr())  # noqa: E731
    call = lambda w: lib.q_gemm(ggml_type, w.data_ptr(), out, n, xq.data_ptr(), rows, y.data_ptr(), out,  # noqa: E731
                                threads)
    prepare()
    for w in ws[:3]:
        call(w)
    best = best_prepare = float("inf")
    for _ in range(repeats):
        t = clock()
        for w in ws:
            call(w)
        best = min(best, (clock() - t) / len(ws))
        t = clock()
        for _ in range(20):
            prepare()
        best_prepare = min(best_prepare, (clock() - t) / 20)
    return best, best_prepare


QDOT = ("qdot.c", "qdot_legacy.c", "qdot_kquants.c", "qdot.h")


def build_qdot_at(rev: str):
    """The quantized kernels of git revision `rev` alone (qdot*.c, qdot.h), built as the
    kernels are (-O3 -march=native -fopenmp) into a temporary library, for side-by-side timing."""
    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp(prefix="twice-qdot-"))
    for name in QDOT:
        text = subprocess.run(["git", "-C", str(root), "show", f"{rev}:core/kernels/{name}"], capture_output=True,
                              check=True).stdout
        (folder / name).write_bytes(text)
    lib = folder / "qdot.so"
    cc = os.environ.get("CC") or "cc"
    subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", *[str(folder / n) for n in QDOT[:3]],
                    "-o", str(lib), "-lm"], check=True)
    handle = ctypes.CDLL(str(lib))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("q_row_bytes", "q_act_bytes"):
        getattr(handle, name).restype = i64
        getattr(handle, name).argtypes = [ctypes.c_int, i64]
    handle.q_prepare.argtypes = [ctypes.c_int, p, i64, i64, p]
    handle.q_gemm.argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, i64, ctypes.c_int]
    return handle


def read_bandwidth() -> float:
    """GB/s of twice bench's roofline read (core/benchmark.measure_bandwidth: a float sum over
    512 MiB, torch's threads). torch's sum is no fast reader on one core (a hand-written AVX2
    read streams ~2.5x as fast there): a batch-1 kernel may pass it."""
    from twice.core.benchmark import measure_bandwidth

    return measure_bandwidth("cpu")["read_bytes_per_s"] / 1e9


def paired_quant(lib, other, ggml_type: int, out: int, n: int, rows: int, threads: int, rounds: int,
                 clock=time.perf_counter) -> tuple[float, float]:
    """Best seconds per q_gemm call of `lib` and of `other` (another build), the same weights
    and prepared activations, timed in alternating rounds."""
    ws = weight_copies(ggml_type, out, n)
    x = torch.randn(rows, n)
    xq = torch.empty(rows * lib.q_act_bytes(ggml_type, n), dtype=torch.uint8)
    lib.q_prepare(ggml_type, x.data_ptr(), n, rows, xq.data_ptr())
    y = torch.empty(rows, out)
    best = {id(lib): float("inf"), id(other): float("inf")}
    for h in (lib, other):
        for w in ws[:3]:
            h.q_gemm(ggml_type, w.data_ptr(), out, n, xq.data_ptr(), rows, y.data_ptr(), out, threads)
    for _ in range(rounds):
        for h in (other, lib):
            t = clock()
            for w in ws:
                h.q_gemm(ggml_type, w.data_ptr(), out, n, xq.data_ptr(), rows, y.data_ptr(), out, threads)
            best[id(h)] = min(best[id(h)], (clock() - t) / len(ws))
    return best[id(lib)], best[id(other)]


def paired_types(lib, types: tuple[int, int], out: int, n: int, rows: int, threads: int, rounds: int,
                 clock=time.perf_counter) -> tuple[float, float]:
    """Best seconds per q_gemm call of two type ids of one build (a type and its x8 layout: the
    same matrix, weight_copies), alternating rounds."""
    ws = {t: weight_copies(t, out, n) for t in types}
    x = torch.randn(rows, n)
    xq = torch.empty(rows * lib.q_act_bytes(types[0], n), dtype=torch.uint8)
    lib.q_prepare(types[0], x.data_ptr(), n, rows, xq.data_ptr())
    y = torch.empty(rows, out)
    best = [float("inf"), float("inf")]
    for t in types:
        for w in ws[t][:3]:
            lib.q_gemm(t, w.data_ptr(), out, n, xq.data_ptr(), rows, y.data_ptr(), out, threads)
    for _ in range(rounds):
        for i in (1, 0):
            t0 = clock()
            for w in ws[types[i]]:
                lib.q_gemm(types[i], w.data_ptr(), out, n, xq.data_ptr(), rows, y.data_ptr(), out, threads)
            best[i] = min(best[i], (clock() - t0) / len(ws[types[i]]))
    return best[0], best[1]


def x8_main(args, lib, clock) -> None:
    from twice.core import quant
    from twice.core.quant import interleave

    shapes = [tuple(map(int, s.lower().split("x"))) for s in args.quant_shapes.split(",")]
    print(f"x8 (interleaved 8 rows) against rows as stored: paired alternating rounds ({args.rounds}); "
          "per row = time / (rows × the 1-row time)")
    print(f"{'type':6} {'out × in':>13} {'rows':>4} {'x8':>9} {'stored':>9} {'speedup':>7} {'GMAC/s':>7} "
          f"{'per row x8':>10} {'stored':>7}")
    for name in args.quant.split(","):
        c = quant.codec(name)
        for out, n in shapes:
            if c.name not in interleave.TYPES or out % 8 or lib.q_row_bytes(c.ggml_type, n) < 0:
                print(f"{c.name:6} {out:>6} × {n:<5}  (no x8 layout for this type or shape: skipped)")
                continue
            base = None
            for rows in map(int, args.rows.split(",")):
                s, then = paired_types(lib, (c.ggml_type + interleave.X8, c.ggml_type), out, n, rows, args.threads,
                                       args.rounds, clock)
                base = base or (s, then)
                print(f"{c.name:6} {out:>6} × {n:<5} {rows:>4} {s * 1e3:>7.3f}ms {then * 1e3:>7.3f}ms "
                      f"{then / s:>6.2f}x {out * n * rows / s / 1e9:>7.1f} {s / (rows * base[0]):>10.3f} "
                      f"{then / (rows * base[1]):>7.3f}", flush=True)


def build_kernels_at(rev: str):
    """The whole native library (every kernel source) of git revision `rev`, built as the
    kernels are, for a native step timed beside this tree's (the weights' layouts must agree)."""
    from twice.core import kernels

    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp(prefix="twice-kernels-at-"))
    for path in kernels.SOURCES + kernels.HEADERS:
        got = subprocess.run(["git", "-C", str(root), "show", f"{rev}:core/kernels/{path.name}"], capture_output=True)
        if got.returncode and path in kernels.HEADERS:  # a header newer than `rev`: its sources never include it
            got.stdout = b""
        elif got.returncode:
            raise SystemExit(f"kernel_bench: {rev} has no core/kernels/{path.name}")
        (folder / path.name).write_bytes(got.stdout)
    lib = kernels._build(source_dir=folder)
    if lib is None:
        raise SystemExit(f"kernel_bench: the kernels of {rev} did not build")
    return lib


def time_steps(steppers: dict, rows_list: list[int], rounds: int, position: int, clock) -> dict:
    """The best seconds a native step takes for each (name, rows), steppers[name][rows] = (step,
    its cache), 8 steps at the cache column `position` a time, in paired rounds (the names'
    order reversed every round)."""
    tokens = {r: torch.randint(0, 1000, (r, 1)) for r in rows_list}
    names = list(steppers)
    best = {(name, r): float("inf") for name in names for r in rows_list}
    for k in range(rounds):
        for r in rows_list:
            for name in (names if k % 2 else names[::-1]):
                native, cache = steppers[name][r]
                cache.length = position
                t = clock()
                for _ in range(8):
                    native(tokens[r], cache)
                    cache.length = position
                best[name, r] = min(best[name, r], (clock() - t) / 8)
    return best


def step_against_main(args) -> None:
    """The native decode step of a model with this tree's kernels and with --against's, one
    load, two decoders (the second calling the other library), paired alternating rounds."""
    from twice.core.cache import KVCache
    from twice.core.native_decode import NativeDecoder
    from twice.weights.load import load

    clock = time.thread_time if args.cpu_time else time.perf_counter
    m = load(args.step or None, device="cpu", dtype=args.step_dtype)
    now, then = NativeDecoder(m.model), NativeDecoder(m.model)
    then.lib = build_kernels_at(args.against)
    dtype = getattr(torch, args.step_dtype)
    print(f"native step of {m.name} ({args.step_dtype}, kv {args.step_kv_dtype or 'auto'}), {args.threads} thread(s), "
          f"position {args.position}: this tree against {args.against}, {args.rounds} paired rounds; load average {os.getloadavg()[0]:.1f}")
    rows_list = list(map(int, args.rows.split(",")))
    caches = {r: KVCache(m.config, r, args.position + 64, dtype, "cpu", kv_dtype=args.step_kv_dtype) for r in rows_list}
    best = time_steps({name: {r: (native, caches[r]) for r in rows_list} for name, native in (("now", now), ("then", then))},
                      rows_list, args.rounds, args.position, clock)
    print(f"{'rows':>4} {'now':>9} {'then':>9} {'speedup':>7}")
    for r in rows_list:
        a, b = best["now", r], best["then", r]
        print(f"{r:>4} {a * 1e3:>7.2f}ms {b * 1e3:>7.2f}ms {b / a:>6.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


def step_main(args) -> None:
    """The native decode step of a whole model (default: twice's default model) at each of
    --rows, with its 32-value types interleaved and with its rows as stored (two loads, one
    process, TWICE_INTERLEAVE read at each load), paired alternating rounds: the serve lever is
    the 16-row step's time over the 1-row step's."""
    from twice.core.cache import KVCache
    from twice.core.native_decode import NativeDecoder
    from twice.weights.load import load

    clock = time.thread_time if args.cpu_time else time.perf_counter
    models = {}
    for layout, env in (("x8", "1"), ("stored", "0")):
        os.environ["TWICE_INTERLEAVE"] = env
        m = load(args.step or None, device="cpu", dtype="float32")
        models[layout] = (m, NativeDecoder(m.model))
    os.environ.pop("TWICE_INTERLEAVE")
    print(f"native step of {models['x8'][0].name}, {args.threads} thread(s), position {args.position}, "
          f"{args.rounds} paired rounds; load average {os.getloadavg()[0]:.1f}")
    rows_list = list(map(int, args.rows.split(",")))
    # the columns before the position hold zeros: the attention reads them all the same
    best = time_steps({layout: {r: (native, KVCache(m.config, r, args.position + 64, torch.float32, "cpu"))
                                for r in rows_list} for layout, (m, native) in models.items()},
                      rows_list, args.rounds, args.position, clock)
    print(f"{'rows':>4} {'x8':>9} {'stored':>9} {'speedup':>7} {'x8 vs 1 row':>11} {'stored vs 1 row':>15}")
    for r in rows_list:
        x, s = best["x8", r], best["stored", r]
        print(f"{r:>4} {x * 1e3:>7.2f}ms {s * 1e3:>7.2f}ms {s / x:>6.2f}x {x / best['x8', rows_list[0]]:>10.2f}x "
              f"{s / best['stored', rows_list[0]]:>14.2f}x", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


def quant_main(args, lib) -> None:
    from twice.core import quant

    shapes = [tuple(map(int, s.lower().split("x"))) for s in args.quant_shapes.split(",")]
    clock = time.perf_counter
    if args.cpu_time:
        if args.threads != 1:
            sys.exit("--cpu-time measures the calling thread: use it with --threads 1")
        clock = time.thread_time
    print(f"quantized weights, {args.threads} threads (q_gemm; prepare = q_prepare of the activations)"
          + (", thread CPU time" if args.cpu_time else "") + f"; load average {os.getloadavg()[0]:.1f}")
    print(f"read bandwidth (twice bench's roofline, torch sum): {read_bandwidth():.1f} GB/s")
    if args.x8 and not args.against:
        x8_main(args, lib, clock)
        return
    other = build_qdot_at(args.against) if args.against else None
    x8 = 0
    if args.x8:  # --x8 --against: the interleaved layout of both builds
        from twice.core.quant import interleave

        x8 = interleave.X8
        peak = kernels.peak_macs(torch.int8, args.threads) or 0
        print(f"x8 layout of both builds; int8 peak (u8·s8 multiply-adds), {args.threads} threads: "
              f"{peak / 1e9:.1f} GMAC/s")
    if other is not None:
        print(f"against {args.against}: paired alternating rounds ({args.rounds}); 'then' = {args.against}'s time")
        print(f"{'type':6} {'out × in':>13} {'rows':>4} {'time':>9} {'then':>9} {'speedup':>7} {'GMAC/s':>7} "
              f"{'GB/s':>6} {'vs rows=1':>9}")
    else:
        print(f"{'type':6} {'out × in':>13} {'rows':>4} {'time':>9} {'prepare':>9} {'GMAC/s':>7} {'GB/s':>6} "
              f"{'vs rows=1':>9}")
    for name in args.quant.split(","):
        c = quant.codec(name)
        for out, n in shapes:
            if lib.q_row_bytes(c.ggml_type, n) < 0:
                print(f"{c.name:6} {out:>6} × {n:<5}  (rows of {n} are not whole blocks of {c.block_size}: skipped)")
                continue
            base = None
            for rows in map(int, args.rows.split(",")):
                if other is not None:
                    if x8 and out % 8:
                        print(f"{c.name:6} {out:>6} × {n:<5}  (no x8 layout for this shape: skipped)")
                        break
                    s, then = paired_quant(lib, other, c.ggml_type + x8, out, n, rows, args.threads, args.rounds,
                                           clock)
                else:
                    s, p = time_quant(lib, c.ggml_type, out, n, rows, args.threads, clock=clock)
                base = base or s
                gbs = out * lib.q_row_bytes(c.ggml_type, n) / s / 1e9
                gmacs = out * n * rows / s / 1e9
                middle = (f"{then * 1e3:>7.3f}ms {then / s:>6.2f}x" if other is not None else f"{p * 1e6:>7.1f}us")
                print(f"{c.name:6} {out:>6} × {n:<5} {rows:>4} {s * 1e3:>7.3f}ms {middle} {gmacs:>7.1f} {gbs:>6.1f} "
                      f"{rows * base / s:>8.1f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--quant", default="", help="GGUF weight types to measure instead, e.g. Q4_K,Q6_K")
    p.add_argument("--quant-shapes", default="576x1536,896x4864")
    p.add_argument("--against", default="", help="with --quant: a git revision whose qdot*.c to time side by side (with --x8: both x8); "
                   "with --step: that revision's whole native library against this tree's")
    p.add_argument("--rounds", type=int, default=5, help="with --against or --x8: paired rounds")
    p.add_argument("--x8", action="store_true",
                   help="with --quant: the interleaved 8-row layout against the rows as stored (32-value types)")
    p.add_argument("--cpu-time", action="store_true",
                   help="with --quant --threads 1: time the thread's CPU seconds (a busy shared machine)")
    p.add_argument("--step", nargs="?", const="", default=None, metavar="MODEL",
                   help="the native decode step of MODEL (default: twice's default model), x8 against rows as stored")
    p.add_argument("--position", type=int, default=64, help="with --step: the cache column each step writes")
    p.add_argument("--step-dtype", default="float32", help="with --step --against: the activations' dtype")
    p.add_argument("--step-kv-dtype", default=None, help="with --step --against: the KV cache's type (e.g. q8_0)")
    args = p.parse_args()
    lib = kernels.library()
    if lib is None:
        sys.exit("the native kernels did not build here (no C compiler?)")
    torch.set_num_threads(args.threads)
    if args.step is not None:
        step_against_main(args) if args.against else step_main(args)
        return
    if args.quant:
        quant_main(args, lib)
        return
    peak = {key: kernels.peak_macs(dtype, args.threads) or 0
            for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    print(f"multiply-add peak, {args.threads} threads: fp32 {peak['fp32'] / 1e9:.1f} GMAC/s, "
          f"bf16 {peak['bf16'] / 1e9:.1f} GMAC/s")
    print(f"{'dtype':8} {'projection':10} {'out × in':>13} {'rows':>4} {'time':>9} {'GMAC/s':>8} {'% peak':>7} {'GB/s':>6}")
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for name, out, n in projections(args.shape):
            for rows in map(int, args.rows.split(",")):
                s = time_gemm(lib, dtype, out, n, rows, args.threads)
                macs = out * n * rows / s
                share = f"{100 * macs / peak[key]:.0f}%" if peak[key] else "—"
                gbs = out * n * torch.tensor([], dtype=dtype).element_size() / s / 1e9
                print(f"{key:8} {name:10} {out:>6} × {n:<5} {rows:>4} {s * 1e3:>7.3f}ms {macs / 1e9:>8.1f} {share:>7} "
                      f"{gbs:>6.1f}")


if __name__ == "__main__":
    main()
