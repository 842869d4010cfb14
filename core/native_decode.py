"""The CPU fast path for decode of llama-family models: one native call per step.

A 135M-parameter model reads its weights in about 8 ms per token on a laptop-class core
pair; run as ~300 PyTorch ops (or 30 compiled graphs) a token costs twice that, the rest
being dispatch. kernels/decode.c runs every layer and the head in one call on the model's
own tensors (weights, rotary tables and the KV cache are shared, never copied), so the
engine's prefill, cache reuse, sampling and stopping stay exactly as they are.

It takes the same interface as fastpath.CompiledDecoder (supports / warmup / __call__),
needs no warm-up, and works for any cache capacity and any batch (rows left-padded as
the cache holds them): a batch reads each weight once for all its rows.
"""

from __future__ import annotations

import ctypes

import torch

from . import kernels
from .cache import KVCache
from .llama import LlamaModel
from .model import CausalLM


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                                    "layers")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int64)]


_LAYER_TENSORS = ("in_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up",
                  "gate_up_bias", "down", "down_bias")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_TENSORS] + [("window", ctypes.c_int64)]


def supported(model: CausalLM) -> bool:
    """Llama-family models on the CPU in float32 or bfloat16, on one rank, where the native
    kernels build. Anything else decodes through PyTorch."""
    if not isinstance(model, LlamaModel) or model.shard.active:
        return False
    weight = model.lm_head_weight
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and model.config.hidden_act in ("silu", "swish") and model.config.head_dim <= 1024
            and all(p.is_contiguous() and p.dtype == weight.dtype for p in model.parameters())
            and kernels.available())


def _pointer(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("native decode needs contiguous weights")
    return t.data_ptr()


class NativeDecoder:
    """Decode steps for batch-1 caches of a llama-family `model` (see `supported`)."""

    compile_seconds = 0.0

    def __init__(self, model: LlamaModel):
        c = model.config
        self.model = model
        self.lib = kernels.library()
        self.dtype = model.lm_head_weight.dtype
        layers = model.layers
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        self.dims = _Dims(hidden=c.hidden_size, heads=attn0.heads, kv_heads=attn0.kv_heads, head_dim=c.head_dim,
                          inter=mlp0.intermediate, vocab=model.lm_head_weight.shape[0], layers=len(layers),
                          eps=c.rms_norm_eps, scale=attn0.scale, bf16=int(self.dtype == torch.bfloat16))
        self.layers = (_Layer * len(layers))()
        for i, block in enumerate(layers):
            a, m = block.self_attn, block.mlp
            tensors = {
                "in_norm": block.input_layernorm.weight, "qkv": a.qkv_proj.weight, "qkv_bias": a.qkv_proj.bias,
                "q_norm": a.q_norm.weight if a.q_norm is not None else None,
                "k_norm": a.k_norm.weight if a.k_norm is not None else None,
                "o": a.o_proj.weight, "o_bias": a.o_proj.bias, "post_norm": block.post_attention_layernorm.weight,
                "gate_up": m.gate_up_proj.weight, "gate_up_bias": m.gate_up_proj.bias,
                "down": m.down_proj.weight, "down_bias": m.down_proj.bias,
            }
            for name in _LAYER_TENSORS:
                setattr(self.layers[i], name, _pointer(tensors[name]))
            self.layers[i].window = a.window or 0
        self.final_norm = _pointer(model.norm.weight)
        self.head = _pointer(model.lm_head_weight)
        self.embed = model.embed_tokens.weight
        _pointer(self.embed)

    def supports(self, cache: KVCache) -> bool:
        return cache.k.dtype == self.dtype and cache.k.is_contiguous() and cache.v.is_contiguous()

    def is_warm(self, cache: KVCache) -> bool:
        return True

    def warmup(self, cache: KVCache) -> float:
        return 0.0

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B, 1] at column cache.length → logits [B, V] float32; advances the cache."""
        column, rows = cache.length, cache.batch
        if column >= cache.capacity:
            raise ValueError(f"cache holds {cache.capacity} tokens; {column} + 1 do not fit")
        ids = tokens.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() != rows:
            raise ValueError(f"{ids.numel()} tokens for a cache of {rows} rows")
        starts = cache.starts.to(torch.int64).contiguous() if cache.starts is not None else None
        rope = self.model.rope
        rope.ensure(column + 1)  # positions are column - start ≤ column
        logits = torch.empty(rows, self.dims.vocab, dtype=torch.float32)
        status = self.lib.decode_step(
            ctypes.byref(self.dims), self.layers, self.final_norm, self.head, self.embed.data_ptr(),
            ids.data_ptr(), rows, rope.cos.data_ptr(), rope.sin.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(),
            cache.capacity, column, starts.data_ptr() if starts is not None else None, logits.data_ptr(),
            torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError(f"a token id is outside the vocabulary of {self.dims.vocab}")
        if status != 0:
            raise MemoryError("native decode could not allocate its scratch buffers")
        cache.length = column + 1
        return logits
