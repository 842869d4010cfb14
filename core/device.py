"""Devices and dtypes: what `auto` means, availability checks, synchronization, peak memory."""

from __future__ import annotations

import resource
import sys

import torch

from .errors import DeviceError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(name: str = "auto") -> torch.device:
    """auto = cuda when a GPU is visible, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r}; use auto, cpu or cuda") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda was asked for but no CUDA GPU is available (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"no GPU {device.index}: this machine has {torch.cuda.device_count()}")
    elif device.type != "cpu":
        raise DeviceError(f"device {name!r} is not supported; use auto, cpu or cuda")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on cuda, float32 on cpu."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise DeviceError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on a GPU (None on CPU: the caller reads the system's)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return None
