"""`twice info MODEL`: what a model is and what it costs, without generating."""

from __future__ import annotations

import json

import typer
from . import options as o
from .app import app
from .console import wide_console
from .format import human_bytes, human_count

INFO_WIDTH = 120  # off a terminal (piped, redirected), at least this many columns


@app.command()
def info(
    model: str = typer.Argument(None, callback=o.names_a_model,
                                help="Model folder, .gguf file or Hub id. Default: SmolLM2-135M-Instruct."),
    revision: o.Revision = None,
    dtype: o.Dtype = "auto",
    dequantize: o.Dequantize = False,
    kv_dtype: o.KvDtype = "auto",
    as_json: bool = typer.Option(False, "--json", help="Print the facts as one JSON object."),
    no_color: o.NoColor = False,
):
    """Architecture, size, context length and KV cache cost of a model."""
    from twice.weights.inspect import describe

    o.check_kv_dtype(kv_dtype)
    facts = describe(model, revision, dtype, dequantize)
    facts["dtype_reason"] = _dtype_reason(dtype)
    element = _kv_cost(facts, kv_dtype)
    if as_json:
        print(json.dumps(facts))
        return
    from rich.table import Table

    t = Table(show_header=False, title=facts["name"], title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    formula = f"2 · {facts['layers']} · {facts['kv_heads']} · {facts['head_dim']} · {element}"
    rows = [
        ("architecture", f"{facts['model_type']} ({facts['folder']})"),
        ("parameters", f"{facts['parameters']:,} ({human_count(facts['parameters'])})"),
        *([("active parameters", f"{facts['active_parameters']:,} ({human_count(facts['active_parameters'])}) per "
             f"token: the chosen experts', {human_bytes(facts['active_weight_bytes'])} of weights read")]
          if facts["active_parameters"] != facts["parameters"] else []),
        ("stored dtype", str(facts["stored_dtype"])),
        ("weights", _weights(facts)),
        ("dtype", f"{facts['dtype']} ({facts['dtype_reason']})"),
        ("context length", f"{facts['context_length']:,} tokens"),
        ("layers / heads / kv heads / head dim",
         f"{facts['layers']} / {facts['heads']} / {facts['kv_heads']} / {facts['head_dim']}"),
        ("hidden / intermediate / vocab", f"{facts['hidden_size']} / {facts['intermediate_size']} / {facts['vocab_size']}"),
        ("position encoding", _rope(facts["rope"])),
        ("sliding window", f"{facts['sliding_window']:,} tokens" if facts["sliding_window"] else "none"),
        ("KV cache per token",
         f"{human_bytes(facts['kv_bytes_per_token'])}: 2 · L · H_kv · d · bytes = {formula} = {facts['kv_bytes_per_token']:,} B"
         + (f" ({facts['kv_dtype']})" if kv_dtype != "auto" else "")),
        ("KV cache at full context",
         f"{human_bytes(facts['kv_bytes_full_context'])} (per token × {facts['context_length']:,})"),
        ("chat template", "yes" if facts["chat_template"] else "no"),
        ("eos tokens", ", ".join(map(str, facts["eos_token_ids"])) or "none"),
        ("decode steps", _steps(facts["decode_steps"])),
    ]
    for k, v in rows:
        t.add_row(k, v)
    wide_console(stderr=False, min_width=INFO_WIDTH, no_color=no_color).print(t)


def _kv_cost(facts: dict, kv_dtype: str) -> str:
    """Set the KV facts for --kv-dtype (kv_dtype, kv_bytes_per_token, kv_bytes_full_context, the
    cache's real bytes: q8_0 34 per 32 values); returns the bytes per element as the formula
    shows them ("2", "34/32")."""
    from twice.core.cache import kv_format
    from twice.core.device import DTYPES

    fmt = kv_format(kv_dtype, DTYPES.get(facts["dtype"]), facts["head_dim"])
    per_token = 2 * facts["layers"] * facts["kv_heads"] * fmt.bytes_per_values(facts["head_dim"])
    facts.update(kv_dtype=fmt.name, kv_bytes_per_token=per_token,
                 kv_bytes_full_context=per_token * facts["context_length"])
    b = fmt.bytes_per_values(fmt.block)
    return str(b) if fmt.block == 1 else f"{b}/{fmt.block}"


def _steps(steps: dict) -> str:
    """Which fast decode steps run the model (the rest: the eager layers), and its features."""
    yes = lambda ok: "yes" if ok else "no: eager"  # noqa: E731
    return (f"native CPU step {yes(steps['native'])}; compiled (--compile, a GPU) {yes(steps['compiled'])}; "
            f"features {', '.join(steps['features'])}")


def _weights(facts: dict) -> str:
    """The weights' bytes and format: a GGUF run as stored names its block types (values per
    type) and the bits per weight; a float model its dtype."""
    size = f"{human_bytes(facts['weight_bytes'])} ({facts['weight_bytes']:,} B)"
    fmt = facts["weight_format"]
    if facts.get("source") is None:
        return f"{size} in {facts['dtype']}"
    total = sum(fmt["types"].values()) or 1
    shares = ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in fmt["types"].items())
    return f"{size} as stored in {facts['source']}: {fmt['bits_per_weight']:.2f} bits per weight ({shares} of values)"


def _dtype_reason(dtype: str) -> str:
    """Why info counts bytes in this dtype: --dtype, or what auto means on this CPU (info
    never touches a GPU)."""
    from twice.core.device import dtype_choice

    return dtype_choice(dtype, "cpu")[1]


def _rope(rope: dict | None) -> str:
    if not rope:
        return "learned absolute positions"
    kind = rope.get("rope_type", "default")
    rest = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in rope.items() if k != "rope_type")
    return f"RoPE {kind}" + (f" ({rest})" if rest else "")
