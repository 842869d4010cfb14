"""The --timing report: every number with the definition it was measured by.

`timing_table` builds the table; `print_timing` prints it on stderr, at least
REPORT_WIDTH columns wide when stderr is not a terminal (a file or a pipe has no width,
and rich would otherwise squeeze the definitions into 80 columns).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .console import wide_console
from .format import counted, human_bytes, percentile, seconds

REPORT_WIDTH = 120


def report_console(no_color: bool = False) -> Console:
    """A stderr console for reports: the terminal's width, or at least REPORT_WIDTH off a terminal."""
    return wide_console(stderr=True, min_width=REPORT_WIDTH, no_color=no_color)


def print_timing(result, loaded, no_color: bool = False, console: Console | None = None) -> None:
    (console or report_console(no_color)).print(timing_table(result, loaded))


def stats_lines(result, loaded=None) -> list[str]:
    """-v/--stats: the few numbers people look at after a run, one topic a line (like
    `ollama run --verbose`); the definitions are --timing's."""
    r = result
    new = r.prompt_tokens - r.reused_tokens
    reused = f" ({r.reused_tokens:,} reused)" if r.reused_tokens else ""
    lines = []
    if loaded is not None:
        why = getattr(loaded, "dtype_reason", "")
        lines.append(f"load      {seconds(loaded.load_seconds)} · {r.device} {r.dtype}" + (f" ({why})" if why else ""))
    if getattr(r, "compile_seconds", 0.0):  # before the request, so in neither TTFT nor decode
        lines.append(f"compile   {seconds(r.compile_seconds)} (the decode step, before this request)")
    lines.append(f"prefill   {counted(new, 'token')}{reused} in {seconds(r.prefill_seconds)}, "
                 f"{r.prefill_tokens_per_second:,.1f} tok/s · TTFT {seconds(r.ttft_seconds)}")
    decode = f"decode    {counted(r.generated_tokens, 'token')} in {seconds(r.decode_seconds)}"
    if r.decode_tokens_per_second:
        decode += f", {r.decode_tokens_per_second:,.1f} tok/s"
    lines.append(decode + f" ({getattr(r, 'decode_path', 'eager')} step; finish: {r.finish_reason})")
    if (spec := speculation_line(getattr(r, "speculation", None))) is not None:
        lines.append(spec)
    c = r.cache
    lines.append(f"KV cache  {human_bytes(c.bytes_in_use)} in use of {human_bytes(c.bytes_allocated)} allocated "
                 f"({human_bytes(c.bytes_per_token)}/token, {c.tokens:,} of {c.context_length:,} tokens)")
    return lines


def print_stats(result, loaded=None, console: Console | None = None) -> None:
    from rich.text import Text

    out = console or report_console()
    for line in stats_lines(result, loaded):
        out.print(Text(line), soft_wrap=True)


def latency_percentiles(steps: list[float]) -> dict:
    """p50/p90/p99/max of the decode steps (nearest rank), in seconds."""
    if not steps:  # no decode step: no latency (null in --json), not a 0.0 that reads as measured
        return {"p50": None, "p90": None, "p99": None, "max": None}
    return {"p50": percentile(steps, 50), "p90": percentile(steps, 90), "p99": percentile(steps, 99),
            "max": max(steps)}


def device_bandwidth(device: str) -> float | None:
    """The device's peak memory bandwidth in bytes/s, where twice knows it."""
    from twice.core.device import device_bandwidth_bytes

    return device_bandwidth_bytes(device)


def bandwidth(result) -> dict:
    """Achieved decode bandwidth: (weight bytes + mean KV cache bytes read per step) ×
    decode tokens/s; and, where the device's peak is known, the fraction of it."""
    per_token = result.bytes_read_per_token()
    rate = result.decode_tokens_per_second
    achieved = per_token * rate if rate else None
    peak = device_bandwidth(result.device)
    return {
        "bytes_read_per_token": per_token,
        "achieved_bytes_per_s": achieved,
        "device_peak_bytes_per_s": peak,
        "fraction_of_peak": achieved / peak if (achieved and peak) else None,
    }


def _unknown_peak() -> str:
    return "twice has no peak bandwidth for this device; measure it with twice bench"


