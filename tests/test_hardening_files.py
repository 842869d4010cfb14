"""Files twice reads, hardened (issue 13, items 3, 4, 11 and the GGUF part of 10):

* two checkpoint tensors for one parameter (a tied head stored as both embed_tokens and
  lm_head) are accepted only when equal, whatever the order of the header;
* safetensors files whose tensors overlap, leave gaps or stop short of the end are refused,
  exactly where the safetensors library refuses them;
* GGUF files whose tensors are misaligned, overlapping, leave gaps or lie outside the file,
  or whose tensor table or metadata is impossible, are refused before any data is read, as
  llama.cpp refuses them; metadata arrays are bounded before they are read;
* a FIFO in the place of any file of a model (or named as the model) is refused, never
  opened blocking: `twice generate` and `twice info` end with one line instead of hanging.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import threading
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from clirun import run_inprocess
from test_fuzz import FUZZ
from test_hostile_inputs import one_error_line, write_small_gguf
from twice.core.cache import KVCache
from twice.core.errors import UnsupportedModelError, WeightsError
from twice.weights import gguf_file
from twice.weights.checkpoint import validate_header
from twice.weights.gguf import convert_gguf
from twice.weights.gguf_file import read_gguf
from twice.weights.load import load

IDS = torch.tensor([[5, 17, 99, 200, 31, 7]])


def logits(folder: Path) -> torch.Tensor:
    m = load(str(folder), device="cpu").model
    with torch.inference_mode():
        return m(IDS, KVCache(m.config, 1, 32, torch.float32, "cpu"), all_logits=True)


def write_ordered(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> Path:
    """A safetensors file whose header and data list the tensors in exactly this order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, t in tensors:
        raw = t.to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
    return path


# -- item 3: two tensors for one parameter ------------------------------------------------------
@pytest.fixture(scope="module")
def tied(model_dirs):
    src = model_dirs("llama3")  # tie_word_embeddings = true, only embed_tokens stored
    tensors = load_file(src / "model.safetensors")
    assert "lm_head.weight" not in tensors
    return src, tensors


@pytest.mark.parametrize("head_first", [False, True], ids=["embed-first", "head-first"])
def test_a_tied_head_stored_twice_with_equal_values_is_accepted(tied, tmp_path, head_first):
    src, tensors = tied
    dest = tmp_path / "both"
    shutil.copytree(src, dest)
    items = [("lm_head.weight", tensors["model.embed_tokens.weight"].clone())]
    items = items + list(tensors.items()) if head_first else list(tensors.items()) + items
    write_ordered(dest / "model.safetensors", items)
    assert torch.equal(logits(src), logits(dest))


@pytest.mark.parametrize("head_first", [False, True], ids=["embed-first", "head-first"])
def test_a_tied_head_stored_twice_with_different_values_is_refused(tied, tmp_path, capsys, head_first):
    src, tensors = tied
    dest = tmp_path / "both"
    shutil.copytree(src, dest)
    other = tensors["model.embed_tokens.weight"].clone()
    other[3, 5] += 1  # one value differs
    items = [("lm_head.weight", other)]
    items = items + list(tensors.items()) if head_first else list(tensors.items()) + items
    write_ordered(dest / "model.safetensors", items)
    before = (dest / "model.safetensors").read_bytes()
    line = one_error_line(run_inprocess(["generate", "hi", "--model", str(dest), "-n", "1", "--raw"], capsys))
    assert "'model.embed_tokens.weight'" in line and "'lm_head.weight'" in line, line
    assert "hold different values" in line and "tie_word_embeddings" in line, line
    assert (dest / "model.safetensors").read_bytes() == before


def test_two_tensors_for_one_parameter_in_different_shards(tied, tmp_path):
    src, tensors = tied
    dest = tmp_path / "shards"
    shutil.copytree(src, dest)
    (dest / "model.safetensors").unlink()
    other = tensors["model.embed_tokens.weight"] * 2
    write_ordered(dest / "a.safetensors", list(tensors.items()))
    write_ordered(dest / "b.safetensors", [("lm_head.weight", other)])
    weight_map = {**{n: "a.safetensors" for n in tensors}, "lm_head.weight": "b.safetensors"}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError) as info:
        load(str(dest), device="cpu")
    message = str(info.value)
    assert "(in a.safetensors)" in message and "(in b.safetensors)" in message and "different values" in message


