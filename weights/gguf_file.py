"""Reading a GGUF file's header: its metadata, its tensor table and where each tensor's data
lies, with every count and size checked against the file before anything is built from it.

The layout rules are llama.cpp's own (ggml/src/gguf.cpp, gguf_init_from_file_impl, and the
bounds check of llama-model-loader), so a file is accepted here exactly when llama.cpp would
load it:

* magic `GGUF`, version 2 or 3; tensor and key counts that the file's bytes can hold;
* metadata keys unique; value types known; no arrays of arrays;
* `general.alignment` (default 32) a 32-bit unsigned power of two;
* tensor names unique and shorter than 64 bytes; at most 4 dimensions, none negative, an
  element count that fits in 63 bits; a known tensor type whose block divides each row;
* tensors laid out in table order, each starting exactly where the one before ended
  (rounded up to the alignment): none misaligned, none overlapping another, no gaps; and
  each tensor's bytes inside the file.

Counts come before arrays: an array's length is checked against `MAX_ARRAY_LENGTH` and
against the bytes left in the file before a single element is read, and numeric arrays are
read in one piece, so metadata costs at most a small multiple of its bytes in memory (the
`gguf` package's GGUFReader holds a numpy array for every element: 1.6 GB for a 2-million-
element array in an 8 MB file). Tensor data is never read here: `GGUFTensor.data` is a
read-only view of the memory-mapped file.

Files written for the other byte order (GGUFWriter can make them) are read as GGUFReader
reads them.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from twice.core.errors import UnsupportedModelError, WeightsError

from .files import open_regular

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64, with the terminating NUL
# The longest metadata array twice reads. Real vocabularies are at most a few hundred
# thousand tokens (and as many merges); an array past this is refused before it is read.
MAX_ARRAY_LENGTH = 1 << 22
BIG_ARRAY = 4096  # read_gguf(big_arrays=False) skips longer metadata arrays (a vocabulary's)

# GGUF value types (gguf.GGUFValueType): struct format and numpy dtype of each scalar.
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
_BOOL, _UINT32 = 7, 4
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# Smallest encoding of a key/value pair (key length, type, one byte) and of a tensor-table
# entry (name length, n_dims, type, offset): counts past what the file can hold are refused.
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One entry of the tensor table. `shape` is GGUF's order (innermost dimension first,
    as gguf.ReaderTensor has it); `data` is what gguf.quants.dequantize takes: the elements
    for float and integer types, else the raw blocks as uint8 rows."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    _buffer: Any
    _order: str

    @property
    def swapped(self) -> bool:
        """Whether the file's numbers are big-endian (F32/F16 values; block bytes never are)."""
        return self._order == ">"

    @property
    def data(self) -> np.ndarray:
        import gguf

        q = gguf.GGMLQuantizationType
        np_dims = tuple(reversed(self.shape))
        plain = {q.F16: np.float16, q.F32: np.float32, q.F64: np.float64, q.I8: np.int8, q.I16: np.int16,
                 q.I32: np.int32, q.I64: np.int64}
        if self.tensor_type in plain:
            dtype = np.dtype(plain[self.tensor_type]).newbyteorder(self._order)
            count = self.n_elements
        else:
            dtype, count = np.dtype(np.uint8), self.n_bytes
            np_dims = gguf.quants.quant_shape_to_byte_shape(np_dims, self.tensor_type) if np_dims else (count,)
        return np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self.data_offset).reshape(np_dims)


@dataclass(frozen=True)
class Skipped:
    """A metadata array read_gguf(..., big_arrays=False) walked past without making its values
    (a tokenizer's 150k tokens and merges: tens of MB of Python objects, for a caller that
    needs only the tensor table and the model's sizes): its length and item type."""

    count: int
    item: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True, eq=False)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int  # where the data section starts


class _Corrupt(Exception):
    pass


