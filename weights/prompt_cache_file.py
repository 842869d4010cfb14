"""Prompt-cache files: a KV cache on disk (twice generate --prompt-cache, twice chat
/save's sidecar). No math: tensors in, tensors out (core/prompt_cache.py says what they are).

The file is safetensors: one tensor per stored cache tensor, named as the cache names it
("k", "v"; a quantized cache's blocks and scales), shaped [layers, kv_heads, tokens, ...]
in the cache's own dtype, and "token_ids" (I64 [tokens]). `__metadata__` holds format
"twice-prompt-cache", version, the model's fingerprint, dtype, kv_dtype, model_type, the
token count, and "checksum": the SHA-256 of the data section (every byte after the header).

Written whole or not at all (safe_write.write_atomic: beside, fsync, rename; never through
a link). Read through the same checks as a checkpoint's header (checkpoint._read_header:
entries, dtypes, offsets that tile the file), then, before any tensor is allocated, the
metadata (format, version, fingerprint, dtype, kv-dtype) and every tensor's name, dtype,
shape and byte range against what this model's cache stores (the table is exactly what
`encode` writes), the token count against the context;
then the data is read once, straight into the new cache's memory, its checksum compared as
it is read (a mismatch drops that cache: the engine keeps its own).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from twice.core.errors import WeightsError
from twice.core.prompt_cache import FORMAT, TOKEN_IDS, VERSION, ForeignPromptCache, PromptCacheError

MAX_HEADER_BYTES = 1 << 20  # a prompt cache's header names a few tensors: kilobytes

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8"}
_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def encode(tensors: dict[str, torch.Tensor], ids: list[int], metadata: dict[str, str]) -> bytes:
    """The file's bytes: tensors (contiguous, CPU) in name order, then token_ids."""
    entries, parts, offset = {}, [], 0
    named = {**{k: tensors[k] for k in sorted(tensors)}, TOKEN_IDS: torch.tensor(ids, dtype=torch.int64)}
    for name, t in named.items():
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
        entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + len(raw)]}
        parts.append(raw)
        offset += len(raw)
    data = b"".join(parts)
    meta = {**metadata, "tokens": str(len(ids)), "checksum": hashlib.sha256(data).hexdigest()}
    header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes
    return struct.pack("<Q", len(header)) + header + data


def write(path: Path, tensors: dict[str, torch.Tensor], ids: list[int], metadata: dict[str, str]) -> None:
    """Replace `path` atomically with a prompt cache. OSError (a read-only folder, a full
    disk) and WriteError (a link, not a regular file) propagate for the caller's one line;
    nothing is left half-written."""
    from .safe_write import write_atomic

    write_atomic(Path(path), encode(tensors, ids, metadata))


