"""The KV cache as something to keep: prompt caches (a session cache ↔ a dict of tensors,
and the checks that a stored one belongs to this model) and context shift (dropping a
span of cached tokens and re-rotating the keys after it to their new positions).

What is math lives here; the file (safetensors, checksum, validation before anything is
allocated) is weights/prompt_cache_file.py, which never computes.

Stored as the cache stores it: every tensor of the cache laid out [layers, batch,
kv_heads, capacity, ...] (K and V for a float cache; the blocks and scales of a quantized
one), one row's filled columns [layers, kv_heads, tokens, ...], in its own dtype. Nothing
is converted, so a loaded cache is bit for bit the one that was saved.

The model's fingerprint (`fingerprint`): SHA-256 over the config, each weight's name,
shape, dtype and 3 × 32 of its elements (first, middle, last; as stored: the blocks of a
quantized weight), the tokenizer file's SHA-256, and the tensor-parallel shard. Another
checkpoint (a fine-tune, another quantization, --dequantize, another tokenizer) gives
another fingerprint; hashing every weight byte would cost a second per GB on every run.
The dtype and the kv-dtype are stored and checked on their own (for a clearer refusal).

Context shift (`shift`, float and quantized caches: a quantized cache's moved keys are
decoded, rotated and encoded again, its values move as stored): RoPE rotates each key pair (x_i, x_{i+d/2}) by the angle
position · inv_freq_i, so the key of a token moved from position p to p − d is the stored
key rotated by −d · inv_freq_i: one more rotation, the same for every moved column,
computed in float64 angles and applied in float32 (an attention-scaling factor folded
into the tables, yarn's, is a magnitude and stays as it was). Partial rotary (phi3's
partial_rotary_factor) rotates the first rotary_dim dimensions only; gemma3's sliding
layers (rope:local) rotate with their own table. Refused in one line: models without
RoPE (gpt2's learned positions cannot move) and longrope (its frequencies change at
original_max_position_embeddings, so a key's rotation depends on how it was computed).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .cache import KVCache, offset_keys_of
from .device import DTYPE_NAMES
from .errors import TwiceError

FORMAT = "twice-prompt-cache"
# 2: q8_0/q4_0 caches hold keys minus the layer's key bias (cache.offset_keys); a version-1 file of such a
# cache would load as if its keys were unshifted, so it is refused as the stale format it is.
# 3: the fingerprint takes the tokenizer file's SHA-256 instead of its serialization (a version-2
# file's fingerprint would never match again: refused as stale, and replaced, not kept as foreign).
VERSION = "3"
TOKEN_IDS = "token_ids"


class PromptCacheError(TwiceError):
    """A prompt-cache file that cannot be used here (foreign, stale, corrupt), or a context
    shift the model cannot do; the run goes on without it where that makes sense."""


class ForeignPromptCache(PromptCacheError):
    """A sound prompt cache made for another model, tokenizer, dtype or kv dtype: not used, and
    not replaced by this run's (it is still good for the runs it was made for)."""


# -- what a cache stores ----------------------------------------------------------------
def stored_tensors(cache: KVCache) -> dict[str, torch.Tensor]:
    """The cache's own tensors laid out [layers, batch, kv_heads, capacity, ...], by
    attribute name: `cache.stored_tensors()` where the cache says, else every tensor
    attribute of that layout (k and v; a quantized cache's blocks and scales)."""
    own = getattr(cache, "stored_tensors", None)
    if callable(own):
        return dict(own())
    lead = (cache.num_layers, cache.batch, cache.kv_heads, cache.capacity)
    found = {name: t for name, t in sorted(vars(cache).items())
             if isinstance(t, torch.Tensor) and t.dim() >= 4 and tuple(t.shape[:4]) == lead}
    assert "k" in found and "v" in found, "a KV cache holds k and v"
    return found


def kv_dtype_name(cache: KVCache) -> str:
    """The cache's element type as --kv-dtype names it (float32, bfloat16, q8_0, ...)."""
    kind = getattr(cache, "kv_dtype", None)
    if isinstance(kind, str):
        return kind
    if isinstance(kind, torch.dtype):
        return DTYPE_NAMES.get(kind, str(kind))
    return DTYPE_NAMES.get(cache.k.dtype, str(cache.k.dtype))


