"""The --timing report: every number with the definition it was measured by."""

from __future__ import annotations

from rich.table import Table

from .format import human_bytes, percentile, seconds


def timing_table(result, loaded) -> Table:
    c = loaded.config
    r = result
    t = Table(title="twice timing report", show_header=True, header_style="bold", title_justify="left")
    t.add_column("phase")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("definition", style="dim")

    t.add_row("load", "weights", seconds(loaded.weights_seconds), "resolve files, read config, copy tensors to the device")
    t.add_row("", "tokenizer", seconds(loaded.tokenizer_seconds), "read tokenizer.json and tokenizer_config.json")
    t.add_row("request", "tokenize", seconds(r.tokenize_seconds), "prompt (and chat template) → token ids")
    new = r.prompt_tokens - r.reused_tokens
    t.add_row("prefill", "prompt tokens", f"{r.prompt_tokens}" + (f" ({r.reused_tokens} reused, {new} new)" if r.reused_tokens else ""),
              "tokens in the prompt; reused = already in the KV cache")
    t.add_row("", "time", seconds(r.prefill_seconds), "forward pass over the new prompt tokens, synchronized")
    t.add_row("", "tokens/s", f"{r.prefill_tokens_per_second:,.1f}", "new prompt tokens ÷ prefill time")
    t.add_row("", "TTFT", seconds(r.ttft_seconds), "request start → first token's text (tokenize + prefill + sample)")
    steps = r.step_seconds
    t.add_row("decode", "tokens", str(r.generated_tokens), f"generated; finish: {r.finish_reason}")
    t.add_row("", "time", seconds(r.decode_seconds), "first token → last token")
    t.add_row("", "tokens/s", f"{r.decode_tokens_per_second:,.1f}", "(generated − 1) ÷ decode time")
    if steps:
        lat = " / ".join(seconds(percentile(steps, q)) for q in (50, 90, 99)) + f" / {seconds(max(steps))}"
        t.add_row("", "latency p50/p90/p99/max", lat, "wall time of each decode step")
    e = r.cache.bytes_per_token // (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim)
    n = r.cache.tokens
    formula = f"2 · {c.num_hidden_layers} · {r.cache.batch} · {n} · {c.num_key_value_heads} · {c.head_dim} · {e}"
    t.add_row("KV cache", "in use", human_bytes(r.cache.bytes_in_use), f"2 · L · B · N · H_kv · d · bytes = {formula}")
    t.add_row("", "allocated", human_bytes(r.cache.bytes_allocated), f"preallocated for {r.cache.capacity} tokens")
    t.add_row("", "per token", human_bytes(r.cache.bytes_per_token), "2 · L · H_kv · d · bytes")
    t.add_row("", "at full context", human_bytes(r.cache.bytes_full_context),
              f"one sequence of {r.cache.context_length} tokens")
    where = "torch.cuda.max_memory_allocated" if r.device.startswith("cuda") else "peak process RSS"
    t.add_row("memory", "peak", human_bytes(r.peak_memory_bytes), where)
    t.add_row("", "weights", human_bytes(r.weight_bytes), f"{r.device}, {r.dtype}")
    if r.decode_tokens_per_second:
        bw = r.bytes_read_per_token() * r.decode_tokens_per_second
        t.add_row("bandwidth", "achieved", f"{bw / 1e9:,.2f} GB/s",
                  "(weight bytes + mean KV bytes read per step) × decode tokens/s")
    return t
