"""llama.cpp for the tests: its convert_hf_to_gguf.py (the reference writer of GGUF files), its
ggml source (the C reference quantizers, ggml_source) and, where installed, llama-cpp-python
(the reference reader). One home for finding them; every
test that converts or loads through llama.cpp goes through here.

The converter ships in llama-cpp-python's sdist, not in its wheel. It is found, first hit wins:
- $TWICE_LLAMA_CPP_CONVERT: a convert_hf_to_gguf.py inside an unpacked llama.cpp tree, the
  tree itself, or an sdist (.tar.gz);
- an unpacked sdist under /work/peer-venv/src (the peer benchmark's, scripts/peer_llamacpp.py);
- the sdist the README's test command downloads into .venv/llama-cpp-sdist/
  (`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .venv/llama-cpp-sdist`).
From an sdist only the converter and what it imports from the vendored tree (conversion/*.py
and gguf-py/gguf/*.py, ~2 MB of the 75 MB) are extracted, once per test session, into a
temporary folder removed at exit. Without any of them the converter tests skip.

The converter knows byte-level BPE tokenizers by a hash of their output and refuses the tiny
tokenizer it has never seen: it runs through a wrapper that names the tokenizer's
pre-tokenizer (default "gpt-2": the tiny tokenizer's byte-level regex is GPT-2's).
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

import pytest

VERSION = "0.3.36"
REPO = Path(__file__).resolve().parent.parent
SDIST_FOLDER = REPO / ".venv" / "llama-cpp-sdist"
PEER_SRC = Path("/work/peer-venv/src")
PEER_PYTHON = Path("/work/peer-venv/bin/python")
SCRIPT = "convert_hf_to_gguf.py"

_WRAPPER = """
import runpy, sys
from pathlib import Path
conv, pre = Path(sys.argv[1]), sys.argv[2]
sys.argv = [str(conv)] + sys.argv[3:]
sys.path[:0] = [str(conv.parent), str(conv.parent / "gguf-py")]
import conversion.base as base
if pre:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(str(conv), run_name="__main__")
"""

_found: dict[str, Path | None] = {}


def _wanted(rel: PurePosixPath) -> bool:
    """The converter and what it imports: conversion/*.py and the vendored gguf package."""
    parts = rel.parts
    if ".." in parts or rel.is_absolute():
        return False
    return (parts == (SCRIPT,)
            or (len(parts) == 2 and parts[0] == "conversion" and rel.suffix == ".py")
            or (len(parts) == 3 and parts[:2] == ("gguf-py", "gguf") and rel.suffix in (".py", ".typed")))


def extract(sdist: Path, into: Path, wanted=_wanted) -> None:
    """The files of llama-cpp-python's sdist under vendor/llama.cpp/ that `wanted` keeps, under
    `into` with the tree's layout (the converter finds conversion/ and gguf-py/ beside it)."""
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            name = PurePosixPath(member.name)
            try:
                rel = name.relative_to(name.parts[0], "vendor", "llama.cpp")
            except ValueError:
                continue
            if wanted(rel):
                dest = into.joinpath(*rel.parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tar.extractfile(member).read())


def _sdists() -> list[Path]:
    """The downloaded sdists, this version first."""
    return (sorted(SDIST_FOLDER.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
            + sorted(SDIST_FOLDER.glob("llama_cpp_python-*.tar.gz")))


def _scratch(prefix: str) -> Path:
    """A temporary folder removed when the test session ends."""
    into = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, into, True)
    return into


def _from(path: Path) -> Path | None:
    if path.is_file() and path.name == SCRIPT:
        return path
    if path.is_dir():
        for candidate in (path / SCRIPT, path / "vendor" / "llama.cpp" / SCRIPT):
            if candidate.is_file():
                return candidate
        return None
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        into = _scratch("twice-llamacpp-")
        extract(path, into)
        return into / SCRIPT if (into / SCRIPT).is_file() else None
    return None


def converter() -> Path | None:
    """The path of convert_hf_to_gguf.py (extracted once per session), or None."""
    if "script" not in _found:
        given = os.environ.get("TWICE_LLAMA_CPP_CONVERT")
        if given:
            _found["script"] = _from(Path(given))
        else:
            candidates = sorted(PEER_SRC.glob(f"llama_cpp_python-*/vendor/llama.cpp/{SCRIPT}"))
            candidates += _sdists()
            _found["script"] = next((s for s in map(_from, candidates) if s is not None), None)
    return _found["script"]


def _ggml_wanted(rel: PurePosixPath) -> bool:
    """What llama.cpp's reference quantizers compile from: ggml/include/*.h, ggml/src/*.h,
    ggml/src/ggml-cpu/*.h and ggml/src/ggml-quants.c."""
    parts = rel.parts
    if ".." in parts or rel.is_absolute() or parts[:1] != ("ggml",):
        return False
    return (rel.suffix == ".h" and parts[1:-1] in (("include",), ("src",), ("src", "ggml-cpu"))) or (
        parts[1:] == ("src", "ggml-quants.c"))


