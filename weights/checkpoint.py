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
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from twice.core.config import ModelConfig
from twice.core.errors import ConfigError, TwiceError, WeightsError
from twice.core.fields import DuplicateKeyError, loads, unique_keys
from twice.core.model import CausalLM, Source, Target

from .files import MAX_JSON_BYTES, open_regular, read_limited

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
    # exists(), not is_file(): a FIFO or device in a checkpoint's place is refused by
    # open_regular (never opened blocking), rather than silently skipped.
    index = folder / INDEX_NAME
    if index.exists():
        try:
            data = loads(read_limited(index, MAX_JSON_BYTES, WeightsError))  # bounded: depth, numbers, size
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
            if not path.exists():
                raise WeightsError(f"{index}: names shard {name} which is missing from {folder}")
            files.append(path)
        return files
    single = folder / SINGLE_NAME
    if single.exists():
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
    """The header of a safetensors file, checked against the file before any tensor is read."""
    return _read_header(path)[0]


def _read_header(path: Path) -> tuple[dict, int]:
    """(header, where the data starts), checked as the safetensors library checks a file
    (safetensors/src/tensor.rs: read_metadata and Metadata::validate), so that a truncated or
    corrupt file is reported as such, naming the file: every entry has a known dtype, a shape
    of non-negative integers and integer data offsets that match the shape; a name appears
    only once; `__metadata__` maps names to strings; and the tensors, sorted by offset, tile
    the data section exactly: the first starts at 0, each starts where the one before ended
    (no overlaps, no gaps) and the last ends at the end of the file."""
    try:
        with open_regular(path, WeightsError) as f:
            size = os.fstat(f.fileno()).st_size
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
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
        if not isinstance(header, dict):
            raise ValueError
    except DuplicateKeyError as e:
        raise WeightsError(f"{path}: corrupt safetensors header (the name {e.key!r} appears twice)") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise WeightsError(f"{path}: corrupt safetensors header (not a JSON object)") from None
    data_size = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise WeightsError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings)")
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
        spans.append((start, end, name))
    _check_tiling(path, sorted(spans), data_size)
    return header, 8 + n


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """The tensors' byte ranges, sorted by start, must cover the data section exactly once."""
    expected, previous = 0, None
    for start, end, name in spans:
        if start < expected:
            raise WeightsError(f"{path}: corrupt safetensors file: tensor {name!r} (bytes {start}-{end} of the data) "
                               f"overlaps tensor {previous[2]!r} (bytes {previous[0]}-{previous[1]})")
        if start > expected:
            raise WeightsError(f"{path}: corrupt safetensors file: bytes {expected}-{start} of the data, before "
                               f"tensor {name!r}, belong to no tensor")
        expected, previous = end, (start, end, name)
    if expected != data_size:
        raise WeightsError(f"{path}: corrupt safetensors file: its last {data_size - expected} bytes belong to no "
                           f"tensor (the tensors end at byte {expected} of the {data_size} bytes of data)")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TensorFile:
    """One validated safetensors file, read tensor by tensor."""

    def __init__(self, path: Path):
        self.path = path
        self.header, self.data_start = _read_header(path)
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
            with open_regular(self.path, WeightsError) as f:
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
            with open_regular(self.path, WeightsError) as f:
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
                raise WeightsError(f"{path}: tensor {name!r} has dtype {tf.header[name]['dtype']}, expected one of {', '.join(_TORCH_FLOATS)}")
            yield name, tf


