"""llama.cpp on the same weights, for `scripts/bench.py --peer llama.cpp` and
`scripts/bench_quant.py` (never in CI).

llama.cpp is what a speed-minded user would pick instead of twice. This runs it through
llama-cpp-python on a GGUF file with the same thread count, the same prompt token ids and
the same definitions as `twice bench`: greedy decoding, TTFT = prefill + first token,
decode tok/s after the first token, the median of the repeats after a warm-up.

Two ways to get the GGUF:
- a float folder, converted at the same precision (f32 or bf16, with llama.cpp's own
  convert_hf_to_gguf.py; scripts/bench.py --peer does that through `make_gguf`);
- a GGUF file given as it is (a quantized download such as a Q4_K_M file): run as stored,
  no conversion, which is what scripts/bench_quant.py compares twice's GGUF loading with.

    python scripts/peer_llamacpp.py MODEL.gguf --threads 2 --workloads decode,prefill --json out.json
    python scripts/peer_llamacpp.py MODEL.gguf --threads 2 --workloads decode-diff,prefill --json out.json
    python scripts/peer_llamacpp.py MODEL.gguf --threads 2 --perplexity-ids ids.json --json out.json
    python scripts/peer_llamacpp.py MODEL.gguf --threads 2 --serve     # JSON lines on stdin/stdout

Workloads: `decode` / `prefill` / `batch1` as `twice bench` defines them (P=32 G=256, P=2048
G=16, P=32 G=64); `decode-diff`: decode tok/s as (160 - 16) / (T(160) - T(16)), T(n) the wall
time of a whole greedy run of n new tokens after the same 32-token prompt (prefill and the
first token cancel out), the way issue 14 measured llama.cpp; `prefill`'s prefill tok/s is
prompt tokens / the wall time of evaluating the prompt.

Perplexity: llama-cpp-python exposes no perplexity (that is llama.cpp's `llama-perplexity`
program, not in the Python package, and it scores only the second half of each window
anyway). So it is computed here from `logits_all=True` evaluations with twice's definition
(core/perplexity.py, `twice perplexity`): the token ids of the text (twice's tokenizer, given
in --perplexity-ids, so both engines score the same tokens), non-overlapping windows of
`context` tokens, each evaluated alone from an empty cache with the BOS ids (`prefix`)
before it, every window token with a preceding token in its window scored, log-softmax in
float64, perplexity = exp(mean NLL).

Prompt token ids: `--ids FILE.json` ({"decode": [...], "prefill": [...], "batch1": [...]},
what scripts/bench_quant.py writes); without it they are made by twice's `prompt_ids` (which
needs twice and torch importable: the main venv), the ids twice bench gives every engine.

Setup, in a venv of its own (about 7 minutes on 2 cores): `pip install llama-cpp-python==0.3.36`
(numpy comes with it). For conversions from a folder also `sentencepiece` and the converter
from the sdist: `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`, unpacked
whole (convert_hf_to_gguf.py needs its `conversion/` and `gguf-py/` siblings) at
llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name: (prompt tokens, new tokens), as core/benchmark.py's WORKLOADS (kept here so this
# script runs in a venv without twice and torch)
WORKLOAD_SIZES = {"decode": (32, 256), "prefill": (2048, 16), "batch1": (32, 64), "decode-diff": (32, 160)}
PEER_WORKLOADS = ("decode", "prefill", "batch1", "decode-diff")  # batch 1: one sequence per llama.cpp context
DIFF_SHORT, DIFF_LONG = 16, 160


def make_gguf(model_dir: Path, dtype: str, convert_script: Path, out_dir: Path) -> Path:
    """The folder's weights as a GGUF of the same precision (cached in out_dir)."""
    kind = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    out = out_dir / f"{model_dir.name}-{kind}.gguf"
    if not out.is_file():
        subprocess.run([sys.executable, str(convert_script), str(model_dir), "--outtype", kind, "--outfile", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def default_prompt_ids(vocab: int, workload: str) -> list[int]:
    from twice.core.benchmark import prompt_ids  # twice's seeded ids (needs torch)

    return prompt_ids(vocab, 1, WORKLOAD_SIZES[workload][0])[0]


class Peer:
    """One llama.cpp model (llama-cpp-python), greedy, batch 1."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 4096):
        import llama_cpp
        from llama_cpp import Llama

        self.llama_cpp, self.gguf, self.threads = llama_cpp, Path(gguf), threads
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=2048, n_ubatch=512, logits_all=False, verbose=False)
        self.vocab = self.llm.n_vocab()
        self._ppl = None  # the logits_all=True twin, made for the first perplexity request

    def info(self) -> dict:
        return {"engine": "llama.cpp", "llama_cpp_python": self.llama_cpp.__version__, "threads": self.threads,
                "n_vocab": self.vocab, "file_bytes": os.path.getsize(self.gguf), "gguf": str(self.gguf),
                "system_info": self.llama_cpp.llama_print_system_info().decode(errors="replace").strip()}

    def _greedy(self) -> int:  # argmax of the last evaluated position's logits, read in place
        import numpy as np

        logits = self.llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.vocab,))))

    def generate(self, ids: list[int], new_tokens: int) -> dict:
        """A whole greedy run from an empty cache: prefill, then new_tokens - 1 steps."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        token = self._greedy()
        t_first = time.perf_counter()
        tokens, steps = [token], []
        for _ in range(new_tokens - 1):
            t = time.perf_counter()
            self.llm.eval([token])
            token = self._greedy()
            steps.append(time.perf_counter() - t)
            tokens.append(token)
        end = time.perf_counter()
        return {"total_s": end - t0, "ttft_s": t_first - t0, "steps": steps, "tokens": tokens}

    def decode_diff(self, ids: list[int], short: int = DIFF_SHORT, long: int = DIFF_LONG) -> dict:
        a, b = self.generate(ids, short), self.generate(ids, long)
        span = b["total_s"] - a["total_s"]
        return {"short_s": a["total_s"], "long_s": b["total_s"], "short": short, "long": long,
                "decode_tokens_per_s": (long - short) / span if span > 0 else 0.0, "tokens": b["tokens"],
                "ttft_s": b["ttft_s"], "step_p50_s": statistics.median(b["steps"]) if b["steps"] else 0.0}

    def prefill(self, ids: list[int]) -> dict:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "prompt_tokens": len(ids), "prefill_tokens_per_s": len(ids) / seconds}

    def perplexity(self, tokens: list[int], context: int, prefix: list[int] = (), max_tokens: int | None = None) -> dict:
        """twice's definition (see the module's docstring), from logits_all=True evaluations."""
        import numpy as np
        from llama_cpp import Llama

        prefix = [int(i) for i in prefix]
        n = len(prefix) + context
        if self._ppl is None or self._ppl[1] < n:
            self._ppl = (Llama(model_path=str(self.gguf), n_ctx=n, n_threads=self.threads,
                               n_threads_batch=self.threads, n_batch=n, n_ubatch=min(n, 512), logits_all=True,
                               verbose=False), n)
        llm = self._ppl[0]
        used = list(tokens[:max_tokens] if max_tokens is not None else tokens)
        first = max(len(prefix), 1)  # the first scored position of a window's sequence
        total, scored, windows = 0.0, 0, 0
        t0 = time.perf_counter()
        for a in range(0, len(used), context):
            seq = prefix + used[a:a + context]
            if len(seq) <= first:
                continue  # nothing to score (a last window of one token without a BOS)
            llm.reset()
            llm.eval(seq)
            logits = np.asarray(llm.scores[first - 1:len(seq) - 1], dtype=np.float64)  # row i predicts seq[i + 1]
            top = logits.max(axis=1)
            lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
            target = np.asarray(seq[first:])
            total += float((lse - logits[np.arange(len(target)), target]).sum())
            scored += len(target)
            windows += 1
        seconds = time.perf_counter() - t0
        return {"perplexity": math.exp(total / scored) if scored else float("nan"),
                "mean_nll": total / scored if scored else float("nan"), "tokens": scored, "windows": windows,
                "context": context, "prefix": prefix, "seconds": seconds, "engine": "llama.cpp",
                "definition": "twice perplexity's (non-overlapping windows, BOS prefix, all window tokens after "
                              "the first scored), from llama.cpp logits_all"}


def run(gguf: Path, threads: int, workloads: list[str], repeats: int, ids: dict | None = None) -> list[dict]:
    """Each workload: a warm-up run, then `repeats` runs; the median run by decode tok/s."""
    peer = Peer(gguf, threads)
    results = []
    for name in workloads:
        p, g = WORKLOAD_SIZES[name]
        prompt = (ids or {}).get(name) or default_prompt_ids(peer.vocab, name)
        if name == "decode-diff":
            runs = [peer.decode_diff(prompt) for _ in range(repeats + 1)][1:]
            best = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
            results.append({"workload": name, "engine": "llama.cpp", "prompt_tokens": len(prompt), "new_tokens": g,
                            "batch": 1, "ttft_s": best["ttft_s"], "decode_tokens_per_s": best["decode_tokens_per_s"],
                            "decode_tokens_per_s_runs": [r["decode_tokens_per_s"] for r in runs],
                            "step_p50_s": best["step_p50_s"], "prefill_tokens_per_s": len(prompt) / best["ttft_s"],
                            "weight_bytes": os.path.getsize(gguf), "repeats": repeats, "threads": threads})
            continue
        runs = []
        for _ in range(repeats + 1):  # the first is the warm-up
            r = peer.generate(prompt, g)
            decode = sum(r["steps"])
            runs.append({"ttft_s": r["ttft_s"], "prefill_tokens_per_s": len(prompt) / r["ttft_s"],
                         "decode_tokens_per_s": (g - 1) / decode if decode else 0.0, "steps": r["steps"]})
        runs = runs[1:]
        best = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
        steps = sorted(best["steps"])
        results.append({
            "workload": name, "engine": "llama.cpp", "prompt_tokens": len(prompt), "new_tokens": g, "batch": 1,
            "ttft_s": best["ttft_s"], "prefill_tokens_per_s": best["prefill_tokens_per_s"],
            "decode_tokens_per_s": best["decode_tokens_per_s"],
            "step_p50_s": statistics.median(steps) if steps else 0.0,
            "step_p99_s": steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else 0.0,
            "peak_memory_bytes": 0, "weight_bytes": os.path.getsize(gguf), "repeats": repeats, "threads": threads,
        })
    return results


def serve(gguf: Path, threads: int) -> None:
    """JSON lines: one request per line on stdin, one answer per line on stdout, the model
    kept loaded (scripts/bench_quant.py alternates its rounds with twice's this way).
    Requests: {"op": "info"}, {"op": "decode_diff", "ids": [...], "short": 16, "long": 160},
    {"op": "generate", "ids": [...], "new_tokens": N}, {"op": "prefill", "ids": [...]},
    {"op": "perplexity", "tokens": [...], "context": C, "prefix": [...]}, {"op": "quit"}."""
    peer = Peer(gguf, threads)
    out = sys.stdout
    out.write(json.dumps({"ready": True, **peer.info()}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            break
        try:
            if op == "info":
                answer = peer.info()
            elif op == "decode_diff":
                answer = peer.decode_diff(req["ids"], req.get("short", DIFF_SHORT), req.get("long", DIFF_LONG))
            elif op == "generate":
                answer = peer.generate(req["ids"], req["new_tokens"])
            elif op == "prefill":
                answer = peer.prefill(req["ids"])
            elif op == "perplexity":
                answer = peer.perplexity(req["tokens"], req["context"], req.get("prefix", []), req.get("max_tokens"))
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception as e:  # reported to the caller, which decides
            answer = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--workloads", default="decode,prefill")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ids", type=Path, default=None, help="prompt ids per workload (JSON), else twice's prompt_ids")
    p.add_argument("--perplexity-ids", type=Path, default=None,
                   help='JSON {"tokens": [...], "context": 512, "prefix": [...], "max_tokens": N}')
    p.add_argument("--serve", action="store_true", help="answer JSON-line requests on stdin (see serve())")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.serve:
        serve(args.gguf, args.threads)
        return
    if args.json is None:
        p.error("--json is required (unless --serve)")
    ids = json.loads(args.ids.read_text()) if args.ids else None
    workloads = [w for w in args.workloads.split(",") if w in PEER_WORKLOADS]
    results = run(args.gguf, args.threads, workloads, args.repeats, ids) if workloads else []
    if args.perplexity_ids:
        spec = json.loads(args.perplexity_ids.read_text())
        peer = Peer(args.gguf, args.threads, n_ctx=512)
        results.append({"workload": "perplexity", **peer.perplexity(spec["tokens"], spec["context"],
                                                                     spec.get("prefix", []), spec.get("max_tokens"))})
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
