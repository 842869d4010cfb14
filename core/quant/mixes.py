"""llama.cpp's quantization mixtures: which type each tensor of a model gets.

A mixture ("q4_k_m") names a base type (Q4_K) and rules that move some tensors to other types:
llama.cpp's ``llama_tensor_get_type`` (src/llama-quant.cpp), for dense models without an importance
matrix, per-tensor overrides or ``--pure``:

- ``output.weight`` (and ``token_embd.weight`` when the model ties its embeddings, i.e. the file
  has no ``output.weight``): Q6_K, or Q8_0 where its rows are not whole blocks of the base type
  (or the architecture is falcon), and Q8_0 stays Q8_0.
- ``attn_v`` (and the fused ``attn_qkv`` / ``attn_kv_b``, which llama.cpp counts as attn_v):
  q4_k_m and q5_k_m use Q6_K in the "use_more_bits" layers (the first and last eighth of the
  layers and every third one between), q4_k_s Q5_K in the first 4 layers, q3_k_m Q5_K in the first
  2 and Q4_K after, q2_k Q4_K when 4 or more query heads share a key/value head, else Q3_K.
- ``ffn_down``: q4_k_m Q6_K in the use_more_bits layers (falcon: Q6_K in the first 16th, Q5_K in the
  use_more_bits layers, else Q4_K), q5_k_m Q6_K there, q4_k_s Q5_K in the first eighth, q3_k_m Q5_K in
  the first 16th and Q4_K after (falcon: Q3_K outside use_more_bits), q2_k Q3_K.
- ``attn_output``: q2_k Q3_K, q3_k_m Q4_K (not for falcon).
- Then the shape fallback: a row length that is not a whole number of the chosen type's blocks
  takes the 32-value type llama.cpp falls back to (Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1,
  Q6_K → Q8_0), and F16 where even 32 does not divide it.

Tensors llama.cpp never quantizes (fewer than 2 dimensions, names not ending in ``weight``, norms,
position embeddings, token types, MoE gates) get "F32" here: twice writes them from float weights.

Not modelled (twice has no such models): mixture-of-experts rules (n_expert), the 70B attn_v rule,
imatrix-only rules, the IQ and TQ types.
"""

from __future__ import annotations

import re
from typing import Sequence

from . import codec

# mixture name -> its base type (llama-quantize's names, lower case)
MIXTURES: dict[str, str] = {
    "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1",
    "q2_k": "Q2_K", "q3_k_m": "Q3_K", "q4_k_s": "Q4_K", "q4_k_m": "Q4_K",
    "q5_k_s": "Q5_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K",
    "f32": "F32", "f16": "F16", "bf16": "BF16",
}
# the short names llama-quantize takes for the medium mixtures
ALIASES: dict[str, str] = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}

# llama.cpp's tensor_type_fallback for rows that are not whole 256-value blocks
FALLBACK: dict[str, str] = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

_LAYER = re.compile(r"blk\.(\d+)\.")
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "altup", "laurel",
                  "per_layer_model_proj", "ssm_conv1d", "attn_rel_b.weight", ".position_embd", ".rel_pos", ".patch_embd")


def mixture_name(mixture: str) -> str:
    """The canonical mixture name ("Q4_K" → "q4_k_m"); ValueError (one line) for an unknown one."""
    key = str(mixture).strip().lower()
    key = ALIASES.get(key, key)
    if key not in MIXTURES:
        raise ValueError(f"unknown quantization mixture {mixture!r} (known: {', '.join([*MIXTURES, *ALIASES])})")
    return key


def check_row(type_name: str, n: int) -> None:
    """ValueError (one line) unless a row of `n` values is a whole number of `type_name` blocks."""
    c = codec(type_name)
    if n <= 0 or n % c.block_size:
        raise ValueError(f"a row of {n} values cannot be stored as {c.name}: its blocks hold {c.block_size} "
                         f"values and {n} is not a {'positive ' if n <= 0 else ''}multiple of {c.block_size}")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every
    third layer between them."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def is_quantized_tensor(name: str, shape: Sequence[int]) -> bool:
    """Whether llama.cpp quantizes this tensor at all (tensor_allows_quantization)."""
    return (len(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NOT_QUANTIZED)
            and name not in ("position_embd.weight", "token_types.weight"))


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _layer(name: str, n_layers: int, order: str) -> int:
    """The tensor's place in llama.cpp's count of its kind: its layer number, or with
    order="name" its place among the layer numbers sorted as text (the order llama.cpp counted in
    before it sorted tensors by layer number, which files made then show)."""
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"tensor {name} has no layer number (blk.N.)")
    i = int(m.group(1))
    if not 0 <= i < n_layers:
        raise ValueError(f"tensor {name}: layer {i} is outside the model's {n_layers} layers")
    if order == "name":
        return sorted(range(n_layers), key=str).index(i)
    return i


