#!/usr/bin/env python3
"""Issue 15's benchmark: twice's native decode step against transformers, per model family.

For each random-weight shape of a real model (core/benchmark.SHAPES: gemma-3-270m,
gemma-2-2b, phi-3-mini, olmo-2-1b, qwen3-30b-a3b, mixtral-8x7b; fewer layers / experts
where the entry's comment says) and each dtype:

- twice: Engine(native=True); its decode_path must be "native" (asserted, and every run's
  result says which step ran), unless the model declares a feature the native step does not
  implement (then the row says "eager" and which features are missing);
- transformers: core/benchmark.hf_twin(share=True): the same config and the very same weight
  memory, `generate(do_sample=False)`, dynamic or static cache (--hf-cache; "best" times both
  once after the warm-up and keeps the faster);
- same prompt (seeded random ids), same greedy length, same threads; both warmed up once
  (and the greedy tokens of the two compared), then --rounds paired rounds, alternating which
  side runs first; the ratio twice tok/s / transformers tok/s per round, median and min–max.
- mixture-of-experts shapes also against a dense shape reading as many parameters per token
  (benchmark.dense_equivalent: the same attention and head, one MLP as wide as the chosen
  experts): MoE step time / dense step time, paired rounds, both on twice's native step.

The issue's bar: ratio >= 3 at batch 1 in bf16 (and float32: an AVX2 CPU's auto dtype), and
MoE time within 1.5x of the dense model's.

Both sides are memory-bound at batch 1, so each row also gives the share of the measured read
bandwidth (core/benchmark.measure_bandwidth, best of before and after) that each side's decode
reaches: the bytes one step reads (the weights a token uses, as stored, and the cache at the
mean position) times tok/s. 1 / transformers' share is the most any step could beat it by on
this machine (`ceiling`): a ratio of 3 needs transformers below a third of the bandwidth.

    python scripts/bench_families.py --threads 2 --rounds 5 --json bench_families.json
    python scripts/bench_families.py --shapes gemma-3-270m --dtypes float32 --rounds 3
    python scripts/bench_families.py --check     # the twins give our logits at small sizes (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from twice.core import benchmark as b
from twice.core import native_decode
from twice.core.config import config_from_dict
from twice.core.engine import Done, Engine, GenerationSettings, Request
from twice.core.hugepages import release_freed_memory
from twice.core.models import family

FAMILY_SHAPES = ("gemma-3-270m", "gemma-2-2b-4l", "phi-3-mini-4l", "olmo-2-1b-4l", "qwen3-30b-a3b-4l16e",
                 "mixtral-8x7b-1l4e")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_moe(shape: dict) -> bool:
    return shape["model_type"] in ("mixtral", "qwen3_moe", "qwen2_moe")


def counts(config) -> dict:
    fam = family(config.model_type)
    total = config.parameter_count()
    active = fam.active_parameter_count(config) if fam.active_parameter_count else total
    return {"parameters": total, "active_parameters": active}


def build(shape: dict, name: str, dtype: torch.dtype, seed: int = 0):
    config = config_from_dict(dict(shape), source=f"shape {name}")
    model = b.random_model(config, "cpu", dtype, seed=seed)
    engine = Engine(model, b.NullTokenizer(), native=True)
    missing = sorted(model.features() - native_decode.IMPLEMENTS)
    if not missing and engine.decode_path != "native":
        raise SystemExit(f"{name}: the native step implements every feature yet decode_path is "
                         f"{engine.decode_path!r}")
    return config, model, engine, missing


def twice_tokens(engine: Engine, prompt: list[int], new: int) -> tuple[list[int], str]:
    settings = GenerationSettings(max_new_tokens=new, ignore_eos=True)
    done = [e.result for e in engine.generate(Request(ids=prompt), settings, reuse_cache=False)
            if isinstance(e, Done)]
    return done[0].token_ids, done[0].decode_path


@torch.inference_mode()
def hf_tokens(hf, prompt: list[int], new: int, static: bool) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    if static:
        kwargs["cache_implementation"] = "static"
    return hf.generate(ids, **kwargs)[0, len(prompt):].tolist()


def same_prefix(a: list[int], b_: list[int]) -> int:
    n = 0
    for x, y in zip(a, b_):
        if x != y:
            break
        n += 1
    return n


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def paired_rounds(rounds: int, first, second) -> tuple[list, list]:
    """`rounds` paired measurements, the order alternating (A B, B A, ...), so a neighbour's
    load or the CPU's clock drifting over the run weighs on both sides alike."""
    a, b_ = [], []
    for r in range(rounds):
        if r % 2 == 0:
            a.append(first())
            b_.append(second())
        else:
            b_.append(second())
            a.append(first())
    return a, b_


