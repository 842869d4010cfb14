#!/usr/bin/env python3
"""Speculative decoding (issue 16) measured side by side in one run (never in CI).

For a target and a draft model (default: the packaged Qwen2.5-Coder-1.5B-Instruct Q4_K_M
and 0.5B Q4_K_M, assembled in ~/.cache/twice/gguf/):

1. cost of a verify pass of K + 1 tokens relative to one decode step, K = 1..8 (the target,
   after a 64-token prompt; median of --reps passes each): the native verify pass
   (NativeDecoder.verify, what speculation runs when the native step runs the target) and the
   eager layers' K + 1-token forward;
2. greedy decode tok/s of the target alone, with --lookup and with --draft, on three prompts:
   a code edit (the prompt holds a function, the request asks for it back with a change:
   lookup's case), code writing (the draft's case) and prose; the tokens must be equal;
   --rounds paired rounds (plain between the lookup and the draft run, which swap sides each
   round): the speed-up is the median of the rounds' ratios, each against its own plain run;
3. the speed-up the standard formula predicts beside the measured one (core.speculative.
   predict_run, what --json's `predicted_speedup` says, here against the plain run's median
   step s): acceptance a per judged guess, the draft's steady cost per guess c, the mean
   verify pass v, the draft's prefill / long catch-ups / dummy step apart;
   predicted = tokens · s / (plain steps·s + probes' time + Σ_K passes_K·(K·c + v) + catch-up),
   tokens = plain steps + probe tokens + Σ_K passes_K·(1 − a^(K+1)) / (1 − a); the row prints
   the engine's own prediction (against its own plain steps) too;
4. llama.cpp's prompt-lookup mode (llama_cpp.llama_speculative.LlamaPromptLookupDecoding,
   num_pred_tokens --peer-pred-tokens, n-gram 2) beside its own plain greedy decode, on the
   same GGUF, threads and prompt token ids (scripts/peer_lookup.py, run by --peer-python).

    python scripts/bench_speculative.py --threads 2 --tokens 128 --rounds 3 --json out.json
    python scripts/bench_speculative.py --tiny      # a smoke run on tiny random models (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GGUF = Path.home() / ".cache" / "twice" / "gguf"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"

FUNCTION = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
PROMPTS = {
    "code-edit": "Here is a Python function:\n\n" + FUNCTION + "\nRewrite it so that it returns a list of the "
                 "same length as `values`, with None where the window is not yet full. Reply with the whole "
                 "function only.",
    "code-write": "Write a Python function `parse_duration(text)` that turns strings like '1h30m', '45s' or "
                  "'2h' into a number of seconds, raising ValueError on bad input. Reply with the code only.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def resolve(ref: str) -> str:
    if Path(ref).exists():
        return ref
    found = sorted(GGUF.glob(f"{ref}-*.gguf"))
    return str(found[0]) if found else ref


def verify_costs(model, config, reps: int) -> dict:
    """{K: verify(K+1) time / one decode step} for the native verify pass (NativeDecoder.verify:
    what speculation runs when the native step runs the target) and, as "eager", for the eager
    layers' K+1-token forward; the step as the engine runs it, after a 64-token prompt."""
    import torch

    from twice.core.cache import KVCache
    from twice.core.engine import Engine
    from twice.core.native_decode import NativeDecoder

    engine = Engine(model, None, ())
    first = next(model.parameters())
    cache = KVCache(config, 1, 128, first.dtype, first.device, kv_heads=model.kv_heads)
    ids = torch.arange(64).unsqueeze(0) % config.vocab_size
    native = engine.fast if isinstance(engine.fast, NativeDecoder) else None
    with torch.inference_mode():
        model(ids, cache)
        base = cache.length

        def timed(run) -> float:
            times = []
            for _ in range(reps):
                cache.truncate(base)
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        token = torch.tensor([[5]])
        step = timed(lambda: engine.fast(token, cache) if engine.fast else model(token, cache))
        out = {"step_s": step, "path": "native" if native else "eager", "eager": {}}
        for k in range(1, 9):
            if native is not None:
                out[k] = timed(lambda: native.verify(torch.arange(k + 1) + 7, cache)) / step
            out["eager"][k] = timed(lambda: model(torch.arange(k + 1).unsqueeze(0) + 7, cache, all_logits=True)) / step
            out.setdefault(k, out["eager"][k])
    return out


