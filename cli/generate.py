"""`twice generate PROMPT`: one prompt, streamed."""

from __future__ import annotations

import json
import sys

import typer

from . import options as o
from .app import app
from .console import COLOR, err_console
from .prompt_input import read_prompt
from .readout import Readout


@app.command()
def generate(
    prompt: str = typer.Argument(None, help="The prompt; '-' or nothing reads standard input."),
    model: o.Model = None,
    revision: o.Revision = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    max_new_tokens: o.MaxNew = 256,
    temperature: o.Temperature = None,
    top_k: o.TopK = None,
    top_p: o.TopP = None,
    min_p: o.MinP = None,
    repetition_penalty: o.RepPenalty = None,
    seed: o.Seed = None,
    stop: o.Stop = None,
    system: o.System = None,
    chat: o.Chat = None,
    prefill_chunk: o.PrefillChunk = None,
    timing: o.Timing = False,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the text, counts and timings."),
    no_color: o.NoColor = False,
):
    """Generate a continuation of PROMPT (or a reply, in chat mode) and stream it."""
    from twice.core.engine import Done, Engine, GenerationSettings, Notice, Request
    from twice.weights.load import load

    if no_color:
        COLOR["on"] = False
    text = read_prompt(prompt)
    err = err_console()
    with Readout(show_text=not as_json) as readout:
        loaded = load(model, revision, device, dtype, progress=lambda msg: readout.set_phase("loading", msg))
        sampling = o.sampling_params(loaded.generation.sampling, temperature, top_k, top_p, min_p,
                                     repetition_penalty, seed)
        settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop or ()),
                                      prefill_chunk=prefill_chunk)
        use_chat = loaded.tokenizer.chat_template is not None if chat is None else chat
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            request = Request(messages=messages)
        else:
            request = Request(text=text)
        engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids)
        result = None
        for event in engine.generate(request, settings):
            if isinstance(event, Notice):
                err.print(f"[yellow]note:[/yellow] {event.message}")
            elif isinstance(event, Done):
                result = event.result
            else:
                readout.on_event(event)
    out = sys.stdout
    if as_json:
        payload = {"model": loaded.name, "settings": {"max_new_tokens": max_new_tokens, "chat": use_chat,
                                                       **sampling.__dict__, "stop": list(settings.stop)},
                   "load_s": loaded.load_seconds, **result.to_dict()}
        out.write(json.dumps(payload) + "\n")
    else:
        out.write("\n")
    out.flush()
    if timing:
        from .report import timing_table

        err.print(timing_table(result, loaded))