def ggml_source() -> Path | None:
    """A ggml source tree holding src/ggml-quants.c (llama.cpp's C reference quantizers), first
    hit wins: $TWICE_GGML_SRC (ggml's repository, llama.cpp's tree or its ggml/ folder), the
    peer's unpacked sdist, or the few files extracted from the sdist in .venv/llama-cpp-sdist
    (once per test session, into a temporary folder removed at exit); None without any."""
    if "ggml" not in _found:
        roots = [Path(os.environ["TWICE_GGML_SRC"])] if os.environ.get("TWICE_GGML_SRC") else []
        roots += sorted(PEER_SRC.glob("llama_cpp_python-*/vendor/llama.cpp"))
        found = next((cand for root in roots for cand in (root, root / "ggml", root / "vendor" / "llama.cpp" / "ggml")
                      if (cand / "src" / "ggml-quants.c").is_file() and (cand / "include" / "ggml.h").is_file()), None)
        if found is None and not os.environ.get("TWICE_GGML_SRC") and _sdists():
            into = _scratch("twice-ggml-")
            extract(_sdists()[0], into, _ggml_wanted)
            if (into / "ggml" / "src" / "ggml-quants.c").is_file():
                found = into / "ggml"
        _found["ggml"] = found
    return _found["ggml"]


def convert(folder: Path, out: Path, outtype: str, pre: str | None = "gpt-2") -> Path:
    """llama.cpp's converter on `folder` → `out` (skips the test where it is not here)."""
    script = converter()
    if script is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not here (the README's test command downloads "
                    "llama-cpp-python's sdist into .venv/llama-cpp-sdist; or set TWICE_LLAMA_CPP_CONVERT)")
    p = subprocess.run([sys.executable, "-c", _WRAPPER, str(script), pre or "", str(folder), "--outtype", outtype,
                        "--outfile", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def llama_cpp_python() -> str | None:
    """A Python that can import llama_cpp: this one, $TWICE_LLAMA_CPP_PYTHON, or the peer
    benchmark's /work/peer-venv/bin/python; None where there is none."""
    if "python" not in _found:
        found = None
        try:
            import llama_cpp  # noqa: F401

            found = sys.executable
        except ImportError:
            for other in (os.environ.get("TWICE_LLAMA_CPP_PYTHON"), str(PEER_PYTHON)):
                if other and Path(other).is_file():
                    ok = subprocess.run([other, "-c", "import llama_cpp"], capture_output=True).returncode == 0
                    if ok:
                        found = other
                        break
        _found["python"] = found
    return _found["python"]


_LOGITS = """
import json, sys
import numpy as np
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], verbose=False, n_ctx=64, n_threads=1, logits_all=True)
ids = json.loads(sys.argv[2])
llm.eval(ids)
print(json.dumps({"n_vocab": llm.n_vocab(), "logits": np.asarray(llm.scores[:len(ids)]).tolist()}))
"""


def llama_logits(path: Path, ids: list[int]):
    """llama.cpp's logits (one row per id) of the GGUF at `path` (skips where llama_cpp is not
    importable)."""
    import json

    import torch

    python = llama_cpp_python()
    if python is None:
        pytest.skip("llama_cpp is not importable (set TWICE_LLAMA_CPP_PYTHON to a Python that has it)")
    p = subprocess.run([python, "-c", _LOGITS, str(path), json.dumps(ids)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    return torch.tensor(result["logits"]), result["n_vocab"]


_VOCAB = """
import json, sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
job = json.loads(sys.stdin.read())
print(json.dumps({"ids": [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in job["texts"]],
                  "bytes": [list(llm.detokenize(ids, special=job["special"])) for ids in job["decode"]]}))
"""


def llama_vocab(path: Path, texts: list[str], decode: list[list[int]] = (), special: bool = True,
                skip: bool = True) -> tuple[list[list[int]], list[str]] | None:
    """llama.cpp's tokens (BOS as the file says, special tokens parsed) of each text and its
    detokenized text of each id list in `decode` (special tokens written out where `special`),
    from the GGUF at `path`. Where llama_cpp is not importable: skips the test, or returns None
    with skip=False (for tests that check llama.cpp only where it is there)."""
    import json

    python = llama_cpp_python()
    if python is None:
        if skip:
            pytest.skip("llama_cpp is not importable (set TWICE_LLAMA_CPP_PYTHON to a Python that has it)")
        return None
    job = {"texts": list(texts), "decode": [list(ids) for ids in decode], "special": special}
    p = subprocess.run([python, "-c", _VOCAB, str(path)], input=json.dumps(job), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    return result["ids"], [bytes(b).decode("utf-8") for b in result["bytes"]]


def llama_tokens(path: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's tokens of each text (llama_vocab's), skipping where llama_cpp is not importable."""
    return llama_vocab(path, texts)[0]