class _Reader:
    """A cursor over the file's bytes; every read checks that the bytes are there."""

    def __init__(self, buffer, order: str):
        self.buffer, self.pos, self.size, self.order = buffer, 0, len(buffer), order
        self._structs: dict[str, struct.Struct] = {}

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _Corrupt(f"{what} runs past the end of the file")

    def _struct(self, fmt: str) -> struct.Struct:
        return self._structs.get(fmt) or self._structs.setdefault(fmt, struct.Struct(self.order + fmt))

    def scalar(self, fmt: str, what: str):
        s = self._struct(fmt)
        self.need(s.size, what)
        (value,) = s.unpack_from(self.buffer, self.pos)
        self.pos += s.size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = self.buffer[self.pos : self.pos + n]  # bytes: mmap slices are copies
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} is not valid UTF-8") from None

    def strings(self, count: int, what: str) -> list[str]:
        unpack, buffer, out = self._struct("Q").unpack_from, self.buffer, []
        pos, size = self.pos, self.size
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise _Corrupt(f"{what} runs past the end of the file")
                (n,) = unpack(buffer, pos)
                pos += 8
                if n > size - pos:
                    raise _Corrupt(f"{what} runs past the end of the file")
                out.append(buffer[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} holds a string that is not valid UTF-8") from None
        self.pos = pos
        return out

    def skip_strings(self, count: int, what: str) -> None:
        """strings() without making them: each length checked against the file, no text kept."""
        unpack = self._struct("Q").unpack_from
        buffer, pos, size = self.buffer, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                raise _Corrupt(f"{what} runs past the end of the file")
            pos += 8 + unpack(buffer, pos)[0]
            if pos > size:
                raise _Corrupt(f"{what} runs past the end of the file")
        self.pos = pos

    def numbers(self, item: int, count: int, what: str) -> list:
        fmt = _SCALARS[item]
        dtype = np.dtype(self.order + fmt)
        self.need(count * dtype.itemsize, what)
        values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return (values != 0).tolist() if item == _BOOL else values.tolist()


def read_gguf(src: Path, big_arrays: bool = True) -> GGUFFile:
    """The header of the GGUF file `src`, checked as llama.cpp checks it (module docstring).
    Raises WeightsError naming the file (UnsupportedModelError for a tensor type the gguf
    package does not know). `big_arrays=False`: metadata arrays of more than BIG_ARRAY
    values are Skipped (walked and bounds-checked, not made). The header's pages are
    given back once it is read (the mapping stays for the tensors' data)."""
    with open_regular(src, WeightsError) as f:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise WeightsError(f"{src}: not a GGUF file (it does not start with the GGUF magic bytes)")
        try:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise WeightsError(f"{src}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    try:
        return _parse(src, buffer, size, big_arrays)
    except _Corrupt as e:
        raise WeightsError(f"{src}: truncated or corrupt GGUF file ({e})") from None


def _parse(src: Path, buffer, size: int, big_arrays: bool = True) -> GGUFFile:
    import gguf

    (version,) = struct.unpack_from("<I", buffer, 4) if size >= 8 else (None,)
    if version is None:
        raise _Corrupt("the header runs past the end of the file")
    order = "<"
    if version & 0xFFFF == 0:  # written for the other byte order (llama.cpp's own test)
        order = ">"
        (version,) = struct.unpack_from(">I", buffer, 4)
    if version not in SUPPORTED_VERSIONS:
        raise _Corrupt(f"GGUF version {version}; supported: {', '.join(map(str, SUPPORTED_VERSIONS))}")
    r = _Reader(buffer, order)
    r.pos = 8
    n_tensors = r.scalar("Q", "the header")
    n_kv = r.scalar("Q", "the header")
    if n_kv * _MIN_KV_BYTES > r.left():
        raise _Corrupt(f"it claims {n_kv:,} metadata keys, more than its {size:,} bytes can hold")
    if n_tensors * _MIN_TENSOR_BYTES > r.left():
        raise _Corrupt(f"it claims {n_tensors:,} tensors, more than its {size:,} bytes can hold")

    metadata: dict[str, Any] = {}
    types: dict[str, int] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        if key in metadata:
            raise _Corrupt(f"metadata key {key!r} appears twice")
        kind = r.scalar("I", f"metadata {key}")
        if kind == _ARRAY:
            item = r.scalar("I", f"metadata {key}")
            count = r.scalar("Q", f"metadata {key}")
            if item == _ARRAY or (item != _STRING and item not in _SCALARS):
                raise _Corrupt(f"metadata {key} is an array of {_type_name(item)}")
            if count > MAX_ARRAY_LENGTH:
                raise WeightsError(f"{src}: metadata {key} holds {count:,} values, more than the "
                                   f"{MAX_ARRAY_LENGTH:,} twice reads in one array")
            if item == _STRING:
                r.need(count * 8, f"metadata {key}")  # each string is at least its 8-byte length
                if big_arrays or count <= BIG_ARRAY:
                    value = r.strings(count, f"metadata {key}")
                else:
                    r.skip_strings(count, f"metadata {key}")
                    value = Skipped(count, item)
            elif big_arrays or count <= BIG_ARRAY:
                value = r.numbers(item, count, f"metadata {key}")
            else:
                size_of = count * np.dtype(_SCALARS[item]).itemsize
                r.need(size_of, f"metadata {key}")
                r.pos += size_of
                value = Skipped(count, item)
        elif kind == _STRING:
            value = r.string(f"metadata {key}")
        elif kind in _SCALARS:
            value = r.scalar(_SCALARS[kind], f"metadata {key}")
            if kind == _BOOL:
                value = value != 0
        else:
            raise _Corrupt(f"metadata {key} has unknown type {kind}")
        metadata[key] = value
        types[key] = kind

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and types["general.alignment"] != _UINT32:
        raise _Corrupt(f"general.alignment must be a uint32, not a {_type_name(types['general.alignment'])}")
    if alignment == 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment {alignment} is not a power of two")

    entries = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"the name of tensor {i}")
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise _Corrupt(f"tensor name {name[:80]!r} is longer than {MAX_NAME_BYTES} bytes")
        if name in names:
            raise _Corrupt(f"tensor {name} appears twice")
        names.add(name)
        n_dims = r.scalar("I", f"tensor {name}")
        if n_dims > MAX_DIMS:
            raise _Corrupt(f"tensor {name} has {n_dims} dimensions, more than {MAX_DIMS}")
        dims = tuple(r.scalar("Q", f"tensor {name}") for _ in range(n_dims))
        if any(d >= 1 << 63 for d in dims):
            raise _Corrupt(f"tensor {name} has a negative dimension")
        n_elements = math.prod(dims)
        if n_elements >= (1 << 63) - 1:
            raise _Corrupt(f"tensor {name} has {n_elements:,} elements, more than 63 bits can count")
        raw_type = r.scalar("I", f"tensor {name}")
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise UnsupportedModelError(f"{src}: tensor {name} has tensor type {raw_type}, which the gguf package "
                                        "does not know") from None
        row = dims[0] if dims else 1
        if row % block:
            raise _Corrupt(f"tensor {name} has {row} values per row, not a multiple of the {block} of a "
                           f"{qtype.name} block")
        offset = r.scalar("Q", f"tensor {name}")
        entries.append((name, qtype, dims, n_elements, n_elements // block * type_size, offset))

    data_start = -(-r.pos // alignment) * alignment
    header_pages = min(size, data_start) // mmap.PAGESIZE * mmap.PAGESIZE
    if header_pages and hasattr(buffer, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        # The header's pages (a vocabulary's megabytes) stay mapped with the file: give them
        # back, as what they held is now Python values (the data's pages fault in as read).
        buffer.madvise(mmap.MADV_DONTNEED, 0, header_pages)
    for name, qtype, dims, n_elements, n_bytes, offset in entries:
        if offset % alignment:
            raise _Corrupt(f"tensor {name} starts at byte {offset:,} of the data section, which is not aligned to "
                           f"{alignment} bytes")
        end = data_start + offset + n_bytes
        if end > size:
            raise _Corrupt(f"tensor {name} ends at byte {end:,} but the file has {size:,}")
    # The tensors' bytes, in the order they lie in the file (a writer may lay them out in
    # another order than its table's), must follow one another with only the alignment's
    # padding between them: a type or shape that lies about a tensor's size shows as a gap
    # or an overlap beside it.
    expected, before = 0, None
    for name, qtype, dims, n_elements, n_bytes, offset in sorted(entries, key=lambda e: e[5]):
        if offset != expected:
            if before is None:
                problem = "leaving the section's first bytes unused"
            else:
                other = f"tensor {before[0]} ({before[1]}, {list(before[2])})"
                problem = (f"{offset - expected:,} bytes after {other} ends" if offset > expected
                           else f"inside {other}, which ends") + f" at byte {expected:,} by its type and shape"
            raise _Corrupt(f"tensor {name} starts at byte {offset:,} of the data section, {problem} (a tensor's "
                           "type or shape is wrong)")
        expected += -(-n_bytes // alignment) * alignment
        before = (name, qtype.name, dims)
    tensors = [GGUFTensor(name, qtype, dims, n_elements, n_bytes, data_start + offset, buffer, order)
               for name, qtype, dims, n_elements, n_bytes, offset in entries]
    return GGUFFile(src, version, metadata, tensors, alignment, data_start)


def _type_name(kind: int) -> str:
    return _TYPE_NAMES.get(kind, f"unknown type {kind}")
