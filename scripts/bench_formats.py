#!/usr/bin/env python3
"""Issue 14's speed targets for twice's own formats, side by side in one run (never in CI).

The default model (SmolLM2-135M-Instruct) in six configurations, each loaded once, in this one
process, on the same threads:

- float32, bf16: its float copy (`--dequantize --dtype float32|bfloat16`), the references;
- q8_0, q4_0 and a K mixture (q4_k_m by default, `--kquant q4_k_s`): quantized in memory from
  the float copy while loading (`--quantize TYPE`, in `--quant-dtype`, bfloat16 by default);
- q4_1: the shipped Q4_1 GGUF as stored (in `--quant-dtype` too).

Measured with core/benchmark.run_twice (what `twice bench` runs: one warm-up run, then a timed
one, per measurement), in paired rounds: every round measures everything once, the order
reversed every other round, so a neighbour's load on a shared machine falls on all alike; each
target's ratio is taken within a round, and the report gives the median of the per-round
ratios with their min–max, next to each side's median:

  (a) batch-1 decode tok/s (twice bench's decode workload: 32-token prompt, 256 new tokens,
      the engine's decode rate) of q8_0 and q4_0 against bf16 (targets ≥ 1.5× and ≥ 2×) and
      against float32; q4_1 and the K mixture beside;
  (b) the K mixture's aggregate decode tok/s at batch 16 against batch 1 (twice bench's batch
      workloads: 32-token prompts, 64 new tokens; target ≥ 5×);
  (c) prefill tok/s of 2,048 tokens (twice bench's prefill workload) of the K mixture and the
      shipped q4_1 against bf16 (target ≥ 0.8×) and against float32.

`--threads 2,1` measures each thread count in turn (all rounds of one, then the next), the
models loaded once. The machine's load average is printed before and after (and with every
round); decode's achieved bandwidth is the weight bytes one step reads × tok/s, against the
read bandwidth measured before and after (core/benchmark.measure_bandwidth, the best of both).

    python scripts/bench_formats.py --threads 2,1 --rounds 5 --json out.json
    python scripts/bench_formats.py --rounds 1 --quick          # a smoke run (lengths / 8)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import find_gguf, step_bytes  # noqa: E402  (scripts/bench_quant.py, beside this file)

FLOATS = ("float32", "bf16")


def configurations(kquant: str, quant_dtype: str) -> dict[str, tuple[str | None, str]]:
    """name → (load()'s `weights`, dtype)."""
    return {"float32": ("dequantize", "float32"), "bf16": ("dequantize", "bfloat16"),
            "q8_0": ("q8_0", quant_dtype), "q4_0": ("q4_0", quant_dtype), kquant: (kquant, quant_dtype),
            "q4_1": (None, quant_dtype)}


BATCH_ALL = ("float32", "q8_0", "q4_0")  # --batch-all: their batch ratios beside the K mixture's


def plan(kquant: str, batch: int, prefill_all: bool, batch_all: bool = False) -> list[tuple[str, str]]:
    """(configuration, workload) pairs, one measurement each per round."""
    decode = [(c, "decode") for c in ("float32", "bf16", "q8_0", "q4_0", kquant, "q4_1")]
    batches = [(c, w) for c in (kquant, *(BATCH_ALL if batch_all else ())) for w in ("batch1", f"batch{batch}")]
    prefills = ["float32", "bf16", kquant, "q4_1"] + (["q8_0", "q4_0"] if prefill_all else [])
    return decode + batches + [(c, "prefill") for c in prefills]


def ratios(kquant: str, batch: int, prefill_all: bool, batch_all: bool = False) -> list[dict]:
    """What is compared: numerator and denominator measurements, the metric, the target."""
    def r(section, num, den, metric, target=None):
        return {"section": section, "num": num, "den": den, "metric": metric, "target": target}

    d, p = "decode_tokens_per_s", "prefill_tokens_per_s"
    out = [r("decode", ("q8_0", "decode"), ("bf16", "decode"), d, 1.5),
           r("decode", ("q4_0", "decode"), ("bf16", "decode"), d, 2.0),
           r("decode", ("q8_0", "decode"), ("float32", "decode"), d),
           r("decode", ("q4_0", "decode"), ("float32", "decode"), d),
           r("decode", ("q4_1", "decode"), ("bf16", "decode"), d),
           r("decode", (kquant, "decode"), ("bf16", "decode"), d),
           r("decode", ("bf16", "decode"), ("float32", "decode"), d),
           r("batch", (kquant, f"batch{batch}"), (kquant, "batch1"), d, 5.0),
           r("prefill", (kquant, "prefill"), ("bf16", "prefill"), p, 0.8),
           r("prefill", ("q4_1", "prefill"), ("bf16", "prefill"), p, 0.8),
           r("prefill", (kquant, "prefill"), ("float32", "prefill"), p),
           r("prefill", ("q4_1", "prefill"), ("float32", "prefill"), p)]
    if prefill_all:
        out += [r("prefill", (q, "prefill"), ("bf16", "prefill"), p) for q in ("q8_0", "q4_0")]
    if batch_all:
        out += [r("batch", (c, f"batch{batch}"), (c, "batch1"), d) for c in BATCH_ALL]
    return out


def key(measure: tuple[str, str]) -> str:
    return f"{measure[0]}/{measure[1]}"


class Loaded:
    """One configuration: its model loaded once, its engine (the native step where it applies)."""

    def __init__(self, name: str, weights: str | None, dtype: str):
        from twice.core.engine import Engine
        from twice.weights.load import load

        t0 = time.perf_counter()
        self.lm = load(None, device="cpu", dtype=dtype, weights=weights)
        self.load_s = time.perf_counter() - t0
        self.engine = Engine(self.lm.model, self.lm.tokenizer)
        self.name, self.weights = name, weights

    def info(self) -> dict:
        e, lm = self.engine, self.lm
        return {"weights": self.weights or "as stored (the shipped GGUF)", "dtype": str(lm.dtype).replace("torch.", ""),
                "decode_path": e.decode_path, "weight_bytes": e.weight_bytes, "weight_format": e.weight_format,
                "load_s": self.load_s}


def workloads(args) -> dict:
    from twice.core.benchmark import WORKLOADS, Workload, scaled

    w = {"decode": Workload("decode", 32, args.decode_tokens),
         "prefill": Workload("prefill", args.prefill_tokens, WORKLOADS["prefill"].new_tokens),
         "batch1": WORKLOADS["batch1"], f"batch{args.batch}": Workload(f"batch{args.batch}", 32, 64, args.batch)}
    return {k: scaled(v, 8) for k, v in w.items()} if args.quick else w


def measure(loaded: Loaded, w) -> dict:
    from twice.core.benchmark import run_twice

    run = run_twice(loaded.engine, w.prompt_tokens, w.new_tokens, w.batch, repeats=1)
    d = run.to_dict()
    d.pop("steps_s", None)
    return d


def paired(rounds: list[dict], spec: dict) -> dict:
    num, den, m = key(spec["num"]), key(spec["den"]), spec["metric"]
    a = [r[num][m] for r in rounds]
    b = [r[den][m] for r in rounds]
    per = [x / y for x, y in zip(a, b) if y]
    out = dict(spec, num=num, den=den, num_median=statistics.median(a), den_median=statistics.median(b),
               ratio=statistics.median(per) if per else None, ratio_min=min(per, default=None),
               ratio_max=max(per, default=None), ratios=per)
    out["met"] = None if spec["target"] is None or out["ratio"] is None else out["ratio"] >= spec["target"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="2", help="thread counts, comma-separated (each measured in turn): 2,1")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds per thread count")
    p.add_argument("--kquant", default="q4_k_m", choices=("q4_k_m", "q4_k_s"), help="the Q4_K mixture")
    p.add_argument("--quant-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of the quantized configurations (activations, norms, cache): the float copy they "
                        "are quantized from is loaded in it")
    p.add_argument("--batch", type=int, default=16, help="the batch of (b)")
    p.add_argument("--decode-tokens", type=int, default=256, help="new tokens of the batch-1 decode workload")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--prefill-all", action="store_true", help="also prefill q8_0 and q4_0")
    p.add_argument("--batch-all", action="store_true", help="also batch vs batch 1 for float32, q8_0 and q4_0")
    p.add_argument("--quick", action="store_true", help="every length divided by 8 (a smoke run)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        p.error(f"--threads: comma-separated integers, got {args.threads!r}")
    if not threads or min(threads) < 1 or args.rounds < 1 or args.batch < 2:
        p.error("--threads must be at least 1, --rounds at least 1, --batch at least 2")

    import torch

    from twice.core.benchmark import best_bandwidth, measure_bandwidth

    say = lambda m: print(f"bench_formats: {m}", file=sys.stderr, flush=True)  # noqa: E731
    gguf = find_gguf("smollm2")
    work = workloads(args)
    report: dict = {"model": "SmolLM2-135M-Instruct", "gguf": str(gguf), "shipped_bytes": step_bytes(gguf),
                    "threads": threads, "rounds": args.rounds, "kquant": args.kquant, "quant_dtype": args.quant_dtype,
                    "quick": args.quick, "torch": torch.__version__, "loadavg_before": os.getloadavg(),
                    "workloads": {k: asdict(v) for k, v in work.items()},
                    "definition": {"decode_tokens_per_s": "core/benchmark.run_twice: batch 1 the engine's decode rate "
                                   "(tokens after the first over their seconds); batch > 1 all rows' tokens after "
                                   "the first over the decode span",
                                   "prefill_tokens_per_s": "prompt tokens / prefill seconds",
                                   "ratio": "median over rounds of the ratio within a round (min-max beside)"}}
    bw_before = measure_bandwidth("cpu")
    loaded: dict[str, Loaded] = {}
    for name, (weights, dtype) in configurations(args.kquant, args.quant_dtype).items():
        say(f"loading {name} (weights={weights or 'as stored'}, dtype={dtype})")
        loaded[name] = Loaded(name, weights, dtype)
        info = loaded[name].info()
        say(f"  {name}: {info['decode_path']} step, {info['weight_bytes'] / 2**20:.0f} MiB, "
            f"{info['weight_format'].get('bits_per_weight', 0):.2f} bits/weight, loaded in {info['load_s']:.1f} s")
        if info["decode_path"] != "native":
            say(f"  note: {name} decodes through the {info['decode_path']} step, not the native one")
    report["configurations"] = {n: c.info() for n, c in loaded.items()}
    measures = plan(args.kquant, args.batch, args.prefill_all, args.batch_all)
    specs = ratios(args.kquant, args.batch, args.prefill_all, args.batch_all)
    report["runs"] = {}
    for t in threads:
        torch.set_num_threads(t)
        rounds = []
        for r in range(args.rounds):
            order = measures if r % 2 == 0 else list(reversed(measures))
            results = {}
            for config, wname in order:
                results[key((config, wname))] = measure(loaded[config], work[wname])
            rounds.append(results)
            line = ", ".join(f"{key(m)} {results[key(m)][spec_metric(m)]:.1f}" for m in measures)
            say(f"{t} threads, round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.2f}): {line}")
        report["runs"][str(t)] = {"rounds": rounds, "ratios": [paired(rounds, s) for s in specs],
                                  "medians": {k: {m: statistics.median(x[k][m] for x in rounds)
                                                  for m in ("decode_tokens_per_s", "prefill_tokens_per_s")}
                                              for k in rounds[0]}}
    bw = best_bandwidth(bw_before, measure_bandwidth("cpu"))
    report["bandwidth"] = bw
    report["loadavg_after"] = os.getloadavg()
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def spec_metric(measure: tuple[str, str]) -> str:
    return "prefill_tokens_per_s" if measure[1] == "prefill" else "decode_tokens_per_s"


TITLES = {"decode": "batch-1 decode tok/s", "batch": "aggregate decode tok/s", "prefill": "prefill tok/s"}


def mix(formats: dict) -> str:
    """A mixture's types by share of the weights (SmolLM2's rows of 576 hold no 256-value K block:
    llama.cpp's rules put Q5_0 / Q8_0 there, so its q4_k_m is mostly Q5_0)."""
    types = formats.get("types") or {}
    total = sum(types.values())
    if len(types) < 2 or not total:
        return ""
    return ": " + ", ".join(f"{t} {100 * v / total:.0f}%" for t, v in types.items())


def render(r: dict) -> str:
    c = r["configurations"]
    w = r["workloads"]
    lines = [f"SmolLM2-135M-Instruct; quantized configurations in {r['quant_dtype']}, the K mixture {r['kquant']}; "
             f"{r['rounds']} paired rounds" + (" (quick: lengths / 8)" if r["quick"] else ""),
             "configurations: " + "; ".join(
                 f"{n} {x['decode_path']} {x['dtype']} {x['weight_bytes'] / 2**20:.0f} MiB "
                 f"({x['weight_format'].get('bits_per_weight', 0):.2f} b/w{mix(x['weight_format'])})"
                 for n, x in c.items()),
             "workloads: " + "; ".join(f"{k} P={v['prompt_tokens']} G={v['new_tokens']} B={v['batch']}"
                                      for k, v in w.items())]
    read = r["bandwidth"]["read_bytes_per_s"]
    for t, run in r["runs"].items():
        lines += ["", f"**{t} thread{'s' if t != '1' else ''}**", "",
                  "| measure | tok/s | reference tok/s | ratio (median of paired rounds, min–max) | target |",
                  "|---|---|---|---|---|"]
        for s in run["ratios"]:
            ratio = f"{s['ratio']:.3f}× ({s['ratio_min']:.2f}–{s['ratio_max']:.2f})" if s["ratio"] else "—"
            target = "" if s["target"] is None else f"≥ {s['target']}× {'met' if s['met'] else 'MISSED'}"
            lines.append(f"| {TITLES[s['section']]}: {s['num']} vs {s['den']} | {s['num_median']:,.1f} | "
                         f"{s['den_median']:,.1f} | {ratio} | {target} |")
        achieved = []
        for n in c:
            k = f"{n}/decode"
            if k in run["medians"]:
                rd = run["rounds"][0][k]
                tps = run["medians"][k]["decode_tokens_per_s"]
                achieved.append(f"{n} {rd['bytes_read_per_step'] * tps / 1e9:.1f} GB/s")
        lines.append(f"decode bandwidth (weights + cache per step × tok/s): {', '.join(achieved)} "
                     f"of {read / 1e9:.1f} GB/s read (measured)")
    la, lb = r["loadavg_before"], r["loadavg_after"]
    lines.append(f"load average before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, after {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