def test_gpt2_names_with_and_without_transformer_prefix(model_dirs, tmp_path):
    src = model_dirs("gpt2")
    tensors = load_file(src / "model.safetensors")
    dest = tmp_path / "gpt2"
    shutil.copytree(src, dest)
    name = next(n for n in tensors if n.endswith("ln_f.bias"))
    twin = name.removeprefix("transformer.") if name.startswith("transformer.") else f"transformer.{name}"
    write_ordered(dest / "model.safetensors", [*tensors.items(), (twin, tensors[name])])
    assert torch.equal(logits(src), logits(dest))
    write_ordered(dest / "model.safetensors", [(twin, tensors[name] + 1), *tensors.items()])
    with pytest.raises(WeightsError, match="hold different values; remove one of them"):
        load(str(dest), device="cpu")


# -- item 4: safetensors layouts, as the safetensors library judges them ------------------------
def raw_safetensors(path: Path, entries: dict, data_bytes: int) -> Path:
    encoded = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data_bytes))
    return path


def f32(start: int, end: int, n: int | None = None) -> dict:
    return {"dtype": "F32", "shape": [(end - start) // 4 if n is None else n], "data_offsets": [start, end]}


LAYOUTS = {
    "in order": ({"a": f32(0, 8), "b": f32(8, 16)}, 16, None),
    "header in another order": ({"b": f32(8, 16), "a": f32(0, 8)}, 16, None),
    "zero-size tensors between": ({"z": f32(0, 0), "a": f32(0, 8), "y": f32(8, 8), "b": f32(8, 12)}, 12, None),
    "no tensors": ({}, 0, None),
    "overlap": ({"a": f32(0, 8), "b": f32(4, 8)}, 8, "overlaps tensor 'a'"),
    "one span for two tensors": ({"a": f32(0, 8), "b": f32(0, 8)}, 8, "overlaps tensor 'a'"),
    "gap": ({"a": f32(0, 4), "b": f32(8, 12)}, 12, "bytes 4-8 of the data, before tensor 'b', belong to no tensor"),
    "gap before the first": ({"a": f32(4, 8)}, 8, "bytes 0-4 of the data"),
    "bytes after the last": ({"a": f32(0, 4)}, 5, "its last 1 bytes belong to no tensor"),
    "data but no tensors": ({}, 3, "its last 3 bytes belong to no tensor"),
    "__metadata__ not strings": ({"__metadata__": {"format": 1}, "a": f32(0, 4)}, 4, "__metadata__"),
}


@pytest.mark.parametrize("case", LAYOUTS, ids=list(LAYOUTS))
def test_safetensors_layouts_are_judged_as_the_library_judges_them(tmp_path, case):
    from safetensors import safe_open

    entries, data_bytes, words = LAYOUTS[case]
    path = raw_safetensors(tmp_path / "t.safetensors", entries, data_bytes)
    try:
        with safe_open(path, "pt"):
            library_accepts = True
    except Exception:
        library_accepts = False
    assert library_accepts == (words is None)
    if words is None:
        assert validate_header(path).keys() == entries.keys()
    else:
        with pytest.raises(WeightsError) as info:
            validate_header(path)
        assert str(path) in str(info.value) and words in str(info.value), str(info.value)


SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "U8": 1}


@pytest.fixture(scope="module")
def layout_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@settings(FUZZ, max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(sorted(SIZES)), st.lists(st.integers(0, 3), max_size=3)), max_size=5),
       st.randoms(use_true_random=False), st.sampled_from([0, 0, 0, -1, 1, 4]),
       st.lists(st.tuples(st.integers(0, 4), st.integers(-5, 5), st.booleans()), max_size=2))
