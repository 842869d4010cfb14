#!/usr/bin/env python3
"""Prefill as a user meets it: twice and transformers each timed as whole processes.

`twice bench` times prefill inside one process after a warm-up, so it never sees what a
process pays the first time it runs a long prompt (first touch of activation memory, a
kernel's first call, the allocator growing). This script runs what a user would type, as
separate processes, alternating the engines and the prompt lengths (A/B pairs, so a
neighbour's load hits both sides alike):

    twice generate --raw -n 1 --temperature 0 --dtype D --timing --json PROMPT
    python -c 'transformers: from_pretrained(FOLDER, dtype=D) + generate(max_new_tokens=1)'

each with a ~2,000-token and a ~20-token prompt on the same model folder (the default
model unless --model), on the same threads (OMP_NUM_THREADS, and twice's --threads where
it has one). A process's prefill is wall(long prompt) − wall(short prompt) of the same
round: load, imports and exit cancel, what the long prompt costs stays. Beside it, each
process's own in-process figure (twice: --json's prefill_s; transformers: the time of its
generate call). Ratios are transformers' seconds ÷ twice's (above 1: twice is faster),
per round, then median and min–max over rounds.

    python scripts/cold_prefill.py                       # fp32 and bf16, 2 threads, 5 rounds
    python scripts/cold_prefill.py --dtypes float32 --rounds 3 --long 1000
    python scripts/cold_prefill.py --bench               # also `twice bench -w prefill` (in-process)

Writes scripts/results/cold_prefill.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Common English words; with SmolLM2's tokenizer each " word" is one token.
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will more can out up who them "
         "some said about into time than other only could new these may two any like first then now my over such "
         "our man me even most made after also did many before must through back years where much your way well "
         "down should because each just those people how too little state good very make world still own see men "
         "work long get here between both life being under never day same another know while last might us great "
         "old year off come since against go came right used take three").split()

HF_CODE = r"""
import json, sys, time
import torch
folder, dtype, threads, prompt_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
model.eval()
text = open(prompt_file, encoding="utf-8").read()
inputs = tokenizer(text, return_tensors="pt")
with torch.inference_mode():
    t0 = time.perf_counter()
    model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    seconds = time.perf_counter() - t0
print(json.dumps({"prompt_tokens": inputs["input_ids"].shape[1], "prefill_s": seconds}))
"""


def make_prompt(tokenizer, tokens: int, seed: int) -> str:
    """Text of exactly `tokens` tokens where the words allow it (otherwise the nearest below)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens + 16)]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose text stays within `tokens` tokens
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid])).ids) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def twice_command() -> list[str]:
    script = Path(sys.executable).with_name("twice")
    return [str(script)] if script.is_file() else [sys.executable, "-c", "from twice.cli.app import main; main()"]


