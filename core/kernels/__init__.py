"""Native kernels, compiled at first use with the system C compiler.

`gemv` (gemv.c) is the matrix-vector product of batch-1 decode. It is registered as the
torch op `twice::gemv`, so compiled graphs (fastpath.py) call it like any other op.
`decode_step` (decode.c) runs a whole llama-family decode step in one call
(native_decode.py). `peak_macs` (peak.c) measures the multiply-add peak that batched
decode is held against (`twice bench`). `argmax` (argmax.c) is greedy decoding's choice
on the CPU; `causal_attention` (prefill.c) is the attention of new tokens in prefill (a
prompt, a chunk, a chat turn, a padded batch). When no C compiler is there, or it fails,
`available()` is False and decode uses the eager or torch.compile'd path instead, prefill
SDPA; nothing else changes.

The shared library lands in <cache>/kernels/, named by a hash of the source, the flags
and the machine, built under a lock into a temporary name and renamed (weights/safe_write),
so concurrent first runs compile once, and neither they nor CPU changes ever load a wrong
or half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..paths import cache_dir

SOURCES = [Path(__file__).with_name(name) for name in ("gemv.c", "decode.c", "peak.c", "argmax.c", "prefill.c",
                                                             "qdot.c", "qdot_legacy.c", "qdot_kquants.c", "quantize.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("bf16.h", "vec.h", "qdot.h", "kvblock.h")]  # part of the build's hash
_STATE: dict = {}


def _libgomp() -> Path | None:
    """torch's own OpenMP runtime: linking the kernel against it shares torch's thread pool
    (two OpenMP runtimes would each spin their own threads on the same cores)."""
    libdir = Path(torch.__file__).parent / "lib"
    found = sorted(libdir.glob("libgomp*.so*"))
    return found[0] if found else None


def _build(march: str = "native", source_dir: Path | None = None) -> ctypes.CDLL | None:
    """The library for this CPU (`march` other than native: for an older instruction set,
    which the tests use to check the portable code paths; `source_dir`: the same files from
    another folder, e.g. another revision's, which scripts/kernel_bench.py times beside)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    flags = ["-O3", f"-march={march}", "-shared", "-fPIC"]
    gomp = _libgomp()
    if gomp is not None:
        flags += ["-fopenmp", f"-L{gomp.parent}", f"-Wl,-rpath,{gomp.parent}", f"-l:{gomp.name}"]
    sources, headers = ([source_dir / p.name for p in names] for names in (SOURCES, HEADERS)) if source_dir \
        else (SOURCES, HEADERS)
    source = b"".join(path.read_bytes() for path in sources + headers)
    key = hashlib.sha256(source + " ".join(flags).encode() + platform.processor().encode()
                         + _cpu_model().encode()).hexdigest()[:16]
    # TWICE_KERNELS_CACHE: a folder for the built library alone (the tests share one across
    # the processes they start with caches of their own: a build costs seconds).
    folder = Path(os.environ["TWICE_KERNELS_CACHE"]) if os.environ.get("TWICE_KERNELS_CACHE") else cache_dir() / "kernels"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        pass
    if not _private(folder):
        # Native code is loaded into this process: never from a folder another user could
        # write. Build it afresh in a private temporary folder instead (not cached).
        folder = Path(tempfile.mkdtemp(prefix="twice-kernels-"))
        temporary = True
    else:
        temporary = False
    lib = folder / f"twice-kernels-{key}.so"
    if not _write_library(lib, [compiler, *flags, *map(str, sources)]):
        return None
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError:
        return None
    finally:
        if temporary:  # once loaded, the mapping outlives the file
            shutil.rmtree(folder, ignore_errors=True)
    handle.gemm.restype = None
    handle.gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    handle.decode_step.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    handle.decode_step.argtypes = [p, p, p, p, p, p, i64, p, p, p, p, i64, i64, p, i64, p, p, p, i64, ctypes.c_int]
    handle.peak_macs.restype = ctypes.c_double
    handle.peak_macs.argtypes = [ctypes.c_int, ctypes.c_int, i64]
    handle.argmax_rows.restype = None
    handle.argmax_rows.argtypes = [p, i64, i64, p]
    handle.causal_attention.restype = ctypes.c_int
    handle.causal_attention.argtypes = [ctypes.c_int, p, i64, i64, i64, p, p, i64, i64, p, i64, i64, i64, i64, i64,
                                        i64, p, ctypes.c_float, ctypes.c_int]
    handle.causal_attention_blocks.restype = ctypes.c_int
    handle.causal_attention_blocks.argtypes = [ctypes.c_int, ctypes.c_int, p, i64, i64, i64, p, p, i64, i64, i64, p,
                                               p, i64, i64, i64, i64, i64, i64, p, ctypes.c_float, ctypes.c_int]
    for name in ("q_row_bytes", "q_act_bytes"):
        getattr(handle, name).restype = i64
        getattr(handle, name).argtypes = [ctypes.c_int, i64]
    handle.q_prepare.restype = None
    handle.q_prepare.argtypes = [ctypes.c_int, p, i64, i64, p]
    for name in ("q_gemm", "q_gemm_reference"):
        getattr(handle, name).restype = None
        getattr(handle, name).argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, i64, ctypes.c_int]
    handle.q_gemm_simd.restype = ctypes.c_int
    handle.q_gemm_simd.argtypes = [ctypes.c_int]
    handle.q_x8_at_load.restype = ctypes.c_int
    handle.q_x8_at_load.argtypes = [ctypes.c_int]
    handle.q_dequantize.restype = None
    handle.q_dequantize.argtypes = [ctypes.c_int, p, i64, i64, p, ctypes.c_int]
    handle.q_dequantize_at.restype = None
    handle.q_dequantize_at.argtypes = [ctypes.c_int, p, i64, i64, i64, p, ctypes.c_int]
    handle.q_interleave.restype = ctypes.c_int
    handle.q_interleave.argtypes = [ctypes.c_int, p, i64, i64, ctypes.c_int]
    return handle


