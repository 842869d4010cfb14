#!/usr/bin/env python3
"""TTFT of a long system prompt reused from a prompt cache vs a fresh prefill (issue 17's
target: >= 10x lower), in one process on one loaded model:

    python scripts/bench_prompt_cache.py --threads 1          # SmolLM2 (the default model, Q4_1), 2,000 tokens
    python scripts/bench_prompt_cache.py --model M --dtype bfloat16 --system-tokens 4000 --json out.json

fresh:  a new Engine, the chat prompt (system + question) prefilled whole: the engine's TTFT.
cached: the prompt cache written once (system + another question, as a first run leaves
        it), then per repeat a new Engine that loads the file (twice generate's
        --prompt-cache path: cli/prompt_cache.load) and answers the question: file load +
        the engine's TTFT (only the question's tokens are prefilled).
Greedy, 8 new tokens; the tokens of both must be equal (checked). Medians of --repeats.

--prefill-head instead times a short chat prompt's fresh TTFT (--system-tokens 100: ~125
prompt tokens, within the native prefill's PREFILL_MAX) two ways in paired alternating rounds
(--repeats pairs, a neighbour's load hits both alike): "last row", the native prefill as it
is (the head for the prompt's last row only), against "every row", NativeDecoder.prefill
replaced by the loop it was (verify over the chunks, every row's logits, the last one kept).
One new token (the CPU seconds are the TTFT's); per side the median TTFT (wall) and
process CPU seconds (all threads), per pair the ratio every-row / last-row; the first tokens
of both must be equal (checked; tests/test_prefill_head.py checks the logits' bits):

    python scripts/bench_prompt_cache.py --prefill-head --system-tokens 100 --threads 1 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

PARAGRAPH = ("You are a careful assistant for a harbour office. Ships arrive at dawn and leave at dusk; "
             "the pilots log every berth, every tide table and every cargo manifest. Answer questions about "
             "schedules, weather, moorings and customs in short, exact sentences, and say when you do not know. ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--dequantize", action="store_true", help="a GGUF model (the default one) from its float copy")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prefill-head", action="store_true",
                    help="A/B in paired rounds: the native prefill's head for the last row only vs every row")
    args = ap.parse_args()

    import torch

    from twice.cli import prompt_cache as pc
    from twice.core.engine import Done, Engine, GenerationSettings, Request
    from twice.core.sampling import SamplingParams
    from twice.weights.load import load

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load(args.model, dtype=args.dtype, device="cpu", weights="dequantize" if args.dequantize else None)
    tok = loaded.tokenizer
    system = ""
    while len(tok.encode(system, add_special_tokens=False)) < args.system_tokens:
        system += PARAGRAPH
    ids = tok.encode(system, add_special_tokens=False)[: args.system_tokens]
    system = tok.decode(ids)

    def request(question: str) -> Request:
        return Request(messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])

    # --prefill-head: one new token, so the process CPU time is the TTFT's
    settings = GenerationSettings(max_new_tokens=1 if args.prefill_head else 8, sampling=SamplingParams(temperature=0.0))

    def answer(engine: Engine, question: str):
        for event in engine.generate(request(question), settings):
            if isinstance(event, Done):
                return event.result
        raise AssertionError

    def new_engine() -> Engine:
        return Engine(loaded.model, tok, loaded.eos_token_ids)

    question = "When does the last ship leave?"
    answer(new_engine(), "warm up")  # kernels, tables, allocator
    if args.prefill_head:
        return prefill_head(args, loaded, lambda: answer(new_engine(), question))
    fresh = []
    for _ in range(args.repeats):
        r = answer(new_engine(), question)
        fresh.append((r.ttft_seconds, r.token_ids, r.prompt_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "system.kv"
        first = new_engine()
        r0 = answer(first, "Which berth is free?")  # the first run: writes the file after its reply
        use = pc.PromptCacheUse(file=str(path))
        t = time.perf_counter()
        pc.save(first, use, r0.prompt_tokens, first.cached_ids[: r0.prompt_tokens])
        save_s = time.perf_counter() - t
        size = path.stat().st_size
        cached = []
        for _ in range(args.repeats):
            engine = new_engine()
            t = time.perf_counter()
            use = pc.load(engine, str(path))
            load_s = time.perf_counter() - t
            assert use.refused is None, use.refused
            r = answer(engine, question)
            cached.append((load_s, r.ttft_seconds, r.token_ids, r.reused_tokens, r.prompt_tokens))
    assert all(c[2] == fresh[0][1] for c in cached) and all(f[1] == fresh[0][1] for f in fresh), "tokens differ"
    fresh_ttft = statistics.median(f[0] for f in fresh)
    load_s = statistics.median(c[0] for c in cached)
    cached_ttft = statistics.median(c[1] for c in cached)
    out = {
        "model": loaded.name, "dtype": str(loaded.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
        "prompt_tokens": fresh[0][2], "reused_tokens": cached[0][3], "file_bytes": size, "save_s": save_s,
        "fresh_ttft_s": fresh_ttft, "cached_load_s": load_s, "cached_ttft_s": cached_ttft,
        "cached_total_s": load_s + cached_ttft, "speedup_ttft": fresh_ttft / cached_ttft,
        "speedup_with_load": fresh_ttft / (load_s + cached_ttft), "repeats": args.repeats,
        "greedy_tokens_equal": True,
    }
    print(f"{loaded.name} {out['dtype']}, {out['threads']} threads: prompt {out['prompt_tokens']} tokens, "
          f"{out['reused_tokens']} from the cache file ({size / 2**20:.1f} MiB, saved in {save_s:.2f} s)")
    print(f"  fresh prefill TTFT  {fresh_ttft * 1000:8.1f} ms")
    print(f"  prompt cache        {load_s * 1000:8.1f} ms load + {cached_ttft * 1000:.1f} ms TTFT = "
          f"{(load_s + cached_ttft) * 1000:.1f} ms  ({out['speedup_with_load']:.1f}x lower; "
          f"{out['speedup_ttft']:.1f}x without the file load)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def prefill_head(args, loaded, run) -> None:
    """--prefill-head: `run` (a fresh engine's answer) with the native prefill as it is and
    as it was (every row's head), alternating, the first side of each pair alternating too."""
    import torch

    from twice.core.native_decode import PREFILL_CHUNK, NativeDecoder

    current = NativeDecoder.prefill

    def every_row(self, tokens, cache, chunk=None):  # the prefill before the head was skipped
        ids = tokens.reshape(-1)
        step = min(chunk or PREFILL_CHUNK, PREFILL_CHUNK)
        for begin in range(0, ids.numel(), step):
            logits = self.verify(ids[begin:begin + step], cache)
        return logits[-1:]

    sides = {"last row": current, "every row": every_row}
    got = {name: [] for name in sides}
    try:
        for i in range(args.repeats + 1):  # round 0 warms both sides up, uncounted
            for name in (list(sides) if i % 2 else list(sides)[::-1]):
                calls = []
                NativeDecoder.prefill = lambda *a, side=sides[name], **k: (calls.append(1), side(*a, **k))[1]
                cpu = time.process_time()
                r = run()
                cpu = time.process_time() - cpu
                assert calls, "the prompt did not prefill through NativeDecoder.prefill"
                if i:
                    got[name].append((r.ttft_seconds, cpu, r.token_ids, r.prompt_tokens))
    finally:
        NativeDecoder.prefill = current
    tokens = {tuple(g[2]) for rows in got.values() for g in rows}
    assert len(tokens) == 1, "the two prefills' first tokens differ"
    med = {name: (statistics.median(g[0] for g in rows), statistics.median(g[1] for g in rows))
           for name, rows in got.items()}
    ratios = [b[0] / a[0] for a, b in zip(got["last row"], got["every row"])]
    cpu_ratios = [b[1] / a[1] for a, b in zip(got["last row"], got["every row"])]
    out = {"model": loaded.name, "dtype": str(loaded.dtype).replace("torch.", ""),
           "threads": torch.get_num_threads(), "prompt_tokens": got["last row"][0][3], "pairs": args.repeats,
           **{f"{k.replace(' ', '_')}_ttft_s": v[0] for k, v in med.items()},
           **{f"{k.replace(' ', '_')}_cpu_s": v[1] for k, v in med.items()},
           "ttft_ratio_median": statistics.median(ratios), "ttft_ratio_min": min(ratios),
           "ttft_ratio_max": max(ratios), "cpu_ratio_median": statistics.median(cpu_ratios),
           "greedy_tokens_equal": True}
    print(f"{loaded.name} {out['dtype']}, {out['threads']} threads: a {out['prompt_tokens']}-token chat prompt, "
          f"fresh TTFT, {args.repeats} paired rounds (medians)")
    for name, (ttft, cpu) in med.items():
        print(f"  head for {name:9s}  TTFT {ttft * 1000:7.1f} ms   CPU {cpu * 1000:7.1f} ms")
    print(f"  every row / last row: TTFT x{out['ttft_ratio_median']:.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f}), "
          f"CPU x{out['cpu_ratio_median']:.3f}; first tokens equal")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
