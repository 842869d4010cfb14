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
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from twice.core.config import ModelConfig
from twice.core.errors import ConfigError, TwiceError, WeightsError
from twice.core.model import CausalLM, Source, Target

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
MAX_HEADER_BYTES = 100_000_000
# A config may imply a few more parameters than the files hold (the shape check then names
# the tensor); past this it describes a different, far larger model, and building it would
# try to allocate that much memory before any tensor is read.
SIZE_SLACK_FACTOR, SIZE_SLACK_PARAMS = 2, 2**24


def checkpoint_files(folder: Path, config: ModelConfig | None = None) -> list[Path]:
    """The safetensors files of a model folder, in index order; clear errors otherwise.

    Each file's header is checked (a truncated or corrupt file fails here, before any
    memory is allocated), and so is the config (`config`, else the folder's config.json
    when it can be read) against the files: a config.json whose sizes imply far more
    parameters than the files hold is refused instead of building that model."""
    files = _list_files(folder)
    stored = 0
    for path in files:
        for name, info in validate_header(path).items():
            if name != "__metadata__" and not name.endswith(_IGNORED_SUFFIXES):
                stored += math.prod(info["shape"])
    if config is None and (folder / "config.json").is_file():
        try:
            from .files import read_config

            config = read_config(folder)
        except TwiceError:  # reported by whoever reads the config for real
            config = None
    if config is not None:
        implied = config.parameter_count()
        if implied > SIZE_SLACK_FACTOR * stored + SIZE_SLACK_PARAMS:
            raise ConfigError(
                f"{folder / 'config.json'}: describes a model of {implied:,} parameters but the checkpoint holds "
                f"{stored:,} values; check its sizes (vocab_size, hidden_size, intermediate_size, "
                "num_hidden_layers, num_attention_heads, ...)"
            )
    return files