def has_threads_flag(cmd: list[str]) -> bool:
    out = subprocess.run(cmd + ["generate", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    return "--threads" in out.stdout


def run_process(cmd: list[str], env: dict) -> dict:
    """Run one process to its end: wall seconds, its own CPU seconds, faults and peak RSS
    (the kernel's accounting of that child, os.wait4), and its stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd[:6])} ...\n{stderr[-2000:]}")
    return {"wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime, "minor_faults": usage.ru_minflt,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "stdout": stdout}


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"no JSON in the output: {text[-500:]}")


def measure(engine: str, dtype: str, prompt_file: Path, args, env: dict, threads_flag: bool) -> dict:
    if engine == "twice":
        cmd = twice_command() + ["generate", "--raw", "-n", "1", "--temperature", "0", "--dtype", dtype, "--timing",
                                 "--json", "--device", "cpu"]
        if args.model:
            cmd += ["--model", str(args.folder)]
        if threads_flag:
            cmd += ["--threads", str(args.threads)]
        cmd.append(prompt_file.read_text(encoding="utf-8"))
        got = run_process(cmd, env)
        data = last_json(got.pop("stdout"))
        got["prompt_tokens"] = data["prompt_tokens"]
        got["in_process_prefill_s"] = data["timings"]["prefill_s"]
        got["load_s"] = data["timings"].get("load_s") or data.get("load_s")
    else:
        cmd = [sys.executable, "-c", HF_CODE, str(args.folder), dtype, str(args.threads), str(prompt_file)]
        got = run_process(cmd, env)
        data = last_json(got.pop("stdout"))
        got["prompt_tokens"] = data["prompt_tokens"]
        got["in_process_prefill_s"] = data["prefill_s"]  # generate() of one token: prefill + one sample
    return got


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run_bench(dtype: str, args, env: dict, out_dir: Path) -> dict | None:
    """`twice bench -w prefill` (P=2048 G=16, random ids, in one process after a warm-up)."""
    path = out_dir / f"cold_prefill-bench-{dtype}.json"
    cmd = twice_command() + ["bench", "--device", "cpu", "--dtype", dtype, "-w", "prefill", "-e", "twice-native",
                             "-e", "transformers", "--threads", str(args.threads), "--repeats", "3", "--json", str(path)]
    if args.model:
        cmd += ["--model", str(args.folder)]
    print("+ " + " ".join(cmd[1:]), flush=True)
    run_process(cmd, env)
    data = json.loads(path.read_text())
    runs = {r["engine"]: r for r in data["results"]}
    twice, hf = runs.get("twice-native") or runs.get("twice"), runs.get("transformers")
    if not (twice and hf):
        return None
    return {"prompt_tokens": twice["prompt_tokens"], "twice_prefill_tokens_per_s": twice["prefill_tokens_per_s"],
            "transformers_prefill_tokens_per_s": hf["prefill_tokens_per_s"],
            "ratio": twice["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"]}


def summarize(dtype: str, rounds: list[dict]) -> dict:
    s: dict = {"dtype": dtype, "rounds": len(rounds)}
    for engine in ("twice", "transformers"):
        long_, short = [r[engine]["long"] for r in rounds], [r[engine]["short"] for r in rounds]
        s[engine] = {
            "long_tokens": long_[0]["prompt_tokens"], "short_tokens": short[0]["prompt_tokens"],
            "whole_process_prefill_s": spread([a["wall_s"] - b["wall_s"] for a, b in zip(long_, short)]),
            "whole_process_cpu_s": spread([(a["user_s"] + a["sys_s"]) - (b["user_s"] + b["sys_s"])
                                           for a, b in zip(long_, short)]),
            "in_process_prefill_s": spread([a["in_process_prefill_s"] for a in long_]),
            "long_wall_s": spread([a["wall_s"] for a in long_]),
            "short_wall_s": spread([b["wall_s"] for b in short]),
            "minor_faults_long_minus_short": spread([a["minor_faults"] - b["minor_faults"]
                                                     for a, b in zip(long_, short)]),
        }
    # Per round: transformers' seconds ÷ twice's (> 1: twice faster), on each measure. A
    # round where a long prompt's process was not slower than the short one's (a neighbour's
    # load swamped the difference) has no ratio; it is counted, not hidden.
    for key in ("whole_process_prefill_s", "whole_process_cpu_s", "in_process_prefill_s"):
        pairs = list(zip(s["twice"][key]["values"], s["transformers"][key]["values"]))
        ratios = [hf / tw for tw, hf in pairs if tw > 0 and hf > 0]
        s[f"ratio_{key}"] = spread(ratios) if ratios else {"median": float("nan"), "min": float("nan"),
                                                           "max": float("nan"), "values": []}
        s[f"ratio_{key}"]["rounds_without_ratio"] = len(pairs) - len(ratios)
    return s


def table(summaries: list[dict]) -> str:
    lines = ["| dtype | engine | prompt | whole-process prefill (median, min–max) | CPU s | in-process prefill | "
             "twice vs transformers (whole process) | (in-process) | (`twice bench`) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        for engine in ("twice", "transformers"):
            e = s[engine]
            w, c, i = e["whole_process_prefill_s"], e["whole_process_cpu_s"], e["in_process_prefill_s"]
            tokens = e["long_tokens"] - e["short_tokens"]
            row = (f"| {s['dtype']} | {engine} | {e['long_tokens']} − {e['short_tokens']} tokens | "
                   f"{w['median']:.2f} s ({w['min']:.2f}–{w['max']:.2f}), {tokens / w['median']:,.0f} tok/s | "
                   f"{c['median']:.2f} | {i['median']:.2f} s ({i['min']:.2f}–{i['max']:.2f}) | ")
            if engine == "twice":
                r, rc, ri = (s[f"ratio_{k}"] for k in ("whole_process_prefill_s", "whole_process_cpu_s",
                                                       "in_process_prefill_s"))
                b = s.get("bench")
                dropped = f", {r['rounds_without_ratio']} rounds without" if r["rounds_without_ratio"] else ""
                row += (f"{r['median']:.2f}× ({r['min']:.2f}–{r['max']:.2f}{dropped}); CPU s {rc['median']:.2f}× | "
                        f"{ri['median']:.2f}× ({ri['min']:.2f}–{ri['max']:.2f}) | "
                        + (f"{b['ratio']:.2f}× |" if b else "— |"))
            else:
                row += " | | |"
            lines.append(row)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (default: twice's default model, SmolLM2-135M)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=int(os.environ.get("TWICE_THREADS", 2)))
    p.add_argument("--long", type=int, default=2000, help="tokens in the long prompt")
    p.add_argument("--short", type=int, default=20, help="tokens in the short prompt")
    p.add_argument("--rounds", type=int, default=5, help="alternations (each runs all four processes)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (the first run converts the model)")
    p.add_argument("--engines", default="twice,transformers")
    p.add_argument("--bench", action="store_true", help="also run `twice bench -w prefill` per dtype (in-process)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "cold_prefill.json")
    args = p.parse_args()

    from twice.weights.resolve import resolve

    args.folder = Path(args.model).resolve() if args.model else resolve(None)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.folder / "tokenizer.json"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "COLUMNS": "200"}
    engines = [e for e in args.engines.split(",") if e]
    threads_flag = has_threads_flag(twice_command())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="twice-cold-"))
    prompts = {}
    for name, tokens in (("long", args.long), ("short", args.short)):
        prompts[name] = work / f"{name}.txt"
        prompts[name].write_text(make_prompt(tokenizer, tokens, seed=1), encoding="utf-8")

    summaries = []
    for dtype in args.dtypes.split(","):
        rounds = []
        for i in range(args.warmup + args.rounds):
            order = engines if i % 2 == 0 else engines[::-1]  # A B, then B A: neither always goes first
            got: dict = {e: {} for e in engines}
            for length in (("long", "short") if i % 2 == 0 else ("short", "long")):
                for engine in order:
                    got[engine][length] = measure(engine, dtype, prompts[length], args, env, threads_flag)
            tag = "warm-up" if i < args.warmup else f"round {i - args.warmup + 1}"
            print(f"{dtype} {tag}: " + "; ".join(
                f"{e} long {got[e]['long']['wall_s']:.2f} s short {got[e]['short']['wall_s']:.2f} s "
                f"(in-process {got[e]['long']['in_process_prefill_s']:.2f} s)" for e in engines), flush=True)
            if i >= args.warmup:
                rounds.append(got)
        if set(engines) == {"twice", "transformers"}:
            s = summarize(dtype, rounds)
            if args.bench:
                s["bench"] = run_bench(dtype, args, env, args.out.parent)
            s["raw"] = rounds
            summaries.append(s)
    result = {"machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "load_average": os.getloadavg()},
              "threads": args.threads, "model_folder": str(args.folder), "command_line": sys.argv[1:],
              "summaries": summaries}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if summaries:
        print(table(summaries))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
