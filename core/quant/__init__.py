"""GGUF block codecs: reference dequantizers from raw block bytes to float32, and the
quantizers back (`quantize`: llama.cpp's reference quantizers bit for bit; mixes.py: which type
each tensor of a model gets in llama.cpp's mixtures).

Each type stores a row of values as whole blocks of ``block_size`` values in
``type_size`` bytes (all multi-byte fields little-endian; "d" is a per-block
fp16 scale, "m"/"dmin" an fp16 minimum/offset).  The layouts, as in llama.cpp's
ggml-common.h and ``dequantize_row_*`` in ggml-quants.c:

- Q8_0 (32 values, 34 bytes): fp16 d, 32 int8 quants; x = d*q.
- Q4_0 (32, 18): fp16 d, 16 bytes of 4-bit quants, low nibbles first (values 0..15 are the low nibbles, 16..31 the high ones); x = d*(q-8).
- Q4_1 (32, 20): fp16 d, fp16 m, 16 bytes of 4-bit quants, low nibbles first; x = d*q + m.
- Q5_0 (32, 22): fp16 d, 4 bytes qh (bit j = 5th bit of value j), 16 bytes of low nibbles as Q4_0; x = d*(q-16).
- Q5_1 (32, 24): fp16 d, fp16 m, 4 bytes qh, 16 bytes of low nibbles; x = d*q + m.
- Q2_K (256, 84): 16 bytes of scales (low nibble: scale, high nibble: min, one per 16 values), 64 bytes of 2-bit quants (each 32-byte half holds 128 values at shifts 0,2,4,6), fp16 d, fp16 dmin; x = d*sc*q - dmin*mn.
- Q3_K (256, 110): 32 bytes hmask (3rd bit, inverted: bit clear = subtract 4), 64 bytes of 2-bit quants as Q2_K, 12 bytes of 6-bit scales (16 of them, offset by 32), fp16 d; x = d*(sc-32)*q.
- Q4_K (256, 144): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (8 of each, one per 32 values), 128 bytes of 4-bit quants (each 32-byte run: low nibbles = 32 values, high nibbles = the next 32); x = d*sc*q - dmin*mn.
- Q5_K (256, 176): fp16 d, fp16 dmin, 12 bytes of scales/mins as Q4_K, 32 bytes qh (bit i of byte l = 5th bit of value 32*i+l), 128 bytes of low nibbles as Q4_K; x = d*sc*q - dmin*mn.
- Q6_K (256, 210): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16 values), fp16 d; x = d*sc*(q-32).

The arithmetic follows the order of operations of the ``gguf`` package's
numpy dequantizers (float32 throughout, no fused multiply-add), so results are
equal to theirs bit for bit.  Pure torch; nothing here prints.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch

from . import floats, kquants, legacy
from .kquants import QK_K


class Codec(NamedTuple):
    name: str
    ggml_type: int  # the type id in GGUF files (ggml_type)
    block_size: int  # values per block
    type_size: int  # bytes per block
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]  # (n, type_size) uint8 -> (n, block_size) float32
    quantize_blocks: Callable[[torch.Tensor], torch.Tensor] | None = None  # (n, block_size) float32 -> (n, type_size) uint8
    # 1: rows as stored; 8: the interleaved 8-row layout of the native kernels (interleave.py),
    # whose ggml_type is the type's + interleave.X8 (in memory only, never in a file)
    rows_per_group: int = 1

    @property
    def quantized(self) -> bool:
        """False for the plain float types (F32, F16, BF16)."""
        return self.block_size > 1

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of `n` values; ValueError where `n` is not whole blocks."""
        if n % self.block_size:
            raise ValueError(f"a row of {n} values is not a whole number of {self.name} blocks of {self.block_size}")
        return n // self.block_size * self.type_size


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        Codec("F32", 0, 1, 4, floats.dequantize_f32, floats.quantize_f32),
        Codec("F16", 1, 1, 2, floats.dequantize_f16, floats.quantize_f16),
        Codec("BF16", 30, 1, 2, floats.dequantize_bf16, floats.quantize_bf16),
        Codec("Q4_0", 2, 32, 18, legacy.dequantize_q4_0, legacy.quantize_q4_0),
        Codec("Q4_1", 3, 32, 20, legacy.dequantize_q4_1, legacy.quantize_q4_1),
        Codec("Q5_0", 6, 32, 22, legacy.dequantize_q5_0, legacy.quantize_q5_0),
        Codec("Q5_1", 7, 32, 24, legacy.dequantize_q5_1, legacy.quantize_q5_1),
        Codec("Q8_0", 8, 32, 34, legacy.dequantize_q8_0, legacy.quantize_q8_0),
        Codec("Q2_K", 10, QK_K, 84, kquants.dequantize_q2_k, kquants.quantize_q2_k),
        Codec("Q3_K", 11, QK_K, 110, kquants.dequantize_q3_k, kquants.quantize_q3_k),
        Codec("Q4_K", 12, QK_K, 144, kquants.dequantize_q4_k, kquants.quantize_q4_k),
        Codec("Q5_K", 13, QK_K, 176, kquants.dequantize_q5_k, kquants.quantize_q5_k),
        Codec("Q6_K", 14, QK_K, 210, kquants.dequantize_q6_k, kquants.quantize_q6_k),
    )
}

