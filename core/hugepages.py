"""Weights in huge pages on the CPU.

Decode streams every weight once per token. With 4 KiB pages that is a TLB miss every
4 KiB (66,000 for a 270 MB model, every token); in 2 MiB pages it is 135. On the 2-vCPU
test machine that alone made SmolLM2-135M's native decode 1.43× (fp32) and 1.48× (bf16)
faster at batch 1 and 1.12× at batch 16 (two models side by side in one process).

Linux gives huge pages to anonymous memory advised with MADV_HUGEPAGE when it is first
touched (transparent huge pages in "madvise" or "always" mode), so the parameters are
moved, before anything is written into them, into one such mapping: one view per
parameter, each 4 KiB-aligned. The KV cache is allocated the same way (batched decode at
1000 tokens of context: 1.16×). Elsewhere, or if the advice is refused, everything stays
in ordinary memory; nothing else changes (TWICE_HUGE_PAGES=0 turns it off).

Activations are ordinary heap memory, and glibc's malloc hands freed memory back to the OS
as soon as the heap's top exceeds a threshold that it keeps adjusting: a prefill's
activations (megabytes per layer) were then faulted in again, page by page, layer after
layer: 37,000 to 337,000 page faults (0.5–0.9 s of system time) in one 2,000-token
float32 prefill of SmolLM2-135M, varying from run to run; 560 once `keep_freed_memory`
fixes both thresholds, so that freed memory stays in the process for the next layer and
the next request (the resident size no longer drops back after a prefill).
TWICE_KEEP_HEAP=0 leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_KEPT: dict[str, bool] = {}


def _advise(address: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(address, length, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def _region(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """An anonymous mapping with `nbytes` advised for huge pages from a 2 MiB boundary on
    (zero-filled by the kernel, page by page as first touched), and that boundary's offset."""
    if not sys.platform.startswith("linux") or os.environ.get("TWICE_HUGE_PAGES", "1") == "0" or nbytes < _HUGE:
        return None
    try:
        region = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, OverflowError):
        return None
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = -base % _HUGE
    if not _advise(base + start, nbytes):
        region.close()
        return None
    return region, start


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zero CPU tensor in huge pages (the KV cache: attention reads it every step), or
    None where that is not possible (then allocate as usual). The tensor's storage keeps
    the mapping alive (torch.frombuffer holds it)."""
    nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    got = _region(nbytes)
    if got is None:
        return None
    region, start = got
    return torch.frombuffer(region, dtype=torch.uint8)[start : start + nbytes].view(dtype).view(shape)


def place_parameters(model: torch.nn.Module) -> bool:
    """Move `model`'s CPU parameters (not yet written: their storage is untouched) into one
    anonymous mapping advised for huge pages. True if done."""
    params = [p for p in [*model.parameters(), *model.buffers()] if p.device.type == "cpu"]
    if not params:
        return False
    sizes = [(p.nbytes + 4095) // 4096 * 4096 for p in params]
    got = _region(sum(sizes))  # None: not Linux, turned off, or a tiny model (under 2 MiB)
    if got is None:
        return False
    region, start = got
    memory = torch.frombuffer(region, dtype=torch.uint8)
    offset = start
    with torch.no_grad():
        for p, size in zip(params, sizes):
            p.data = memory[offset : offset + p.nbytes].view(p.dtype).view(p.shape)
            offset += size
    model._huge_page_region = region  # (the views' storage holds it too; this names it for tests)
    return True


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS
    (once per process, at a CPU model's first forward pass, after handing back what was
    free then; True if in effect). Allocations under 32 MiB (the most glibc allows
    from its heap: every activation of a 2,048-token prefill of a 135M model) come from the
    heap, and the heap's top is trimmed only beyond 2 GiB. Setting the thresholds also
    stops glibc from moving them as it goes. Elsewhere (not glibc, TWICE_KEEP_HEAP=0)
    malloc stays as it is."""
    if "done" not in _KEPT:
        _KEPT["done"] = False
        if os.environ.get("TWICE_KEEP_HEAP", "1") != "0" and _glibc():
            try:
                libc = ctypes.CDLL(None)
                libc.malloc_trim(ctypes.c_size_t(0))  # what loading left free goes back first
                mallopt = libc.mallopt
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                _KEPT["done"] = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
            except (OSError, AttributeError):
                pass
    return _KEPT["done"]


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


def release_freed_memory() -> None:
    """Give the heap's free memory back to the OS now (glibc's malloc_trim): a measurement
    that starts here sees its own memory as added, and pays its first touch as a fresh
    process does (twice bench, core/benchmark.py). Nothing elsewhere."""
    if _KEPT.get("done"):
        try:
            ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
        except (OSError, AttributeError):
            pass