def timing_table(result, loaded) -> Table:
    c = loaded.config
    r = result
    t = Table(title="twice timing report", show_header=True, header_style="bold", title_justify="left")
    t.add_column("phase", style="cyan")
    t.add_column("measure")
    t.add_column("value", justify="right", style="bold")
    t.add_column("definition", style="dim")

    t.add_row("load", "weights", seconds(loaded.weights_seconds),
              "resolve files, read config, build the model, copy tensors to the device")
    t.add_row("", "tokenizer", seconds(loaded.tokenizer_seconds), "read tokenizer.json and tokenizer_config.json")
    compile_seconds = getattr(r, "compile_seconds", 0.0)
    if compile_seconds:
        t.add_row("", "compile", seconds(compile_seconds),
                  "torch.compile of the decode step before this request (not part of TTFT)")
    t.add_row("request", "tokenize", seconds(r.tokenize_seconds), "prompt (and chat template) → token ids")
    new = r.prompt_tokens - r.reused_tokens
    t.add_row("prefill", "prompt tokens",
              f"{r.prompt_tokens:,}" + (f" ({r.reused_tokens:,} reused, {new:,} new)" if r.reused_tokens else ""),
              "tokens in the prompt; reused = already in the KV cache")
    t.add_row("", "time", seconds(r.prefill_seconds), "forward pass over the new prompt tokens, synchronized")
    t.add_row("", "tokens/s", f"{r.prefill_tokens_per_second:,.1f}", "new prompt tokens ÷ prefill time")
    t.add_row("", "TTFT", seconds(r.ttft_seconds), "request start → first token's text (tokenize + prefill + sample)")
    steps = r.step_seconds
    t.add_row("decode", "tokens", f"{r.generated_tokens:,}", f"generated, the first included; finish: {r.finish_reason}")
    t.add_row("", "time", seconds(r.decode_seconds), "first token → last token")
    rate = r.decode_tokens_per_second
    t.add_row("", "tokens/s", "n/a" if rate is None else f"{rate:,.1f}",
              "after the first token: (generated − 1) ÷ decode time"
              + ("; needs at least 2 generated tokens (a decode step)" if rate is None else ""))
    t.add_row("", "step", getattr(r, "decode_path", "eager"),
              "native: one C call per step (CPU, a model whose every feature the C step implements); compiled: torch.compile (batch 1 on the CPU; any batch, as a CUDA graph, on a GPU); eager: PyTorch layers")
    if steps:
        p = latency_percentiles(steps)
        t.add_row("", "step latency p50", seconds(p["p50"]),
                  f"wall time of each of the {len(steps):,} decode steps after the first token; nearest-rank "
                  "percentiles: half the steps took at most p50")
        t.add_row("", "step latency p90", seconds(p["p90"]), "90% of the steps took at most this")
        t.add_row("", "step latency p99", seconds(p["p99"]), "99% of the steps took at most this")
        t.add_row("", "step latency max", seconds(p["max"]), "the slowest step")
    speculation_rows(t, getattr(r, "speculation", None))
    L, H, d = c.num_hidden_layers, loaded.model.kv_heads, c.head_dim  # kv heads in this rank's cache
    e = r.cache.bytes_per_token // (2 * L * H * d)
    if getattr(r.cache, "element_bytes", (0, 1))[0]:  # the real bytes per element: 34/32 for a q8_0 cache
        e = r.cache.element_words
    b, n = r.cache.batch, r.cache.tokens
    formula = f"2 · {L} · {b} · {n} · {H} · {d} · {e}"
    t.add_row("KV cache", "in use", human_bytes(r.cache.bytes_in_use),
              f"2 · L · B · N · H_kv · d · bytes = {formula} = {r.cache.bytes_in_use:,} B")
    t.add_row("", "allocated", human_bytes(r.cache.bytes_allocated),
              f"preallocated for N = {r.cache.capacity:,} tokens: 2 · {L} · {b} · {r.cache.capacity} · {H} · {d} · {e}")
    t.add_row("", "per token", human_bytes(r.cache.bytes_per_token),
              f"2 · L · H_kv · d · bytes = 2 · {L} · {H} · {d} · {e} = {r.cache.bytes_per_token:,} B"
              + (f" ({r.cache.kv_dtype})" if getattr(r.cache, "kv_dtype", "") else ""))
    t.add_row("", "at full context", human_bytes(r.cache.bytes_full_context),
              f"one sequence of the model's {r.cache.context_length:,} tokens: per token × {r.cache.context_length:,}")
    where = "torch.cuda.max_memory_allocated" if r.device.startswith("cuda") else "peak process RSS"
    t.add_row("memory", "peak", human_bytes(r.peak_memory_bytes), where)
    t.add_row("", "weights", human_bytes(r.weight_bytes), weights_words(r))
    active = getattr(r, "active_weight_bytes", 0)
    if active and active != r.weight_bytes:
        t.add_row("", "active weights", human_bytes(active),
                  "read per decode step: all but the experts the router did not choose")
    why = getattr(loaded, "dtype_reason", "")
    t.add_row("", "device / dtype", f"{r.device} / {r.dtype}",
              "where the model ran, and its weights' dtype" + (f" ({why})" if why else ""))
    bw = bandwidth(r)
    if bw["achieved_bytes_per_s"]:
        t.add_row("bandwidth", "achieved", f"{bw['achieved_bytes_per_s'] / 1e9:,.2f} GB/s",
                  f"({'active ' if active and active != r.weight_bytes else ''}weight bytes + mean KV bytes read "
                  f"per step = {human_bytes(bw['bytes_read_per_token'])}) "
                  "× decode tokens/s")
        if bw["fraction_of_peak"] is not None:
            t.add_row("", "of device peak", f"{100 * bw['fraction_of_peak']:.1f}%",
                      f"achieved ÷ {bw['device_peak_bytes_per_s'] / 1e9:,.0f} GB/s, the {r.device} device's peak")
        else:
            t.add_row("", "of device peak", "unknown", f"{_unknown_peak()}")
    else:
        t.add_row("bandwidth", "achieved", "n/a", "needs at least 2 generated tokens (a decode step)")
    shard = getattr(loaded.model, "shard", None)
    if shard is not None and shard.active:
        n = shard.world
        t.add_row("tensor parallel", "ranks", str(n), "processes sharing the model (numbers above are rank 0's)")
        t.add_row("", "KV cache", f"{human_bytes(r.cache.bytes_allocated)} × {n}",
                  f"allocated per rank (each holds 1/{n} of the KV heads); total {human_bytes(n * r.cache.bytes_allocated)}")
        t.add_row("", "weights", f"{human_bytes(r.weight_bytes)} per rank",
                  f"1/{n} of every layer's projections, plus the replicated embeddings and norms")
        busy = r.prefill_seconds + r.decode_seconds
        share = f" = {100 * shard.stats.seconds / busy:.1f}% of prefill + decode" if busy else ""
        t.add_row("", "all-reduce", seconds(shard.stats.seconds),
                  f"{shard.stats.calls} all-reduces (2 per layer per forward pass), wall time{share}")
    return t


