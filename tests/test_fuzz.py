"""Fuzzing the parsers that read untrusted bytes: only twice's own errors may come out.

* the safetensors header reader (weights.checkpoint: validate_header, TensorFile, the
  shard index), on random bytes, on headers built from random JSON values, and on
  mutations of a real file;
* the GGUF converter (weights.gguf.convert_gguf) on mutations and truncations of a small
  valid GGUF file;
* the batch input parser and the --resume scanner (cli.batch), and chat's /load reader;
* chat templates assembled from hostile pieces (weights.tokenizer): each render ends,
  quickly, with text or a TokenizerError.

Every test is derandomized (the same examples on every run) and bounded: all of them
together take well under a minute on one core.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import gguf
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from test_hostile_inputs import write_small_gguf
from twice.core.errors import TwiceError, WeightsError

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


# -- safetensors -------------------------------------------------------------------------
def write_safetensors(path: Path, header, data: bytes = b"", raw_header: bytes | None = None) -> Path:
    encoded = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def read_everything(path: Path) -> None:
    """What the loader does with a file: validate it, then read every float tensor."""
    from twice.core.model import Source
    from twice.weights.checkpoint import _TORCH_FLOATS, TensorFile

    tf = TensorFile(path)
    for name in tf.names:
        if tf.header[name]["dtype"] in _TORCH_FLOATS:
            tensor = tf.read(name)
            assert tuple(tensor.shape) == tf.shape(name)
            shape = tf.shape(name)
            if shape and shape[0] >= 2:  # a tensor-parallel rank's rows
                rows = tf.read(name, Source(0, 0, 1, shape[0]))
                assert rows.shape[0] == 1
            if len(shape) == 2 and shape[1] >= 2:  # ... or columns
                cols = tf.read(name, Source(1, 1, shape[1], shape[1]))
                assert torch.equal(cols, tensor[:, 1:])


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(FUZZ, max_examples=300)
@given(st.binary(max_size=300))
@example(b"")
@example(struct.pack("<Q", 2**64 - 1))
@example(struct.pack("<Q", 2) + b"{}")
@example(struct.pack("<Q", 4) + b"null")
@example(struct.pack("<Q", 3) + b"\xff\xfe{")
def test_random_bytes_are_refused_cleanly(fuzz_dir, data):
    path = fuzz_dir / "random.safetensors"
    path.write_bytes(data)
    try:
        read_everything(path)
    except WeightsError as e:
        assert "\n" not in str(e) and str(path) in str(e)


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=8))
DTYPES = st.sampled_from(["F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "f32", "", "Q4"])
DIMS = st.one_of(st.integers(-2, 6), st.sampled_from([True, 2**40, 1.0, "3", None]))
OFFSET = st.one_of(st.integers(-4, 200), st.sampled_from([True, 1.5, "0", None, 2**64]))
ENTRY = st.one_of(
    st.fixed_dictionaries({"dtype": DTYPES, "shape": st.lists(DIMS, max_size=3),
                           "data_offsets": st.lists(OFFSET, min_size=0, max_size=3)}),
    st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), JSON_SCALARS, max_size=3),
    JSON_SCALARS,
    st.lists(JSON_SCALARS, max_size=3),
)


@settings(FUZZ, max_examples=600)
@given(st.dictionaries(st.text(max_size=6), ENTRY, max_size=4), st.binary(max_size=160),
       st.sampled_from(["", "__metadata__", "dup"]))
def test_random_headers_are_refused_or_read_exactly(fuzz_dir, header, data, extra):
    path = fuzz_dir / "header.safetensors"
    raw = None
    if extra == "__metadata__":
        header["__metadata__"] = {"format": "pt"}
    elif extra == "dup" and header:  # the same name twice in the JSON text
        name, entry = next(iter(header.items()))
        raw = json.dumps(header)[:-1].encode() + b", " + json.dumps({name: entry})[1:].encode()
    write_safetensors(path, header, data, raw)
    try:
        read_everything(path)
    except WeightsError as e:
        assert "\n" not in str(e)


@pytest.fixture(scope="module")
def real_file(fuzz_dir) -> bytes:
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5).to(torch.bfloat16),
               "c": torch.zeros(0, 2), "d.ids": torch.arange(4, dtype=torch.int32)}
    save_file(tensors, fuzz_dir / "real.safetensors", metadata={"format": "pt"})
    return (fuzz_dir / "real.safetensors").read_bytes()


@settings(FUZZ, max_examples=600)
@given(st.data())
def test_mutated_real_file(fuzz_dir, real_file, data):
    (n,) = struct.unpack("<Q", real_file[:8])
    mutated = bytearray(real_file)
    for _ in range(data.draw(st.integers(1, 4), "mutations")):
        where = data.draw(st.integers(0, 8 + n - 1), "position")  # the length field and the JSON
        mutated[where] = data.draw(st.integers(0, 255), "byte")
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(mutated))), "truncate")
    if cut is not None:
        del mutated[cut:]
    path = fuzz_dir / "mutated.safetensors"
    path.write_bytes(bytes(mutated))
    try:
        read_everything(path)
    except WeightsError as e:
        assert "\n" not in str(e)


@settings(FUZZ, max_examples=150)
@given(st.one_of(st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
                 st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                     st.dictionaries(st.text(max_size=10), inner,
                                                                                     max_size=3)),
                              max_leaves=6).map(json.dumps),
                 st.dictionaries(st.sampled_from(["a", "model.norm.weight"]),
                                 st.sampled_from(["model.safetensors", "../x.safetensors", "/etc/passwd", ".hidden",
                                                  "", 3, None, "shard.safetensors"]), max_size=2)
                 .map(lambda m: json.dumps({"weight_map": m}))))
def test_shard_index(fuzz_dir, real_file, text):
    from twice.weights.checkpoint import checkpoint_files

    folder = fuzz_dir / "indexed"
    folder.mkdir(exist_ok=True)
    (folder / "shard.safetensors").write_bytes(real_file)
    (folder / "model.safetensors.index.json").write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        files = checkpoint_files(folder)
    except TwiceError as e:
        assert "\n" not in str(e)
    else:
        assert all(f.parent == folder for f in files)


# -- GGUF --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def valid_gguf(fuzz_dir) -> tuple[bytes, int]:
    from twice.weights.gguf import convert_gguf

    path = write_small_gguf(fuzz_dir / "small.gguf")
    convert_gguf(path, fuzz_dir / "small-converted")  # the unmutated file converts
    return path.read_bytes(), gguf.GGUFReader(path).data_offset


def try_convert(fuzz_dir: Path, data: bytes) -> None:
    from twice.weights.gguf import convert_gguf

    src, dest = fuzz_dir / "mutated.gguf", fuzz_dir / "mutated-out"
    src.write_bytes(data)
    shutil.rmtree(dest, ignore_errors=True)
    started = time.monotonic()
    try:
        convert_gguf(src, dest)
    except TwiceError as e:
        assert "\n" not in str(e) and str(src) in str(e)
        assert not dest.exists()  # nothing half-written is left behind
    else:
        assert (dest / "config.json").is_file() and (dest / "model.safetensors").is_file()
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    assert time.monotonic() - started < 10


@settings(FUZZ, max_examples=600)
@given(st.data())
def test_mutated_gguf(fuzz_dir, valid_gguf, data):
    original, header_end = valid_gguf
    mutated = bytearray(original)
    for _ in range(data.draw(st.integers(1, 6), "mutations")):
        # Mostly the header, metadata and tensor table (where parsing happens), sometimes the data.
        region = data.draw(st.sampled_from(["header", "header", "header", "anywhere"]), "region")
        end = header_end if region == "header" else len(mutated)
        where = data.draw(st.integers(4, end - 1), "position")
        value = data.draw(st.one_of(st.integers(0, 255), st.sampled_from([0, 0xFF, 0x7F, 0x80])), "byte")
        mutated[where] = value
    cut = data.draw(st.one_of(st.none(), st.none(), st.integers(4, len(mutated))), "truncate")
    if cut is not None:
        del mutated[cut:]
    try_convert(fuzz_dir, bytes(mutated))


@settings(FUZZ, max_examples=100)
@given(st.binary(max_size=200))
def test_random_bytes_after_the_gguf_magic(fuzz_dir, data):
    try_convert(fuzz_dir, b"GGUF" + data)


# -- batch input, --resume output, chat /load ----------------------------------------------
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=10),
              st.sampled_from(["\ud800", "", " ", "x\u2028y"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
LINE_KEYS = st.sampled_from(["id", "prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                             "stop", "other"])
MESSAGE = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", 3]),
                                           "content": st.one_of(st.text(max_size=10), st.integers())}),
                    JSON_VALUES)
LINE_OBJECT = st.dictionaries(LINE_KEYS, st.one_of(JSON_VALUES, st.lists(MESSAGE, max_size=3)), max_size=6)
LINE = st.one_of(LINE_OBJECT.map(lambda o: json.dumps(o, ensure_ascii=False)), JSON_VALUES.map(json.dumps),
                 st.text(max_size=30), st.sampled_from(["{", "[" * 5000, '{"id": 1, "prompt": "\\ud800"}', "\ufeff{}"]))


@settings(FUZZ, max_examples=600)
@given(st.lists(LINE, max_size=6), st.sampled_from(["\n", "\r\n"]), st.sampled_from(["txt", "jsonl"]))
def test_batch_lines(lines, newline, fmt):
    from twice.cli.batch import line_settings
    from twice.cli.batch_input import parse_input
    from twice.core.engine import GenerationSettings

    text = newline.join(lines)
    records, errors = parse_input(text, fmt)
    assert all("\n" not in e.message and e.line >= 1 for e in errors)
    assert len({r.key for r in records}) == len(records)
    base = GenerationSettings(max_new_tokens=8)
    for record in records:
        assert (record.prompt is None) != (record.messages is None)
        try:
            line_settings(record, base)  # per-line options were checked: building settings works
        except TwiceError:
            pytest.fail(f"line {record.line}: options passed parsing but the settings refuse them: {record.options}")


@settings(FUZZ, max_examples=400)
@given(st.one_of(st.binary(max_size=200),
                 st.lists(st.one_of(JSON_VALUES.map(lambda v: json.dumps(v).encode()),
                                    st.fixed_dictionaries({"id": st.one_of(st.text(max_size=4), st.integers()),
                                                           "finish_reason": st.sampled_from(["eos", "length", 3])})
                                    .map(lambda d: json.dumps(d).encode()),
                                    st.binary(max_size=20)), max_size=5)
                 .flatmap(lambda ls: st.sampled_from([b"\n".join(ls), b"\n".join(ls) + b"\n"]))))
def test_resume_scanner(data):
    from twice.cli.batch_output import scan_output

    try:
        state = scan_output(data, "out.jsonl")
    except TwiceError as e:
        assert "\n" not in str(e)
    else:
        keep = len(data) if state.keep_bytes is None else state.keep_bytes
        assert keep <= len(data) and (keep == 0 or data[keep - 1:keep] == b"\n")


@settings(FUZZ, max_examples=250)
@given(st.one_of(st.binary(max_size=80),
                 st.fixed_dictionaries({"version": st.sampled_from([1, 1, 2, "1", None]),
                                        "system": st.one_of(st.none(), st.text(max_size=5), st.integers()),
                                        "model": st.one_of(st.none(), st.text(max_size=5), st.lists(st.none())),
                                        "messages": st.one_of(st.lists(MESSAGE, max_size=4), JSON_VALUES)})
                 .map(lambda d: json.dumps(d).encode()),
                 JSON_VALUES.map(lambda v: json.dumps(v).encode())))
def test_chat_load(fuzz_dir, data):
    from twice.cli.conversation_file import read_conversation

    path = fuzz_dir / "conversation.json"
    path.write_bytes(data)
    try:
        system, messages, model = read_conversation(path)
    except ValueError as e:
        assert "\n" not in str(e)
    else:
        assert system is None or isinstance(system, str)
        assert all(m["role"] in ("user", "assistant") and isinstance(m["content"], str) for m in messages)


# -- chat templates ------------------------------------------------------------------------
PIECES = [
    "{% for m in messages %}", "{% endfor %}", "{{ m.content }}", "{{ m['role'] }}", "{{ bos_token }}",
    "{% for i in range(100000) %}", "{% for j in range(100000) %}", "{{ 'x' * 100000 }}", "{{ '%s' % i }}",
    "{% set ns = namespace(s='ab') %}", "{% set ns.s = ns.s ~ ns.s %}", "{% set ns.s = ns.s + ns.s %}",
    "{{ ns.s|length }}", "{{ ''.__class__ }}", "{{ cycler.__init__.__globals__ }}", "{{ messages|tojson }}",
    "{{ 'ab'.center(1000) }}", "{{ '{:>9}'.format(1) }}", "{{ raise_exception('no') }}", "{% if m %}",
    "{% endif %}", "{{ lipsum(2) }}", "{{ 2 ** 300 }}", "{{ m.content|upper|replace('A', 'bb') }}",
    "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}", "{{ f(1) }}", "{{ undefined_thing.x }}", "text",
    "{{ messages[0].content * 1000 }}", "{{ (messages|list) * 1000 }}",
]


@settings(FUZZ, max_examples=200)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=8))
def test_chat_templates_end_quickly(fuzz_dir, tokenizer, pieces):
    from twice.weights.chat_template import TemplateLimits
    from twice.weights.tokenizer import Tokenizer

    folder = fuzz_dir / "template"
    if not folder.exists():
        folder.mkdir()
        tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                              "chat_template": "".join(pieces)}))
    tok = Tokenizer(folder)
    started = time.monotonic()
    try:
        text = tok.render_chat([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}])
    except TwiceError as e:
        assert "\n" not in str(e)
    else:
        assert len(text) <= TemplateLimits.items
    assert time.monotonic() - started < TemplateLimits.seconds + 1
