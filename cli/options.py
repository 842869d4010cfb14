"""Options shared by generate, chat and batch, and turning them into engine settings."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

def _no_empty_name(value: str | None, hint: str) -> str | None:
    # `--model "$M"` or `twice info "$M"` with M unset would quietly mean the default model (and
    # --draft "" drafted with it; quantize named its file after the working folder): an empty
    # name is refused before anything loads.
    if value is not None and not value.strip():
        raise typer.BadParameter(f"{value!r} names no model ({hint})")
    return value


def _names_something(value: str | None) -> str | None:
    return _no_empty_name(value, "leave the option out for its default")


def names_a_model(value: str | None) -> str | None:
    """A MODEL argument's callback (info, quantize, convert)."""
    return _no_empty_name(value, "give a folder, a .gguf file, a Hub id or a packaged model's name")


Model = Annotated[Optional[str], typer.Option("--model", "-m", callback=_names_something,
                                              help="Model folder, .gguf file or Hub id (org/name). Default: SmolLM2-135M-Instruct.")]
Revision = Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")]
Device = Annotated[str, typer.Option(help="auto (cuda if available), cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on cuda; on the cpu bfloat16 where the CPU has AVX-512 BF16 or AMX, "
                                          "else float32; TWICE_CPU_AUTO_DTYPE=float32|bfloat16 pins it), float32, "
                                          "bfloat16 or float16.")]
Dequantize = Annotated[bool, typer.Option("--dequantize", help="Run a .gguf file from a float copy (converted once "
                                                              "into the cache, in --dtype) instead of as stored.")]
