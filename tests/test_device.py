"""What `--dtype auto` means on the CPU: decided by the CPU's instruction-set flags (never by
a timing, so the same command picks the same dtype on every run), pinnable, and an invalid
pin is an error."""

import pytest
import torch

from twice.core import device
from twice.core.errors import UsageError

CPU = torch.device("cpu")


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv(device.CPU_AUTO_DTYPE_ENV, raising=False)


@pytest.mark.parametrize("flags, expected, why", [
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, "auto: this CPU has AVX-512 BF16"),
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, torch.bfloat16, "auto: this CPU has AVX-512 BF16 and AMX"),
    ({"avx2", "avx512f", "avx512_vnni"}, torch.float32, "auto: this CPU has no AVX-512 BF16 or AMX"),
    (set(), torch.float32, "auto: this CPU has no AVX-512 BF16 or AMX"),  # no /proc/cpuinfo (another OS)
])
def test_auto_follows_the_cpu_flags(unpinned, monkeypatch, flags, expected, why):
    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    for _ in range(3):  # the same answer every time: nothing is measured
        assert device.resolve_dtype("auto", CPU) == expected
        assert device.dtype_choice("auto", CPU) == (expected, why)
    assert device.describe_dtype("auto", CPU) == f"{device.DTYPE_NAMES[expected]} ({why})"


def test_nothing_is_timed(unpinned, monkeypatch):
    import time

    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("the dtype must not depend on a timing"))
    assert device.cpu_auto_dtype() in (torch.float32, torch.bfloat16)
    assert not hasattr(device, "_bf16_speedup")


def test_pinned_by_the_environment(monkeypatch):
    monkeypatch.setattr(device, "cpu_flags", lambda: pytest.fail("pinned: the flags are not read"))
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        monkeypatch.setenv(device.CPU_AUTO_DTYPE_ENV, name)
        assert device.dtype_choice("auto", CPU) == (dtype, f"auto: TWICE_CPU_AUTO_DTYPE={name}")


@pytest.mark.parametrize("value", ["float16", "bf16", "measure", "Float32", "float32 ", "\x1b[31mx"])
def test_an_invalid_pin_is_an_error(monkeypatch, value):
    monkeypatch.setenv(device.CPU_AUTO_DTYPE_ENV, value)
    with pytest.raises(UsageError, match="TWICE_CPU_AUTO_DTYPE=.* float32 or bfloat16") as e:
        device.resolve_dtype("auto", CPU)
    assert "\x1b" not in str(e.value)
    assert device.resolve_dtype("float32", CPU) == torch.float32  # an explicit --dtype does not consult it


def test_an_empty_pin_means_unpinned(monkeypatch):
    monkeypatch.setenv(device.CPU_AUTO_DTYPE_ENV, "")
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx512_bf16"})
    assert device.resolve_dtype("auto", CPU) == torch.bfloat16


def test_cuda_and_explicit_dtypes():
    assert device.dtype_choice("auto", torch.device("cuda")) == (torch.bfloat16, "auto: bfloat16 on a GPU")
    assert device.dtype_choice("float16", CPU) == (torch.float16, "--dtype")
    with pytest.raises(UsageError, match="unknown dtype"):
        device.resolve_dtype("int8", CPU)


def test_the_flags_read_here():
    flags = device.cpu_flags()
    assert isinstance(flags, set)
    import platform

    if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
        assert "sse2" in flags  # every x86-64 CPU has it