BY_GGML_TYPE: dict[int, Codec] = {c.ggml_type: c for c in CODECS.values()}

# Where each block type keeps its fp16 fields (d; m or dmin): byte offsets within a block.
# A NaN or infinite one makes every value of its block NaN or infinite.
HALF_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
# The exponent bits of the float types (all set: NaN or infinite), by the integer view of a value.
_NOT_FINITE = {"F16": (torch.int16, 0x7C00), "BF16": (torch.int16, 0x7F80), "F32": (torch.int32, 0x7F800000)}


def all_finite(raw: torch.Tensor, type_name: str) -> bool:
    """Whether whole blocks of `type_name` (uint8 bytes, as stored) hold only finite numbers:
    a float type's values, a block type's fp16 scales and minima (llama.cpp's
    ggml_validate_row_data checks the same). Read in slices: no copy of a large tensor."""
    c = codec(type_name)
    flat = raw.reshape(-1)
    if not c.quantized:
        view, mask = _NOT_FINITE[c.name]
        values = flat.view(view)
        step = 1 << 22
        return not any(bool(((values[i:i + step] & mask) == mask).any()) for i in range(0, values.numel(), step))
    blocks = flat.reshape(-1, c.type_size)
    step = 1 << 20
    for off in HALF_FIELDS[c.name]:
        for i in range(0, blocks.shape[0], step):
            half = blocks[i:i + step, off:off + 2].contiguous().view(torch.int16)
            if bool(((half & 0x7C00) == 0x7C00).any()):
                return False
    return True


def codec(type_name: str) -> Codec:
    """The codec for a type name such as ``"Q4_K"`` (case-insensitive)."""
    c = CODECS.get(str(type_name).upper())
    if c is None:
        raise ValueError(f"unsupported quantization type {type_name!r} (known: {', '.join(CODECS)})")
    return c


