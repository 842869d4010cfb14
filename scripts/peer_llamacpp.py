"""llama.cpp on the same weights, for `scripts/bench.py --peer llama.cpp` (never in CI).

llama.cpp is what a speed-minded user would pick instead of twice. This runs it through
llama-cpp-python on a GGUF made from the same safetensors folder at the same precision
(f32 or bf16, with llama.cpp's own convert_hf_to_gguf.py), with the same thread count,
the same prompt token ids and the same definitions as `twice bench`: greedy decoding,
TTFT = prefill + first token, decode tok/s after the first token, the median of the
repeats after a warm-up.

    python scripts/peer_llamacpp.py MODEL.gguf --threads 2 --workloads decode,prefill --json out.json

Setup (about 7 minutes on 2 cores): `pip install llama-cpp-python==0.3.36 sentencepiece`
(the converter imports sentencepiece for llama models), and the converter from the sdist:
`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`, unpacked whole
(convert_hf_to_gguf.py needs its `conversion/` and `gguf-py/` siblings) at
llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from twice.core.benchmark import WORKLOADS, prompt_ids

PEER_WORKLOADS = ("decode", "prefill", "batch1")  # batch 1: one sequence per llama.cpp context


def make_gguf(model_dir: Path, dtype: str, convert_script: Path, out_dir: Path) -> Path:
    """The folder's weights as a GGUF of the same precision (cached in out_dir)."""
    kind = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    out = out_dir / f"{model_dir.name}-{kind}.gguf"
    if not out.is_file():
        subprocess.run([sys.executable, str(convert_script), str(model_dir), "--outtype", kind, "--outfile", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def run(gguf: Path, threads: int, workloads: list[str], repeats: int) -> list[dict]:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=2048,
                n_ubatch=512, logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def greedy() -> int:  # argmax of the last evaluated position's logits, read in place
        logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(vocab,))))
    results = []
    for name in workloads:
        p, g = WORKLOADS[name].prompt_tokens, WORKLOADS[name].new_tokens
        ids = prompt_ids(vocab, 1, p)[0]  # the ids twice bench gives every engine
        runs = []
        for i in range(repeats + 1):  # the first is the warm-up
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            token = greedy()
            t_first = time.perf_counter()
            steps = []
            for _ in range(g - 1):
                t = time.perf_counter()
                llm.eval([token])
                token = greedy()
                steps.append(time.perf_counter() - t)
            decode = sum(steps)
            if i:
                runs.append({"ttft_s": t_first - t0, "prefill_tokens_per_s": p / (t_first - t0),
                             "decode_tokens_per_s": (g - 1) / decode if decode else 0.0, "steps": steps})
        best = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
        steps = sorted(best["steps"])
        results.append({
            "workload": name, "engine": "llama.cpp", "prompt_tokens": p, "new_tokens": g, "batch": 1,
            "ttft_s": best["ttft_s"], "prefill_tokens_per_s": best["prefill_tokens_per_s"],
            "decode_tokens_per_s": best["decode_tokens_per_s"],
            "step_p50_s": statistics.median(steps) if steps else 0.0,
            "step_p99_s": steps[min(len(steps) - 1, int(0.99 * len(steps)))] if steps else 0.0,
            "peak_memory_bytes": 0, "weight_bytes": os.path.getsize(gguf), "repeats": repeats,
        })
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--workloads", default="decode,prefill")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    results = run(args.gguf, args.threads, [w for w in args.workloads.split(",") if w in PEER_WORKLOADS], args.repeats)
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