def tensor_type(mixture: str, gguf_tensor_name: str, n_layers: int, shape: Sequence[int], arch: str, *,
                tied_embeddings: bool = True, n_gqa: int = 1, order: str = "numeric") -> str:
    """The type llama.cpp's mixture gives one tensor ("Q4_K", "Q6_K", "F32", ...).

    shape: the tensor's shape in torch order (the row length last: GGUF's ne reversed).
    arch: llama.cpp's architecture name ("llama", "qwen2", "gpt2", ...; only "falcon" changes rules).
    tied_embeddings: the model has no separate output.weight, so token_embd.weight is also the
    output matrix and follows output's rule (llama.cpp assumes so until it sees output.weight).
    n_gqa: query heads per key/value head (q2_k's attn_v rule).
    order: "numeric" counts layers by number (llama.cpp today); "name" as older llama.cpp did.
    """
    mix = mixture_name(mixture)
    if order not in ("numeric", "name"):
        raise ValueError(f"order must be 'numeric' or 'name', got {order!r}")
    name = str(gguf_tensor_name)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError(f"tensor {name} has no dimensions")
    if not is_quantized_tensor(name, shape):
        return "F32"
    base = MIXTURES[mix]
    if not codec(base).quantized:
        return base
    falcon = str(arch).lower() == "falcon"
    cat = _category(name)
    nx = shape[-1]
    new = base

    if cat == "output" or (tied_embeddings and cat == "token_embd"):
        if falcon or nx % codec(new).block_size:
            new = "Q8_0"
        elif new != "Q8_0":
            new = "Q6_K"
    elif cat == "attn_v":
        i = _layer(name, n_layers, order)
        if mix == "q2_k":
            new = "Q4_K" if n_gqa >= 4 else "Q3_K"
        elif mix == "q3_k_m":
            new = "Q5_K" if i < 2 else "Q4_K"
        elif mix in ("q4_k_m", "q5_k_m") and use_more_bits(i, n_layers):
            new = "Q6_K"
        elif mix == "q4_k_s" and i < 4:
            new = "Q5_K"
    elif cat == "ffn_down":
        i = _layer(name, n_layers, order)
        n = n_layers
        if mix == "q2_k":
            new = "Q3_K"
        elif mix == "q3_k_m":
            new = "Q5_K" if i < n // 16 else ("Q4_K" if not falcon or use_more_bits(i, n) else "Q3_K")
        elif mix == "q4_k_m":
            if falcon:
                new = "Q6_K" if i < n // 16 else ("Q5_K" if use_more_bits(i, n) else "Q4_K")
            elif use_more_bits(i, n):
                new = "Q6_K"
        elif mix == "q5_k_m" and use_more_bits(i, n):
            new = "Q6_K"
        elif mix == "q4_k_s" and not falcon and i < n // 8:
            new = "Q5_K"
    elif cat == "attn_output" and not falcon:
        if mix == "q2_k":
            new = "Q3_K"
        elif mix == "q3_k_m":
            new = "Q4_K"
    return fallback(new, nx)


def fallback(type_name: str, n: int) -> str:
    """llama.cpp's tensor_type_fallback: the type itself where rows of `n` values are whole blocks
    of it, else the 32-value type it falls back to, else F16."""
    c = codec(type_name)
    if n % c.block_size == 0:
        return c.name
    new = FALLBACK.get(c.name, c.name)
    return new if n % codec(new).block_size == 0 else "F16"


__all__ = ["ALIASES", "FALLBACK", "MIXTURES", "check_row", "fallback", "is_quantized_tensor", "mixture_name",
           "tensor_type", "use_more_bits"]
