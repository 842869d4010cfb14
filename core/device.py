"""Devices and dtypes: what `auto` means, availability checks, synchronization, peak memory."""

from __future__ import annotations

import os
import resource
import sys

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
    """auto = bfloat16 on cuda; on the cpu bfloat16 where this CPU has bf16 dot-product
    instructions (see cpu_auto_dtype), else float32."""
    return dtype_choice(name, device)[0]


def dtype_choice(name: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """The dtype `name` means on `device` (a torch.device or its type, "cpu" / "cuda"), and
    why, in words for the readout and the reports: "auto: this CPU has AVX-512 BF16", "--dtype", ..."""
    if name == "auto":
        if getattr(device, "type", device) == "cuda":
            return torch.bfloat16, "auto: bfloat16 on a GPU"
        return cpu_auto_dtype_and_reason()
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name], "--dtype"


def describe_dtype(name: str, device: torch.device) -> str:
    """One phrase for people: "bfloat16 (auto: this CPU has AVX-512 BF16)"."""
    dtype, why = dtype_choice(name, device)
    return f"{DTYPE_NAMES[dtype]} ({why})"


CPU_AUTO_DTYPE_ENV = "TWICE_CPU_AUTO_DTYPE"  # float32 | bfloat16 pins it; unset or empty: from the CPU's flags
# /proc/cpuinfo flags of the instructions that make bfloat16 decode faster than float32 on
# the CPU: bf16 dot products (AVX-512 BF16: the native kernels use them) and AMX's bf16 tiles
# (oneDNN's matrix products use them; every AMX CPU also has AVX-512 BF16).
BF16_FLAGS = {"avx512_bf16": "AVX-512 BF16", "amx_bf16": "AMX"}


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags as Linux reports them (the first "flags" line of
    /proc/cpuinfo); empty where there is none (another OS, a restricted sandbox).
    (torch.backends.cpu.get_cpu_capability() names only the widest vector ISA torch
    dispatches to, "AVX512" or "AVX2", which says nothing about bf16 instructions.)"""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return set()


def cpu_auto_dtype() -> torch.dtype:
    """What `--dtype auto` means on the CPU (see cpu_auto_dtype_and_reason)."""
    return cpu_auto_dtype_and_reason()[0]


def cpu_auto_dtype_and_reason() -> tuple[torch.dtype, str]:
    """What `--dtype auto` means on the CPU, decided by what the CPU is, never by a timing
    (a timing on a busy machine picks one dtype one run and the other the next, and the same
    --seed then gives different text): bfloat16 halves the bytes decode reads per token, but
    only CPUs with bf16 dot products (AVX-512 BF16, AMX) turn that into speed; elsewhere
    converting costs more than it saves, so float32. $TWICE_CPU_AUTO_DTYPE=float32 or
    bfloat16 pins it; any other non-empty value is an error."""
    pinned = os.environ.get(CPU_AUTO_DTYPE_ENV, "")
    if pinned.strip():
        if pinned not in ("float32", "bfloat16"):
            shown = pinned if pinned.isprintable() and len(pinned) <= 40 else repr(pinned[:40])
            raise UsageError(f"{CPU_AUTO_DTYPE_ENV}={shown} is not a dtype --dtype auto can mean on the CPU; "
                             "set it to float32 or bfloat16, or unset it to decide from the CPU's flags")
        return DTYPES[pinned], f"auto: {CPU_AUTO_DTYPE_ENV}={pinned}"
    flags = cpu_flags()
    has = [label for flag, label in BF16_FLAGS.items() if flag in flags]
    if has:
        return torch.bfloat16, f"auto: this CPU has {' and '.join(has)}"
    return torch.float32, "auto: this CPU has no AVX-512 BF16 or AMX"


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
