"""A process's first prefill: what the warm-up of an in-process bench hides (core/hugepages.py).

glibc's malloc returns freed memory to the OS beyond a threshold it keeps moving, so a
prefill's activations were faulted in again page by page, layer after layer, in every
request. `keep_freed_memory` pins the thresholds: memory freed is reused, never faulted
in twice.
"""

import ctypes
import resource
import sys

import pytest
import torch

from twice.core import benchmark, hugepages
from twice.core.cache import KVCache
from twice.core.config import config_from_dict

linux_glibc = pytest.mark.skipif(not (sys.platform.startswith("linux") and hugepages._glibc()),
                                 reason="mallopt is glibc's")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _libc():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _layer(libc) -> int:
    """Allocate 3 × 6 MiB, touch, free: the page faults that took."""
    before = _faults()
    buffers = [libc.malloc(6 << 20) for _ in range(3)]
    for b in buffers:
        ctypes.memset(b, 1, 6 << 20)  # first touch
    for b in buffers:
        libc.free(b)
    return _faults() - before


@linux_glibc
def test_freed_activation_memory_is_reused_without_faulting_again(monkeypatch):
    monkeypatch.setattr(hugepages, "_KEPT", {})
    monkeypatch.delenv("TWICE_KEEP_HEAP", raising=False)
    assert hugepages.keep_freed_memory() and hugepages.keep_freed_memory()  # once; then remembered
    libc = _libc()
    p = libc.malloc(8 << 20)
    libc.free(p)  # with glibc's moving thresholds this sets them to 8 MiB (mmap) / 16 MiB (trim)
    rounds = [_layer(libc) for _ in range(4)]  # a layer's activations: 18 MiB live at once, then freed
    # The first round may fault its 4,608 pages in; the later ones reuse them. With glibc's
    # moving thresholds every round faulted all 4,576 again (the heap's top was trimmed).
    assert max(rounds[1:]) < 500, rounds


@linux_glibc
def test_the_bench_hands_it_back_so_each_run_counts_and_touches_its_own_memory(monkeypatch):
    monkeypatch.setattr(hugepages, "_KEPT", {})
    monkeypatch.delenv("TWICE_KEEP_HEAP", raising=False)
    assert hugepages.keep_freed_memory()
    libc = _libc()
    _layer(libc)
    kept = _layer(libc)
    assert kept < 500  # kept
    with benchmark._PeakMemory(torch.device("cpu")):  # releases first
        # touched afresh, as a new process would: at most 4,608 faults of 4 KiB pages; fewer
        # where the kernel backs some of it with huge pages (3,224 seen in a full run)
        fresh = _layer(libc)
        assert fresh > 1000 and fresh > 4 * kept, (fresh, kept)


def test_turned_off_or_elsewhere_it_leaves_malloc_alone(monkeypatch):
    monkeypatch.setattr(hugepages, "_KEPT", {})
    monkeypatch.setenv("TWICE_KEEP_HEAP", "0")

    def no_libc(*args, **kwargs):
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(hugepages.ctypes, "CDLL", no_libc)
    assert hugepages.keep_freed_memory() is False
    monkeypatch.setattr(hugepages, "_KEPT", {})
    monkeypatch.delenv("TWICE_KEEP_HEAP")
    monkeypatch.setattr(hugepages, "_glibc", lambda: False)  # musl, macOS, Windows
    assert hugepages.keep_freed_memory() is False


@linux_glibc
def test_a_cpu_forward_pass_keeps_freed_memory(monkeypatch):
    monkeypatch.setattr(hugepages, "_KEPT", {})
    monkeypatch.delenv("TWICE_KEEP_HEAP", raising=False)
    config = config_from_dict(dict(benchmark.SHAPES["tiny"]))
    model = benchmark.random_model(config, "cpu", torch.float32)
    assert hugepages._KEPT == {}  # loading is left as it was
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), KVCache(config, 1, 8, torch.float32, "cpu"))
    assert hugepages._KEPT == {"done": True}
