"""Memory of loading a GGUF as stored, against the issue's targets (never in CI):

* resident weight memory within 10% of the file's tensor bytes;
* peak memory of the whole process while loading ≤ 1.3 × the file size + the runtime's
  own overhead (the RSS of a process that has imported torch and twice and built the
  native kernels, measured first in the same child process). The tokenizer (a
  150k-token vocabulary with its merges is ~150 MB in `tokenizers`) is reported on its
  own line: the weights' share is the peak less runtime and tokenizer.

Each model is loaded in a fresh child process (peak RSS is per process):

    python scripts/load_memory.py [MODEL ...] [--json out.json]

MODEL: a .gguf path or a name twice resolves (default: the default model and the packaged
Qwen2.5-Coder-0.5B/1.5B Q4_K_M files).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
import torch
from twice.core import kernels
from twice.weights.load import load
from twice.weights.resolve import resolve
from twice.weights.gguf_load import gguf_source, stored_formats
kernels.available()
folder = resolve(sys.argv[1])   # header folder (written once) before the baseline
source = gguf_source(folder)
baseline = rss()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from twice.weights.tokenizer import Tokenizer
tokenizer = Tokenizer(folder)
with_tokenizer = rss()
del tokenizer
loaded = load(sys.argv[1])
after = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"model": sys.argv[1], "file": str(source), "file_bytes": source.stat().st_size,
                  "tensor_bytes": stored_formats(source)["weight_bytes"], "weight_bytes": loaded.model.weight_bytes(),
                  "baseline_rss": baseline, "tokenizer_rss": with_tokenizer - baseline, "peak_rss": max(peak, peak_before), "rss_after_load": after}))
"""

DEFAULT = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=DEFAULT)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    rows = []
    for model in args.models:
        out = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["weights_vs_tensor_bytes"] = r["weight_bytes"] / r["tensor_bytes"]
        r["load_peak_over_baseline"] = r["peak_rss"] - r["baseline_rss"]
        r["peak_vs_file"] = r["load_peak_over_baseline"] / r["file_bytes"]
        r["weights_peak_vs_file"] = (r["load_peak_over_baseline"] - r["tokenizer_rss"]) / r["file_bytes"]
        rows.append(r)
        print(f"{model}: file {r['file_bytes'] / 2**20:.0f} MiB, weights {r['weight_bytes'] / 2**20:.0f} MiB "
              f"({r['weights_vs_tensor_bytes']:.3f}× tensor bytes), peak while loading {r['peak_rss'] / 2**20:.0f} MiB "
              f"= runtime {r['baseline_rss'] / 2**20:.0f} MiB + {r['peak_vs_file']:.2f}× file size "
              f"(tokenizer {r['tokenizer_rss'] / 2**20:.0f} MiB; the rest {r['weights_peak_vs_file']:.2f}× file size)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