def layout(cache: KVCache) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name → (dtype, shape of one row's columns with the token count as -1): what a
    stored cache for this model must hold."""
    out = {}
    for name, t in stored_tensors(cache).items():
        out[name] = (t.dtype, (t.shape[0], t.shape[2], -1, *t.shape[4:]))
    return out


def snapshot(cache: KVCache, tokens: int, row: int = 0) -> dict[str, torch.Tensor]:
    """Row `row`'s first `tokens` columns of every stored tensor, on the CPU, contiguous."""
    if not 0 < tokens <= cache.length:
        raise ValueError(f"the cache holds {cache.length} columns, not {tokens}")
    return {name: t[:, row, :, :tokens].contiguous().cpu() for name, t in stored_tensors(cache).items()}


def destinations(cache: KVCache, tokens: int) -> dict[str, torch.Tensor]:
    """Where a stored cache's tensors go in an empty one-row `cache` (of capacity ≥
    `tokens`): views [layers, kv_heads, tokens, ...] of row 0's first columns, each
    [tokens, ...] slice contiguous; fill them, then call `restored`."""
    if tokens > cache.capacity or cache.batch != 1:
        raise ValueError("restore needs a one-row cache with room for the stored tokens")
    return {name: t[:, 0, :, :tokens] for name, t in stored_tensors(cache).items()}


def restored(cache: KVCache, tokens: int) -> None:
    """Mark `cache` as holding the `tokens` columns written into its `destinations`."""
    cache.length = tokens
    cache.starts = None
    invalidate = getattr(cache, "invalidate", None)  # a cache with derived state (a float copy) rebuilds it
    if callable(invalidate):
        invalidate()


# -- whose cache it is --------------------------------------------------------------------
def fingerprint(model: torch.nn.Module, tokenizer=None) -> str:
    """A hex digest that differs between checkpoints, quantizations and tokenizers (see the
    module's docstring for what it covers and why not every byte)."""
    h = hashlib.sha256()
    h.update(repr(model.config).encode())
    shard = getattr(model, "shard", None)
    h.update(f"shard {getattr(shard, 'rank', 0)}/{getattr(shard, 'world', 1)}".encode())
    seen = set()
    modules = dict(model.named_modules())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not isinstance(t, torch.Tensor) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
        owner, _, leaf = name.rpartition(".")
        h.update(_sampled_bytes(t, getattr(modules.get(owner), "stored_bytes", None), leaf))
    digest = getattr(tokenizer, "digest", None)  # the tokenizer file's, as it was read
    if digest is not None:
        h.update(digest.encode())
    elif (hf := getattr(tokenizer, "hf", None)) is not None:
        h.update(hf.to_str().encode())
    return h.hexdigest()


def _sampled_bytes(t: torch.Tensor, stored, leaf: str) -> bytes:
    """The bytes of 3 × 32 elements of `t` (first, middle, last), as stored: a quantized
    weight's blocks as the file holds them, whatever their layout in memory (`stored`, the
    owner's stored_bytes). Indexed in numpy: a torch call per piece would cost more than the
    rest of a prompt-cache load."""
    n = t.numel()
    at = np.concatenate([np.arange(b, min(b + 32, n), dtype=np.int64)
                         for b in (0, max(0, n // 2 - 16), max(0, n - 32))])
    if t.device.type != "cpu":
        return t.detach().reshape(-1)[torch.from_numpy(at).to(t.device)].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    if stored is not None and (got := stored(leaf, at)) is not None:
        return got.tobytes()
    flat = t.detach().reshape(-1).view(torch.uint8).numpy()
    size = t.element_size()
    return flat[(at[:, None] * size + np.arange(size)).reshape(-1)].tobytes()


def describe(model: torch.nn.Module, cache: KVCache, tokenizer=None) -> dict[str, str]:
    """The metadata a stored cache carries and is checked against."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint(model, tokenizer),
        "dtype": DTYPE_NAMES.get(model_dtype(model), str(model_dtype(model))),
        "kv_dtype": kv_dtype_name(cache),
        "model_type": model.config.model_type,
    }


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return next(model.parameters()).dtype


# -- context shift ------------------------------------------------------------------------
def shift_refusal(model: torch.nn.Module) -> str | None:
    """Why this model's cached keys cannot be moved to new positions (one line), or None."""
    rope = getattr(model, "rope", None)
    kind = (model.config.rope_parameters or {}).get("rope_type") if model.config.rope_parameters else None
    if kind is None:
        return (f"--context-shift needs rotary position embeddings; {model.config.model_type} has learned "
                "absolute positions, which cached keys cannot be moved away from")
    if kind == "longrope" or getattr(rope, "boundary", None) is not None:
        return ("--context-shift does not work with longrope scaling: its frequencies change at "
                "original_max_position_embeddings, so a cached key's rotation depends on how it was computed")
    local = getattr(model, "rope_local", None)
    if local is not None and getattr(local, "boundary", None) is not None:
        return "--context-shift does not work with longrope scaling on the sliding layers' table"
    return None


def _layer_tables(model: torch.nn.Module) -> list:
    """The RotaryTables each layer's keys were rotated with (gemma3's sliding layers: the
    local table)."""
    layers = getattr(model, "layers", None)
    n = model.config.num_hidden_layers
    local = getattr(model, "rope_local", None)
    out = []
    for i in range(n):
        block = layers[i] if layers is not None else None
        out.append(local if (local is not None and getattr(block, "local_rope", False)) else model.rope)
    return out


def _rotation(table, distance: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [rotary_dim] (float32) of the rotation by −distance positions."""
    angle = -float(distance) * table.inv_freq.double().cpu()
    angle = torch.cat((angle, angle))
    return angle.cos().float().to(device), angle.sin().float().to(device)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float32 keys [..., head_dim] rotated (rotate-half convention, the first
    cos.shape[-1] dimensions)."""
    from .rope import apply_rotary

    return apply_rotary(keys.float(), cos, sin)


def shift(model: torch.nn.Module, cache: KVCache, keep: int, drop: int, end: int | None = None) -> None:
    """Drop columns [keep, keep + drop) of a one-row cache: columns [keep + drop, end) move
    to [keep, end − drop) with their keys rotated by −drop positions; the cache then holds
    end − drop columns (end: the cache's length by default). Exactly (within float
    rounding) the cache a fresh prefill of the kept tokens at their new positions gives."""
    if (why := shift_refusal(model)) is not None:
        raise PromptCacheError(why)
    end = cache.length if end is None else end
    if cache.batch != 1 or cache.starts is not None:
        raise ValueError("context shift works on a one-row cache")
    if not (0 <= keep and drop >= 1 and keep + drop <= end <= cache.length):
        raise ValueError(f"cannot drop columns [{keep}, {keep + drop}) of {end}")
    moved = end - keep - drop
    if set(stored_tensors(cache)) != {"k", "v"}:
        raise PromptCacheError(f"--context-shift cannot move this cache's tensors ({sorted(stored_tensors(cache))})")
    # A quantized cache (cache.py's blocks): keys decoded, rotated in float32, encoded again
    # (one more rounding of the moved keys); values move as stored, bit for bit.
    # (decode_keys/encode_keys: a block cache's keys are stored minus the key bias, cache.py)
    offset_keys_of(cache, model)  # a cache restored from a file: its key offsets before any layer ran
    decode = getattr(cache, "decode_keys", lambda stored, layer, dtype: stored.to(dtype))
    encode = getattr(cache, "encode_keys", lambda x, layer: x.to(cache.k.dtype))
    if moved:
        tables = _layer_tables(model)
        rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(cache.num_layers):
            table = tables[layer]
            if id(table) not in rotations:
                rotations[id(table)] = _rotation(table, drop, cache.k.device)
            cos, sin = rotations[id(table)]
            keys = decode(cache.k[layer, 0, :, keep + drop:end].clone(), layer, torch.float32)
            values = cache.v[layer, 0, :, keep + drop:end].clone()
            cache.k[layer, 0, :, keep:keep + moved] = encode(rotate_keys(keys, cos, sin), layer)
            cache.v[layer, 0, :, keep:keep + moved] = values
    cache.length = keep + moved
    invalidate = getattr(cache, "invalidate", None)
    if callable(invalidate):
        invalidate()


def plan_shift(old: list[int], new: list[int]) -> tuple[int, int, int]:
    """How the cached tokens `old` become a prefix of `new` by dropping one span: (keep,
    drop, matched): old[:keep] and old[keep + drop : keep + drop + matched] are new's first
    keep + matched tokens. Chooses the drop that keeps most (the shortest among equals);
    drop 0 when no dropped span helps (plain prefix reuse)."""
    keep = 0
    n = min(len(old), len(new))
    while keep < n and old[keep] == new[keep]:
        keep += 1
    best = (0, 0)  # (matched, -drop)
    if keep < len(new):
        first = new[keep]
        for start in range(keep + 1, len(old)):
            if old[start] != first:
                continue
            m = 0
            limit = min(len(old) - start, len(new) - keep)
            while m < limit and old[start + m] == new[keep + m]:
                m += 1
            if (m, -(start - keep)) > best:
                best = (m, -(start - keep))
    matched, drop = best[0], -best[1]
    return keep, drop, matched
