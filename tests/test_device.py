"""What `--dtype auto` means on the CPU: measured, pinnable."""

import pytest
import torch

from twice.core import device


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(device, "_cpu_auto", [])
    monkeypatch.setenv(device.CPU_AUTO_DTYPE_ENV, "measure")


@pytest.mark.parametrize("speedup, expected", [(2.0, torch.bfloat16), (1.0, torch.float32), (1.29, torch.float32)])
def test_auto_follows_the_measured_speedup(fresh, monkeypatch, speedup, expected):
    calls = []
    monkeypatch.setattr(device, "_bf16_speedup", lambda: calls.append(1) or speedup)
    assert device.resolve_dtype("auto", torch.device("cpu")) == expected
    assert device.resolve_dtype("auto", torch.device("cpu")) == expected
    assert len(calls) == 1  # measured once per process


def test_pinned_by_the_environment(fresh, monkeypatch):
    monkeypatch.setattr(device, "_bf16_speedup", lambda: pytest.fail("pinned: nothing to measure"))
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        monkeypatch.setenv(device.CPU_AUTO_DTYPE_ENV, name)
        assert device.resolve_dtype("auto", torch.device("cpu")) == dtype


def test_the_measurement_runs_here(fresh):
    speedup = device._bf16_speedup()
    assert 0.05 < speedup < 20  # a real ratio of two timings, whatever this CPU is
    assert device.cpu_auto_dtype() in (torch.float32, torch.bfloat16)
