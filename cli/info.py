"""`twice info MODEL`: what a model is and what it costs, without generating."""

from __future__ import annotations

import json

import typer

from . import options as o
from .app import app
from .console import COLOR, out_console
from .format import human_bytes


@app.command()
def info(
    model: str = typer.Argument(None, help="Model folder, .gguf file or Hub id. Default: SmolLM2-135M-Instruct."),
    revision: o.Revision = None,
    dtype: o.Dtype = "auto",
    as_json: bool = typer.Option(False, "--json", help="Print the facts as one JSON object."),
    no_color: o.NoColor = False,
):
    """Architecture, size, context length and KV cache cost of a model."""
    from twice.weights.inspect import describe

    if no_color:
        COLOR["on"] = False
    facts = describe(model, revision, dtype)
    if as_json:
        print(json.dumps(facts))
        return
    from rich.table import Table

    t = Table(show_header=False, title=facts["name"], title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("architecture", f"{facts['model_type']} ({facts['folder']})"),
        ("parameters", f"{facts['parameters']:,}"),
        ("stored dtype", str(facts["stored_dtype"])),
        ("weights", f"{human_bytes(facts['weight_bytes'])} in {facts['dtype']}"),
        ("context length", f"{facts['context_length']:,} tokens"),
        ("layers / heads / kv heads / head dim",
         f"{facts['layers']} / {facts['heads']} / {facts['kv_heads']} / {facts['head_dim']}"),
        ("hidden / intermediate / vocab", f"{facts['hidden_size']} / {facts['intermediate_size']} / {facts['vocab_size']}"),
        ("rope", str(facts["rope"])),
        ("sliding window", str(facts["sliding_window"])),
        ("KV cache per token", f"{human_bytes(facts['kv_bytes_per_token'])} (2 · L · H_kv · d · bytes)"),
        ("KV cache at full context", human_bytes(facts["kv_bytes_full_context"])),
        ("chat template", "yes" if facts["chat_template"] else "no"),
        ("eos tokens", ", ".join(map(str, facts["eos_token_ids"])) or "none"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    out_console().print(t)