def load_into(model: CausalLM, folder: Path, files: list[Path] | None = None, check_only: bool = False) -> None:
    """Fill every parameter of `model` from the checkpoint in `folder` (whose `files`
    checkpoint_files() has already listed and checked, if given). `check_only`: read no
    data, only check the headers' names and shapes against the model (`twice info`, on a
    model built on the meta device)."""
    files = files if files is not None else checkpoint_files(folder)
    targets = model.placements()
    params = dict(model.named_parameters(remove_duplicate=False))
    # Weights held as blocks (--quantize): a meta stand-in for the shape checks; store_rows quantizes.
    modules = dict(model.named_modules())
    blocks = {f"{name}.weight": m for name, m in modules.items() if hasattr(m, "store_rows")}
    for name, m in blocks.items():
        params[name] = torch.empty(m.weight.shape, device="meta")
    filled: dict[tuple[str, int], tuple[str, TensorFile]] = {}  # what filled each place, and from where
    unexpected: list[str] = []
    scratch = Scratch()
    with torch.inference_mode():
        for name, tf in iter_tensors(files):
            places = targets.get(name)
            if places is None:
                if not name.endswith(_IGNORED_SUFFIXES) and not name.startswith(model.unused_prefixes):
                    unexpected.append(name)
                continue
            for target in places:
                if check_only:
                    _check_shape(tf, name, target, params[target.param])
                    filled.setdefault(target.key, (name, tf))
                    continue
                if target.key in filled:  # a second tensor for the same place: it must say the same
                    _check_same(model, filled[target.key], (name, tf), target, params[target.param], scratch)
                    continue
                if target.param in blocks:
                    tensor = _checked_read(tf, name, target, params[target.param], scratch)
                    if not all_finite(tensor):
                        raise WeightsError(f"{tf.path}: tensor {name!r} contains NaN or infinite values")
                    blocks[target.param].store_rows(target.row, tensor.t() if target.transpose else tensor)
                else:
                    _copy(tf, name, target, params[target.param], scratch)
                filled[target.key] = (name, tf)
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else "")
        raise WeightsError(f"{folder}: tensors not used by a {model.config.model_type} model: {shown}")
    spans: dict[str, list[tuple[int, int]]] = {}  # rows filled per parameter
    for name, places in targets.items():
        for t in places:
            if t.key in filled and filled[t.key][0] == name:
                spans.setdefault(t.param, []).append((t.row, t.row + (t.rows if t.rows is not None else 1)))
    missing = sorted({n for n, places in targets.items() for t in places
                      if t.key not in filled and not n.startswith("transformer.")
                      and not _covered(spans.get(t.param, ()), t.row, t.row + (t.rows or 1))})
    if missing:
        shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
        raise WeightsError(f"{folder}: checkpoint is missing tensors: {shown}")


def _covered(spans, start: int, stop: int) -> bool:
    """Rows [start, stop) lie inside the union of the filled `spans` (one stacked tensor
    fills the rows of every per-expert target, and the other way round)."""
    for lo, hi in sorted(spans):
        if lo > start:
            return False
        start = max(start, hi)
        if start >= stop:
            return True
    return False


def _check_same(model: CausalLM, first: tuple[str, TensorFile], second: tuple[str, TensorFile], target: Target,
                param: torch.Tensor, scratch: Scratch) -> None:
    """Two checkpoint tensors map to one parameter (a tied head stored under both names,
    GPT-2's names with and without `transformer.`): they are accepted only when they hold the
    same values, so that the result can never depend on which one the header lists first.
    (transformers 5 warns and unties the head when they differ; twice refuses instead, since
    the config then does not describe the checkpoint.)"""
    (name_a, tf_a), (name_b, tf_b) = first, second
    b = _checked_read(tf_b, name_b, target, param, scratch)
    a = tf_a.read(name_a, target.source)  # a fresh buffer: the scratch one holds b
    if a.dtype != b.dtype:
        common = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    if torch.equal(a, b):
        return
    where = f"{tf_a.path}: tensors" if tf_a.path == tf_b.path else f"{tf_a.path.parent}: tensors"
    names = (f"{name_a!r} and {name_b!r}" if tf_a.path == tf_b.path
             else f"{name_a!r} (in {tf_a.path.name}) and {name_b!r} (in {tf_b.path.name})")
    tied = model.config.tie_word_embeddings and "lm_head.weight" in (name_a, name_b)
    why = ("config.json ties the output head to the embeddings (tie_word_embeddings), so the checkpoint should "
           "hold one of them, or the same values in both; if its head is its own, set tie_word_embeddings to false"
           if tied else "remove one of them")
    raise WeightsError(f"{where} {names} both fill {target.param} but hold different values; {why}")


def _check_shape(tf: TensorFile, name: str, target: Target, param: torch.Tensor) -> torch.Tensor:
    """The part of `param` that tensor `name` fills, after checking the tensor's shape (in
    its file's header) against it."""
    dest = param if target.rows is None else param[target.row : target.row + target.rows]
    expected = target.checkpoint_shape(tuple(param.shape))
    shape = tf.shape(name)
    if shape != expected:
        raise WeightsError(f"{tf.path}: tensor {name!r} has shape {list(shape)}, the config implies {list(expected)}")
    return dest


def _checked_read(tf: TensorFile, name: str, target: Target, param: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """The tensor `name` as stored (this rank's slice of it), after checking its shape
    against the place it fills."""
    dest = _check_shape(tf, name, target, param)
    tensor = tf.read(name, target.source, scratch)
    return tensor.reshape(dest.shape) if target.stored_shape is not None else tensor


def _copy(tf: TensorFile, name: str, target: Target, param: torch.Tensor, scratch: Scratch) -> None:
    dest = param if target.rows is None else param[target.row : target.row + target.rows]
    tensor = _checked_read(tf, name, target, param, scratch)
    if not all_finite(tensor):
        raise WeightsError(f"{tf.path}: tensor {name!r} contains NaN or infinite values")
    dest.copy_(tensor.t() if target.transpose else tensor)
