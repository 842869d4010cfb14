"""`twice perplexity TEXT_FILE`: how well a model predicts a text (core/perplexity.py says
exactly what is scored).

stdout carries the result and its definition (or, with --json, one JSON object); a
progress bar is drawn on stderr when it is a terminal, and leaves nothing behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from twice.core.errors import PromptError
from twice.core.perplexity import DEFAULT_CONTEXT

from . import options as o
from .app import app

# A text to score is read whole and tokenized whole: the same bound as a prompt on standard
# input. (Quality texts are a few MB: wikitext-2's test split is 1.3 MB.)
MAX_TEXT_BYTES = 64 * 2**20


@app.command()
def perplexity(
    text_file: Path = typer.Argument(..., help="The text to score (UTF-8).", show_default=False),
    model: o.Model = None,
    revision: o.Revision = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    dequantize: o.Dequantize = False,
    quantize: o.Quantize = None,
    threads: o.Threads = None,
    kv_dtype: o.KvDtype = "auto",
    context: int = typer.Option(None, "--context", help=f"Tokens per window (at least 2). Default {DEFAULT_CONTEXT}, "
                                "or the model's context where that is shorter.", show_default=False),
    max_tokens: int = typer.Option(None, "--max-tokens", help="Score only the text's first N tokens (at least 2).",
                                   show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (perplexity, tokens, windows, context, "
                                 "model, ...) instead of the text."),
    no_color: o.NoColor = False,
):
    """Perplexity of TEXT_FILE under the model: exp(mean negative log-likelihood of its tokens),
    in windows of --context tokens that do not overlap, each scored on its own."""
    _check_flags(context, max_tokens, threads)
    o.check_kv_dtype(kv_dtype)
    weights = o.weights_choice(dequantize, quantize)
    if no_color:
        from .console import COLOR

        COLOR["on"] = False
    text = read_text(text_file)  # a bad file fails before any model loads
    o.apply_threads(threads)

    from twice.core import perplexity as ppl
    from twice.core.device import DTYPE_NAMES

    bar = _Bar(enabled=_isatty(sys.stderr))
    with bar:
        loaded = _load(bar, model, revision, device, dtype, weights)
        from twice.core.cache import kv_format

        kv = kv_format(kv_dtype, loaded.dtype, loaded.config.head_dim)  # a head size it cannot hold: one line
        prefix = ppl.bos_prefix(loaded.tokenizer)
        window = ppl.choose_context(context, loaded.config.max_position_embeddings, len(prefix))
        bar.phase("tokenizing the text")
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        result = None
        for event in ppl.score(loaded.model, ids, window, prefix, max_tokens, dtype=loaded.dtype,
                               device=loaded.device, kv_dtype=kv_dtype):
            if isinstance(event, ppl.PerplexityResult):
                result = event
            else:
                bar.window(event)
    payload = json_payload(result, loaded, text_file, max_tokens, DTYPE_NAMES.get(loaded.dtype, str(loaded.dtype)),
                           ppl.weight_summary(loaded.model))
    payload["kv_dtype"] = kv.name
    out = sys.stdout
    if as_json:
        out.write(json.dumps(payload) + "\n")
    else:
        out.write(result_text(payload) + "\n")
    out.flush()


def _check_flags(context, max_tokens, threads) -> None:
    """The flags' own ranges, before the file is read or the model loads (core/perplexity.py
    imports torch only when scoring starts)."""
    from twice.core.perplexity import check_settings

    o.check_threads(threads)
    check_settings(context=context, max_tokens=max_tokens)


def read_text(path: Path) -> str:
    """The file's text: a regular file of at most MAX_TEXT_BYTES, valid UTF-8 without NUL
    bytes, not empty (every failure one line naming the file)."""
    from twice.weights.files import read_limited

    from .prompt_input import strip_bom

    raw = read_limited(path, MAX_TEXT_BYTES, PromptError)
    try:
        text = strip_bom(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PromptError(f"{path}: not valid UTF-8 (byte {e.start:,}: {raw[e.start:e.start + 1]!r}); "
                          "twice perplexity reads UTF-8 text") from None
    if (nul := raw.find(b"\0")) >= 0:
        raise PromptError(f"{path}: holds a NUL byte (byte {nul:,}): not a text file")
    if not text.strip():
        raise PromptError(f"{path}: " + ("the file is empty" if not text else "the file holds only white space")
                          + "; there is nothing to score")
    return text


def json_payload(result, loaded, text_file: Path, max_tokens, dtype_name: str, weights: dict | None) -> dict:
    """The --json object. `tokens` counts the scored tokens (the mean's denominator)."""
    payload = {
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        "windows": result.windows,
        "context": result.context,
        "model": loaded.name,
        "mean_nll": result.mean_nll,
        "text_file": str(text_file),
        "text_tokens": result.text_tokens,
        "tokens_used": result.tokens_used,
        "max_tokens": max_tokens,
        "bos_token_ids": list(result.prefix),
        "bos_token": "".join(loaded.tokenizer.hf.id_to_token(i) or "" for i in result.prefix) or None,
        "model_folder": str(loaded.folder),
        "model_type": loaded.config.model_type,
        "device": loaded.device.type,
        "dtype": dtype_name,
        "dtype_reason": getattr(loaded, "dtype_reason", ""),
        "load_s": loaded.load_seconds,
        "score_s": result.seconds,
        "tokens_per_second": result.tokens_per_second,
    }
    if weights is not None:  # the weights' storage (types, bytes, bits per weight)
        payload["weights"] = weights
    return payload


def result_text(p: dict) -> str:
    """Two lines: the number, and what it is."""
    from .errors import printable

    bos = f"the BOS token {p['bos_token']!r} before each" if p["bos_token_ids"] else "no BOS token"
    first = ("" if p["bos_token_ids"] else ", except each window's first")
    cut = (f" (the first {p['tokens_used']:,} of its {p['text_tokens']:,})"
           if p["tokens_used"] < p["text_tokens"] else "")
    from .format import counted

    lines = [
        f"perplexity {p['perplexity']:.4f} over {counted(p['tokens'], 'token')} in {counted(p['windows'], 'window')} "
        f"of {p['context']:,} "
        f"({p['model']}, {p['device']} {p['dtype']}"
        + (f", KV cache {p['kv_dtype']}" if p.get("kv_dtype") not in (None, p["dtype"]) else "")
        + f"; {p['tokens_per_second']:,.0f} tok/s)",
        f"= exp(mean negative log-likelihood, {p['mean_nll']:.4f} nats) of every token of the text{cut}{first}, "
        f"given the tokens before it in its window: the text encoded once without special tokens, cut into windows "
        f"of {p['context']:,} tokens that do not overlap, each scored on its own with {bos}",
    ]
    return "\n".join(printable(line) for line in lines)


class _Bar:
    """A transient rich progress bar on stderr (windows scored, perplexity so far, ETA), or nothing."""

    def __init__(self, enabled: bool):
        self.progress = self.task = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from .console import err_console

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[so_far]}"), TimeRemainingColumn(), console=err_console(),
                                 transient=True, redirect_stdout=False, redirect_stderr=False)
        self.task = self.progress.add_task("loading", total=None, so_far="")

    def __enter__(self) -> "_Bar":
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def phase(self, text: str) -> None:
        if self.progress is not None:
            from .errors import printable

            self.progress.update(self.task, description=printable(text))

    def window(self, event) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description="windows", total=event.windows, completed=event.window,
                                 so_far=f"perplexity so far {event.perplexity:.3f}")
            self.progress.refresh()  # a window takes milliseconds to seconds: drawn as it ends


def _load(bar: _Bar, model, revision, device, dtype, weights=None):
    from twice.weights.load import load

    bar.phase(f"loading {model or 'the default model'}")
    return load(model, revision, device, dtype, progress=lambda message: bar.phase(f"loading: {message}"),
                weights=weights)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