def predicted(spec: dict, step: float) -> float | None:
    """The speed-up core.speculative.predict_run gives from the run's measured acceptance, draft,
    verify, prefill and catch-up costs, judged against the plain run's decode step."""
    from twice.core.speculative import predict_run

    p = predict_run(spec, step)
    return p["speedup"] if p else None


def peer_lookup(args, gguf: str, prompts: dict) -> dict | None:
    """llama.cpp's plain greedy and prompt-lookup decode tok/s (scripts/peer_lookup.py in the
    llama-cpp-python venv), on the same GGUF, threads and prompt token ids."""
    import subprocess

    if not args.peer_python or not Path(args.peer_python).exists() or not gguf.endswith(".gguf"):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"gguf": gguf, "threads": args.threads, "new_tokens": args.tokens, "rounds": args.rounds,
                   "num_pred_tokens": args.peer_pred_tokens, "max_ngram_size": 2, "prompts": prompts}, f)
    done = subprocess.run([args.peer_python, str(HERE / "peer_lookup.py"), f.name], capture_output=True, text=True)
    Path(f.name).unlink()
    if done.returncode != 0:
        print(f"llama.cpp lookup: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(done.stdout)


def run(args) -> dict:
    import torch

    from twice.core.engine import Done, Engine, GenerationSettings, Request
    from twice.core.sampling import SamplingParams
    from twice.weights.load import load

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    modes = [m for m in ("lookup", "draft") if m in args.modes.split(",")]
    draft = load(resolve(args.draft), device="cpu", dtype=args.dtype) if "draft" in modes else None
    target = load(resolve(args.target), device="cpu", dtype=args.dtype)
    report = {"target": target.name, "draft": draft.name if draft else None, "threads": torch.get_num_threads(),
              "tokens": args.tokens, "rounds": args.rounds, "load_average_before": load_before}
    if args.reps:
        costs = verify_costs(target.model, target.config, args.reps)
        report["verify_over_step"] = costs
        print(f"verify(K+1) / step ({costs['path']}): " + ", ".join(f"K={k} {costs[k]:.2f}" for k in range(1, 9)),
              flush=True)
        if costs["path"] == "native":
            print("verify(K+1) / step (eager): " + ", ".join(f"K={k} {costs['eager'][k]:.2f}" for k in range(1, 9)),
                  flush=True)
    greedy = SamplingParams()
    engines = {"plain": Engine(target.model, target.tokenizer, target.eos_token_ids)}
    if "lookup" in modes:
        engines["lookup"] = Engine(target.model, target.tokenizer, target.eos_token_ids)
    if draft is not None:
        engines["draft"] = Engine(target.model, target.tokenizer, target.eos_token_ids, draft=draft.model)
    rows, prompt_ids, plain_tokens = [], {}, {}
    for name, text in PROMPTS.items():
        if name not in args.prompts.split(","):
            continue
        messages = [{"role": "user", "content": text}] if target.tokenizer.chat_template else None
        request = Request(messages=messages) if messages else Request(text=text)
        results: dict[str, list] = {mode: [] for mode in engines}
        # Paired rounds: plain in the middle, beside each mode (a load change between runs hits
        # both sides of a pair alike); the modes swap sides every round.
        others = [m for m in engines if m != "plain"]
        order = others[:1] + ["plain"] + others[1:]
        for r in range(args.rounds):
            for mode in (order if r % 2 == 0 else order[::-1]):
                engine = engines[mode]
                engine.reset()
                settings = GenerationSettings(max_new_tokens=args.tokens, sampling=greedy, lookup=mode == "lookup",
                                              ignore_eos=True, draft_tokens=args.draft_tokens,
                                              truncate="left" if args.tiny else None)
                if not prompt_ids.get(name):
                    prompt_ids[name] = engine._tokenize(request, settings)[0]
                results[mode].append([e for e in engine.generate(request, settings) if isinstance(e, Done)][0].result)
        plains = results["plain"]
        plain_tokens[name] = plains[0].token_ids
        plain_rate = statistics.median(p.decode_tokens_per_second for p in plains)
        step = statistics.median(t for p in plains for t in p.step_seconds) if plains[0].step_seconds else 0.0
        for mode in modes:
            runs = results[mode]
            rate = statistics.median(x.decode_tokens_per_second for x in runs)
            r = sorted(runs, key=lambda x: x.decode_tokens_per_second)[len(runs) // 2]
            spec = r.speculation
            # each round's ratio is taken against the plain run beside it (the VM's speed drifts between
            # rounds): their median is the speed-up; the ratio of the medians is kept beside it
            paired = [x.decode_tokens_per_second / p.decode_tokens_per_second for x, p in zip(runs, plains)]
            row = {"prompt": name, "mode": mode, "plain_tok_s": plain_rate, "tok_s": rate,
                   "speedup": statistics.median(paired), "speedup_of_medians": rate / plain_rate,
                   "speedup_rounds": paired,
                   "predicted_speedup": predicted(spec, step),
                   "same_tokens": all(x.token_ids == plains[0].token_ids for x in runs + plains),
                   "speculation": spec, "load_average": os.getloadavg()}
            rows.append(row)
            off = f"  [{spec['drafting_off']}]" if spec.get("drafting_off") else ""
            print(f"{name:10s} {mode:6s} plain {row['plain_tok_s']:6.1f} tok/s  {mode} {row['tok_s']:6.1f} tok/s  "
                  f"x{row['speedup']:.2f} ({min(paired):.2f}-{max(paired):.2f}; predicted "
                  f"x{row['predicted_speedup']:.2f}, engine's x{spec['predicted_speedup'] or 0:.2f})  accepted "
                  f"{100 * spec['acceptance_rate']:.0f}%  {spec['tokens_per_target_pass']:.2f} tok/pass  "
                  f"K used {spec['k_used']}  same tokens {row['same_tokens']}  load "
                  f"{row['load_average'][0]:.2f}{off}", flush=True)
    report["rows"] = rows
    if "llama.cpp" in args.modes.split(","):
        peer = peer_lookup(args, resolve(args.target), prompt_ids)
        report["llama_cpp_lookup"] = peer
        for name, r in (peer or {}).items():
            p, q = statistics.median(r["plain"]), statistics.median(r["lookup"])
            print(f"{name:10s} llama.cpp plain {p:6.1f} tok/s  lookup {q:6.1f} tok/s  x{q / p:.2f}  "
                  f"(LlamaPromptLookupDecoding, {args.peer_pred_tokens} tokens, n-gram 2; its tokens = twice's "
                  f"plain greedy: {r['lookup_tokens'] == plain_tokens[name]}, its own plain: "
                  f"{r['lookup_tokens'] == r['plain_tokens']})", flush=True)
    report["load_average_after"] = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {report['load_average_after'][0]:.2f}", flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-tokens", type=int, default=None, help="fix K (default adaptive)")
    p.add_argument("--rounds", type=int, default=1, help="paired rounds (plain and each mode alternate; medians)")
    p.add_argument("--prompts", default=",".join(PROMPTS), help="which prompts (comma-separated)")
    p.add_argument("--modes", default="lookup,draft,llama.cpp",
                   help="lookup, draft, llama.cpp (its prompt-lookup mode, via --peer-python)")
    p.add_argument("--peer-python", default="/work/peer-venv/bin/python",
                   help="a python with llama-cpp-python 0.3.36 (scripts/peer_lookup.py runs in it)")
    p.add_argument("--peer-pred-tokens", type=int, default=10, help="LlamaPromptLookupDecoding's num_pred_tokens")
    p.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args()
    if args.tiny:
        sys.path.insert(0, str(HERE.parent / "tests"))
        import tiny

        root = Path(tempfile.mkdtemp(prefix="bench-spec-"))
        tok = tiny.train_tokenizer()
        args.target = str(tiny.make_model(root / "target", "llama", tok))
        args.draft = str(tiny.make_model(root / "draft", "llama", tok, seed=1))
        args.tokens, args.reps = min(args.tokens, 24), min(args.reps, 2)
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
