"""Options shared by generate, chat and batch, and turning them into engine settings."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Model = Annotated[Optional[str], typer.Option("--model", "-m", help="Model folder, .gguf file or Hub id (org/name). Default: SmolLM2-135M-Instruct.")]
Revision = Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")]
Device = Annotated[str, typer.Option(help="auto (cuda if available), cpu or cuda.")]
Dtype = Annotated[str, typer.Option(help="auto (bfloat16 on cuda; on the cpu bfloat16 where a quick measurement shows this CPU multiplies it faster, "
                                          "else float32), float32, bfloat16 or float16.")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Most tokens to generate.")]
Temperature = Annotated[Optional[float], typer.Option(help="0 = greedy. Default: the model's generation_config, else 0.")]
TopK = Annotated[Optional[int], typer.Option(help="Keep the k most likely tokens (0 = off).")]
TopP = Annotated[Optional[float], typer.Option(help="Keep the smallest set of tokens with this much probability.")]
MinP = Annotated[Optional[float], typer.Option(help="Drop tokens below min-p × the top token's probability.")]
RepPenalty = Annotated[Optional[float], typer.Option("--repetition-penalty", help="> 1 discourages repeating tokens.")]
Seed = Annotated[Optional[int], typer.Option(help="Seed for sampling (same seed, same output).")]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable); it is not printed.")]
System = Annotated[Optional[str], typer.Option(help="System message (chat mode).")]
Chat = Annotated[Optional[bool], typer.Option("--chat/--raw", help="Apply the chat template (default: on when the model has one).")]
PrefillChunk = Annotated[Optional[int], typer.Option(help="Prefill at most this many tokens per forward pass.")]
Timing = Annotated[bool, typer.Option("--timing", help="Print a timing and memory report at the end (stderr).")]
NoColor = Annotated[bool, typer.Option("--no-color", help="No colors (also NO_COLOR=1).")]
Truncate = Annotated[Optional[str], typer.Option(
    help="left: drop the start of a prompt that does not fit the context (default: refuse it).")]
TensorParallel = Annotated[int, typer.Option(
    "--tp", help="Tensor-parallel degree: shard the model over this many processes (run under torchrun "
                 "--nproc-per-node N). Default 1.")]
Compile = Annotated[bool, typer.Option("--compile", help="Compile the decode step with torch.compile (faster "
                                                         "decode; compile time is reported on its own): batch 1 on "
                                                         "the CPU; any batch on a GPU, where each cache's whole step "
                                                         "is also recorded once as a CUDA graph. "
                                                         "Llama-family models on the CPU already decode with the "
                                                         "native step, which needs no compiling.")]


def sampling_params(generation_defaults: dict, temperature, top_k, top_p, min_p, repetition_penalty, seed):
    """Explicit flags win; otherwise the model's generation_config when it asks for
    sampling (do_sample), else greedy."""
    from twice.core.sampling import SamplingParams

    d = generation_defaults if generation_defaults.get("do_sample") else {}

    def pick(flag, key, default):
        return flag if flag is not None else d.get(key, default)

    return SamplingParams(
        temperature=float(pick(temperature, "temperature", 0.0 if not d else 1.0)),
        top_k=int(pick(top_k, "top_k", 0)),
        top_p=float(pick(top_p, "top_p", 1.0)),
        min_p=float(pick(min_p, "min_p", 0.0)),
        repetition_penalty=float(
            repetition_penalty if repetition_penalty is not None else generation_defaults.get("repetition_penalty", 1.0)
        ),
        seed=seed,
    )


def check_flags(max_new_tokens=None, prefill_chunk=None, temperature=None, top_k=None, top_p=None, min_p=None,
                repetition_penalty=None, seed=None, truncate=None) -> None:
    """Refuse impossible settings before the model loads (one-line PromptError), with the
    same checks the engine makes later on the merged settings."""
    from twice.core.engine import GenerationSettings

    sampling = sampling_params({}, temperature, top_k, top_p, min_p, repetition_penalty, seed)
    GenerationSettings(max_new_tokens=256 if max_new_tokens is None else max_new_tokens, sampling=sampling,
                       prefill_chunk=prefill_chunk, truncate=truncate)


def ignored_with_greedy(sampling, top_k=None, top_p=None, min_p=None, seed=None) -> str | None:
    """A note when sampling flags were given but decoding is greedy (temperature 0)."""
    if sampling.temperature != 0:
        return None
    given = [name for name, value in (("--top-k", top_k), ("--top-p", top_p), ("--min-p", min_p), ("--seed", seed))
             if value is not None]
    if not given:
        return None
    return f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with greedy decoding (temperature 0)"
