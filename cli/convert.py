"""`twice convert MODEL.gguf OUT_DIR`: a GGUF file → a Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path

import typer

from .app import app
from .console import err_console


@app.command()
def convert(
    src: Path = typer.Argument(..., help="A .gguf file (llama architecture)."),
    out_dir: Path = typer.Argument(..., help="Folder to create (config.json, model.safetensors, tokenizer files)."),
    dtype: str = typer.Option("float32", help="Tensor dtype to write: float32, bfloat16 or float16."),
    overwrite: bool = typer.Option(False, help="Replace OUT_DIR if it exists."),
):
    """Convert a GGUF file (dequantized) into a folder transformers and twice can load."""
    from twice.core.errors import ModelNotFoundError, WeightsError
    from twice.weights.gguf import DestinationExists, convert_gguf

    if not src.is_file():
        raise ModelNotFoundError(f"{src}: no such file")
    try:
        folder = convert_gguf(src, out_dir, dtype=dtype, overwrite=overwrite)
    except DestinationExists:  # its text names the Python argument; here the flag is --overwrite
        raise WeightsError(f"{out_dir}: folder exists and is not empty (pass --overwrite to replace it)") from None
    err_console().print(f"converted {src.name} → {folder}")
