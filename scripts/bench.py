#!/usr/bin/env python3
"""The full benchmark matrix: `twice bench` for each model/shape and dtype, each in its own
process (so one run's memory and compiled code do not leak into the next), collected into
one JSON file and one markdown table (the README's).

    python scripts/bench.py                       # SmolLM2-135M (real), fp32 and bf16, this machine
    python scripts/bench.py --shapes smollm2-360m,qwen2.5-0.5b,llama-3.2-1b
    python scripts/bench.py --device cuda --shapes llama-3.2-1b --dtypes bfloat16 \\
        --workloads decode,batch1,batch32          # the GPU check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_llamacpp  # noqa: E402  (scripts/peer_llamacpp.py, beside this file)


def run_one(subject: dict, dtype: str, args, out_dir: Path) -> dict:
    tag = f"{subject['label']}-{dtype}".replace("/", "_")
    json_path = out_dir / f"{tag}.json"
    cmd = [sys.executable, "-c", "from twice.cli.app import main; main()", "bench", "--device", args.device,
           "--dtype", dtype, "--repeats", str(args.repeats), "--json", str(json_path)]
    # The default model: its float copy (--dequantize), the weights the float matrix and its llama.cpp peer measure
    # (run as stored, the default model is its Q4_1 file: scripts/bench_quant.py compares that one).
    cmd += (["--shape", subject["shape"]] if subject.get("shape")
            else ["--model", subject["model"]] if subject.get("model") else ["--dequantize"])
    for w in args.workloads.split(","):
        cmd += ["-w", w]
    for e in (args.engines.split(",") if args.engines else []):
        cmd += ["-e", e]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.plot:
        cmd += ["--plot", str(out_dir / f"{tag}.png")]
    print("+", " ".join(cmd[3:]), flush=True)
    t = time.time()
    subprocess.run(cmd, check=True)
    data = json.loads(json_path.read_text())
    data["label"], data["wall_s"] = subject["label"], time.time() - t
    return data


def add_peer(data: dict, subject: dict, dtype: str, args, out_dir: Path) -> None:
    """llama.cpp on a GGUF of the same folder at the same precision, same threads, appended
    to this run's results with its ratios against transformers (scripts/peer_llamacpp.py)."""
    from twice.weights.resolve import default_model

    if subject.get("shape"):
        return  # random weights exist only inside `twice bench`
    folder = Path(subject["model"]) if subject.get("model") else default_model()
    if not (folder / "config.json").is_file():
        print(f"skip llama.cpp for {subject['label']}: not a local model folder", file=sys.stderr)
        return
    gguf = peer_llamacpp.make_gguf(folder, dtype, args.llama_convert, out_dir)
    peer_json = out_dir / f"{gguf.stem}-llamacpp.json"
    threads = args.threads or data["bandwidth"]["threads"]
    workloads = ",".join(w for w in args.workloads.split(",") if w in peer_llamacpp.PEER_WORKLOADS)
    subprocess.run([sys.executable, str(Path(peer_llamacpp.__file__)), str(gguf), "--threads", str(threads),
                    "--workloads", workloads, "--repeats", str(args.repeats), "--json", str(peer_json)], check=True)
    hf = {r["workload"]: r for r in data["results"] if r["engine"] == "transformers"}
    read = data["bandwidth"]["read_bytes_per_s"] if data.get("bandwidth") else None
    peak = (data.get("compute_peak") or {}).get("macs_per_s")
    for r in json.loads(peer_json.read_text()):
        base = hf.get(r["workload"])
        if base:
            r["decode_vs_transformers"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            r["prefill_vs_transformers"] = r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
            # The same bytes and multiply-adds per step as transformers (same weights and dtype).
            if read:
                r["fraction_of_bandwidth"] = base["bytes_read_per_step"] * r["decode_tokens_per_s"] / read
            if peak and base.get("macs_per_step"):
                r["fraction_of_compute_peak"] = base["macs_per_step"] * r["decode_tokens_per_s"] / r["batch"] / peak
        data["results"].append(r)


def markdown(runs: list[dict]) -> str:
    lines = ["| model | dtype | workload | engine | TTFT | prefill tok/s | decode tok/s | p50 / p99 step | "
             "peak +mem | decode vs transformers | prefill vs transformers | % of read bandwidth | % of MAC peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for data in runs:
        s = data["setup"]
        for r in data["results"]:
            vs = lambda k: f"{r[k]:.2f}×" if r.get(k) else "—"  # noqa: E731
            share = lambda k: f"{100 * r[k]:.0f}%" if r.get(k) else "—"  # noqa: E731
            lines.append(
                f"| {data['label']} | {s['dtype']} | {r['workload']} (P={r['prompt_tokens']}, G={r['new_tokens']}, "
                f"B={r['batch']}) | {r['engine']} | {r['ttft_s'] * 1000:.0f} ms | {r['prefill_tokens_per_s']:,.0f} | "
                f"{r['decode_tokens_per_s']:,.1f} | {r['step_p50_s'] * 1000:.1f} / {r['step_p99_s'] * 1000:.1f} ms | "
                f"{r['peak_memory_bytes'] / 2**20:.0f} MiB | {vs('decode_vs_transformers')} | "
                f"{vs('prefill_vs_transformers')} | {share('fraction_of_bandwidth')} | "
                f"{share('fraction_of_compute_peak')} |")
    lines.append("")
    for data in runs:  # each run measured its own limits
        bw, peak = data.get("bandwidth"), data.get("compute_peak")
        line = f"{data['label']} {data['setup']['dtype']}:"
        if bw:
            line += (f" memory bandwidth ({bw['device']}, {bw['threads']} threads) read "
                     f"{bw['read_bytes_per_s'] / 1e9:.1f} GB/s, copy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s;")
        if peak:
            line += f" multiply-add peak {peak['macs_per_s'] / 1e9:.1f} GMAC/s."
        lines.append(line + "  ")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="default", help="comma-separated model references ('default' = SmolLM2-135M)")
    p.add_argument("--shapes", default="", help="comma-separated random-weight shapes (see twice bench --help)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workloads", default="decode,prefill,naive,batch1,batch4,batch16")
    p.add_argument("--engines", default="", help="comma-separated engines (default: per workload)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="folder for JSON, plots and table (default: a temp folder)")
    p.add_argument("--plot", action="store_true", help="draw per-token latency plots (needs matplotlib)")
    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="also run llama.cpp (llama-cpp-python) on a GGUF of the same weights and precision")
    p.add_argument("--llama-convert", type=Path, default=None,
                   help="llama.cpp's convert_hf_to_gguf.py (in the llama-cpp-python sdist), for --peer")
    args = p.parse_args()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="twice-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    subjects = [{"label": "SmolLM2-135M" if m == "default" else m, "model": None if m == "default" else m}
                for m in args.models.split(",") if m]
    subjects += [{"label": f"{s} (random)", "shape": s} for s in args.shapes.split(",") if s]
    if args.peer and not (args.llama_convert and args.llama_convert.is_file()):
        p.error("--peer llama.cpp needs --llama-convert PATH/convert_hf_to_gguf.py")
    runs = []
    for subject in subjects:
        for dtype in args.dtypes.split(","):
            data = run_one(subject, dtype, args, out_dir)
            if args.peer:
                add_peer(data, subject, dtype, args, out_dir)
            runs.append(data)
    (out_dir / "all.json").write_text(json.dumps(runs, indent=1))
    table = markdown(runs)
    (out_dir / "table.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out_dir}/all.json and {out_dir}/table.md", file=sys.stderr)
    os.sys.stdout.flush()


if __name__ == "__main__":
    main()
