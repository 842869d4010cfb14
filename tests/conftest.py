import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return tiny.train_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """family -> folder of a tiny random model saved by transformers (built lazily)."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = tiny.make_model(root / family, family, tokenizer)
        return built[family]

    return get


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Converted models and other cache writes go to a per-session temporary folder.
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path_factory.getbasetemp() / "twice-cache"))
    # One build of the native kernels for the whole run, also for the processes tests start
    # with caches of their own (a build of every kernel source costs several seconds).
    monkeypatch.setenv("TWICE_KERNELS_CACHE", str(tmp_path_factory.getbasetemp() / "twice-kernels"))
    # The tests compare against transformers in float32; what `--dtype auto` means on a CPU
    # depends on its instruction set, so it is pinned here (test_device.py tests the choice).
    monkeypatch.setenv("TWICE_CPU_AUTO_DTYPE", "float32")