def dequantize(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """Dequantize raw block bytes to float32.

    ``data`` is a uint8 tensor whose last dimension holds whole blocks of one
    row (rows may be stacked in leading dimensions); the result has the same
    leading shape and ``n_blocks * block_size`` values in its last dimension.
    """
    c = codec(type_name)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{c.name} data must be a uint8 tensor, got {got}")
    if data.dim() == 0:
        raise ValueError(f"{c.name} data must have at least one dimension")
    row_bytes = data.shape[-1]
    if row_bytes % c.type_size:
        raise ValueError(
            f"{c.name} row of {row_bytes} bytes is not a whole number of {c.type_size}-byte blocks"
        )
    lead = tuple(data.shape[:-1])
    n_blocks = row_bytes // c.type_size
    blocks = data.reshape(-1, c.type_size)
    out = c.dequantize_blocks(blocks)
    return out.reshape(*lead, n_blocks * c.block_size)


def quantize(x: torch.Tensor, type_name: str, *, native: bool = True) -> torch.Tensor:
    """Quantize float values to raw block bytes: the inverse direction of `dequantize`.

    ``x`` is a float tensor whose last dimension is one row of whole blocks (rows may be stacked
    in leading dimensions); it is converted to float32 first. The result is uint8 with the same
    leading shape and ``codec.row_bytes(n)`` bytes in its last dimension. The bytes are those of
    llama.cpp's reference quantizers (``quantize_row_*_ref``, no importance matrix): for
    F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 equal to ``gguf.quants.quantize``, for the K types to the C
    reference built without fused multiply-adds (see kquants). For all-zero blocks holding a
    -0.0 the sign of a zero d/m follows C where gguf's numpy differs (legacy.py).

    Where the native kernels are built (twice.core.kernels) the C port of the same quantizers
    (core/kernels/quantize.c, the same bytes, 10-100x faster) does the work; ``native=False``,
    or no C compiler, runs the torch quantizers here (the reference the tests hold the C to).

    ValueError (one line) for a row that is not whole blocks, a NaN or infinite value, or values
    too large for the type (an fp16 scale, or an F16 value, that would be infinite).
    """
    c = codec(type_name)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"values to quantize to {c.name} must be a float tensor, got {got}")
    if x.dim() == 0:
        raise ValueError(f"values to quantize to {c.name} must have at least one dimension")
    n = x.shape[-1]
    row_bytes = c.row_bytes(n)
    lead = tuple(x.shape[:-1])
    with _one_intra_op_thread() as threads:
        x = x.detach().to(device="cpu", dtype=torch.float32)
        blocks = x.reshape(-1, c.block_size)
        out = _quantize_native(c, blocks, threads) if native else None  # checks NaN/inf itself
        if out is None:
            if x.numel() and not bool(torch.isfinite(x).all()):
                raise ValueError(f"cannot quantize to {c.name}: the values include NaN or infinity")
            out = _quantize_parts(c, blocks, threads)
        if blocks.shape[0] and c.name != "F32":
            _check_finite_scales(out, c.name)
    return out.reshape(*lead, row_bytes)


def native_library():
    """The native kernels' library with q_quantize declared (core/kernels/quantize.c), or None
    where they did not build (no C compiler, TWICE_NATIVE_KERNELS=0) or lack it."""
    from .. import kernels

    return declare_native(kernels.library())


def declare_native(lib):
    """`lib` (a ctypes library built from core/kernels, or None) with q_quantize's signature
    declared; None where it has no q_quantize."""
    if lib is None or getattr(lib, "q_quantize", None) is None:
        return None
    if getattr(lib, "_twice_quantize", False):
        return lib
    import ctypes

    lib.q_quantize.restype = ctypes.c_int
    lib.q_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib._twice_quantize = True
    return lib


def _quantize_native(c: Codec, blocks: torch.Tensor, threads: int, lib=None) -> torch.Tensor | None:
    """c.quantize_blocks(blocks) by the C quantizer on up to `threads` threads (no more than the
    cores the load average leaves free; OpenMP hands out runs of blocks, so a busy core holds up
    only its own run); None where there is none (F32, no native kernels). ValueError (quantize's
    line) for a NaN or infinite value. `lib`: another build (the tests' portable one)."""
    if c.name == "F32":
        return None  # a view of the values: nothing to compute
    lib = declare_native(lib) if lib is not None else native_library()
    if lib is None:
        return None
    blocks = blocks.contiguous()
    out = torch.empty((blocks.shape[0], c.type_size), dtype=torch.uint8)
    if blocks.shape[0] == 0:
        return out
    workers = max(1, min(threads, _free_cores()))
    status = lib.q_quantize(c.ggml_type, blocks.data_ptr(), blocks.shape[0], out.data_ptr(), workers)
    if status == -2:  # it looks at every value first (one pass with the quantizing, not one more)
        raise ValueError(f"cannot quantize to {c.name}: the values include NaN or infinity")
    return out if status == 0 else None