def _list_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError
            names = list(dict.fromkeys(weight_map.values()))
        except OSError as e:
            raise WeightsError(f"{index}: cannot read ({e.strerror or e})") from None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
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
    """Check a safetensors header against the file size before any tensor is read, so a
    truncated or corrupt file is reported as such (and names the file). Every entry must
    have a known dtype, a shape of non-negative integers and integer data offsets that
    match the shape and lie inside the file; a name may appear only once."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise WeightsError(f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})")
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) != n:
        raise WeightsError(f"{path}: truncated safetensors file (the header claims {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        if not isinstance(header, dict):
            raise ValueError
    except _DuplicateName as e:
        raise WeightsError(f"{path}: corrupt safetensors header (the name {e.args[0]!r} appears twice)") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise WeightsError(f"{path}: corrupt safetensors header (not a JSON object)") from None
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
                raise ValueError
            start, end = offsets
            count = 1
            for dim in shape:
                if not _is_int(dim) or dim < 0:
                    raise ValueError
                count *= dim
            if not (isinstance(dtype, str) and dtype in _DTYPES) or not (_is_int(start) and _is_int(end)):
                raise ValueError
            if not (0 <= start <= end) or end - start != count * _DTYPES[dtype]:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise WeightsError(f"{path}: corrupt safetensors entry for tensor {name!r}") from None
        if end > data_size:
            raise WeightsError(
                f"{path}: truncated: tensor {name!r} ends at byte {end} of the data but the file holds {data_size}"
            )
    return header


class _DuplicateName(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateName(key)
        out[key] = value
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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

    def read(self, name: str, source: Source | None = None, scratch: Scratch | None = None) -> torch.Tensor:
        """The tensor as stored, in a fresh buffer (or in `scratch`'s, valid until its next
        use); only the `source` slice of it (rows or columns) when a tensor-parallel rank
        needs just that part."""
        info = self.header[name]
        dtype = _TORCH_FLOATS[info["dtype"]]
        shape = list(info["shape"])
        start, end = info["data_offsets"]
        if source is None:
            return self._read_span(name, start, end - start, shape, dtype, scratch)
        row_bytes = (end - start) // shape[0] if shape and shape[0] else 0
        if source.dim == 0:  # whole rows: one contiguous span
            shape[0] = source.stop - source.start
            return self._read_span(name, start + source.start * row_bytes, shape[0] * row_bytes, shape, dtype, scratch)
        # Columns [a, b) of a 2-D tensor: a strided read, one span per row, of exactly those bytes.
        element = row_bytes // shape[1] if shape[1] else 0
        width = (source.stop - source.start) * element
        out = bytearray(shape[0] * width)
        view = memoryview(out)
        try:
            with open(self.path, "rb") as f:
                for r in range(shape[0]):
                    f.seek(self.data_start + start + r * row_bytes + source.start * element)
                    if f.readinto(view[r * width : (r + 1) * width]) != width:
                        raise WeightsError(f"{self.path}: truncated while reading tensor {name!r}")
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot read tensor {name!r} ({e.strerror or e})") from None
        shape[1] = source.stop - source.start
        return torch.frombuffer(out, dtype=dtype).reshape(shape) if out else torch.empty(shape, dtype=dtype)

    def _read_span(self, name: str, offset: int, length: int, shape: list[int], dtype: torch.dtype,
                   scratch: Scratch | None) -> torch.Tensor:
        buf = scratch.take(length) if scratch is not None else bytearray(length)
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + offset)
                got = f.readinto(memoryview(buf)[:length])
        except OSError as e:
            raise WeightsError(f"{self.path}: cannot read tensor {name!r} ({e.strerror or e})") from None
        if got != length:
            raise WeightsError(f"{self.path}: truncated while reading tensor {name!r}")
        if not length:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype, count=length // dtype.itemsize).reshape(shape)


class Scratch:
    """One read buffer for every tensor of a load: a fresh one per tensor is zero-filled
    and faulted in each time, which cost as much as the reads themselves."""

    def __init__(self):
        self.buffer = bytearray()

    def take(self, length: int) -> bytearray:
        if len(self.buffer) < length:
            self.buffer = bytearray(length)  # a new one: tensors may still view the old
        return self.buffer


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`. A float32 sum is finite only if every element is
    (NaN and inf propagate), and costs a twentieth of isfinite(); only a sum that is not
    (an overflow, or a real NaN/inf) pays for the element-wise check."""
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32))) or bool(torch.isfinite(tensor).all())


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


def load_into(model: CausalLM, folder: Path, files: list[Path] | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint in `folder` (whose `files`
    checkpoint_files() has already listed and checked, if given)."""
    files = files if files is not None else checkpoint_files(folder)
    targets = model.targets()
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[tuple[str, int]] = set()
    unexpected: list[str] = []
    scratch = Scratch()
    with torch.inference_mode():
        for name, tf in iter_tensors(files):
            target = targets.get(name)
            if target is None:
                if not name.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            _copy(tf, name, target, params[target.param], scratch)
            filled.add(target.key)
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else "")
        raise WeightsError(f"{folder}: tensors not used by a {model.config.model_type} model: {shown}")
    missing = sorted({n for n, t in targets.items() if t.key not in filled and not n.startswith("transformer.")})
    if missing:
        shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        raise WeightsError(f"{folder}: checkpoint is missing tensors: {shown}")


def _copy(tf: TensorFile, name: str, target: Target, param: torch.Tensor, scratch: Scratch) -> None:
    dest = param if target.rows is None else param[target.row : target.row + target.rows]
    expected = list(dest.shape[::-1]) if target.transpose else list(dest.shape)
    if target.source is not None:  # this rank keeps a slice: the file holds the whole tensor
        expected[target.source.dim] = target.source.total
    shape = tf.shape(name)
    if shape != tuple(expected):
        raise WeightsError(f"{tf.path}: tensor {name!r} has shape {list(shape)}, the config implies {expected}")
    tensor = tf.read(name, target.source, scratch)
    if not all_finite(tensor):
        raise WeightsError(f"{tf.path}: tensor {name!r} contains NaN or infinite values")
    dest.copy_(tensor.t() if target.transpose else tensor)