def test_layouts_agree_with_the_safetensors_library(layout_dir, tensors, rnd, extra, shifts):
    """Random tilings, shuffled in the header and then perturbed (a start or an end moved,
    the file a little longer or shorter): accepted exactly when the library accepts them."""
    from safetensors import safe_open

    order = list(range(len(tensors)))
    rnd.shuffle(order)
    entries, offset = {}, 0
    for i in order:
        dtype, shape = tensors[i]
        size = SIZES[dtype] * math.prod(shape)
        entries[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    for which, delta, both in shifts:
        if entries:
            span = entries[f"t{which % len(entries)}"]["data_offsets"]
            span[0] += delta
            span[1] += delta if both else 0
    names = list(entries)
    rnd.shuffle(names)
    path = raw_safetensors(layout_dir / "t.safetensors", {n: entries[n] for n in names},
                           max(0, offset + extra))
    try:
        with safe_open(path, "pt"):
            library_accepts = True
    except Exception:
        library_accepts = False
    try:
        validate_header(path)
        we_accept = True
    except WeightsError as e:
        assert "\n" not in str(e)
        we_accept = False
    assert we_accept == library_accepts, entries


def test_an_overlapping_checkpoint_is_refused_through_the_cli(model_dirs, tmp_path, capsys):
    dest = tmp_path / "model"
    shutil.copytree(model_dirs("llama"), dest)
    path = dest / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    names = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    # The second tensor (by offset) gets the first one's bytes: same size needed, so use norms.
    norms = [k for _, k in names if k.endswith("layernorm.weight")]
    header[norms[1]]["data_offsets"] = header[norms[0]]["data_offsets"]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + n :])
    for command in (["generate", "hi", "--model", str(dest), "-n", "1"], ["info", str(dest)]):
        line = one_error_line(run_inprocess(command, capsys))
        assert "model.safetensors: corrupt safetensors file" in line and "overlaps" in line, line


# -- item 4: GGUF layouts, as llama.cpp judges them ---------------------------------------------
@pytest.fixture
def small_gguf(tmp_path) -> Path:
    return write_small_gguf(tmp_path / "model.gguf")


@contextmanager
def patching(path: Path):
    """GGUFReader over `path` in read-write mode: assigning into its parts edits the file."""
    reader = gguf.GGUFReader(path, "r+")
    yield reader
    reader.data.flush()
    del reader


def refused(src: Path, error=WeightsError, *words: str) -> str:
    dest = src.parent / "out"
    with pytest.raises(error) as info:
        convert_gguf(src, dest)
    message = str(info.value)
    assert "\n" not in message and str(src) in message, message
    for w in words:
        assert w in message, (w, message)
    assert not dest.exists()
    return message


def test_our_reader_reads_what_gguf_reader_reads(small_gguf):
    ours, theirs = read_gguf(small_gguf), gguf.GGUFReader(small_gguf)
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