Quantize = Annotated[Optional[str], typer.Option(
    "--quantize", help="Quantize the weights in memory while loading: q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k_m, "
                       "q4_k_s, q4_k_m, q5_k_s, q5_k_m, q6_k (llama.cpp's mixtures; twice quantize writes a file).")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate.")]
Temperature = Annotated[Optional[float], typer.Option(
    help="0 = greedy. Default: the model's generation_config (greedy if it says do_sample false), else 0.8 "
         "(llama.cpp's default; with top-k 40, top-p 0.95, min-p 0.05).")]
TopK = Annotated[Optional[int], typer.Option(help="Keep the k most likely tokens (0 = off). Default: the model's, else 40.")]
TopP = Annotated[Optional[float], typer.Option(help="Keep the smallest set of tokens with this much probability. "
                                                    "Default: the model's, else 0.95.")]
MinP = Annotated[Optional[float], typer.Option(help="Drop tokens below min-p × the top token's probability. "
                                                    "Default: the model's, else 0.05.")]
RepPenalty = Annotated[Optional[float], typer.Option("--repetition-penalty", help="> 1 discourages repeating tokens. "
                                                                                "Default: the model's, else 1 (off).")]
Threads = Annotated[Optional[int], typer.Option(help="CPU threads for the model's kernels (1 to 1024). Default: "
                                                     "torch's (the cores it may use).")]
Stats = Annotated[bool, typer.Option("--stats", "-v", help="Print a few lines of stats at the end (stderr): TTFT, "
                                                           "prefill and decode tokens/s, KV cache bytes.")]
Seed = Annotated[Optional[int], typer.Option(help="Seed for sampling (same seed, same output).")]


def _stop_texts(values: list[str] | None) -> list[str] | None:
    # An empty text matches nothing: `--stop "$END"` with END unset would run to the length
    # limit without a word; said before anything loads.
    if values and any(v == "" for v in values):
        raise typer.BadParameter("an empty text matches nothing; give the text to stop at", param_hint="'--stop'")
    return values


Stop = Annotated[Optional[list[str]], typer.Option("--stop", callback=_stop_texts,
                                                   help="Stop when this text appears (repeatable); it is not printed.")]
def _system_text(value: str | None) -> str | None:
    # An empty one would be no system message at all (the template's default one then), while
    # --json reported "system": "".
    if value == "":
        raise typer.BadParameter("an empty text is no system message; leave the option out", param_hint="'--system'")
    return value


System = Annotated[Optional[str], typer.Option(callback=_system_text, help="System message (chat mode).")]
Chat = Annotated[Optional[bool], typer.Option("--chat/--raw", help="Apply the chat template (default: on when the model has one).")]
PrefillChunk = Annotated[Optional[int], typer.Option(help="Prefill at most this many tokens per forward pass.")]
Timing = Annotated[bool, typer.Option("--timing", help="Print a timing and memory report at the end (stderr).")]
NoColor = Annotated[bool, typer.Option("--no-color", help="No colors (also NO_COLOR=1).")]
Truncate = Annotated[Optional[str], typer.Option(
    help="left: drop the start of a prompt that does not fit the context (default: refuse it); in chat mode, "
         "the start of the rendered chat (the system message goes first).")]
TensorParallel = Annotated[int, typer.Option(
    "--tp", help="Tensor-parallel degree: shard the model over this many processes (run under torchrun "
                 "--nproc-per-node N). Default 1.")]
Compile = Annotated[bool, typer.Option("--compile", help="Compile the decode step with torch.compile (faster "
                                                         "decode; compile time is reported on its own): batch 1 on "
                                                         "the CPU; any batch on a GPU, where each cache's whole step "
                                                         "is also recorded once as a CUDA graph. "
                                                         "Llama-family models on the CPU already decode with the "
                                                         "native step, which needs no compiling.")]

DraftModel = Annotated[Optional[str], typer.Option(
    "--draft", callback=_names_something, help="Speculative decoding with a draft model (folder, .gguf file or Hub id) that shares the model's "
                    "vocabulary: it proposes tokens, the model verifies several in one pass (same output).")]
DraftTokens = Annotated[Optional[int], typer.Option(
    "--draft-tokens", help="Tokens proposed per verify pass, 1..32 (with --draft or --lookup). Default: adaptive, "
                           "1..8 or none, from the measured acceptance rate and costs.")]
Lookup = Annotated[bool, typer.Option(
    "--lookup", help="Speculative decoding by prompt lookup: proposals from the latest earlier occurrence of the "
                     "last 3, 2 or 1 tokens in the prompt and the text so far (no second model; same output).")]

PromptCache = Annotated[Optional[str], typer.Option(
    "--prompt-cache", help="Keep the prompt's KV cache in FILE (safetensors): a later run whose prompt begins with "
                           "the same tokens loads it and prefills only the rest. Written after the reply; a file "
                           "made with another model, dtype or kv-dtype, or corrupt, is refused with a notice.")]
PromptCacheRO = Annotated[bool, typer.Option(
    "--prompt-cache-ro", help="Use --prompt-cache FILE but never write it.")]

ContextShift = Annotated[bool, typer.Option(
    "--context-shift", help="When the conversation no longer fits the context, drop its oldest turns from the KV "
                            "cache (the system message stays) and re-rotate the kept keys to their new positions "
                            "instead of refusing the message. RoPE models only.")]
Keep = Annotated[Optional[int], typer.Option(
    "--keep", help="With --context-shift: never drop the turns that begin within the first N tokens. Default 0 "
                   "(only the system message is kept).")]


JsonSchema = Annotated[Optional[str], typer.Option(
    "--json-schema", help="Structured output: the text must be JSON valid under the JSON schema in FILE "
                          "(through llguidance's token masks; cut short only by --max-new-tokens).")]
JsonObject = Annotated[bool, typer.Option(
    "--json-object", help="Structured output: the text must be one JSON object (any keys). (--json prints the "
                          "result as JSON; this constrains the text.)")]
Regex = Annotated[Optional[str], typer.Option(
    "--regex", help="Structured output: the text must match PATTERN as a whole (Rust regex syntax).")]
Grammar = Annotated[Optional[str], typer.Option(
    "--grammar", help="Structured output: the text must be in the language of the grammar in FILE: Lark "
                      "(.lark) or GBNF (.gbnf, llama.cpp's; by extension, else by content).")]

KvDtype = Annotated[str, typer.Option(
    "--kv-dtype", help="The KV cache's element type: auto (the model's dtype), float32, bfloat16, float16, q8_0 "
                       "(34 bytes per 32 values: 0.53 of bf16) or q4_0 (18 per 32). Quantized caches store GGUF's "
                       "Q8_0/Q4_0 blocks along the head dimension (a multiple of 32), written once per token and "
                       "read as stored by the native decode step.")]


def check_kv_dtype(kv_dtype: str) -> None:
    """An unknown --kv-dtype name: one line, before the model loads (the head size is checked
    when the engine is built)."""
    from twice.core.cache import kv_format

    kv_format(kv_dtype, None)


def check_speculation(draft: str | None, draft_tokens: int | None, lookup: bool, tp: int = 1) -> None:
    """--draft / --lookup / --draft-tokens: one line before anything loads."""
    from twice.core.errors import UsageError
    from twice.core.speculative import check_draft_tokens

    check_draft_tokens(draft_tokens)
    if draft is not None and lookup:
        raise UsageError("--draft and --lookup exclude each other (choose one proposer)")
    if draft_tokens is not None and draft is None and not lookup:
        raise UsageError("--draft-tokens needs --draft MODEL or --lookup")
    if (draft is not None or lookup) and tp > 1:
        raise UsageError(f"{'--draft' if draft is not None else '--lookup'} does not work with --tp "
                         "(speculative decoding runs on one process)")


def load_draft(draft: str | None, revision, device, dtype, progress=None):
    """The draft model, loaded BEFORE the model (a draft that cannot load fails first),
    on the same device and dtype; None without --draft."""
    if draft is None:
        return None
    from twice.weights.load import load

    return load(draft, None, device, dtype, progress=progress)


def check_draft(loaded, draft) -> str | None:
    """The draft must share the model's vocabulary (one line, else); returns a notice when
    it is larger than the model (speculation will be slower)."""
    if draft is None:
        return None
    from twice.core.speculative import check_vocabularies

    check_vocabularies(loaded.tokenizer, draft.tokenizer, loaded.config.vocab_size, draft.config.vocab_size)
    big, small = draft.model.weight_bytes(), loaded.model.weight_bytes()
    if big > small:
        return (f"the draft model ({big / 2**20:,.0f} MiB of weights) is larger than the model "
                f"({small / 2**20:,.0f} MiB): speculative decoding will be slower than the model alone")
    return None


# What a llama.cpp (or ollama) user knows: llama.cpp's common_params_sampling defaults
# (common/common.h: temp 0.80, top_k 40, top_p 0.95, min_p 0.05, penalty_repeat 1.00), used
# when neither a flag nor the model's generation_config says. Greedy decoding, the old
# default, makes small models loop ("I'm glad to have you back." nine times).
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# transformers' GenerationConfig defaults, for the keys a do_sample=true config leaves out:
# what the model's author got from transformers.
TRANSFORMERS_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


def sampling_params(generation_defaults: dict, temperature, top_k, top_p, min_p, repetition_penalty, seed):
    """The one place sampling settings are decided. Explicit flags win. Otherwise the model's
    generation_config: do_sample false decodes greedily (transformers' rule, and what the
    author asked for); do_sample true samples with its values, transformers' defaults for the
    keys it leaves out; without do_sample, its values where it gives them and llama.cpp's
    defaults (DEFAULT_SAMPLING) for the rest. The repetition penalty is the model's (in
    greedy decoding too, as transformers applies it), else 1."""
    from twice.core.sampling import SamplingParams

    g = generation_defaults
    do_sample = g.get("do_sample")
    if do_sample is False:
        d = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    elif do_sample:
        d = {**TRANSFORMERS_SAMPLING, **{k: g[k] for k in TRANSFORMERS_SAMPLING if k in g}}
    else:
        d = {**DEFAULT_SAMPLING, **{k: g[k] for k in DEFAULT_SAMPLING if k in g}}

    def pick(flag, key):
        return flag if flag is not None else d[key]

    return SamplingParams(
        temperature=float(pick(temperature, "temperature")),
        top_k=int(pick(top_k, "top_k")),
        top_p=float(pick(top_p, "top_p")),
        min_p=float(pick(min_p, "min_p")),
        repetition_penalty=float(repetition_penalty if repetition_penalty is not None
                                 else g.get("repetition_penalty", 1.0)),
        seed=seed,
    )


def check_flags(max_new_tokens=None, prefill_chunk=None, temperature=None, top_k=None, top_p=None, min_p=None,
                repetition_penalty=None, seed=None, truncate=None, threads=None) -> None:
    """Refuse impossible settings before the model loads (one-line PromptError), with the
    same checks the engine makes later on the merged settings."""
    from twice.core.engine import GenerationSettings

    check_threads(threads)
    sampling = sampling_params({}, temperature, top_k, top_p, min_p, repetition_penalty, seed)
    GenerationSettings(max_new_tokens=256 if max_new_tokens is None else max_new_tokens, sampling=sampling,
                       prefill_chunk=prefill_chunk, truncate=truncate)


MAX_THREADS = 1024  # beyond any CPU twice runs on; torch takes an int32 and libgomp a stack per thread


def check_threads(threads) -> None:
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        from twice.core.errors import PromptError

        raise PromptError(f"--threads must be between 1 and {MAX_THREADS}, got {threads}")


def apply_threads(threads) -> None:
    """--threads N: validated (one line when below 1), then torch's CPU thread count (the
    native kernels run on torch's OpenMP pool, so they follow it too)."""
    check_threads(threads)
    if threads is not None:
        from twice.core.device import set_threads

        set_threads(threads)


def settle_loaded() -> None:
    """Once the model, its tokenizer and the engine are built: their objects (~185,000 for
    SmolLM2: torch modules, tensors' Python parts, the tokenizer, templates) live as long as
    the command, so they are frozen out of Python's cyclic garbage collector, which otherwise
    walked all of them in every full collection (~140 ms, a stall in the token stream; a
    200-token decode ran 3% faster with them frozen). Objects made later are collected as
    before."""
    import gc

    gc.freeze()


def compile_note(engine, compile: bool) -> str | None:
    """What --compile did not do, in one notice: the native step decodes instead (the llama
    family on the CPU), or tensor parallelism keeps the eager layers."""
    if not compile or engine.decode_path == "compiled":
        return None
    if engine.decode_path == "native":
        return ("--compile has no effect here: this model decodes with the native step on the CPU "
                "(one C call per token, faster than the compiled step; nothing to compile)")
    if getattr(engine.model.shard, "active", False):
        return "--compile has no effect with --tp: tensor-parallel decode runs the eager layers"
    return None


def dtype_words(loaded) -> str:
    """"cpu bfloat16 (auto: this CPU has AVX-512 BF16)": where the model runs, in what, and why."""
    from twice.core.device import DTYPE_NAMES

    name = DTYPE_NAMES.get(loaded.dtype, str(loaded.dtype))
    why = getattr(loaded, "dtype_reason", "")
    return f"{loaded.device.type} {name}" + (f" ({why})" if why else "")


def ignored_with_greedy(sampling, top_k=None, top_p=None, min_p=None, seed=None) -> str | None:
    """A note when sampling flags were given but decoding is greedy (temperature 0)."""
    if sampling.temperature != 0:
        return None
    given = [name for name, value in (("--top-k", top_k), ("--top-p", top_p), ("--min-p", min_p), ("--seed", seed))
             if value is not None]
    if not given:
        return None
    return f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with greedy decoding (temperature 0)"


def system_ignored(system: str | None, chat: bool | None, use_chat: bool, what: str = "") -> str | None:
    """A note when --system was given but prompts go in raw (--raw, or no chat template)."""
    if not system or use_chat:
        return None
    return ("--system is used only in chat mode; ignored with --raw"
            + ("" if chat is False else " (the model has no chat template)") + what)


def weights_choice(dequantize: bool, quantize: str | None) -> str | None:
    """How to hold the weights, from --dequantize / --quantize: None (as stored),
    "dequantize", or a mixture name; a bad combination or name fails before loading."""
    from twice.core.errors import UsageError

    if quantize is None:
        return "dequantize" if dequantize else None
    if dequantize:
        raise UsageError("--dequantize and --quantize exclude each other (--quantize starts from the float weights)")
    from twice.weights.gguf_write import canonical_mixture

    try:
        return canonical_mixture(quantize)
    except UsageError as e:
        raise UsageError(str(e).replace("--type", "--quantize", 1)) from None


def constraint_spec(json_schema=None, json_object=False, regex=None, grammar=None, draft=None, lookup=False):
    """--json-schema FILE / --json-object / --regex PATTERN / --grammar FILE as one
    constraints.ConstraintSpec (None: free text), read and compiled before the model loads:
    a missing file, bad JSON, an invalid or unsatisfiable schema, regex or grammar, two of
    them at once, or one with speculative decoding: one line."""
    given = [name for name, value in (("--json-schema", json_schema), ("--json-object", json_object or None),
                                      ("--regex", regex), ("--grammar", grammar)) if value is not None]
    if not given:
        return None
    from pathlib import Path

    from twice.core import constraints as c
    from twice.core.errors import UsageError
    from twice.weights.files import read_limited

    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} exclude each other (one constraint on the output)")
    if draft is not None or lookup:
        raise UsageError(f"{given[0]} does not work with {'--draft' if draft is not None else '--lookup'} "
                         "(structured output decodes without speculation)")

    def text_of(path: str) -> str:
        raw = read_limited(Path(path), c.MAX_SPEC_BYTES, c.ConstraintError)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise c.ConstraintError(f"{path}: not UTF-8 text (byte {e.start})") from None

    if json_schema is not None:
        spec = c.json_schema(text_of(json_schema), json_schema)
    elif json_object:
        spec = c.ConstraintSpec("json_object", "", "--json-object")
    elif regex is not None:
        spec = c.ConstraintSpec("regex", regex, "--regex")
    else:
        text = text_of(grammar)
        spec = c.ConstraintSpec(c.grammar_kind(text, grammar), text, grammar)
    c.validate(spec)
    return spec
