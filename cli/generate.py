"""`twice generate PROMPT`: one prompt, streamed.

stdout carries the generated text (or, with --json, one JSON object) and nothing else;
the live status line, notes and the --timing report go to stderr (the status line to
stdout's terminal when stdout is one: it is erased at the end).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import typer

from twice.core.errors import PromptError

from . import options as o
from .app import app
from .prompt_input import check_text_arguments, read_prompt
from .readout import Readout


@app.command()
def generate(
    prompt: str = typer.Argument(None, help="The prompt; '-' or nothing reads standard input."),
    model: o.Model = None,
    revision: o.Revision = None,
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    dequantize: o.Dequantize = False,
    quantize: o.Quantize = None,
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
    truncate: o.Truncate = None,
    tp: o.TensorParallel = 1,
    timing: o.Timing = False,
    stats: o.Stats = False,
    threads: o.Threads = None,
    compile: o.Compile = False,
    kv_dtype: o.KvDtype = "auto",
    draft: o.DraftModel = None,
    draft_tokens: o.DraftTokens = None,
    lookup: o.Lookup = False,
    json_schema: o.JsonSchema = None,
    json_object: o.JsonObject = False,
    regex: o.Regex = None,
    grammar: o.Grammar = None,
    prompt_cache: o.PromptCache = None,
    prompt_cache_ro: o.PromptCacheRO = False,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, counts, finish reason, "
                                 "timings, cache bytes, model, settings) instead of the text."),
    no_color: o.NoColor = False,
):
    """Generate a continuation of PROMPT (or a reply, in chat mode) and stream it."""
    # Bad settings fail in one line before the model loads; so does a missing prompt.
    o.check_flags(max_new_tokens, prefill_chunk, temperature, top_k, top_p, min_p, repetition_penalty, seed,
                  truncate, threads)
    o.check_speculation(draft, draft_tokens, lookup, tp)
    constraint = o.constraint_spec(json_schema, json_object, regex, grammar, draft, lookup)  # read and compiled now
    o.check_kv_dtype(kv_dtype)
    from .prompt_cache import check_options as check_prompt_cache

    check_prompt_cache(prompt_cache, prompt_cache_ro, tp)
    if no_color:
        from .console import COLOR

        COLOR["on"] = False
    check_text_arguments(system=system, stop=stop)
    weights = o.weights_choice(dequantize, quantize)
    text = read_prompt(prompt)
    o.apply_threads(threads)

    from .distributed import finish, start

    launch, shard = start(device, tp)
    try:
        if launch.world > 1 and not shard.active:
            raise PromptError(f"twice generate under torchrun needs --tp {launch.world} (one model sharded over "
                              "the processes); to spread many prompts over processes, use twice batch")
        _generate(text, model, revision, launch.device if launch.world > 1 else device, dtype, max_new_tokens,
                  temperature, top_k, top_p, min_p, repetition_penalty, seed, stop, system, chat, prefill_chunk,
                  truncate, timing, compile, as_json, no_color, shard, quiet=launch.rank != 0, stats=stats,
                  weights=weights, constraint=constraint, speculation=(draft, draft_tokens, lookup), kv_dtype=kv_dtype,
                  prompt_cache=(prompt_cache, prompt_cache_ro))
    finally:
        finish(launch)


def _generate(text, model, revision, device, dtype, max_new_tokens, temperature, top_k, top_p, min_p,
              repetition_penalty, seed, stop, system, chat, prefill_chunk, truncate, timing, compile, as_json,
              no_color, shard, quiet: bool, stats: bool = False, weights: str | None = None, constraint=None,
              speculation=(None, None, False), prompt_cache=(None, False), kv_dtype: str = "auto") -> None:
    """One request; `quiet` (a tensor-parallel rank other than 0) computes and prints nothing."""
    from twice.core.device import DTYPE_NAMES
    from twice.core.engine import Done, Engine, GenerationSettings, Notice, Request
    from twice.weights.load import load

    shard.stats.synchronize = timing
    where = ", ".join(f"{k} {v}" for k, v in (("device", device), ("dtype", dtype)) if v != "auto")
    loading = f"{model or 'the default model'}: config, tokenizer, weights" + (f" ({where})" if where else "")
    with Readout(show_text=not as_json and not quiet, no_color=no_color, live=False if quiet else None) as readout:
        draft, draft_tokens, lookup = speculation
        if draft is not None:
            readout.set_phase("loading", f"draft {draft}")
        drafted = o.load_draft(draft, None, device, dtype, progress=lambda msg: readout.set_phase("loading", msg))
        readout.set_phase("loading", loading)
        loaded = load(model, revision, device, dtype, progress=lambda msg: readout.set_phase("loading", msg),
                      shard=shard, weights=weights)
        readout.set_model(o.dtype_words(loaded), f"{loaded.device.type} {DTYPE_NAMES.get(loaded.dtype, loaded.dtype)}")
        sampling = o.sampling_params(loaded.generation.sampling, temperature, top_k, top_p, min_p,
                                     repetition_penalty, seed)
        settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, stop=tuple(stop or ()),
                                      prefill_chunk=prefill_chunk, truncate=truncate, lookup=lookup,
                                      draft_tokens=draft_tokens, constraint=constraint)
        note = (lambda message: None) if quiet else readout.note
        if (larger := o.check_draft(loaded, drafted)) is not None:
            note(larger)
        if (ignored := o.ignored_with_greedy(sampling, top_k, top_p, min_p, seed)) is not None:
            note(ignored)
        use_chat = loaded.tokenizer.chat_template is not None if chat is None else chat
        if use_chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            request = Request(messages=messages)
        else:
            if (ignored := o.system_ignored(system, chat, use_chat)) is not None:
                note(ignored)
            request = Request(text=text)
        readout.set_phase("prefill", "chat template, tokenize" if use_chat else "tokenize")
        engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids, compile=compile,
                        draft=drafted.model if drafted is not None else None, kv_dtype=kv_dtype)
        o.settle_loaded()
        if (compiled := o.compile_note(engine, compile)) is not None:
            note(compiled)
        result = None
        cache_file, cache_ro = prompt_cache
        cached = None
        if cache_file is not None:
            from . import prompt_cache as pc

            cached = pc.load(engine, cache_file)
            for line in pc.notices(cached, read_only=cache_ro):
                note(line)
        for event in engine.generate(request, settings):
            if isinstance(event, Notice):
                note(event.message)
            elif isinstance(event, Done):
                result = event.result
            else:
                readout.on_event(event)
        if cached is not None and not cache_ro and result is not None and engine.cache is not None:
            # After the reply, so that writing the file never delays the first token.
            n = result.prompt_tokens
            pc.save(engine, cached, n, engine.cached_ids[:n])
            if cached.not_saved is not None:
                note(pc.notices(cached)[-1])
    if quiet:
        return
    out = sys.stdout
    if as_json:
        payload = json_payload(result, loaded, settings, use_chat, system if use_chat else None, compile)
        payload["settings"]["draft"] = drafted.name if drafted is not None else None
        if cached is not None:
            payload["prompt_cache"] = {**cached.to_dict(), "read_only": cache_ro}
        out.write(json.dumps(payload) + "\n")
    else:
        out.write("\n")
    out.flush()
    if timing:
        from .report import print_timing

        print_timing(result, loaded, no_color=no_color)
    if stats:
        from .report import print_stats

        print_stats(result, loaded)
    _check_finished(result)


def _check_finished(result) -> None:
    """A row that could not go on (its grammar's engine failed) ends the command with the
    reason, after what it printed: the output is incomplete, not a finished answer."""
    if result is not None and result.finish_reason == "error":
        from twice.core.constraints import ConstraintError

        raise ConstraintError(result.error)


def json_payload(result, loaded, settings, chat: bool, system: str | None, compiled: bool = False) -> dict:
    """The --json object: the model, every setting used, and the result (text, token
    counts, finish reason, timings, cache bytes, memory, bandwidth)."""
    from .report import bandwidth, latency_percentiles

    body = result.to_dict()
    timings = body.pop("timings")
    timings = {
        "load_s": loaded.load_seconds,
        "load_weights_s": loaded.weights_seconds,
        "load_tokenizer_s": loaded.tokenizer_seconds,
        **timings,
        **{f"step_{k}_s": v for k, v in latency_percentiles(result.step_seconds).items()},
    }
    body["cache"]["context_length"] = result.cache.context_length
    return {
        "model": loaded.name,
        "model_folder": str(loaded.folder),
        "model_type": loaded.config.model_type,
        "settings": {
            "max_new_tokens": settings.max_new_tokens,
            **dataclasses.asdict(settings.sampling),
            "stop": list(settings.stop),
            "chat": chat,
            "system": system,
            "prefill_chunk": settings.prefill_chunk,
            "truncate": settings.truncate,
            "compile": compiled,
            "lookup": settings.lookup,
            "draft_tokens": settings.draft_tokens,
            **({"constraint": settings.constraint.to_dict()} if settings.constraint is not None else {}),
            "device": result.device,
            "dtype": result.dtype,
        },
        "dtype_reason": getattr(loaded, "dtype_reason", ""),
        "load_s": loaded.load_seconds,
        **body,
        "timings": timings,
        "bandwidth": bandwidth(result),
    }