def looks_like_one(path: Path) -> bool:
    """Whether `path` is a prompt-cache file by its header's metadata (to replace it without
    asking): of any version (a file an older twice wrote is ours to replace), and damaged
    past its header (a truncated cache is still ours)."""
    from .files import open_regular

    try:
        with open_regular(Path(path), PromptCacheError) as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if not 2 <= length <= MAX_HEADER_BYTES:
                return False
            header = json.loads(f.read(length))
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        return isinstance(meta, dict) and meta.get("format") == FORMAT
    except (PromptCacheError, OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return False


def _header(path: Path, any_version: bool = False) -> tuple[dict, int, int]:
    """(header, data start, file size), the header checked as a checkpoint's, and a twice
    prompt cache by its metadata's format and (unless `any_version`) version."""
    from .checkpoint import _read_header
    from .files import open_regular

    with open_regular(path, PromptCacheError) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
    if len(head) == 8 and struct.unpack("<Q", head)[0] > MAX_HEADER_BYTES:
        raise PromptCacheError(f"{path}: not a twice prompt cache (not a safetensors file: its first 8 bytes "
                               f"give a header of {struct.unpack('<Q', head)[0]:,} bytes)")
    try:
        header, start = _read_header(path)
    except WeightsError as e:
        raise PromptCacheError(str(e).replace("safetensors", "prompt-cache", 1)) from None
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise PromptCacheError(f"{path}: not a twice prompt cache (a safetensors file without its metadata)")
    if meta.get("version") != VERSION and not any_version:
        raise PromptCacheError(f"{path}: prompt-cache version {json.dumps(meta.get('version'))}, "
                               f"this twice reads {json.dumps(VERSION)}")
    return header, start, size


@dataclass
class Checked:
    """A prompt cache whose header holds what this model's cache stores: `tokens` columns,
    the data from byte `start` on, `checksum` the SHA-256 its data must have."""

    path: Path
    tokens: int
    start: int
    checksum: str
    names: tuple[str, ...]  # the stored tensors in the file's order (token_ids after them)


def check(path: Path, expected: dict[str, str], layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
          max_tokens: int) -> Checked:
    """A prompt cache made for this model, checked by its header alone, or PromptCacheError
    naming the first mismatch (one line). `expected`: fingerprint, dtype, kv_dtype (the
    metadata this run would write); `layout`: name → (dtype, [layers, kv_heads, -1, ...])."""
    path = Path(path)
    header, start, _ = _header(path)
    meta = header["__metadata__"]
    for key, flag in (("dtype", "--dtype"), ("kv_dtype", "--kv-dtype")):
        if meta.get(key) != expected[key]:
            raise ForeignPromptCache(f"{path}: holds a {meta.get(key)} cache, this run's is {expected[key]} ({flag})")
    if meta.get("fingerprint") != expected["fingerprint"]:
        made = meta.get("model_type") or "another model"
        raise ForeignPromptCache(f"{path}: made with another model or tokenizer: {made}, fingerprint "
                                 f"{str(meta.get('fingerprint'))[:12]}, this model's {expected['fingerprint'][:12]}")
    names = set(header) - {"__metadata__"}
    if names != set(layout) | {TOKEN_IDS}:
        raise PromptCacheError(f"{path}: holds tensors {sorted(names)}, this model's cache stores "
                               f"{sorted(set(layout) | {TOKEN_IDS})}")
    ids_entry = header[TOKEN_IDS]
    if ids_entry["dtype"] != "I64" or len(ids_entry["shape"]) != 1:
        raise PromptCacheError(f"{path}: token_ids must be I64 [tokens], got {ids_entry['dtype']} {ids_entry['shape']}")
    tokens = ids_entry["shape"][0]
    if not 1 <= tokens <= max_tokens:
        raise PromptCacheError(f"{path}: holds {tokens:,} tokens; this model's context takes 1 to {max_tokens:,}")
    if meta.get("tokens") != str(tokens):
        raise PromptCacheError(f"{path}: its metadata says {meta.get('tokens')} tokens, token_ids holds {tokens}")
    for name, (dtype, shape) in layout.items():
        want = [tokens if d == -1 else d for d in shape]
        got = header[name]
        if got["dtype"] != _ST_DTYPES.get(dtype) or got["shape"] != want:
            raise PromptCacheError(f"{path}: tensor {name!r} is {got['dtype']} {got['shape']}, this model's cache "
                                   f"needs {_ST_DTYPES.get(dtype)} {want}")
    # The table is the one encode() writes: the tensors in name order, then token_ids, end to
    # end. The checksum covers the data alone, so a table whose ranges were swapped (k read
    # from v's bytes) would pass it.
    at = 0
    for name in (*sorted(layout), TOKEN_IDS):
        entry = header[name]
        end = at + _elem(entry) * math.prod(entry["shape"])
        if entry["data_offsets"] != [at, end]:
            raise PromptCacheError(f"{path}: tensor {name!r} lies at bytes {entry['data_offsets']} of the data, where "
                                   f"twice writes it at {[at, end]} (the header was changed)")
        at = end
    return Checked(path, tokens, start, str(meta.get("checksum")), tuple(sorted(layout)))


def fill(checked: Checked, into: dict[str, torch.Tensor], vocab_size: int) -> list[int]:
    """Read the checked file's tensors into `into` (name → a view [layers, kv_heads, tokens,
    ...] whose [tokens, ...] slices are each contiguous: a cache's own memory, so the data
    is read once, into where it stays) and return its token ids; PromptCacheError if the
    data is short, does not match its checksum, or holds an id outside the vocabulary (the
    views then hold garbage: the caller drops what they belong to)."""
    from .files import open_regular

    path, h = checked.path, hashlib.sha256()
    ids = torch.empty(checked.tokens, dtype=torch.int64)
    try:
        with open_regular(path, PromptCacheError) as f:
            f.seek(checked.start)
            for name in checked.names:
                for per_layer in into[name]:
                    for piece in per_layer:
                        _read_exactly(f, piece, h, path)
            _read_exactly(f, ids, h, path)
    except OSError as e:
        raise PromptCacheError(f"{path}: cannot read ({e.strerror or e})") from None
    if h.hexdigest() != checked.checksum:
        raise PromptCacheError(f"{path}: its data does not match its checksum (the file is corrupt or was changed)")
    ids = ids.tolist()
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise PromptCacheError(f"{path}: token id {max(ids) if max(ids) >= vocab_size else min(ids)} is outside "
                               f"the vocabulary (0..{vocab_size - 1})")
    return ids


def _read_exactly(f, dest: torch.Tensor, h, path: Path) -> None:
    """dest's bytes from f (straight into a contiguous CPU tensor, else through a copy), hashed."""
    direct = dest.device.type == "cpu" and dest.is_contiguous()
    target = dest if direct else torch.empty(dest.shape, dtype=dest.dtype)
    raw = target.reshape(-1).view(torch.uint8).numpy()
    if f.readinto(raw) != raw.size:
        raise PromptCacheError(f"{path}: truncated while reading")
    h.update(raw)
    if not direct:
        dest.copy_(target)


def _elem(entry: dict) -> int:
    return torch.empty((), dtype=_TORCH[entry["dtype"]]).element_size()


# -- an engine's session cache ↔ a file ---------------------------------------------------
def _new_cache(engine, capacity: int):
    """A one-row cache as the engine makes its session cache (same dtype, kv-dtype, heads)."""
    from twice.core.cache import KVCache

    extra = {"kv_dtype": engine.kv_dtype} if getattr(engine, "kv_dtype", None) is not None else {}
    return KVCache(engine.config, 1, capacity, engine.dtype, engine.device, kv_heads=engine.model.kv_heads, **extra)


def load_into(engine, path: Path) -> int:
    """Make the prompt cache at `path` the engine's session cache (its next `generate`
    prefills only what follows the stored tokens); returns the tokens loaded. Any mismatch
    is PromptCacheError and leaves the engine as it was."""
    from twice.core import prompt_cache as pc

    probe = _new_cache(engine, 1)
    expected = pc.describe(engine.model, probe, engine.tokenizer)
    checked = check(path, expected, pc.layout(probe), engine.context_length)
    cache = _new_cache(engine, engine._capacity(checked.tokens))
    ids = fill(checked, pc.destinations(cache, checked.tokens), engine.config.vocab_size)
    pc.restored(cache, checked.tokens)
    engine.reset()
    engine.cache, engine.cached_ids = cache, ids
    return len(ids)


def save_from(engine, path: Path, tokens: int | None = None) -> int:
    """Write the engine's session cache (its first `tokens` cached tokens; all by default)
    to `path` atomically; returns the tokens written. Nothing cached: PromptCacheError."""
    from twice.core import prompt_cache as pc

    cache = engine.cache
    held = min(len(engine.cached_ids), cache.length) if cache is not None else 0
    n = held if tokens is None else min(tokens, held)
    if n < 1:
        raise PromptCacheError(f"{path}: nothing to save (the KV cache is empty)")
    write(path, pc.snapshot(cache, n), engine.cached_ids[:n], pc.describe(engine.model, cache, engine.tokenizer))
    return n
