"""Read safetensors checkpoints (one file or sharded) straight into a model's parameters.

Each tensor is read from the memory-mapped file, cast and copied into its place, and
dropped before the next one is read: peak memory is the model plus its largest tensor,
never a second full-precision copy. Pickle checkpoints are refused, never unpickled.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from twice.core.errors import WeightsError
from twice.core.model import CausalLM, Target

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")

# Buffers some checkpoints carry that are recomputed here, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")

_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, in index order; clear errors otherwise."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError
            names = list(dict.fromkeys(weight_map.values()))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise WeightsError(f"{index}: not a valid safetensors index (expected a non-empty weight_map)") from None
        files = []
        for name in names:
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise WeightsError(f"{index}: invalid shard name {name!r}")
            path = folder / name
            if not path.is_file():
                raise WeightsError(f"{index}: names shard {name} which is missing from {folder}")
            files.append(path)
        return files
    single = folder / SINGLE_NAME
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    pickles = [name for name in PICKLE_NAMES if (folder / name).exists()]
    if pickles:
        raise WeightsError(
            f"{folder / pickles[0]}: pickle checkpoints are refused because unpickling can run arbitrary code; "
            "convert it to safetensors first (e.g. transformers' save_pretrained(..., safe_serialization=True))"
        )
    raise WeightsError(f"{folder}: no model.safetensors or {INDEX_NAME} found")


def validate_header(path: Path) -> dict:
    """Check a safetensors header against the file size before the library maps it, so a
    truncated or corrupt file is reported as such (and names the file)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise WeightsError(f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})")
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise WeightsError(f"{path}: corrupt safetensors header (not a JSON object)") from None
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            count = 1
            for dim in shape:
                if not isinstance(dim, int) or dim < 0:
                    raise ValueError
                count *= dim
            if dtype not in _DTYPES or not (0 <= start <= end) or end - start != count * _DTYPES[dtype]:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: corrupt safetensors entry for tensor {name!r}") from None
        if end > data_size:
            raise WeightsError(
                f"{path}: truncated: tensor {name!r} ends at byte {end} of the data but the file holds {data_size}"
            )
    return header


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Path, object]]:
    """(name, file, reader) for every tensor, refusing names that appear twice."""
    seen: dict[str, Path] = {}
    for path in files:
        header = validate_header(path)
        try:
            reader = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise WeightsError(f"{path}: cannot open safetensors file ({e})") from None
        with reader:
            for name in header:
                if name == "__metadata__":
                    continue
                if name in seen:
                    raise WeightsError(f"{path}: tensor {name!r} is also in {seen[name]}")
                seen[name] = path
                if header[name]["dtype"] not in _FLOAT_DTYPES and not name.endswith(_IGNORED_SUFFIXES):
                    raise WeightsError(f"{path}: tensor {name!r} has dtype {header[name]['dtype']}, expected a float type")
                yield name, path, reader


def load_into(model: CausalLM, folder: Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `folder`."""
    files = checkpoint_files(folder)
    targets = model.targets()
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[tuple[str, int]] = set()
    unexpected: list[str] = []
    with torch.inference_mode():
        for name, path, reader in iter_tensors(files):
            target = targets.get(name)
            if target is None:
                if not name.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            _copy(reader, name, path, target, params[target.param])
            filled.add(target.key)
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else "")
        raise WeightsError(f"{folder}: tensors not used by a {model.config.model_type} model: {shown}")
    missing = sorted({n for n, t in targets.items() if t.key not in filled and not n.startswith("transformer.")})
    if missing:
        shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        raise WeightsError(f"{folder}: checkpoint is missing tensors: {shown}")


def _copy(reader, name: str, path: Path, target: Target, param: torch.Tensor) -> None:
    dest = param if target.rows is None else param[target.row : target.row + target.rows]
    expected = tuple(dest.shape[::-1]) if target.transpose else tuple(dest.shape)
    shape = tuple(reader.get_slice(name).get_shape())
    if shape != expected:
        raise WeightsError(f"{path}: tensor {name!r} has shape {list(shape)}, the config implies {list(expected)}")
    tensor = reader.get_tensor(name)
    if not torch.isfinite(tensor).all():
        raise WeightsError(f"{path}: tensor {name!r} contains NaN or infinite values")
    dest.copy_(tensor.t() if target.transpose else tensor)
