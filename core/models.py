"""Model families by `model_type`, and building a model with uninitialized weights."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .hugepages import place_parameters
from .gpt2 import GPT2Model
from .llama import LlamaModel
from .model import CausalLM
from .parallel import SINGLE, Shard

FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "gpt2": GPT2Model,
}


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, shard: Shard = SINGLE) -> CausalLM:
    """The model's modules with storage allocated on `device` in `dtype` but not
    initialized (see layers.Linear): the loader fills every parameter. (Building on the
    meta device would do the same but imports torch's meta kernels, ~80 MB resident.)"""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = FAMILIES[config.model_type](config, shard)
    finally:
        torch.set_default_dtype(previous)
    if config.tie_word_embeddings and hasattr(model, "lm_head"):
        raise AssertionError("tied models have no separate head")
    model.eval().requires_grad_(False)
    if device.type == "cpu":
        place_parameters(model)  # before the loader writes them: decode reads them every token
    model.prepare(device, dtype)
    return model