def bench_shape(name: str, dtype_name: str, args) -> dict:
    shape = b.SHAPES[name]
    dtype = DTYPES[dtype_name]
    P, G = args.prompt, args.tokens
    row: dict = {"shape": name, "model_type": shape["model_type"], "dtype": dtype_name,
                 "threads": torch.get_num_threads(), "prompt_tokens": P, "new_tokens": G}
    t0 = time.perf_counter()
    config, model, engine, missing = build(shape, name, dtype)
    row |= counts(config) | {"weight_bytes": model.weight_bytes(), "active_weight_bytes": model.active_weight_bytes()}
    hf = b.hf_twin(model, share=True)
    say(f"{name} {dtype_name}: built in {time.perf_counter() - t0:.1f} s "
        f"({row['parameters'] / 1e6:.0f}M parameters, {row['active_parameters'] / 1e6:.0f}M active)")
    prompt = b.prompt_ids(config.vocab_size, 1, P)[0]

    # Warm-up of both (untimed), their greedy tokens compared; which cache serves transformers.
    ours, path = twice_tokens(engine, prompt, G)
    row["decode_path"] = path
    row["native_missing"] = missing
    if not missing:
        assert path == "native", f"{name}: decode ran {path!r}, not the native step"
    theirs = hf_tokens(hf, prompt, G, static=False)
    row["greedy_tokens_equal"] = same_prefix(ours, theirs)
    row["greedy_tokens"] = {"twice": ours, "transformers": theirs}
    static = args.hf_cache == "static"
    if args.hf_cache == "best":
        dyn = b.run_transformers(hf, P, G, repeats=1, warmup=False).decode_tokens_per_s
        try:
            hf_tokens(hf, prompt, G, static=True)  # the static cache's warm-up
            sta = b.run_transformers(hf, P, G, repeats=1, warmup=False, static_cache=True).decode_tokens_per_s
        except Exception as e:  # transformers 5.24's phi3 sliding-window mask fails on a static cache
            sta = None
            row["hf_static_cache_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            say(f"  transformers' static cache failed ({row['hf_static_cache_error']}): timing its dynamic cache")
        static = sta is not None and sta > dyn
        row["hf_cache_probe_tok_s"] = {"dynamic": dyn, "static": sta}
    row["hf_cache"] = "static" if static else "dynamic"
    say(f"  twice decode step: {path}" + (f" (native lacks {', '.join(missing)})" if missing else "")
        + f"; transformers: {row['hf_cache']} cache; greedy tokens equal for the first "
          f"{row['greedy_tokens_equal']}/{G}")

    ours_runs, hf_runs = paired_rounds(
        args.rounds,
        lambda: b.run_twice(engine, P, G, repeats=1, warmup=False),
        lambda: b.run_transformers(hf, P, G, repeats=1, warmup=False, static_cache=static))
    ratios = [o.decode_tokens_per_s / h.decode_tokens_per_s for o, h in zip(ours_runs, hf_runs)]
    row["twice_tok_s"] = statistics.median(r.decode_tokens_per_s for r in ours_runs)
    row["transformers_tok_s"] = statistics.median(r.decode_tokens_per_s for r in hf_runs)
    row["twice_step_p50_s"] = statistics.median(r.step_p50_s for r in ours_runs)
    row["transformers_step_p50_s"] = statistics.median(r.step_p50_s for r in hf_runs)
    row["ratio"] = summary(ratios)
    step_bytes = row["active_weight_bytes"] + config.kv_bytes_per_token(dtype.itemsize) * (P + G // 2)
    bw = args.bandwidth["read_bytes_per_s"]
    row["step_bytes"] = step_bytes
    row["twice_bandwidth_share"] = step_bytes * row["twice_tok_s"] / bw
    row["transformers_bandwidth_share"] = step_bytes * row["transformers_tok_s"] / bw
    row["ratio_ceiling"] = 1 / row["transformers_bandwidth_share"]
    say(f"  twice {row['twice_tok_s']:.2f} tok/s, transformers {row['transformers_tok_s']:.2f} tok/s: "
        f"{row['ratio']['median']:.2f}x (min {row['ratio']['min']:.2f}, max {row['ratio']['max']:.2f}; "
        f"{args.rounds} rounds); of the read bandwidth: twice {row['twice_bandwidth_share']:.0%}, "
        f"transformers {row['transformers_bandwidth_share']:.0%} (ceiling {row['ratio_ceiling']:.2f}x)")
    del hf
    gc.collect()

    if is_moe(shape) and not args.no_dense:
        dense_shape = b.dense_equivalent(shape)
        dconfig, dmodel, dengine, dmissing = build(dense_shape, f"{name} dense", dtype, seed=1)
        dense = {"model_type": dense_shape["model_type"], "intermediate_size": dense_shape["intermediate_size"]}
        dense |= counts(dconfig) | {"weight_bytes": dmodel.weight_bytes()}
        _, dpath = twice_tokens(dengine, prompt, G)  # warm-up
        dense["decode_path"] = dpath
        moe_runs, dense_runs = paired_rounds(
            args.rounds,
            lambda: b.run_twice(engine, P, G, repeats=1, warmup=False),
            lambda: b.run_twice(dengine, P, G, repeats=1, warmup=False))
        # time per token: MoE over dense (the bar: at most 1.5)
        times = [d.decode_tokens_per_s / m.decode_tokens_per_s for m, d in zip(moe_runs, dense_runs)]
        dense["moe_tok_s"] = statistics.median(r.decode_tokens_per_s for r in moe_runs)
        dense["dense_tok_s"] = statistics.median(r.decode_tokens_per_s for r in dense_runs)
        dense["moe_over_dense_time"] = summary(times)
        row["dense_twin"] = dense
        say(f"  vs dense {dense['model_type']} (intermediate {dense['intermediate_size']}, "
            f"{dense['parameters'] / 1e6:.2f}M parameters vs {row['active_parameters'] / 1e6:.2f}M active; "
            f"step {dpath}): MoE {dense['moe_tok_s']:.2f} tok/s, dense {dense['dense_tok_s']:.2f} tok/s, "
            f"MoE time {dense['moe_over_dense_time']['median']:.2f}x the dense's "
            f"(min {dense['moe_over_dense_time']['min']:.2f}, max {dense['moe_over_dense_time']['max']:.2f})")
        del dmodel, dengine
    del model, engine
    gc.collect()
    release_freed_memory()
    return row


# -- --check: the twins are the same models, at small sizes --------------------------------
def small(shape: dict) -> dict:
    """The shape with small widths and vocabulary, its family's own fields kept (windows
    shrunk below the check's prompt so that they bite, at most 6 layers, layer types cut)."""
    d = dict(shape)
    heads, kv = d["num_attention_heads"], d["num_key_value_heads"]
    d.update(vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=max(1, 4 * kv // heads), num_hidden_layers=min(6, d["num_hidden_layers"]))
    if "head_dim" in d:
        d["head_dim"] = 16
    if "moe_intermediate_size" in d:
        d["moe_intermediate_size"] = 32
    if d.get("sliding_window"):
        d["sliding_window"] = 8
    if d.get("layer_types"):
        d["layer_types"] = list(d["layer_types"])[: d["num_hidden_layers"]]
    return d


@torch.inference_mode()
def check(names: list[str]) -> bool:
    from twice.core.cache import KVCache

    ok = True
    for name in names:
        shapes = [(name, small(b.SHAPES[name]))]
        if is_moe(b.SHAPES[name]):
            shapes.append((f"{name} dense", b.dense_equivalent(small(b.SHAPES[name]))))
        for label, d in shapes:
            config = config_from_dict(dict(d), source=f"shape {label}")
            model = b.random_model(config, "cpu", torch.float32)
            with torch.no_grad():  # weights large enough that caps and routing bite
                for p in model.parameters():
                    p.mul_(10.0) if p.dim() > 1 else None
            hf = b.hf_twin(model, share=True)
            ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
            got = model(ids, KVCache(config, 1, 32, torch.float32, "cpu"), all_logits=True)
            want = hf(ids).logits
            diff = (got - want).abs().max().item()
            twin_params = sum(p.numel() for p in hf.parameters())
            good = diff < 1e-4 and twin_params == config.parameter_count()
            ok &= good
            say(f"{label}: max |ours - transformers| = {diff:.2e}, parameters {config.parameter_count()} "
                f"(twin {twin_params}), layer types {list(config.layer_types) or '-'}: {'ok' if good else 'DIFFERS'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(FAMILY_SHAPES), help="comma-separated core/benchmark.SHAPES names")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per run")
    ap.add_argument("--rounds", type=int, default=3, help="paired timed rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hf-cache", choices=("dynamic", "static", "best"), default="best")
    ap.add_argument("--no-dense", action="store_true", help="skip the MoE-vs-dense rows")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--check", action="store_true", help="only check the twins at small sizes")
    args = ap.parse_args()
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in b.SHAPES] + [t for t in args.dtypes.split(",") if t not in DTYPES]
    if unknown:
        say(f"bench_families: error: unknown shape or dtype {unknown[0]!r}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.check:
        return 0 if check(names) else 1
    rows = []
    before = b.measure_bandwidth("cpu")
    args.bandwidth = before
    for dtype_name in args.dtypes.split(","):
        for name in names:
            rows.append(bench_shape(name, dtype_name, args))
            if args.json:  # written after every row: a long run interrupted keeps what it measured
                out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows,
                       "native_implements": sorted(native_decode.IMPLEMENTS), "bandwidth": args.bandwidth}
                args.json.write_text(json.dumps(out, indent=1))
    after = b.measure_bandwidth("cpu")
    best = b.best_bandwidth(before, after)
    for r in rows:  # shares against the better of the two measurements
        for side in ("twice", "transformers"):
            r[f"{side}_bandwidth_share"] = r["step_bytes"] * r[f"{side}_tok_s"] / best["read_bytes_per_s"]
        r["ratio_ceiling"] = 1 / r["transformers_bandwidth_share"]
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows,
                                         "native_implements": sorted(native_decode.IMPLEMENTS), "bandwidth": best,
                                         "bandwidth_before": before, "bandwidth_after": after}, indent=1))
    say(f"read bandwidth {best['read_bytes_per_s'] / 1e9:.1f} GB/s (before {before['read_bytes_per_s'] / 1e9:.1f}, "
        f"after {after['read_bytes_per_s'] / 1e9:.1f})")
    print(f"{'shape':22} {'dtype':9} {'step':7} {'twice tok/s':>11} {'hf tok/s':>9} {'ratio (min-max)':>20} "
          f"{'bw twice/hf':>12} {'ceiling':>8} {'MoE/dense time':>16}")
    for r in rows:
        rt = r["ratio"]
        moe = r.get("dense_twin", {}).get("moe_over_dense_time")
        print(f"{r['shape']:22} {r['dtype']:9} {r['decode_path']:7} {r['twice_tok_s']:11.2f} "
              f"{r['transformers_tok_s']:9.2f} {rt['median']:7.2f}x ({rt['min']:.2f}-{rt['max']:.2f})"
              f" {r['twice_bandwidth_share']:5.0%}/{r['transformers_bandwidth_share']:<5.0%} {r['ratio_ceiling']:7.2f}x"
              + (f" {moe['median']:9.2f}x ({moe['min']:.2f}-{moe['max']:.2f})" if moe else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
