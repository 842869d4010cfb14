"""`twice bench --kv`: the context × kv-dtype sweep's checks, table, JSON and plot
(the measuring is core/benchmark_kv.py)."""

from __future__ import annotations

import json
from pathlib import Path

from twice.core.config import MAX_SIZE
from twice.core.errors import PromptError

from .console import wide_console
from .format import human_bytes

QUICK_CONTEXTS = (64, 128)


def check_kv_options(kv: bool, kv_dtypes, contexts, batch: int) -> None:
    """One line for a bad --kv-dtype / --kv-context / --kv-batch, before the model loads."""
    from . import options as o

    for name in kv_dtypes or ():
        o.check_kv_dtype(name)
    if not kv:
        if kv_dtypes and len(kv_dtypes) > 1:
            raise PromptError("one --kv-dtype for the suite (several are swept with --kv)")
        if contexts or batch != 1:
            raise PromptError("--kv-context and --kv-batch go with --kv")
        return
    if any(c < 1 for c in contexts or ()):
        raise PromptError(f"--kv-context must be at least 1 token, got {min(contexts)}")
    if not 1 <= batch <= MAX_SIZE:
        raise PromptError(f"--kv-batch must be 1 to {MAX_SIZE:,}, got {batch:,}")


def run_kv(model, setup: dict, kv_dtypes, contexts, batch: int, repeats: int, quick: bool, json_out, plot, say):
    from twice.core import benchmark_kv as bk

    limit = model.config.max_position_embeddings
    steps = 4 if quick else 16
    wanted = list(dict.fromkeys(contexts or (QUICK_CONTEXTS if quick else bk.CONTEXTS)))  # each once
    usable = [c for c in wanted if c + steps <= limit]
    if not usable:
        raise PromptError(f"no --kv-context fits the model's context of {limit:,} tokens (with {steps} decode steps)")
    for c in wanted:
        if c not in usable:
            say(f"skip context {c:,}: with {steps} decode steps it needs {c + steps:,} positions, the model has "
                f"{limit:,}")
    types = list(dict.fromkeys(kv_dtypes or bk.KV_DTYPES))
    if not kv_dtypes:  # the default sweep leaves out what this model's head size cannot hold
        from twice.core.cache import KVDtypeError, kv_format

        head_dim = model.config.head_dim
        for t in list(types):
            try:
                kv_format(t, None, head_dim)  # the model dtype matters only to float caches
            except KVDtypeError as e:
                types.remove(t)
                say(f"skip --kv-dtype {t}: it needs {str(e).split(' needs ', 1)[-1]}")
    points = bk.sweep(model, usable, tuple(types), batch, steps, repeats, progress=say)
    out = wide_console(stderr=False, min_width=120)
    out.print(kv_table(points, setup))
    if json_out is not None:
        from twice.weights.safe_write import write_atomic

        write_atomic(Path(json_out), json.dumps({"setup": setup, "kv": [p.to_dict() for p in points]}, indent=1))
        say(f"wrote {json_out}")
    if plot is not None:
        kv_plot(points, Path(plot), setup)
        say(f"wrote {plot}")


def kv_table(points, setup: dict):
    from rich.table import Table

    t = Table(title=f"{setup['model']} · {setup['device']} {setup['dtype']} · {setup['threads']} threads · "
                    f"decode at each context (median step)", title_justify="left")
    for col in ("kv dtype", "context", "batch", "KV bytes", "per token", "decode tok/s", "step", "read / step",
                "KV share", "vs first", "step path"):
        t.add_column(col, justify="left" if col in ("kv dtype", "step path") else "right")
    for p in points:
        t.add_row(p.kv_dtype, f"{p.context:,}", str(p.batch), human_bytes(p.kv_bytes), f"{p.kv_bytes_per_token:,} B",
                  f"{p.decode_tokens_per_s:,.1f}", f"{p.step_s * 1000:.2f} ms", human_bytes(p.bytes_read_per_step),
                  f"{100 * p.kv_share:.0f}%", f"{p.speedup:.2f}×", p.path)
    t.caption = ("KV bytes = cache.bytes_per_token × batch × context (q8_0: 34 bytes per 32 values, q4_0: 18); read / "
                 "step = weights + each row's K and V at the mean position; vs first = decode tok/s ÷ the first "
                 "kv dtype's at that context")
    return t


def kv_plot(points, path: Path, setup: dict) -> None:
    """KV bytes and decode tok/s against context, one line per kv dtype (as bench's --plot, matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PromptError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    for kv in dict.fromkeys(p.kv_dtype for p in points):
        mine = [p for p in points if p.kv_dtype == kv]
        left.plot([p.context for p in mine], [p.kv_bytes / 2**20 for p in mine], marker="o", label=kv)
        right.plot([p.context for p in mine], [p.decode_tokens_per_s for p in mine], marker="o", label=kv)
    left.set_ylabel("KV cache (MiB)")
    right.set_ylabel("decode tokens/s")
    for ax in (left, right):
        ax.set_xlabel("context (tokens)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{setup['model']} · {setup['device']} {setup['dtype']} · batch {points[0].batch}")
    fig.tight_layout()
    import io

    from twice.weights.safe_write import write_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, format=(path.suffix[1:] or "png").lower())
    write_atomic(path, buffer.getvalue())
    plt.close(fig)