@pytest.mark.parametrize("variant", ["big-endian", "aligned-64"])
def test_other_byte_order_and_alignment_convert(tmp_path, monkeypatch, capsys, variant):
    class Writer(gguf.GGUFWriter):
        def __init__(self, *args, **kwargs):
            if variant == "big-endian":
                kwargs["endianess"] = gguf.GGUFEndian.BIG
            super().__init__(*args, **kwargs)
            if variant == "aligned-64":
                self.add_custom_alignment(64)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    src = write_small_gguf(tmp_path / "m.gguf", qtype=None)
    monkeypatch.undo()
    ours, theirs = read_gguf(src), gguf.GGUFReader(src)
    assert ours.alignment == theirs.alignment == (64 if variant == "aligned-64" else 32)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(a.data, b.data)
    convert_gguf(src, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # The float copy holds the file's values (gguf's dequantize viewed a big-endian F32 tensor
    # as this machine's floats: garbage), and as stored gives the same tokens.
    converted = load_file(str(tmp_path / "out" / "model.safetensors"))
    norm = next(t for t in theirs.tensors if t.name == "blk.0.attn_norm.weight")
    assert np.array_equal(converted["model.layers.0.input_layernorm.weight"].numpy(), norm.data.astype(np.float32))
    runs = [run_inprocess(["generate", "hi", "--raw", "-n", "4", "--temperature", "0", "--json", "--model", str(src),
                           *flag], capsys) for flag in ([], ["--dequantize"])]
    assert all(r.code == 0 for r in runs), [r.err for r in runs]
    assert json.loads(runs[0].out)["token_ids"] == json.loads(runs[1].out)["token_ids"]


def test_misaligned_overlapping_and_gapped_tensors_are_refused(small_gguf):
    original = small_gguf.read_bytes()
    cases = [
        (1, +4, "is not aligned to 32 bytes"),
        (2, None, "inside tensor"),  # starts where tensor 1 starts
        (1, +64, "64 bytes after tensor"),  # a gap (and an overlap with the next)
        (-1, +64, "but the file has"),
        (3, 2**63, "ends at byte 9,223,372,036,854,7"),  # far outside the file
    ]
    for index, change, words in cases:
        small_gguf.write_bytes(original)
        with patching(small_gguf) as r:
            offset = r.tensors[index].field.parts[5]
            offset[0] = r.tensors[1].field.parts[5][0] if change is None else (int(offset[0]) + change) % 2**64
        refused(small_gguf, WeightsError, "truncated or corrupt GGUF file", words)


def test_tensors_laid_out_in_another_order_than_the_table_read_as_gguf_reads_them(small_gguf, tmp_path):
    """The format asks only for aligned offsets: a file whose tensor data lies in another
    order than its table (two tensors' bytes and offsets swapped) is the same model. It was
    refused as corrupt; a size that lies still shows as a gap or an overlap."""
    import gguf

    original = read_gguf(small_gguf)
    a, b = [t for t in original.tensors if t.n_bytes == original.tensors[1].n_bytes][:2]
    want = {t.name: np.array(t.data) for t in original.tensors}  # copies: the file is rewritten below
    data = bytearray(small_gguf.read_bytes())
    bytes_a = data[a.data_offset:a.data_offset + a.n_bytes]
    data[a.data_offset:a.data_offset + a.n_bytes] = data[b.data_offset:b.data_offset + b.n_bytes]
    data[b.data_offset:b.data_offset + b.n_bytes] = bytes_a
    small_gguf.write_bytes(bytes(data))
    with patching(small_gguf) as r:
        fields = {t.name: t.field.parts[5] for t in r.tensors}
        fields[a.name][0], fields[b.name][0] = int(fields[b.name][0]), int(fields[a.name][0])
    ours, theirs = read_gguf(small_gguf), gguf.GGUFReader(small_gguf)
    for t, g in zip(ours.tensors, theirs.tensors, strict=True):
        assert np.array_equal(t.data, g.data) and np.array_equal(np.asarray(t.data), want[t.name]), t.name


def test_the_loader_walks_past_the_vocabulary_without_making_it(small_gguf, monkeypatch):
    """Loading as stored reads the header again for its tensor table: the tokenizer's arrays
    (150k strings and merges, tens of MB of Python objects at the load's peak) are walked and
    bounds-checked but not made (big_arrays=False); the table and the sizes are the same."""
    from twice.weights import gguf_file
    from twice.weights.gguf_file import Skipped

    monkeypatch.setattr(gguf_file, "BIG_ARRAY", 8)  # the tiny vocabulary counts as big here
    whole, lean = read_gguf(small_gguf), read_gguf(small_gguf, big_arrays=False)
    tokens = lean.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, Skipped) and len(tokens) == len(whole.metadata["tokenizer.ggml.tokens"]) > 8
    assert [(t.name, t.data_offset, t.n_bytes) for t in lean.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in whole.tensors]
    small = {k: v for k, v in whole.metadata.items() if not isinstance(lean.metadata[k], Skipped)}
    assert small and all(lean.metadata[k] == v for k, v in small.items())
    # a string past the end of the file is refused while skipping too
    data = small_gguf.read_bytes()
    start = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8
    small_gguf.write_bytes(data[:start] + struct.pack("<Q", 1 << 40) + data[start + 8:])
    with pytest.raises(WeightsError, match="runs past the end of the file"):
        read_gguf(small_gguf, big_arrays=False)


