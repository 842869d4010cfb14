"""GGUF files of the `gpt2` architecture, as `twice quantize` and llama.cpp's convert_hf_to_gguf.py
write them, load both ways: through the float copy (`--dequantize`, `twice convert`:
weights/gguf.py) and as stored (weights/gguf_load.py: the Conv1D matrices, [in, out] in GPT-2's
checkpoints, are [out, in] in the file, the layout of twice's linear layers, so they become
blocks untransposed; position embeddings, biases and LayerNorms with bias as float).

References built here, independently of the code under test: transformers' GPT2LMHeadModel on
the original folder, with each matrix round-tripped through its type in the file by the `gguf`
package (blocks run along the input features: the GGUF layout). The native kernels are not
built in the lean tests (twice's gpt2 decodes through PyTorch; their bit-exact dequantizer is
test_qkernels.py's): the one slow test runs generate with them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tiny
from clirun import one_error_line, run_inprocess
from twice.core import kernels
from twice.core.cache import KVCache
from twice.core.qweight import BlockLinear, BlockWeight, weight_formats
from twice.weights.gguf_file import read_gguf
from twice.weights.load import load

KINDS = ["f32", "q8_0", "q4_0"]
# checkpoint leaf → llama.cpp's, per layer; the Conv1D ones are transposed in the file.
LAYER = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
         "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
GLOBAL = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight", "ln_f.weight": "output_norm.weight",
          "ln_f.bias": "output_norm.bias"}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture(autouse=True)
def _float_products(monkeypatch):
    """Eager products in float (the dequantized blocks), the reference the as-stored model
    must equal; and no kernel build (tens of seconds) unless an earlier test built them."""
    from twice.core import qweight

    monkeypatch.setattr(qweight, "KERNEL_ROWS", 0)
    if "lib" not in kernels._STATE:
        monkeypatch.setitem(kernels._STATE, "lib", None)


@pytest.fixture(scope="module")
def files(tmp_path_factory, model_dirs):
    """kind → the tiny gpt2 written by `twice quantize --type kind` (once per module)."""
    root = tmp_path_factory.mktemp("gpt2gguf")
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            from twice.weights.gguf_write import write_gguf

            made[kind] = root / f"gpt2-{kind}.gguf"
            write_gguf(model_dirs("gpt2"), made[kind], kind)
        return made[kind]

    return get


def _ids(tokenizer) -> list[int]:
    return tokenizer.encode(tiny.CORPUS[1]).ids[:14]


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    cache = KVCache(loaded.config, 1, 32, loaded.dtype, "cpu", kv_heads=loaded.model.kv_heads)
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids]), cache, all_logits=True)[0].float()


def _gguf_name(hf: str) -> str:
    hf = hf.removeprefix("transformer.")
    if hf in GLOBAL:
        return GLOBAL[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{LAYER['.'.join(rest[:-1])]}.{rest[-1]}"


def _round_trip(values: np.ndarray, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype).reshape(values.shape)


def _reference(folder: Path, path: Path):
    """transformers' model of `folder` with every tensor round-tripped through the type the
    file stores it in (in the file's layout: Conv1D matrices transposed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    types = {t.name: t.tensor_type for t in read_gguf(path).tensors}
    with torch.no_grad():
        for name, p in model.named_parameters():
            values = p.detach().float().numpy()
            conv = name.endswith(CONV1D)
            stored = values.T.copy() if conv else values
            back = _round_trip(np.ascontiguousarray(stored, dtype=np.float32), types[_gguf_name(name)])
            p.copy_(torch.from_numpy(np.ascontiguousarray(back.T if conv else back)))
    return model


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# -- (a) the float copy ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_equals_transformers(model_dirs, files, tokenizer, kind):
    """--dequantize: the float GPT-2 folder of the file is transformers' model with each tensor
    in the file's type (f32: the original model itself), within float rounding."""
    folder, path = model_dirs("gpt2"), files(kind)
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    assert floats.config.model_type == "gpt2" and floats.config.tie_word_embeddings
    assert not any(isinstance(m, BlockLinear) for m in floats.model.modules())
    ids = _ids(tokenizer)
    want = _hf_logits(_reference(folder, path), ids)
    got = _logits(floats, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if kind != "f32":  # the quantization moved the logits (else the check above proves little)
        original = _hf_logits(_reference(folder, files("f32")), ids)
        assert float((got - original).abs().max()) > 1e-3


def test_convert_writes_a_gpt2_folder(tmp_path, capsys, model_dirs, files, tokenizer):
    """`twice convert` of an f32 gpt2 GGUF: the checkpoint's own names, shapes (Conv1D [in, out])
    and values, and a config transformers loads as the same model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder, out = model_dirs("gpt2"), tmp_path / "back"
    r = run_inprocess(["convert", str(files("f32")), str(out)], capsys)
    assert r.code == 0, r
    original, back = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    names = {k if k.startswith("transformer.") else f"transformer.{k}" for k in original}
    assert set(back) == names - {"lm_head.weight"}  # tied: the head is the embedding
    for name, value in back.items():
        torch.testing.assert_close(value, original.get(name, original.get(name.removeprefix("transformer."))),
                                   rtol=0, atol=0, msg=name)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["activation_function"] == "gelu_new"
    ids = _ids(tokenizer)
    want = _hf_logits(AutoModelForCausalLM.from_pretrained(folder).eval(), ids)
    got = _hf_logits(AutoModelForCausalLM.from_pretrained(out).eval(), ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- (b) as stored --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_as_stored_equals_dequantized(files, tokenizer, kind):
    """As stored: every Conv1D matrix of the file is a block-stored linear layer read
    untransposed (f32 in a float32 model: ordinary float parameters, read as they lie); the
    logits are the dequantized model's; resident weights are the file's tensor bytes."""
    path = files(kind)
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    layers = [m for block in stored.model.h for m in (block.attn.qkv_proj, block.attn.o_proj, block.mlp.c_fc,
                                                      block.mlp.c_proj)]
    if kind == "f32":
        assert not any(hasattr(m, "part_for_row") for m in stored.model.modules())
    else:
        assert all(isinstance(m, BlockLinear) for m in layers)
        assert isinstance(stored.model.wte.weight, BlockWeight)
        assert kind.upper() in weight_formats(stored.model)["types"]
    ids = _ids(tokenizer)
    a, b = _logits(stored, ids), _logits(floats, ids)
    if kind == "f32":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    file_bytes = sum(t.n_bytes for t in read_gguf(path).tensors)
    assert 0.9 * file_bytes <= stored.model.weight_bytes() <= 1.1 * file_bytes


def test_as_stored_bfloat16(files, tokenizer):
    """In bfloat16 the F32 matrices stay F32 blocks (the file's type, not the model's) and the
    vectors become bf16 parameters: the logits follow the float32 model within bf16 rounding."""
    stored = load(str(files("q8_0")), device="cpu", dtype="bfloat16")
    floats = load(str(files("q8_0")), weights="dequantize", device="cpu", dtype="float32")
    assert stored.model.h[0].ln_1.weight.dtype == torch.bfloat16
    a, b = _logits(stored, _ids(tokenizer)), _logits(floats, _ids(tokenizer))
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def _rewrite(src: Path, out: Path, *, drop_keys=(), set_keys=None, tensors=None) -> Path:
    """A copy of the GGUF `src` with metadata keys dropped or set, and its tensors as
    `tensors(name, float_values, type) -> [(name, array, raw_type)]` makes them."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), "gpt2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in drop_keys:
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, field.contents())
        else:
            writer.add_key_value(field.name, field.contents(), field.types[0])
    tiny.add_gguf_metadata(writer, set_keys or {})
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        made = tensors(t.name, values, t.tensor_type) if tensors else [(t.name, np.asarray(t.data), t.tensor_type)]
        for name, data, kind in made:
            writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _as_llama_cpp_converts(name, values, kind):
    """convert_hf_to_gguf.py's GPT2Model with --outtype f16: matrices F16 but the position
    embeddings (F32, as every 1-D tensor), and the tied head written out as output.weight."""
    def f16(v):
        return np.ascontiguousarray(v, dtype=np.float16), gguf.GGMLQuantizationType.F16

    if values.ndim == 1 or name == "position_embd.weight":
        return [(name, np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.F32)]
    made = [(name, *f16(values))]
    if name == "token_embd.weight":
        made.append(("output.weight", *f16(values)))
    return made


def test_a_file_as_llama_cpp_converts_it(tmp_path, model_dirs, files, tokenizer):
    """A file laid out as llama.cpp's converter writes GPT-2 (F16, output.weight beside
    token_embd, no vocab_size or head_count_kv keys): untied head, the model in F16 through
    both paths, equal to each other and to transformers' with F16-rounded weights."""
    path = _rewrite(files("f32"), tmp_path / "llama-cpp.gguf", tensors=_as_llama_cpp_converts,
                    drop_keys=("gpt2.vocab_size", "gpt2.attention.head_count_kv"))
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    assert not stored.config.tie_word_embeddings and isinstance(stored.model.lm_head, BlockLinear)
    assert isinstance(stored.model.h[1].mlp.c_proj.weight, BlockWeight)
    assert weight_formats(stored.model)["types"].keys() == {"F16", "F32"}
    ids = _ids(tokenizer)
    torch.testing.assert_close(_logits(stored, ids), _logits(floats, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(floats, ids), _hf_logits(_reference(model_dirs("gpt2"), path), ids),
                               rtol=1e-5, atol=1e-5)


def test_generate_runs_the_file(capsys, files):
    """`twice generate --model FILE.gguf` for gpt2: eager decode over the blocks, the tokens the
    float copy gives (greedy), the weight format in --json."""
    path = str(files("q4_0"))
    args = ["generate", "hello", "--model", path, "-n", "6", "--temperature", "0", "--json"]
    r = run_inprocess(args, capsys)
    assert r.code == 0, r
    got = json.loads(r.out)
    r = run_inprocess(args + ["--dequantize"], capsys)
    assert r.code == 0, r
    want = json.loads(r.out)
    assert got["model_type"] == "gpt2" and got["generated_tokens"] == 6
    assert got["token_ids"] == want["token_ids"]
    assert "Q4_0" in got["weights"]["types"] and set(want["weights"]["types"]) == {"F32"}


def test_quantize_in_memory_and_from_a_gguf(tmp_path, capsys, model_dirs, files, tokenizer):
    """`--quantize q8_0` of the gpt2 folder is the q8_0 file bit for bit (types and logits);
    `twice quantize` of the f32 gpt2 GGUF (through its float copy) writes the same tensors
    as quantizing the folder."""
    in_memory = load(str(model_dirs("gpt2")), weights="q8_0", device="cpu", dtype="float32")
    from_file = load(str(files("q8_0")), device="cpu", dtype="float32")
    assert weight_formats(in_memory.model) == weight_formats(from_file.model)
    ids = _ids(tokenizer)
    assert torch.equal(_logits(in_memory, ids), _logits(from_file, ids))
    again = tmp_path / "from-gguf.gguf"
    r = run_inprocess(["quantize", str(files("f32")), str(again), "--type", "q8_0"], capsys)
    assert r.code == 0, r
    a = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(again)).tensors}
    b = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(files("q8_0"))).tensors}
    assert a == b


