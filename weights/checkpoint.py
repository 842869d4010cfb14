"""Read safetensors checkpoints (one file or sharded) straight into a model's parameters.

Each tensor is read with one plain read() into a buffer, cast and copied into its place,
and dropped before the next one is read: peak memory is the model plus its largest
tensor, never a second full-precision copy. (The format is an 8-byte header length, a
JSON header and raw little-endian data; reading it directly, rather than through the
safetensors library's memory map, keeps the file's pages out of the process's resident
memory, lets the header be validated against the file size first, and lets a tensor-
parallel rank read only its rows.) Pickle checkpoints are refused, never unpickled.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

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
_TORCH_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


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


class TensorFile:
    """One validated safetensors file, read tensor by tensor."""

    def __init__(self, path: Path):
        self.path = path
        self.header = validate_header(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        self.data_start = 8 + n
        self.names = [k for k in self.header if k != "__metadata__"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (or rows [a, b) of its first dimension) as stored, in a fresh buffer."""
        info = self.header[name]
        dtype = _TORCH_FLOATS[info["dtype"]]
        shape = list(info["shape"])
        start, end = info["data_offsets"]
        if rows is not None:
            row_bytes = (end - start) // shape[0] if shape and shape[0] else 0
            start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        buf = bytearray(end - start)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + start)
                got = f.readinto(buf)
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot read tensor {name!r} ({e.strerror or e})") from None
        if got != len(buf):
            raise WeightsError(f"{self.path}: truncated while reading tensor {name!r}")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, TensorFile]]:
    """(name, file) for every tensor, refusing names that appear twice and non-float data."""
    seen: dict[str, Path] = {}
    for path in files:
        tf = TensorFile(path)
        for name in tf.names:
            if name in seen:
                raise WeightsError(f"{path}: tensor {name!r} is also in {seen[name]}")
            seen[name] = path
            if tf.header[name]["dtype"] not in _TORCH_FLOATS and not name.endswith(_IGNORED_SUFFIXES):
                raise WeightsError(f"{path}: tensor {name!r} has dtype {tf.header[name]['dtype']}, expected a float type")
            yield name, tf


def load_into(model: CausalLM, folder: Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `folder`."""
    files = checkpoint_files(folder)
    targets = model.targets()
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[tuple[str, int]] = set()
    unexpected: list[str] = []
    with torch.inference_mode():
        for name, tf in iter_tensors(files):
            target = targets.get(name)
            if target is None:
                if not name.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            _copy(tf, name, target, params[target.param])
            filled.add(target.key)
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else "")
        raise WeightsError(f"{folder}: tensors not used by a {model.config.model_type} model: {shown}")
    missing = sorted({n for n, t in targets.items() if t.key not in filled and not n.startswith("transformer.")})
    if missing:
        shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        raise WeightsError(f"{folder}: checkpoint is missing tensors: {shown}")


def _copy(tf: TensorFile, name: str, target: Target, param: torch.Tensor) -> None:
    dest = param if target.rows is None else param[target.row : target.row + target.rows]
    expected = tuple(dest.shape[::-1]) if target.transpose else tuple(dest.shape)
    shape = tf.shape(name)
    if shape != expected:
        raise WeightsError(f"{tf.path}: tensor {name!r} has shape {list(shape)}, the config implies {list(expected)}")
    tensor = tf.read(name)
    if not torch.isfinite(tensor).all():
        raise WeightsError(f"{tf.path}: tensor {name!r} contains NaN or infinite values")
    dest.copy_(tensor.t() if target.transpose else tensor)