def test_tensors_outside_the_file_are_refused(small_gguf):
    data = small_gguf.read_bytes()
    last = read_gguf(small_gguf).tensors[-1]
    small_gguf.write_bytes(data[: last.data_offset + last.n_bytes - 1])
    refused(small_gguf, WeightsError, f"tensor {last.name} ends at byte {last.data_offset + last.n_bytes:,}")


def test_impossible_tensor_tables_are_refused(small_gguf):
    original = small_gguf.read_bytes()

    def case(edit, error, *words):
        small_gguf.write_bytes(original)
        with patching(small_gguf) as r:
            edit(r)
        refused(small_gguf, error, *words)

    def n_dims(r):
        r.tensors[0].field.parts[2][0] = 5

    def negative(r):
        r.tensors[0].field.parts[3][1] = 2**64 - 3

    def overflow(r):
        r.tensors[0].field.parts[3][:] = [2**62, 4]

    def unknown_type(r):
        r.tensors[0].field.parts[4][0] = 4  # Q4_2, removed from ggml

    def row_not_in_blocks(r):
        t = next(t for t in r.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0)
        t.field.parts[3][0] = 48  # Q8_0 blocks hold 32 values

    def twice_named(r):
        gate = next(t for t in r.tensors if t.name == "blk.0.ffn_gate.weight")
        gate.field.parts[1][:] = np.frombuffer(b"blk.0.ffn_down.weight", np.uint8)

    case(n_dims, WeightsError, "has 5 dimensions, more than 4")
    case(negative, WeightsError, "has a negative dimension")
    case(overflow, WeightsError, "more than 63 bits can count")
    case(unknown_type, UnsupportedModelError, "tensor type 4")
    case(row_not_in_blocks, WeightsError, "48 values per row, not a multiple of the 32 of a Q8_0 block")
    case(twice_named, WeightsError, "tensor blk.0.ffn_down.weight appears twice")


@pytest.mark.parametrize("alignment, words", [(48, "general.alignment 48 is not a power of two"),
                                              (0, "general.alignment 0 is not a power of two")])
def test_bad_alignment_is_refused(tmp_path, alignment, words):
    src = write_small_gguf(tmp_path / "m.gguf", metadata={"general.alignment": alignment})
    refused(src, WeightsError, words)


