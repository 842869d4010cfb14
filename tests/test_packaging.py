"""The wheel installs cli/, core/ and weights/ as twice.cli, twice.core, twice.weights and
nothing else at the top level."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_holds_every_module_under_twice(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("twice-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("cli", "core", "weights"):
        sources = [s for pattern in ("*.py", "*.c", "*.h") for s in (ROOT / folder).rglob(pattern)]
        for source in sources:  # subpackages and the native kernels' C sources too
            if "__pycache__" not in source.parts:
                assert f"twice/{source.relative_to(ROOT).as_posix()}" in names, source
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"twice", next(t for t in tops if t.endswith(".dist-info"))}
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "twice = twice.cli.app:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_no_bare_top_level_packages_importable():
    import importlib.util

    for bare in ("cli", "core", "weights"):
        spec = importlib.util.find_spec(bare)
        assert spec is None or "site-packages" not in (spec.origin or ""), bare