def speculation_rows(t: Table, s: dict | None) -> None:
    """--timing's rows for speculative decoding (core/speculative.py), when it ran."""
    if not s:
        return
    k = s["draft_tokens"]
    t.add_row("speculation", "proposer", f"{s['proposer']}",
              f"draft tokens per pass: {k}" + (" (1..8 or none, from the measured acceptance and costs)"
                                               if k == "adaptive" else " (--draft-tokens)"))
    if s.get("drafting_off"):
        t.add_row("", "drafting", "off", s["drafting_off"].removeprefix("drafting off: "))
    t.add_row("", "proposals", f"{s['proposals']:,}", "proposed tokens the model verified")
    t.add_row("", "accepted", f"{s['accepted']:,}", "of those, kept (equal to the model's own choice)")
    t.add_row("", "acceptance rate", f"{100 * s['acceptance_rate']:.1f}%", "accepted ÷ proposals")
    t.add_row("", "mean accepted run", f"{s['mean_accepted_run']:.2f}", "proposals kept per verify pass")
    t.add_row("", "target passes", f"{s['target_passes']:,}",
              f"model forward passes after the first token ({s['verify_passes']:,} verify passes, the rest plain "
              f"steps); {s['tokens_per_target_pass']:.2f} tokens per pass")
    t.add_row("", "draft time", seconds(s["draft_s"]), "proposing (the draft model's steps, or the lookup)")
    t.add_row("", "verify time", seconds(s["verify_s"]), "the model's passes over the proposals, acceptance included")
    rate, without = (("n/a" if v is None else f"{v:,.1f}") for v in
                     (s["decode_tokens_per_s"], s["decode_tokens_per_s_without_draft"]))
    t.add_row("", "tokens/s", rate,
              f"decode with the draft's share; {without} without it "
              "(decode time − draft time)")
    if (p := s.get("prediction")) is not None:
        t.add_row("", "predicted speed-up", f"{p['speedup']:.2f}x",
                  f"the standard formula over the request: acceptance {100 * p['acceptance']:.0f}%, mean K "
                  f"{p['mean_k']:.1f}, draft {seconds(p['draft_s_per_guess'])}/guess, verify "
                  f"{seconds(p['verify_s_per_pass'])}/pass, step {seconds(p['step_s'])}, prefill and catch-up "
                  f"{seconds(p['catch_up_s'])}")


def speculation_line(s: dict | None) -> str | None:
    if not s:
        return None
    return (f"speculate {s['proposer']}: {s['accepted']:,}/{s['proposals']:,} accepted "
            f"({100 * s['acceptance_rate']:.0f}%), {s['tokens_per_target_pass']:.2f} tokens per pass, "
            f"draft {seconds(s['draft_s'])} · verify {seconds(s['verify_s'])}"
            + (f", predicted {s['predicted_speedup']:.2f}x" if s.get("predicted_speedup") is not None else "")
            + ("; drafting off (it cannot pay)" if s.get("drafting_off") else ""))


def weights_words(r) -> str:
    """How the weights are held: the float dtype, or the block types (share of the values)
    and bits per weight of a model run as stored / quantized."""
    fmt = getattr(r, "weight_format", None) or {}
    types = fmt.get("types") or {}
    if set(types) <= {"F32", "BF16", "F16"}:
        return f"parameters × bytes per element, on {r.device} in {r.dtype}"
    total = sum(types.values()) or 1
    shares = ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in types.items())
    return f"stored blocks: {shares} of the matrices' values, {fmt['bits_per_weight']:.2f} bits per weight; norms in {r.dtype}"
