"""Model families by `model_type` (each family module's FAMILY), and building a model with
uninitialized weights."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import ModelConfig
from .hugepages import place_parameters
from . import gemma, gpt2, llama, moe, olmo2, phi3
from .family import Family, GgufForm
from .model import CausalLM
from .parallel import SINGLE, Shard
from .qweight import materialize, store_as_blocks

# Every family module, once: its FAMILY names the model_types it reads (family.py).
FAMILIES: dict[str, Family] = {t: m.FAMILY for m in (llama, gpt2, olmo2, phi3, gemma, moe) for t in m.FAMILY.model_types}


def family(model_type: str) -> Family:
    return FAMILIES[model_type]


# How llama.cpp's GGUF files hold each model_type that has a form (family.GgufForm).
GGUF_FORMS: dict[str, GgufForm] = {t: form for m in (llama, gpt2, olmo2, phi3, gemma, moe) for t, form in m.FAMILY.gguf.items()}
# The architectures a GGUF file may name, as read back.
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(f.arch for f in GGUF_FORMS.values() if f.reads_back))


def gguf_form_of_file(arch: str, experts: bool) -> tuple[str, GgufForm] | None:
    """The model_type (and its form) a file of llama.cpp architecture `arch` reads back as:
    the form that has experts if the file has them (llama with experts is Mixtral), else the
    architecture's only form; None: an architecture twice does not read."""
    forms = [(t, f) for t, f in GGUF_FORMS.items() if f.arch == arch and f.reads_back]
    exact = [(t, f) for t, f in forms if f.experts == experts]
    return (exact or forms or [None])[0]


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, shard: Shard = SINGLE,
                layouts: Callable[[CausalLM], dict[str, list[tuple[str, int]]]] | None = None) -> CausalLM:
    """The model's modules with storage allocated on `device` in `dtype` but not
    initialized (see layers.Linear): the loader fills every parameter. (Building on the
    meta device would do the same but imports torch's meta kernels, ~80 MB resident.)

    `layouts`, given the model's modules, names the weights stored as blocks and their row
    groups (qweight.store_as_blocks): then the model is built on the meta device first, so
    that the float matrices those replace are never allocated."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device if layouts is None else "meta"):
            model = FAMILIES[config.model_type].model(config, shard)
        if layouts is not None:
            store_as_blocks(model, layouts(model), device)
            materialize(model, device)
    finally:
        torch.set_default_dtype(previous)
    if config.tie_word_embeddings and hasattr(model, "lm_head"):
        raise AssertionError("tied models have no separate head")
    model.eval().requires_grad_(False)
    if device.type == "cpu":
        place_parameters(model)  # before the loader writes them: decode reads them every token
    model.prepare(device, dtype)
    return model


def meta_model(config: ModelConfig) -> CausalLM:
    """The model's modules on the meta device: its shapes and features, no storage."""
    with torch.device("meta"):
        return FAMILIES[config.model_type].model(config)


def decode_steps(config: ModelConfig) -> dict:
    """Which decode steps implement the features a model of `config` declares (family.py),
    decided from the config alone (the model built on the meta device): the native CPU step
    (where its C kernels build) and the compiled one (--compile; a GPU). Either one that does
    not leaves decoding to the eager layers."""
    from . import fastpath, native_decode

    features = meta_model(config).features()
    return {"features": sorted(features), "native": features <= native_decode.IMPLEMENTS,
            "compiled": features <= fastpath.IMPLEMENTS}