# -- bad input ------------------------------------------------------------------------------


def test_conv1d_left_in_checkpoint_layout_is_one_line(tmp_path, capsys, files):
    """A Conv1D matrix written [in, out] (not transposed as llama.cpp writes it): one line
    naming the tensor and both shapes, for both paths."""
    def untransposed(name, values, kind):
        if name == "blk.0.ffn_up.weight":
            return [(name, np.ascontiguousarray(values.T, dtype=np.float32), gguf.GGMLQuantizationType.F32)]
        return [(name, np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.F32)]

    path = _rewrite(files("f32"), tmp_path / "untransposed.gguf", tensors=untransposed)
    before = path.read_bytes()
    for extra in ([], ["--dequantize"]):
        line = one_error_line(run_inprocess(["generate", "hi", "--model", str(path), "-n", "2", *extra], capsys))
        assert "blk.0.ffn_up.weight" in line and "[64, 256]" in line and "[256, 64]" in line
    assert path.read_bytes() == before


def test_grouped_kv_heads_are_one_line(tmp_path, capsys, files):
    path = _rewrite(files("f32"), tmp_path / "gqa.gguf", drop_keys=("gpt2.attention.head_count_kv",),
                    set_keys={"gpt2.attention.head_count_kv": 2})
    line = one_error_line(run_inprocess(["generate", "hi", "--model", str(path), "-n", "2"], capsys))
    assert "key/value heads" in line and "gpt2" in line


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native kernels")
def test_generate_with_the_integer_kernels(capsys, files, monkeypatch, tokenizer):
    """With the native kernels (built here if not yet): short products through the int8
    kernel, the logits within Q8_0 activation error of the float products; generate runs."""
    from twice.core import qweight

    monkeypatch.setitem(kernels._STATE, "lib", kernels._build())
    path = str(files("q8_0"))
    stored = load(path, device="cpu", dtype="float32")
    ids = _ids(tokenizer)
    ref = _logits(stored, ids)  # KERNEL_ROWS 0: float products
    monkeypatch.setattr(qweight, "KERNEL_ROWS", 64)
    got = _logits(stored, ids)
    assert not torch.equal(got, ref) and float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())
    r = run_inprocess(["generate", "hello", "--model", path, "-n", "4", "--temperature", "0", "--json"], capsys)
    assert r.code == 0, r
    assert json.loads(r.out)["generated_tokens"] == 4


