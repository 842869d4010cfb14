"""`twice quantize` of a model whose tokenizer is SentencePiece-style BPE (byte fallback, spaces
as "▁"): the GGUF holds llama.cpp's "llama" tokenizer (tokens, scores ranking the merges as the
tokenizer.json does, token types, add_space_prefix), and the tokenizer twice rebuilds from the
file encodes and decodes as transformers' tokenizer of the folder (Gemma's style without a
prefix space, Llama 2's with one); llama.cpp's own tokenizer agrees where its package is here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tiny
from clirun import run_inprocess
from llamacpp import llama_tokens
from twice.weights.gguf_file import read_gguf
from twice.weights.load import load

TEXTS = tiny.CORPUS + ["  two  spaces\tand\ttabs 0123456789", "x", " leading space", "ünïcödé ☃ 漢字 🙂"]


@pytest.fixture(scope="module", params=["gemma", "llama"])
def written(request, tmp_path_factory, model_dirs):
    """style → (folder, q8_0 file): tiny llama with that style's SentencePiece tokenizer."""
    root = tmp_path_factory.mktemp(f"spm-{request.param}")
    folder = Path(shutil.copytree(model_dirs("llama"), root / "model"))
    tiny.spm_tokenizer(folder, request.param)
    out = root / "model.gguf"
    from twice.weights.gguf_write import write_gguf

    write_gguf(folder, out, "q8_0")
    return request.param, folder, out


def test_the_file_holds_the_llama_tokenizer(written):
    style, folder, path = written
    meta = read_gguf(path).metadata
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_space_prefix"] is (style == "llama")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert types[tokens.index("<0x41>")] == 6 and types[tokens.index("<unk>")] == 2
    assert types[tokens.index("<bos>" if style == "gemma" else "<s>")] == 3
    assert tokens[-1] == "[PAD511]" and types[-1] == 5  # the vocabulary padded to the model's 512


def sentencepiece_ids(folder: Path, text: str) -> list[int]:
    """sentencepiece itself on the folder's tokenizer.model, with the BOS both tokenizers add."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    return [sp.bos_id(), *sp.encode(text)]


def test_rebuilt_tokenizer_encodes_as_transformers_and_sentencepiece(written):
    """transformers' tokenizer of the folder, except that a text beginning with a space gets the
    prefix space anyway in Llama 2's style: llama.cpp and sentencepiece always prepend it, where
    transformers' Metaspace (prepend_scheme "first") does not; sentencepiece for every text."""
    from transformers import AutoTokenizer

    style, folder, path = written
    ours = load(str(path), device="cpu", dtype="float32").tokenizer
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == sentencepiece_ids(folder, text), text
        if style == "gemma" or not text[:1].isspace():
            assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    if style == "gemma":
        text = "<start_of_turn>user\nHi<end_of_turn>\n"
        assert ours.encode(text) == theirs.encode(text)


@pytest.mark.slow
def test_llama_cpp_tokenizes_the_file_alike(written):
    """llama.cpp's own tokenizer on twice's file: sentencepiece's tokens for every text."""
    style, folder, path = written
    assert llama_tokens(path, TEXTS) == [sentencepiece_ids(folder, t) for t in TEXTS]


def test_a_tokenizer_llama_cpp_cannot_hold_is_one_line(model_dirs, tmp_path, capsys):
    """A SentencePiece-style tokenizer.json that also splits on whitespace (llama.cpp's "llama"
    tokenizer never pre-splits): refused in one line, nothing written."""
    import json

    folder = Path(shutil.copytree(model_dirs("llama"), tmp_path / "model"))
    tiny.spm_tokenizer(folder, "llama")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    r = run_inprocess(["quantize", str(folder), str(out), "--type", "q8_0"], capsys)
    assert r.code == 2, r
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("twice: error: ") and "cannot be written as GGUF" in lines[0], r.err
    assert list(out.parent.iterdir()) == []
