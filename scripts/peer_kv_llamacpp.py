"""llama.cpp's perplexity with quantized K/V caches, by twice perplexity's definition (the same
token ids and non-overlapping windows; scripts/peer_llamacpp.py's perplexity, with type_k / type_v
/ flash attention per configuration: llama.cpp needs flash attention for a quantized V cache).
Run it with a python that has llama-cpp-python (0.3.36 in /work/peer-venv):

    python scripts/quality_text.py quality.txt
    python scripts/peer_kv_llamacpp.py MODEL.gguf quality.txt --max-tokens 4096 --context 512 \
        --configs f16/f16/fa,q8_0/q8_0/fa,q8_0/f16/fa,f16/q8_0/fa [--threads 1] [--json out.json]

Each configuration is K type / V type / fa|nofa. The token ids come from twice's tokenizer (the
main venv: `twice` must be importable with --twice-python, default /work/main/.venv/bin/python).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
IDS = """import json, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from quality import token_ids
tokens, prefix = token_ids(Path(sys.argv[1]), Path(sys.argv[2]).read_text(encoding="utf-8"))
print(json.dumps({"tokens": tokens, "prefix": prefix}))"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf")
    p.add_argument("text")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--configs", default="f16/f16/fa,q8_0/q8_0/fa")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--twice-python", default="/work/main/.venv/bin/python")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import numpy as np
    from llama_cpp import Llama

    here = str(__import__("pathlib").Path(__file__).resolve().parent)
    out = subprocess.run([a.twice_python, "-c", IDS, a.gguf, a.text, here], capture_output=True, text=True, check=True)
    spec = json.loads(out.stdout)
    used, prefix = spec["tokens"][:a.max_tokens], spec["prefix"]
    first = max(len(prefix), 1)
    results = []
    for config in a.configs.split(","):
        tk, tv, fa = config.split("/")
        n = len(prefix) + a.context
        llm = Llama(model_path=a.gguf, n_ctx=n, n_threads=a.threads, n_threads_batch=a.threads, n_batch=n,
                    n_ubatch=min(n, 512), logits_all=True, verbose=False, type_k=TYPES[tk], type_v=TYPES[tv],
                    flash_attn=fa == "fa")
        total, scored, per, t0 = 0.0, 0, [], time.time()
        for start in range(0, len(used), a.context):
            seq = prefix + used[start:start + a.context]
            if len(seq) <= first:
                continue
            llm.reset()
            llm.eval(seq)
            logits = np.asarray(llm.scores[first - 1:len(seq) - 1], dtype=np.float64)
            top = logits.max(axis=1)
            lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
            target = np.asarray(seq[first:])
            nll = float((lse - logits[np.arange(len(target)), target]).sum())
            total, scored = total + nll, scored + len(target)
            per.append(nll)
        row = {"config": config, "perplexity": math.exp(total / scored), "tokens": scored, "window_nll": per,
               "seconds": time.time() - t0}
        print(json.dumps(row), flush=True)
        results.append(row)
        del llm
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