def test_alignment_of_the_wrong_type_is_refused(tmp_path, monkeypatch):
    real = gguf.GGUFWriter.add_uint32

    def add_uint32(self, key, value):
        return self.add_uint64(key, value) if key == "general.alignment" else real(self, key, value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_uint32", add_uint32)
    src = write_small_gguf(tmp_path / "m.gguf", metadata={"general.alignment": 32})
    monkeypatch.undo()
    refused(src, WeightsError, "general.alignment must be a uint32, not a uint64")


def test_duplicate_metadata_keys_are_refused(tmp_path):
    src = write_small_gguf(tmp_path / "m.gguf", metadata={"general.aaaa": 1, "general.bbbb": 2})
    with patching(src) as r:
        r.fields["general.bbbb"].parts[1][:] = np.frombuffer(b"general.aaaa", np.uint8)
    refused(src, WeightsError, "metadata key 'general.aaaa' appears twice")


# -- part of item 10: counts before arrays ------------------------------------------------------
def test_counts_are_checked_before_arrays_are_read(tmp_path, monkeypatch):
    src = write_small_gguf(tmp_path / "m.gguf", metadata={"general.junk": [1, 2, 3, 4]})
    original = src.read_bytes()

    def with_count(key, count):
        src.write_bytes(original)
        with patching(src) as r:
            r.fields[key].parts[4][0] = count

    with_count("general.junk", (1 << 22) + 1)
    refused(src, WeightsError, "metadata general.junk holds 4,194,305 values, more than the 4,194,304 twice reads")
    with_count("general.junk", 3_000_000)  # under the limit, but the file cannot hold it
    refused(src, WeightsError, "truncated or corrupt GGUF file (metadata general.junk runs past the end of the file)")
    with_count("tokenizer.ggml.tokens", 2**40)
    refused(src, WeightsError, "tokenizer.ggml.tokens holds 1,099,511,627,776 values")
    with_count("tokenizer.ggml.tokens", 100_000)  # at least 8 bytes each: 800 kB, not in this file
    refused(src, WeightsError, "metadata tokenizer.ggml.tokens runs past the end of the file")
    src.write_bytes(original)
    monkeypatch.setattr(gguf_file, "MAX_ARRAY_LENGTH", 8)
    refused(src, WeightsError, "tokenizer.ggml.tokens holds 16 values, more than the 8 twice reads")
    monkeypatch.undo()
    for offset, what in ((8, "tensors"), (16, "metadata keys")):  # the header's two counts
        src.write_bytes(original[:offset] + struct.pack("<Q", 2**40) + original[offset + 8 :])
        refused(src, WeightsError, f"it claims 1,099,511,627,776 {what}, more than its")


def insert_array_elements(src: Path, key: str, extra: int) -> None:
    """Grow the uint32 metadata array `key` by `extra` zeros in place (a multiple of the
    alignment in bytes, so that the data section moves by whole units and stays valid)."""
    with patching(src) as r:
        field = r.fields[key]
        end = field.offset + sum(int(p.nbytes) for p in field.parts)
        field.parts[4][0] += extra
    data = src.read_bytes()
    src.write_bytes(data[:end] + bytes(4 * extra) + data[end:])


def test_a_two_million_element_array_costs_its_size_not_gigabytes(tmp_path):
    src = write_small_gguf(tmp_path / "m.gguf", metadata={"general.junk": [0] * 8})
    insert_array_elements(src, "general.junk", 2_000_000)
    tracemalloc.start()
    try:
        header = read_gguf(src)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(header.metadata["general.junk"]) == 2_000_008
    # An 8 MB array: a list of 2 M small ints (16 MB) and numpy's view of it, where the
    # gguf package's GGUFReader held a numpy array per element (1.6 GB, VmHWM).
    assert peak < 48 << 20, peak
    convert_gguf(src, tmp_path / "out")


# -- item 11: FIFOs are never opened blocking ---------------------------------------------------
@contextmanager
def fifo_watchdog(fifo: Path, seconds: float = 60):
    """Fails the test (instead of hanging it forever) if the code under test blocks opening
    `fifo`: after `seconds` the FIFO's write end is opened, which releases a blocked reader."""
    done, hung = threading.Event(), []

    def watch():
        if not done.wait(seconds):
            hung.append(True)
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        assert not hung, f"opening {fifo} blocked"


def shard(folder: Path) -> None:
    """Turn the folder's model.safetensors into a one-shard indexed checkpoint."""
    header = validate_header(folder / "model.safetensors")
    name = "model-00001-of-00001.safetensors"
    (folder / "model.safetensors").rename(folder / name)
    weight_map = {k: name for k in header if k != "__metadata__"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


FIFO_FILES = {
    "config.json": None,
    "generation_config.json": None,
    "tokenizer.json": None,
    "tokenizer_config.json": None,
    "chat_template.jinja": None,
    "model.safetensors": None,
    "model.safetensors.index.json": None,  # beside a model.safetensors that would otherwise load
    "model-00001-of-00001.safetensors": shard,
}


@pytest.mark.parametrize("name", FIFO_FILES, ids=list(FIFO_FILES))
def test_a_fifo_in_a_model_folder_is_refused_without_hanging(model_dirs, tmp_path, capsys, name):
    folder = tmp_path / "model"
    shutil.copytree(model_dirs("llama"), folder)
    if FIFO_FILES[name]:
        FIFO_FILES[name](folder)
    fifo = folder / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    for command in (["generate", "hi", "--model", str(folder), "-n", "1"], ["info", str(folder)]):
        with fifo_watchdog(fifo):
            line = one_error_line(run_inprocess(command, capsys))
        assert f"{fifo}: not a regular file" in line, (command[0], line)


def test_a_fifo_named_as_the_model_is_refused_without_hanging(tmp_path, capsys):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for command in (["generate", "hi", "--model", str(fifo), "-n", "1"], ["info", str(fifo)]):
        with fifo_watchdog(fifo):
            line = one_error_line(run_inprocess(command, capsys))
        assert f"{fifo}: not a regular file" in line, line
    with fifo_watchdog(fifo):
        refused(fifo, WeightsError, "not a regular file")


# -- NaN or infinite numbers inside blocks --------------------------------------------------
@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                       "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_all_finite_finds_every_scale_the_codec_reads(type_name):
    """quant.all_finite reads exactly the fp16 fields (or float values) that make the
    dequantized values NaN or infinite: a NaN or an infinity put in each field of a block is
    found, and the reference dequantizer agrees that the block went bad."""
    from twice.core import quant

    c = quant.codec(type_name)
    raw = quant.quantize(torch.randn(3, 512, generator=torch.Generator().manual_seed(1)), type_name, native=False)
    assert quant.all_finite(raw, type_name)
    fields = quant.HALF_FIELDS.get(type_name) or (0,)
    for off in fields:
        for bad in ((b"\x00\x7e", b"\x00\x7c") if type_name != "F32" else (b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f")):
            spoiled = raw.clone().reshape(-1, c.type_size)
            where = 5 if c.quantized else 1
            spoiled[where, off:off + len(bad)] = torch.tensor(list(bad), dtype=torch.uint8)
            if type_name == "BF16":
                spoiled = spoiled.reshape(-1, 2)
                spoiled[1] = torch.tensor([0x80, 0x7f], dtype=torch.uint8)  # bf16 infinity
            assert not quant.all_finite(spoiled.reshape(raw.shape), type_name), (off, bad)
            assert not torch.isfinite(quant.dequantize(spoiled.reshape(raw.shape), type_name)).all(), (off, bad)


@pytest.mark.parametrize("tensor", ["blk.0.ffn_up.weight", "blk.0.attn_norm.weight"])
def test_a_gguf_with_a_nan_scale_or_value_is_refused_as_stored_and_by_convert(tmp_path, capsys, tensor):
    """A NaN fp16 scale in a Q8_0 block ran as stored (garbage text, a perplexity of 561),
    and twice convert wrote a folder twice then refused."""
    from twice.weights.gguf_file import read_gguf

    src = write_small_gguf(tmp_path / "m.gguf")
    t = next(t for t in read_gguf(src).tensors if t.name == tensor)
    data = bytearray(src.read_bytes())
    if "ffn_up" in tensor:  # Q8_0: the first block's d, an fp16 NaN
        data[t.data_offset:t.data_offset + 2] = b"\x00\x7e"
    else:  # F32: the first value, a NaN
        data[t.data_offset:t.data_offset + 4] = b"\x00\x00\xc0\x7f"
    src.write_bytes(bytes(data))
    line = one_error_line(run_inprocess(["generate", "hi", "--raw", "-n", "2", "--model", str(src)], capsys))
    assert tensor in line and "NaN or infinite" in line, line
    out = tmp_path / "float"
    line = one_error_line(run_inprocess(["convert", str(src), str(out)], capsys))
    assert tensor in line and "NaN or infinite values" in line and not out.exists(), line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("metadata, args, words", [
    ({"tokenizer.chat_template": "{{ raise_exception('nope') }}"}, ["generate", "hi", "-n", "1", "--chat", "--model"],
     "nope (in {src}: tokenizer.chat_template)"),
    ({"tokenizer.chat_template": "{% if %}"}, ["generate", "hi", "-n", "1", "--chat", "--model"],
     "{src}: tokenizer.chat_template: chat template syntax error"),
    ({"llama.context_length": 3_000_000_000}, ["info"], "{src}: metadata llama.context_length must be at most 2,147,483,647"),
])
def test_a_gguf_s_bad_metadata_is_named_by_the_gguf_not_the_cache(tmp_path, capsys, metadata, args, words):
    """The folder twice writes into its cache from a GGUF's metadata is not the user's: errors
    about its config.json or tokenizer_config.json name the .gguf (and its key) instead."""
    src = write_small_gguf(tmp_path / "m.gguf", metadata=metadata)
    line = one_error_line(run_inprocess([*args, str(src)], capsys))
    assert words.format(src=src) in line and "as-stored" not in line, line
