"""`twice bench`: twice against transformers and a cache-less loop, side by side, in one run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import options as o
from .app import app
from .console import err_console, wide_console

TABLE_WIDTH = 180  # off a terminal (a file, a pipe): the table at this width; on one, the terminal's
WorkloadOpt = Annotated[Optional[list[str]], typer.Option(
    "--workload", "-w", help="decode (P=32 G=256), prefill (P=2048 G=16), naive (P=1000 G=100), batch1/batch4/batch16/batch32 "
                             "(P=32 G=64). Repeatable. Default: decode, prefill, batch1, batch4.")]


@app.command()
def bench(
    model: o.Model = None,
    shape: Annotated[Optional[str], typer.Option(help="Random weights with the shapes of a real model instead of "
                                                      "--model: tiny, smollm2-135m, smollm2-360m, qwen2.5-0.5b, "
                                                      "llama-3.2-1b, gemma-3-270m, gemma-2-2b-4l, phi-3-mini-4l, "
                                                      "olmo-2-1b-4l, qwen3-30b-a3b-4l16e, mixtral-8x7b-1l4e "
                                                      "(-NL: N layers, -ME: M experts of the real model's).")] = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    dequantize: o.Dequantize = False,
    quantize: o.Quantize = None,
    threads: Annotated[Optional[int], typer.Option(help="CPU threads for every engine (at least 1; default: torch's).")] = None,
    workload: WorkloadOpt = None,
    engine: Annotated[Optional[list[str]], typer.Option(
        "--engine", "-e", help="naive, transformers, transformers-static, twice (eager), twice-native (one C call per token, CPU), twice-compiled (repeatable). "
                               "Default: per workload.")] = None,
    repeats: Annotated[int, typer.Option(help="Timed repeats per measurement (median reported), after a warm-up.")] = 3,
    quick: Annotated[bool, typer.Option(help="Divide every workload's lengths by 8 (smoke test).")] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write all numbers to this JSON file.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Draw per-token decode latency against position (PNG).")] = None,
    kv: Annotated[bool, typer.Option("--kv", help="Sweep context length x --kv-dtype instead: KV bytes, decode "
                                                  "tok/s and the KV share of the bytes a step reads (--plot: bytes "
                                                  "and tok/s against context).")] = False,
    kv_dtype: Annotated[Optional[list[str]], typer.Option(
        "--kv-dtype", help="The KV cache's element type (auto, float32, bfloat16, float16, q8_0, q4_0). With --kv: "
                           "repeatable, the types swept (default auto, q8_0, q4_0); else one, for the twice engines.")] = None,
    kv_context: Annotated[Optional[list[int]], typer.Option(
        "--kv-context", help="With --kv: context lengths (repeatable; default 512, 1024, 2048, 4096, within the "
                             "model's context).")] = None,
    kv_batch: Annotated[int, typer.Option("--kv-batch", help="With --kv: rows decoded together.")] = 1,
):
    """Measure TTFT, prefill and decode speed, latency percentiles and memory of twice against
    transformers (same weights, dtype, device, threads), with the device's measured memory
    bandwidth as the roofline for decode (and, on the CPU, its measured multiply-add peak as
    the roofline for batches)."""
    from twice.core import benchmark as b

    from rich.text import Text

    from .bench_render import CAPTION, bandwidth_line, peak_line, results_tables, suite_json

    err = err_console()
    weights = o.weights_choice(dequantize, quantize)
    from .bench_kv import check_kv_options

    check_kv_options(kv, kv_dtype, kv_context, kv_batch)
    _check_before_measuring(repeats, json_out, plot, shape, model, weights, kv, workload, engine)
    o.apply_threads(threads)
    names = workload or ["decode", "prefill", "batch1", "batch4"]
    unknown = [n for n in names if n not in b.WORKLOADS]
    bad_engines = [e for e in (engine or []) if e not in b.ENGINES]
    if unknown or bad_engines:
        from twice.core.errors import PromptError

        what = f"workload {unknown[0]!r}" if unknown else f"engine {bad_engines[0]!r}"
        known = ", ".join(b.WORKLOADS if unknown else b.ENGINES)
        raise PromptError(f"unknown {what}; known: {known}")
    workloads = [b.scaled(b.WORKLOADS[n], 8) if quick else b.WORKLOADS[n] for n in names]
    say = lambda message: err.print(f"[dim]{message}[/dim]")  # noqa: E731
    if shape is not None:
        from twice.core.device import dtype_choice, resolve_device

        dev = resolve_device(device)
        dt, why = dtype_choice(dtype, dev)
        net = b.random_model(b.shape_config(shape), dev, dt)
        tokenizer, name = b.NullTokenizer(), f"{shape} shapes, random weights"
    else:
        from twice.weights.load import load

        loaded = load(model, None, device, dtype, progress=say, weights=weights)
        net, tokenizer, name, why = loaded.model, loaded.tokenizer, loaded.name, loaded.dtype_reason
    setup = b.describe_setup(net) | {"model": name, "dtype_reason": why}
    from twice.core.cache import kv_format

    for kind in kv_dtype or ():  # a head size a block type cannot hold: one line before measuring, as generate's
        kv_format(kind, None, net.config.head_dim)
    if kv:
        from .bench_kv import run_kv

        return run_kv(net, setup, kv_dtype, kv_context, kv_batch, repeats, quick, json_out, plot, say)
    say(f"measuring memory bandwidth on {setup['device']}")
    before = b.measure_bandwidth(setup["device"])
    skipped: list[str] = []

    def note(message: str) -> None:
        if message.startswith("skip "):
            skipped.append(message.removeprefix("skip "))
        say(message)

    results = b.run_suite(net, tokenizer, workloads, engine, repeats, progress=note,
                          kv_dtype=kv_dtype[0] if kv_dtype else None)
    if not results:  # an empty table and exit 0 would read as a finished benchmark
        from twice.core.errors import PromptError

        raise PromptError("nothing was measured: " + ("; ".join(dict.fromkeys(skipped)) or "no engine ran"))
    say("measuring memory bandwidth again")
    bandwidth = b.best_bandwidth(before, b.measure_bandwidth(setup["device"]))
    say("measuring the multiply-add peak")
    peak = b.measure_compute_peak(net)
    out = wide_console(stderr=False, min_width=TABLE_WIDTH)
    for table in results_tables(results, setup, bandwidth, peak, width=out.width):
        out.print(table)
    out.print(Text(CAPTION, style="dim"))
    err.print(bandwidth_line(bandwidth))
    if peak is not None:
        err.print(peak_line(peak))
    if json_out is not None:
        from twice.weights.safe_write import write_atomic  # whole or not at all, never through a link

        write_atomic(json_out, json.dumps(suite_json(results, setup, bandwidth, peak), indent=1))
        err.print(f"wrote {json_out}")
    if plot is not None:
        from .bench_render import latency_plot

        latency_plot(results, plot, setup)
        err.print(f"wrote {plot}")


def _check_before_measuring(repeats, json_out, plot, shape, model, weights, kv, workload, engine) -> None:
    """What would fail, or be ignored, only after minutes of measuring: one line first."""
    import importlib.util

    from twice.core.errors import PromptError

    if repeats < 1:
        raise PromptError(f"--repeats must be at least 1, got {repeats}")
    if shape is not None and (model is not None or weights is not None):
        given = "--model" if model is not None else ("--dequantize" if weights == "dequantize" else "--quantize")
        raise PromptError(f"{given} has no effect with --shape (random weights of that shape); give one or the other")
    if kv and (workload or engine):
        raise PromptError(f"{'-w/--workload' if workload else '-e/--engine'} has no effect with --kv "
                          "(it sweeps twice's decode over context x --kv-dtype)")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise PromptError("--plot needs matplotlib (pip install matplotlib)")
    for path, flag in ((json_out, "--json"), (plot, "--plot")):
        if path is not None:
            _check_output(path, flag)
    if plot is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if (plot.suffix[1:] or "png").lower() not in kinds:
            raise PromptError(f"--plot {plot}: matplotlib draws {', '.join(sorted(kinds))} (by the file's suffix), "
                              f"not {plot.suffix!r}")


def _check_output(path: Path, flag: str) -> None:
    """A file --json / --plot can write once the measuring is done: a name this system allows
    (is_dir raises on one too long), in a folder that exists and takes a new file (tried, and
    removed)."""
    import tempfile

    from twice.core.errors import PromptError

    from .format import os_message

    try:
        if path.is_dir():
            raise PromptError(f"{flag} {path}: is a folder; give a file name")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise PromptError(f"{flag} {path}: the folder {parent} does not exist")
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name[:32]}.", suffix=".probe"):
            pass
    except OSError as e:
        raise PromptError(f"{flag} {path}: cannot be written ({os_message(e)})") from None
