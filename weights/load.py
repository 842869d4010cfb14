"""Everything needed to generate from a model reference: config, weights, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from twice.core.config import ModelConfig
from twice.core.device import DTYPE_NAMES, dtype_choice, resolve_device
from twice.core.errors import DeviceError, TokenizerError, UnsupportedModelError
from twice.core.model import CausalLM
from twice.core.models import build_model
from twice.core.parallel import SINGLE, Shard
from twice.core.qweight import interleave_weights

from .checkpoint import checkpoint_files, load_into
from .files import GenerationDefaults, read_config, read_generation_config
from .gguf_load import StoredTensors, gguf_source, named_as_the_gguf
from .resolve import resolve
from .tokenizer import Tokenizer


@dataclass
class LoadedModel:
    name: str
    folder: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    generation: GenerationDefaults
    device: torch.device
    dtype: torch.dtype
    weights_seconds: float
    tokenizer_seconds: float
    dtype_reason: str = ""  # why this dtype: "--dtype", "auto: this CPU has AVX-512 BF16", ...

    @property
    def load_seconds(self) -> float:
        return self.weights_seconds + self.tokenizer_seconds

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config's eos ids, plus the tokenizer's eos token (chat models end
        their turn with it even where generation_config forgets to say so)."""
        ids = list(self.generation.eos_token_ids)
        tok_eos = self.tokenizer.eos_token_id
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return tuple(ids)


def check_vocabulary(tokenizer: Tokenizer, config: ModelConfig, folder: Path) -> None:
    """Every id the tokenizer can produce (its model's vocabulary and its added and special
    tokens) must be a row of the model's embedding; else one line, before the weights load
    (an id past the embedding would fail inside the first forward pass)."""
    hf = tokenizer.hf
    largest = max(hf.get_vocab_size(with_added_tokens=False) - 1, max(hf.get_added_tokens_decoder(), default=-1))
    if largest >= config.vocab_size:
        raise TokenizerError(
            f"{folder / 'tokenizer.json'}: the tokenizer has token ids up to {largest:,}, but the model's vocabulary "
            f"(vocab_size in config.json) has {config.vocab_size:,} (ids 0..{config.vocab_size - 1:,}): "
            "the tokenizer does not belong to this model")


def _mixture_layouts(model: CausalLM, mixture: str) -> dict[str, list[tuple[str, int]]]:
    """--quantize: the row groups of each matrix of `model` (on the meta device) in the types
    llama.cpp's `mixture` gives their checkpoint tensors."""
    from .gguf_write import memory_types

    targets = model.placements()
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    shapes, columns = {}, {}
    for hf, places in targets.items():
        t = places[0]
        p = params.get(t.param)
        if p is None or p.dim() != 2:
            continue
        rows = sum(q.rows if q.rows is not None else p.shape[0] for q in places)
        columns[hf] = p.shape[1]
        # The type follows the whole tensor's shape (a rank holds a slice of it), as the parameter holds it.
        src, dim = t.source, t.param_dim
        shapes[hf] = (src.total if dim == 0 else rows, src.total if dim == 1 else p.shape[1])
    from twice.core.quant import codec

    types = memory_types(model.config, mixture, shapes)
    parts: dict[str, list[tuple[int, str, int]]] = {}
    for hf, type_name in types.items():
        if hf.startswith("transformer.") or type_name == "F32":
            continue
        block = codec(type_name).block_size
        if columns[hf] % block:  # tensor parallelism split the row inside a block
            raise UnsupportedModelError(
                f"--quantize {mixture}: {hf} would be {type_name} (blocks of {block} values), but each of the "
                f"{model.shard.world} ranks holds {columns[hf]} of its columns; use fewer ranks, or no --quantize")
        for t in targets[hf]:
            parts.setdefault(t.param, []).append((t.row, type_name, t.rows if t.rows is not None
                                                  else params[t.param].shape[0]))
    layouts = {p: [(kind, rows) for _, kind, rows in sorted(ps)] for p, ps in parts.items()}
    for p, layout in layouts.items():  # stacked experts (core/experts.py): one part per run of a type
        if getattr(modules.get(p.removesuffix(".weight")), "stacked", False):
            merged: list[tuple[str, int]] = []
            for kind, rows in layout:
                if merged and merged[-1][0] == kind:
                    merged[-1] = (kind, merged[-1][1] + rows)
                else:
                    merged.append((kind, rows))
            layouts[p] = merged
    return layouts


def load(ref: str | None = None, revision: str | None = None, device: str = "auto", dtype: str = "auto",
         progress=None, shard: Shard = SINGLE, weights: str | None = None) -> LoadedModel:
    """Resolve `ref`, read its config and tokenizer, and load its weights (only this rank's
    slices when `shard` splits the model across tensor-parallel ranks). `weights` says how
    to hold them: None: as stored (a GGUF file's quantized matrices stay in their blocks);
    "dequantize": a GGUF through its float copy; a mixture name ("q4_k_m"): quantized in
    memory from the float weights while loading."""
    say = progress or (lambda message: None)
    t0 = time.perf_counter()
    dev = resolve_device(device)  # a bad --device/--dtype fails before any download
    dt, dtype_reason = dtype_choice(dtype, dev)
    folder = resolve(ref, revision, progress, dequantize=weights is not None)
    say("reading config")
    gguf = gguf_source(folder)
    with named_as_the_gguf(folder, gguf):
        config = read_config(folder)
        generation = read_generation_config(folder, config)
        # Fail on a missing/corrupt/pickle checkpoint (or a GGUF we cannot run) before building anything.
        stored = StoredTensors(gguf) if gguf is not None else None
        files = checkpoint_files(folder, config) if stored is None else []
        t1 = time.perf_counter()
        say("reading tokenizer")
        tokenizer = Tokenizer(folder, shown_as=gguf)
        check_vocabulary(tokenizer, config, folder)
    t2 = time.perf_counter()
    try:
        say(f"building the model on {dev} in {DTYPE_NAMES.get(dt, dt)}")
        if stored is None and weights not in (None, "dequantize"):
            model = build_model(config, dev, dt, shard, layouts=lambda m: _mixture_layouts(m, weights))
            say(f"quantizing the weights to {weights}")
            load_into(model, folder, files)
        elif stored is None:
            model = build_model(config, dev, dt, shard)
            say("copying weights")
            load_into(model, folder, files)
        else:
            model = build_model(config, dev, dt, shard, layouts=lambda m: stored.layouts(m, dt))
            say(f"reading {gguf.name}'s tensors as stored")
            stored.fill(model)
    except torch.OutOfMemoryError:
        raise DeviceError(f"out of memory loading {folder.name} on {dev} in {dtype}; try a smaller dtype or the cpu") from None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    else:  # the 32-value types' blocks into the native kernels' interleaved rows (each rank's own)
        interleave_weights(model)
    t3 = time.perf_counter()
    name = ref or folder.name
    return LoadedModel(name, folder, config, model, tokenizer, generation, dev, dt,
                       weights_seconds=(t1 - t0) + (t3 - t2), tokenizer_seconds=t2 - t1, dtype_reason=dtype_reason)
