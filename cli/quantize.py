"""`twice quantize MODEL OUT.gguf --type TYPE`: any model twice loads → a GGUF file llama.cpp loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from twice.core.paths import user_path

from . import options as o
from .app import app
from .console import err_console, wide_console
from .format import human_bytes

TYPES = "q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_m, q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k, f16, bf16, f32"


@app.command()
def quantize(
    model: str = typer.Argument(..., callback=o.names_a_model,
                                help="Model folder, .gguf file or Hub id (org/name); smollm2-135m-instruct: "
                                     "the default model."),
    out: Path = typer.Argument(..., help="The GGUF file to write."),
    type_name: str = typer.Option(..., "--type", "-t", help=f"Tensor types, as llama-quantize names them: {TYPES} "
                                                            "(q4_k = q4_k_m, q5_k = q5_k_m, q3_k = q3_k_m)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    revision: o.Revision = None,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
    no_color: o.NoColor = False,
):
    """Write MODEL as a GGUF file (metadata, tokenizer, chat template, tensors in TYPE)."""
    from twice.weights.gguf_write import canonical_mixture

    mixture = canonical_mixture(type_name)  # a bad --type fails before anything is resolved or read
    _refuse_existing(out, overwrite)
    from twice.weights.gguf_write import write_gguf
    from twice.weights.resolve import resolve

    err = err_console()
    live = sys.stderr.isatty()
    status = err.status("resolving the model") if live else None
    try:
        if status is not None:
            status.start()
        say = (lambda message: status.update(message)) if status is not None else None
        folder = _float_folder(resolve, model, revision, say)
        _refuse_own_input(out, model, folder)

        def progress(index: int, total: int, plan) -> None:
            if status is not None:
                status.update(f"quantizing {index}/{total}: {plan.name} → {plan.type_name}")

        summary = write_gguf(folder, out, mixture, overwrite=overwrite, name=_model_name(model, folder),
                             progress=progress)
    finally:
        if status is not None:
            status.stop()
    if as_json:
        print(json.dumps(summary.as_dict()))
        return
    _print_summary(summary, no_color)


def _float_folder(resolve, model: str, revision, say) -> Path:
    """The model as a float folder (config.json, safetensors, tokenizer): a GGUF file is
    converted once into the cache (resolve's `dequantize`, where resolve has it; before,
    every GGUF was converted)."""
    import inspect

    if "dequantize" in inspect.signature(resolve).parameters:
        return resolve(model, revision, say, dequantize=True)
    return resolve(model, revision, say)


def _refuse_existing(out: Path, overwrite: bool) -> None:
    from twice.core.errors import WeightsError

    if out.is_symlink():
        raise WeightsError(f"{out}: is a symbolic link; twice does not write through links (choose another name)")
    if out.is_dir():
        raise WeightsError(f"{out}: is a folder; give the GGUF file's name")
    if out.exists() and not overwrite:
        raise WeightsError(f"{out}: exists (pass --overwrite to replace it)")


def _refuse_own_input(out: Path, model: str, folder: Path) -> None:
    """OUT must not be the model being quantized, nor a file of the folder it is read from
    (--overwrite would destroy the source: its config.json or safetensors made GGUF bytes)."""
    from twice.core.errors import WeightsError

    from twice.weights.resolve import named_gguf

    target = out.resolve()
    # the file a path names, or the one behind a name twice ships (the default model's, a packaged one's)
    for source in (user_path(model), named_gguf(model)):
        if source is not None and source.is_file() and source.resolve() == target:
            raise WeightsError(f"{out}: is the model being quantized; --overwrite would replace it "
                               "(choose another name)")
    if target.is_relative_to(folder.resolve()):
        raise WeightsError(f"{out}: is inside {folder}, the model folder being read; choose a name outside it")


def _model_name(ref: str, folder: Path) -> str:
    """general.name: the Hub id or the folder's (file's) name."""
    path = user_path(ref)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return ref or folder.name


def _print_summary(summary, no_color: bool) -> None:
    from rich.table import Table

    t = Table()
    t.add_column("type")
    t.add_column("tensors", justify="right")
    t.add_column("bytes", justify="right")
    for kind, count in sorted(summary.types.items(), key=lambda kv: -summary.type_bytes[kv[0]]):
        t.add_row(kind, str(count), human_bytes(summary.type_bytes[kind]))
    t.add_row("all", str(summary.tensors), human_bytes(summary.tensor_bytes), style="bold")
    console = wide_console(stderr=False, min_width=80, no_color=no_color)
    console.print(f"wrote {summary.path} ({summary.mixture}, {summary.architecture} from {summary.model})",
                  markup=False, soft_wrap=True)
    console.print(t)
    console.print(f"{summary.parameters:,} weights in {human_bytes(summary.tensor_bytes)}: "
                  f"{summary.bits_per_weight:.2f} bits per weight; file {human_bytes(summary.file_bytes)} "
                  f"({summary.file_bytes:,} B); {summary.seconds:.1f} s", markup=False, soft_wrap=True)