class _CompileFailed(Exception):
    pass


def _write_library(lib: Path, command: list[str]) -> bool:
    """The library at `lib`, found there or compiled by `command` (given "-o FILE" after
    it); False where the compiler fails. Through safe_write: under `lib`'s lock (a second
    first run waits for the first, then finds its library instead of compiling again),
    into a temporary name beside it (those that killed builds left are removed first),
    0700 and renamed into place."""
    from twice.core.errors import TwiceError
    from twice.weights.safe_write import atomic_file, exclusive_lock

    try:
        with exclusive_lock(lib, wait=True, what="the native kernels"):
            if lib.is_file() and _private(lib):
                return True
            with atomic_file(lib, mode=0o700, what="the native kernels") as tmp:
                result = subprocess.run([*command, "-o", str(tmp), "-lm"], capture_output=True, timeout=120)
                if result.returncode != 0:
                    raise _CompileFailed
    except (_CompileFailed, OSError, subprocess.SubprocessError, TwiceError):
        return False
    return True


def _private(path: Path) -> bool:
    """Owned by this user (or root), not a link, and writable by nobody else."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    import stat

    getuid = getattr(os, "getuid", None)
    mine = getuid is None or st.st_uid in (getuid(), 0)
    return mine and not stat.S_ISLNK(st.st_mode) and not st.st_mode & 0o022


def _cpu_model() -> str:
    """The CPU's name and feature flags: a library built with -march=native for one CPU must
    never be loaded on another (a missing instruction would kill the process)."""
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags") and key not in seen:
                    seen[key] = line
    except OSError:
        pass
    return "".join(seen.values())


def library() -> ctypes.CDLL | None:
    if "lib" not in _STATE:
        _STATE["lib"] = _build() if os.environ.get("TWICE_NATIVE_KERNELS", "1") != "0" else None
    return _STATE["lib"]


def available() -> bool:
    return library() is not None


_PEAK_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def peak_macs(dtype: torch.dtype, threads: int) -> float | None:
    """This CPU's multiply-adds per second in `dtype` on `threads` threads, measured
    (peak.c, the best of 3 runs of ~0.03 s: the machine may be shared); None where the
    kernels did not build or have no such instructions. torch.int8: the quantized kernels'
    u8·s8 integer dot product (block weights against int8 activations)."""
    lib = library()
    if lib is None or dtype not in _PEAK_KINDS:
        return None
    value = max(lib.peak_macs(_PEAK_KINDS[dtype], threads, 10_000_000) for _ in range(3))
    return value or None


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """logits [B, V] → each row's argmax [B] (int64), as torch.argmax(-1) gives it; None
    where this is not a contiguous float32 CPU tensor or the kernels did not build (the
    caller then asks torch)."""
    if not (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and logits.shape[1] > 0):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, column: int = 0,
                     starts: torch.Tensor | None = None) -> torch.Tensor | None:
    """Causal attention of T new tokens after `column` cached ones on the CPU, as
    [B, T, H·D] (attend's layout): token t sees keys [0, column + t] (column 0: SDPA(q, k,
    v, is_causal=True, enable_gqa=True)); with `starts` [B], row b's keys begin at
    starts[b] (left padding before it; a padding token sees only itself, as Step's masks
    say). q [B, H, T, D], k/v [B, KV, column + T, D] (the cache's rows). None where prefill.c does not apply: a dtype other than bf16 and fp32,
    another device, a head size other than 64 or 128, layouts it does not read, or a CPU
    without AVX-512 BF16 (the caller then uses SDPA)."""
    b, h, t, d = q.shape
    if not (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float32)
            and d in (64, 128) and k.shape == v.shape and k.shape[0] == b and k.shape[2] == column + t
            and k.shape[3] == d
            and h % k.shape[1] == 0 and q.stride(3) == 1 and k.stride(3) == v.stride(3) == 1
            and k.stride(2) == v.stride(2) == d and k.stride()[:2] == v.stride()[:2]):
        return None
    return _attention(q, starts, lambda lib, out, rows: lib.causal_attention(
        int(q.dtype == torch.bfloat16), q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(),
        v.data_ptr(), k.stride(0), k.stride(1), out.data_ptr(), b, h, k.shape[1], t, d, column, rows, scale,
        torch.get_num_threads()))


def _attention(q: torch.Tensor, starts: torch.Tensor | None, call) -> torch.Tensor | None:
    """What both native attentions share: the library, `starts` as prefill.c takes it, the
    output [B, T, H·D] and the status; `call(lib, out, starts pointer)` runs the kernel."""
    lib = library()
    if lib is None:
        return None
    b, h, t, d = q.shape
    if starts is not None:
        if starts.shape != (b,) or starts.device.type != "cpu":
            return None
        starts = starts.to(torch.int64).contiguous()
    out = torch.empty(b, t, h * d, dtype=q.dtype)
    status = call(lib, out, starts.data_ptr() if starts is not None else None)
    if status == -2:
        raise MemoryError("native attention could not allocate its buffers")
    return out if status == 0 else None


def causal_attention_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_type: int, scale: float,
                            column: int = 0, starts: torch.Tensor | None = None,
                            key_offset: torch.Tensor | None = None) -> torch.Tensor | None:
    """causal_attention over a block cache's layer as stored: k/v [B, KV, ≥column + T, bytes]
    uint8 rows of Q8_0 (kv_type 8) or Q4_0 (2) blocks of the head dimension (cache.py's
    layout), key_offset [KV, D] float32 (the keys' stored offset, added back) or None. The
    result is bit for bit causal_attention's over the cache's own decode of those columns;
    None where that does not apply (as causal_attention's)."""
    b, h, t, d = q.shape
    size = {8: 34, 2: 18}.get(kv_type)
    if not (size and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32) and d in (64, 128)
            and k.dtype == v.dtype == torch.uint8 and k.shape == v.shape and k.dim() == 4 and k.shape[0] == b
            and k.shape[2] >= column + t and k.shape[3] == d // 32 * size and h % k.shape[1] == 0
            and q.stride(3) == 1 and k.stride(3) == v.stride(3) == 1 and k.stride(2) == v.stride(2) == k.shape[3]
            and k.stride()[:2] == v.stride()[:2]):
        return None
    if key_offset is not None:
        if key_offset.shape != (k.shape[1], d) or key_offset.device.type != "cpu":
            return None
        key_offset = key_offset.to(torch.float32).contiguous()
    return _attention(q, starts, lambda lib, out, rows: lib.causal_attention_blocks(
        int(q.dtype == torch.bfloat16), kv_type, q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(),
        v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), key_offset.data_ptr() if key_offset is not None else None,
        out.data_ptr(), b, h, k.shape[1], t, d, column, rows, scale, torch.get_num_threads()))


@torch.library.custom_op("twice::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1, in] (w's dtype) @ w [out, in].T → [1, out] float32, on the CPU."""
    lib = library()
    out, n = w.shape
    y = torch.empty(1, out, dtype=torch.float32)
    x = x.to(w.dtype).contiguous()
    w = w.contiguous()  # a no-op for Linear weights; a view (a TP slice) is copied once
    lib.gemm(w.data_ptr(), x.data_ptr(), y.data_ptr(), out, n, 1, int(w.dtype == torch.bfloat16),
             torch.get_num_threads())
    return y


@gemv.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty(1, w.shape[0], dtype=torch.float32, device=x.device)


# A 32-value type's ggml id + X8: its rows in the interleaved 8-row layout (core/quant/interleave.py).
X8 = 256


def _quant_shapes(lib, data: torch.Tensor, ggml_type: int, n: int) -> int:
    """The row bytes of `data` ([rows, row_bytes] uint8, contiguous, on the CPU) for rows
    of `n` values of `ggml_type` (an interleaved type: whole groups of 8 rows); ValueError
    where they disagree."""
    row_bytes = lib.q_row_bytes(int(ggml_type), int(n))
    if row_bytes < 0:
        raise ValueError(f"ggml type {ggml_type} has no native kernel for rows of {n} values")
    if not (data.dtype == torch.uint8 and data.dim() == 2 and data.device.type == "cpu" and data.is_contiguous()
            and data.shape[1] == row_bytes and (ggml_type < X8 or data.shape[0] % 8 == 0)):
        raise ValueError(f"quantized weight must be contiguous uint8 [rows, {row_bytes}] on the CPU"
                         f"{' (whole groups of 8 rows)' if ggml_type >= X8 else ''}, "
                         f"got {data.dtype} {tuple(data.shape)} on {data.device.type}")
    return row_bytes


def quant_matmul(x: torch.Tensor, data: torch.Tensor, ggml_type: int, *, lib=None,
                 reference: bool = False) -> torch.Tensor | None:
    """x [rows, n] float32 @ W.T, W being `data` [out, row_bytes] as stored in a GGUF (blocks
    of `ggml_type`, a ggml_type id) → float32 [rows, out], with the activations quantized to
    int8 blocks as llama.cpp does (qdot.c; for F32/F16/BF16 weights, float dot products).
    Each row's result is the same whatever the number of rows. None where the kernels did
    not build. `lib`: another build (tests); `reference`: the portable scalar code."""
    lib = lib or library()
    if lib is None:
        return None
    if not (x.dim() == 2 and x.device.type == "cpu"):
        raise ValueError(f"quant_matmul takes a [rows, n] CPU tensor, got {tuple(x.shape)} on {x.device.type}")
    rows, n = x.shape
    _quant_shapes(lib, data, ggml_type, n)
    x = x.to(torch.float32).contiguous()
    out = data.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32)
    if rows == 0 or out == 0:
        return y
    xq = torch.empty(rows * lib.q_act_bytes(int(ggml_type), n), dtype=torch.uint8)
    lib.q_prepare(int(ggml_type), x.data_ptr(), n, rows, xq.data_ptr())
    gemm = lib.q_gemm_reference if reference else lib.q_gemm
    gemm(int(ggml_type), data.data_ptr(), out, n, xq.data_ptr(), rows, y.data_ptr(), out, torch.get_num_threads())
    return y


def dequantize_rows(data: torch.Tensor, ggml_type: int, n: int, *, lib=None, start: int = 0,
                    stop: int | None = None) -> torch.Tensor | None:
    """Rows [start, stop) of `data` [nrows, row_bytes] (blocks of `ggml_type`) → float32
    [stop - start, n], bit for bit what twice.core.quant.dequantize gives (an interleaved
    type: what its rows as stored give). None where the kernels did not build."""
    lib = lib or library()
    if lib is None:
        return None
    _quant_shapes(lib, data, ggml_type, n)
    stop = data.shape[0] if stop is None else stop
    if not 0 <= start <= stop <= data.shape[0]:
        raise ValueError(f"rows [{start}, {stop}) of a matrix of {data.shape[0]} rows")
    y = torch.empty(stop - start, n, dtype=torch.float32)
    if stop > start:
        lib.q_dequantize_at(int(ggml_type), data.data_ptr(), start, stop - start, n, y.data_ptr(),
                            torch.get_num_threads())
    return y


def x8_at_load(ggml_type: int, *, lib=None) -> bool:
    """Whether loading should rewrite a part of `ggml_type` (as stored) into its interleaved
    8-row layout: the library declares it where its tiles read that layout at least as fast as
    the rows as stored at every batch (Q6_K only with the 512-bit two-group tile). False where
    the kernels did not build."""
    lib = lib or library()
    return lib is not None and bool(lib.q_x8_at_load(int(ggml_type)))


def interleave_rows(data: torch.Tensor, ggml_type: int, n: int, *, lib=None) -> bool:
    """Rewrite `data` [rows, row_bytes] (rows % 8 == 0, blocks of a 32-value `ggml_type` as
    stored) in place into its interleaved 8-row layout (core/quant/interleave.py: the same
    bytes as its torch `interleave`). False where the kernels did not build (data untouched);
    MemoryError where a group's buffer could not be allocated."""
    lib = lib or library()
    if lib is None:
        return False
    _quant_shapes(lib, data, ggml_type, n)
    status = lib.q_interleave(int(ggml_type), data.data_ptr(), data.shape[0], n, torch.get_num_threads())
    if status == -2:
        raise MemoryError("could not allocate a buffer to interleave the weights")
    if status != 0:
        raise ValueError(f"ggml type {ggml_type} rows [{data.shape[0]}, {n}] have no interleaved layout")
    return True


@torch.library.custom_op("twice::quant_matmul", mutates_args=())
def quant_matmul_op(x: torch.Tensor, data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """quant_matmul as a torch op, so that compiled graphs (fastpath.py) call the integer
    kernel like any other op (a ctypes call cannot be traced). Only where available()."""
    return quant_matmul(x, data, ggml_type)


@quant_matmul_op.register_fake
def _(x: torch.Tensor, data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return torch.empty(x.shape[0], data.shape[0], dtype=torch.float32, device=x.device)