# the least values a part of a tensor that quantize() hands to one worker thread holds
_MIN_PART_VALUES = 1 << 17
_MAX_PART_VALUES = 1 << 22
_THREADS_LOCK = threading.Lock()


def _free_cores() -> int:
    """Cores not busy by the 1-minute load average (all of them where it is unknown)."""
    cores = os.cpu_count() or 1
    try:
        return max(1, int(cores - os.getloadavg()[0] + 0.5))
    except (OSError, AttributeError):
        return cores


@contextlib.contextmanager
def _one_intra_op_thread():
    """torch's intra-op threads set to 1 while quantizing; yields the count it had (1 if another
    thread is quantizing at the same time, which then leaves the setting alone)."""
    if not _THREADS_LOCK.acquire(blocking=False):
        yield 1
        return
    threads = torch.get_num_threads()
    try:
        if threads != 1:
            torch.set_num_threads(1)
        yield threads
    finally:
        if threads != 1:
            torch.set_num_threads(threads)
        _THREADS_LOCK.release()


def _quantize_parts(c: Codec, blocks: torch.Tensor, threads: int) -> torch.Tensor:
    """c.quantize_blocks on up to `threads` Python threads (one part of the rows each; torch
    releases the GIL inside its kernels), no more than the cores the load average leaves free.

    The quantizers are long chains of small element-wise ops. torch's intra-op threads add a
    barrier to each (quantize() runs them single-threaded), and Python threads hand the GIL back
    and forth: on a machine with fewer free cores than threads both cost several times over
    (SmolLM2-135M's q4_k_m mixture on a 2-core host at load 7-11: 17-27 s single-threaded, 263 s
    with 2 intra-op threads, 116 s with 2 Python threads)."""
    n = blocks.shape[0]
    if n == 0:
        return torch.empty((0, c.type_size), dtype=torch.uint8)
    workers = min(threads, _free_cores(), max(1, n * c.block_size // _MIN_PART_VALUES))
    # parts of at most _MAX_PART_VALUES values bound the temporaries (a few times a part's size)
    n_parts = max(workers, -(-n * c.block_size // _MAX_PART_VALUES))
    if n_parts <= 1:
        return c.quantize_blocks(blocks)
    per = -(-n // n_parts)
    parts = [blocks[i:i + per] for i in range(0, n, per)]
    if workers <= 1:
        return torch.cat([c.quantize_blocks(p) for p in parts])
    with ThreadPoolExecutor(workers, thread_name_prefix="twice-quantize") as pool:
        return torch.cat(list(pool.map(c.quantize_blocks, parts)))


# byte offsets of each block's fp16 fields (the F16 "block" is its one value)
_FP16_FIELDS = {
    "F16": (0,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def _check_finite_scales(out: torch.Tensor, name: str) -> None:
    """An fp16 field that rounded to infinity (values past what the type's scale holds) would
    dequantize to inf/NaN: refuse it rather than write it."""
    if name == "BF16":  # float32's range: only values within half a bf16 step of FLT_MAX round to inf
        if bool(((out.contiguous().view(torch.int16) & 0x7F80) == 0x7F80).any()):
            raise ValueError("cannot quantize to BF16: the values are too large (past bfloat16's 3.39e38)")
        return
    for off in _FP16_FIELDS[name]:
        h = out[:, off:off + 2].contiguous().view(torch.int16)
        if bool(((h & 0x7C00) == 0x7C00).any()):
            what = "values" if name == "F16" else "block scales"
            raise ValueError(f"cannot quantize to {name}: the values are too large ({what} past fp16's 65504)")
