"""Devices and dtypes: what `auto` means, availability checks, synchronization, peak memory."""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

from .errors import DeviceError, UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(name: str = "auto") -> torch.device:
    """auto = cuda when a GPU is visible, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}; use auto, cpu or cuda") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda was asked for but no CUDA GPU is available (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"no GPU {device.index}: this machine has {torch.cuda.device_count()}")
    elif device.type != "cpu":
        raise UsageError(f"device {name!r} is not supported; use auto, cpu or cuda")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on cuda; on the cpu bfloat16 where this CPU measurably multiplies it
    faster than float32 (see cpu_auto_dtype), else float32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu_auto_dtype()
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


CPU_AUTO_DTYPE_ENV = "TWICE_CPU_AUTO_DTYPE"  # float32 | bfloat16 | measure (the default)
BF16_MIN_SPEEDUP = 1.3
_cpu_auto: list[torch.dtype] = []


def cpu_auto_dtype() -> torch.dtype:
    """What `--dtype auto` means on the CPU, measured rather than assumed: decode is one
    matrix-vector product per weight, so time that product for a 16 MiB float32 matrix and
    the same matrix in bfloat16, with the kernel decode uses (the native one where it
    builds). bfloat16 halves the bytes read, but only CPUs with bf16 dot products (AVX-512
    BF16, AMX) turn that into speed; elsewhere converting costs more than it saves. It is
    chosen when it is at least BF16_MIN_SPEEDUP× faster. Measured once per process (~0.1 s);
    $TWICE_CPU_AUTO_DTYPE=float32 or bfloat16 pins it."""
    pinned = os.environ.get(CPU_AUTO_DTYPE_ENV, "measure")
    if pinned in ("float32", "bfloat16"):
        return DTYPES[pinned]
    if not _cpu_auto:
        _cpu_auto.append(torch.bfloat16 if _bf16_speedup() >= BF16_MIN_SPEEDUP else torch.float32)
    return _cpu_auto[0]


def _bf16_speedup() -> float:
    from . import kernels

    out, n = 4096, 1024
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(out, n, generator=g)
    x32 = torch.randn(1, n, generator=g)
    w16, x16 = w32.bfloat16(), x32.bfloat16()
    lib = kernels.library()
    y = torch.empty(1, out)

    def product(x, w):
        if lib is None:
            return torch.nn.functional.linear(x, w)
        # As the native decode step calls it: straight through ctypes (the torch op's first
        # call alone costs a second of dispatcher setup).
        lib.gemm(w.data_ptr(), x.data_ptr(), y.data_ptr(), out, n, 1, int(w.dtype == torch.bfloat16),
                 torch.get_num_threads())

    def best(x, w) -> float:
        product(x, w)  # warm-up: first touch, thread pool
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(4):
                product(x, w)
            times.append(time.perf_counter() - t)
        return min(times)

    with torch.inference_mode():
        return best(x32, w32) / best(x16, w16)


def set_threads(n: int) -> None:
    """CPU threads for torch's kernels (and inductor's compiled ones)."""
    torch.set_num_threads(n)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """GPU: the caching allocator's peak since the last reset; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # Linux: VmHWM is this process image's own high-water mark. (ru_maxrss also counts
    # the parent's memory that a fork copied in before exec, so it overstates.)
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on a GPU (None on CPU: the caller reads the system's)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None


# Peak memory bandwidth of known GPUs (bytes/s), by a substring of the device name, most
# specific first. Used to show decode's achieved bandwidth as a fraction of the peak.
_GPU_BANDWIDTH = [
    ("GH200", 4.0e12), ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
    ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
    ("L40S", 864e9), ("L40", 864e9), ("L4", 300e9), ("A10G", 600e9), ("A10", 600e9), ("T4", 320e9),
    ("V100", 900e9), ("RTX 4090", 1.008e12), ("RTX 3090", 936e9), ("RTX 6000 Ada", 960e9), ("A6000", 768e9),
]


def device_bandwidth_bytes(device: str) -> float | None:
    """Peak memory bandwidth of a known GPU in bytes/s; None for the CPU (measure it with
    `twice bench`) or an unknown GPU."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev).lower()
    return next((bw for key, bw in _GPU_BANDWIDTH if key.lower() in name), None)
