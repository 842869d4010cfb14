"""`twice convert MODEL.gguf OUT_DIR`: a GGUF file → a Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path

import typer

from . import options as o
from .app import app
from .console import err_console


@app.command()
def convert(
    model: str = typer.Argument(..., metavar="SRC", callback=o.names_a_model,
                                help="A .gguf file, or the name of a model twice ships (smollm2-135m-instruct, "
                                     "qwen2.5-coder-0.5b-instruct-q4_k_m, qwen2.5-coder-1.5b-instruct-q4_k_m)."),
    folder_name: str = typer.Argument(..., metavar="OUT_DIR",
                                      help="Folder to create (config.json, model.safetensors, tokenizer files)."),
    dtype: str = typer.Option("float32", help="Tensor dtype to write: float32, bfloat16 or float16."),
    overwrite: bool = typer.Option(False, help="Replace OUT_DIR if it exists (a model folder: it holds "
                                               "config.json, and not the GGUF file itself)."),
):
    """Convert a GGUF file (dequantized) into a folder transformers and twice can load."""
    from twice.core.errors import ModelNotFoundError, UsageError, WeightsError
    from twice.core.paths import user_path
    from twice.weights.gguf import DestinationExists, convert_gguf
    from twice.weights.resolve import named_gguf

    if not folder_name.strip():  # a Path would read "" as ".", the working folder
        raise UsageError(f"{folder_name!r} names no folder (OUT_DIR: the folder to create)")
    out_dir = user_path(folder_name)
    # A name twice ships is read as --model reads it: before any path of that name.
    src = named_gguf(model) or user_path(model)
    if src.is_dir():
        raise ModelNotFoundError(f"{src}: is a folder; twice convert reads a .gguf file (a model folder "
                                 "already is what it writes)")
    if not src.is_file():
        raise ModelNotFoundError(f"{src}: no such file")
    if overwrite:
        _check_replaceable(src, out_dir)
    try:
        folder = convert_gguf(src, out_dir, dtype=dtype, overwrite=overwrite)
    except DestinationExists:  # its text names the Python argument; here the flag is --overwrite
        raise WeightsError(f"{out_dir}: folder exists and is not empty (pass --overwrite to replace it)") from None
    err_console().print(f"converted {src.name} → {folder}")


def _check_replaceable(src: Path, out_dir: Path) -> None:
    """--overwrite replaces OUT_DIR whole: only a model folder (config.json; an earlier
    conversion, say) may go, never a folder of other files, nor one holding the file
    being converted."""
    from twice.core.errors import WeightsError

    if not out_dir.is_dir() or out_dir.is_symlink() or not any(out_dir.iterdir()):
        return  # nothing to replace (or convert_gguf's own refusal of a link or a file)
    if src.resolve().is_relative_to(out_dir.resolve()):
        raise WeightsError(f"{out_dir}: holds {src.name}, the file being converted; --overwrite would delete it "
                           "(choose another folder)")
    if not (out_dir / "config.json").is_file():
        raise WeightsError(f"{out_dir}: not a model folder (no config.json); --overwrite replaces only a model "
                           "folder, never other files (choose another folder, or empty this one)")
