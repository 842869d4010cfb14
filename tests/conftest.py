import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One folder for the native kernels of the whole run, set before collection: modules ask
# kernels.available() while they are imported (skip marks), and that first build must land
# where every test and every process the tests start will look, never in the user's cache
# (it did: each run then built the kernels twice, the second time inside the first test
# that started a process, ~12 s or far more on a busy machine).
KERNELS_CACHE = tempfile.mkdtemp(prefix="twice-test-kernels-")
os.environ["TWICE_KERNELS_CACHE"] = KERNELS_CACHE

import tiny  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _kernels_built():
    """The native kernels built once, first: every test's processes share the library
    (_isolated_cache points them at it), and a test that starts a process with a time limit
    (waiting for a line, a signal sent while it loads) must not pay for the build — with every
    kernel source it takes 15-20 s on a quiet 2-core machine, far more when it is busy."""
    from twice.core import kernels

    kernels.available()
    yield
    shutil.rmtree(KERNELS_CACHE, ignore_errors=True)


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


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tiny models (one thread is faster than two fighting a
    busy machine for its cores): `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Converted models and other cache writes go to a per-session temporary folder.
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path_factory.getbasetemp() / "twice-cache"))
    # One build of the native kernels for the whole run, also for the processes tests start
    # with caches of their own (a build of every kernel source costs several seconds).
    monkeypatch.setenv("TWICE_KERNELS_CACHE", KERNELS_CACHE)
    # The tests compare against transformers in float32; what `--dtype auto` means on a CPU
    # depends on its instruction set, so it is pinned here (test_device.py tests the choice).
    monkeypatch.setenv("TWICE_CPU_AUTO_DTYPE", "float32")