@pytest.mark.parametrize("stored", ["safetensors", "q8_0", "--quantize q8_0"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_keep_their_slices(model_dirs, files, stored, rank):
    """--tp 2: each rank's qkv_proj is three slices of the fused c_attn (its q, k and v heads;
    columns of the Conv1D [in, out] checkpoint tensor, rows of the file's [out, in] matrix) and
    so is its bias; c_fc its rows, o_proj and c_proj their columns, those two biases whole (added
    once, after the all-reduce); from safetensors, from a GGUF as stored and quantized at load
    (tests/test_parallel.py runs two ranks)."""
    from twice.core.parallel import Shard

    src, weights = (model_dirs("gpt2"), None) if stored == "safetensors" else \
        (files("q8_0"), None) if stored == "q8_0" else (model_dirs("gpt2"), "q8_0")
    whole = load(str(src), device="cpu", dtype="float32", weights=weights).model
    part = load(str(src), device="cpu", dtype="float32", weights=weights, shard=Shard(rank=rank, world=2)).model
    c = whole.config
    H, inter = c.hidden_size, c.intermediate_size

    def rows(linear) -> torch.Tensor:
        return linear.weight.dequantize(torch.float32) if isinstance(linear, BlockLinear) else linear.weight

    def mine(w: torch.Tensor, start: int, size: int, dim: int = 0) -> torch.Tensor:
        return w.narrow(dim, start + rank * size // 2, size // 2)

    assert part.kv_heads * 2 == whole.kv_heads
    for a, b in zip(whole.h, part.h):
        for get in (rows, lambda m: m.bias):
            qkv = get(a.attn.qkv_proj)
            assert torch.equal(get(b.attn.qkv_proj), torch.cat([mine(qkv, 0, H), mine(qkv, H, H), mine(qkv, 2 * H, H)]))
            assert torch.equal(get(b.mlp.c_fc), mine(get(a.mlp.c_fc), 0, inter))
        assert torch.equal(rows(b.attn.o_proj), mine(rows(a.attn.o_proj), 0, H, dim=1))
        assert torch.equal(rows(b.mlp.c_proj), mine(rows(a.mlp.c_proj), 0, inter, dim=1))
        assert torch.equal(b.attn.o_proj.bias, a.attn.o_proj.bias) and torch.equal(b.mlp.c_proj.bias, a.mlp.c_proj.bias)
