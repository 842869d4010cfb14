#!/usr/bin/env python3
"""Qwen2-MoE decode, native step vs eager step (issue 15, moe:shared), on a random model.

The model: a transformers Qwen2MoeConfig with random weights (seeded), tiny but not trivial:
hidden 512, 8 layers, 8 heads (4 kv heads), 8 experts of 512 rows, top-2, a shared expert of 1024
rows behind its sigmoid gate, vocabulary 16384. Saved once to --folder, then loaded by twice as
each --formats entry (float32, bfloat16, q8_0 = `--quantize q8_0` at load). For each format: the
same prompt, greedy, --tokens new tokens; Engine(native=True) (decode_path "native", asserted) and
Engine(native=False), both warmed up once (and their greedy tokens compared), then --rounds paired
rounds alternating which side runs first; decode tok/s per side, the ratio per round, median and
min–max, with `uptime` before and after.

    python scripts/bench_moe_native.py --threads 1 --rounds 5 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from twice.core.engine import Done, Engine, GenerationSettings, Request

SHAPE = dict(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
             shared_expert_intermediate_size=1024, max_position_embeddings=4096, tie_word_embeddings=False,
             use_sliding_window=False, bos_token_id=0, eos_token_id=2)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def build(folder: Path) -> None:
    if (folder / "config.json").exists():
        return
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tiny  # the tests' byte-level tokenizer (its vocabulary fits in 16384)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2MoeConfig(**SHAPE)).eval()
    model.save_pretrained(folder)
    tiny.save_tokenizer(folder, tiny.train_tokenizer())


def decode(engine: Engine, prompt: list[int], new: int):
    settings = GenerationSettings(max_new_tokens=new, ignore_eos=True)
    done = [e.result for e in engine.generate(Request(ids=prompt), settings, reuse_cache=False)
            if isinstance(e, Done)]
    return done[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", default="/tmp/twice-bench-qwen2moe")
    p.add_argument("--formats", default="float32,bfloat16,q8_0")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    build(folder)
    from twice.weights.load import load

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 500, (args.prompt,), generator=g).tolist()
    rows = []
    for fmt in args.formats.split(","):
        options = dict(dtype="float32", weights="q8_0") if fmt == "q8_0" else dict(dtype=fmt)
        m = load(str(folder), device="cpu", **options)
        native = Engine(m.model, m.tokenizer, m.eos_token_ids, native=True)
        eager = Engine(m.model, m.tokenizer, m.eos_token_ids, native=False)
        if native.decode_path != "native":
            raise SystemExit(f"{fmt}: decode_path is {native.decode_path!r}, not native")
        a, b = decode(native, prompt, args.tokens), decode(eager, prompt, args.tokens)  # warm-up
        agree = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        before = load_average()
        nat, eag = [], []
        for r in range(args.rounds):
            order = [(nat, native), (eag, eager)] if r % 2 == 0 else [(eag, eager), (nat, native)]
            for out, engine in order:
                out.append(decode(engine, prompt, args.tokens).decode_tokens_per_second)
        after = load_average()
        ratios = [x / y for x, y in zip(nat, eag)]
        row = dict(format=fmt, native_tok_s=statistics.median(nat), eager_tok_s=statistics.median(eag),
                   ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
                   native_rounds=nat, eager_rounds=eag, greedy_tokens_agree=agree, tokens=args.tokens,
                   threads=args.threads, load_before=before, load_after=after)
        rows.append(row)
        say(f"{fmt:9s} native {row['native_tok_s']:7.1f} tok/s  eager {row['eager_tok_s']:7.1f} tok/s  "
            f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})  greedy agree {agree}/{args.tokens}  "
            f"load {before} -> {after}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
