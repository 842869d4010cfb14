"""GGUF files run as stored (weights/gguf_load.py, core/qweight.py): tiny models of each
architecture written by `twice quantize` in each block type, loaded without a float copy,
give the float model's logits (the dequantized file through --dequantize, whose float path
test_gguf.py checks against transformers), hold about the file's tensor bytes, and decode
natively within the error of int8 activations."""

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
from twice.core.native_decode import NativeDecoder, supported
from twice.core.qweight import BlockWeight, weight_formats
from twice.weights.gguf_file import read_gguf
from twice.weights.load import load

# 256-wide so that the k-quants' 256-value blocks fit every row.
WIDE = dict(vocab_size=tiny.VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05,
            bos_token_id=0, eos_token_id=2, tie_word_embeddings=False)
LEGACY = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
KQUANTS = ["q6_k", "q5_k_m", "q4_k_m", "q3_k_m", "q2_k"]


def _wide_model(folder: Path, family: str, tokenizer) -> Path:
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[family]
    extra = {"head_dim": 64} if family == "qwen3" else {}
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**WIDE, **extra))
    model.save_pretrained(folder)
    tiny.save_tokenizer(folder, tokenizer)
    return folder


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("wide")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = _wide_model(root / family, family, tokenizer)
        return built[family]

    return get


_WRITTEN: dict[tuple[Path, str], Path] = {}  # one file per (model, type) for the whole module


def _quantized(tmp_path, capsys, folder: Path, kind: str) -> Path:
    key = (folder, kind)
    if key in _WRITTEN and _WRITTEN[key].is_file():
        return _WRITTEN[key]
    out = tmp_path / f"{folder.parent.name}-{folder.name}-{kind}.gguf"
    r = run_inprocess(["quantize", str(folder), str(out), "--type", kind], capsys)
    assert r.code == 0, r
    _WRITTEN[key] = out
    return out


def _prefill_logits(loaded, ids: list[int]) -> torch.Tensor:
    cache = KVCache(loaded.config, 1, 64, loaded.dtype, "cpu", kv_heads=loaded.model.kv_heads)
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids]), cache, all_logits=True)[0]


PROMPT = list(range(5, 5 + 20))


@pytest.fixture(autouse=True)
def _float_products(monkeypatch):
    """Eager products in float (the dequantized blocks): the reference the as-stored model
    must equal exactly. test_native_step_on_blocks compares the integer kernels against it."""
    from twice.core import qweight

    monkeypatch.setattr(qweight, "KERNEL_ROWS", 0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_as_stored_equals_dequantized(tmp_path, capsys, model_dirs, family, kind):
    path = _quantized(tmp_path, capsys, model_dirs(family), kind)
    stored, floats = load(str(path)), load(str(path), weights="dequantize")
    assert any(isinstance(m.weight, BlockWeight) for m in stored.model.modules() if hasattr(m, "part_for_row"))
    assert not any(hasattr(m, "part_for_row") for m in floats.model.modules())
    a, b = _prefill_logits(stored, PROMPT), _prefill_logits(floats, PROMPT)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", LEGACY + KQUANTS)
def test_every_type_as_stored(tmp_path, capsys, wide_dirs, kind):
    path = _quantized(tmp_path, capsys, wide_dirs("llama"), kind)
    stored, floats = load(str(path)), load(str(path), weights="dequantize")
    torch.testing.assert_close(_prefill_logits(stored, PROMPT), _prefill_logits(floats, PROMPT), rtol=1e-5, atol=1e-5)
    # Resident weights: the file's tensor bytes (norms and biases included), within 10%.
    file_bytes = sum(t.n_bytes for t in read_gguf(path).tensors)
    assert 0.9 * file_bytes <= stored.model.weight_bytes() <= 1.1 * file_bytes
    formats = weight_formats(stored.model)
    assert formats["bits_per_weight"] < 9 and formats["types"]


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native step")
@pytest.mark.parametrize("family,kind", [("llama", "q4_1"), ("qwen2", "q8_0"), ("qwen3", "q4_k_m"),
                                         ("llama", "q6_k"), ("llama", "q5_0")])
def test_native_step_on_blocks(tmp_path, capsys, wide_dirs, family, kind):
    """One native step (int8 activations through qdot.c) against the eager step on the same
    blocks (the float product of the dequantized weights): close, and the native step is
    chosen for block-stored llama-family models."""
    path = _quantized(tmp_path, capsys, wide_dirs(family), kind)
    loaded = load(str(path))
    assert supported(loaded.model)
    native = NativeDecoder(loaded.model)
    caches = [KVCache(loaded.config, 2, 64, loaded.dtype, "cpu") for _ in range(2)]
    prompt = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.inference_mode():
        for c in caches:
            loaded.model(prompt, c)
        token = torch.tensor([[7], [11]])
        ref = loaded.model(token, caches[0])  # the eager layers, every product in float
        got = native(token, caches[1])
    assert caches[1].length == caches[0].length
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() < 0.05 * scale
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=0.05, atol=0.05 * caches[0].k.abs().max().item())


@pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native step")
def test_native_batch_rows_equal_alone(tmp_path, capsys, wide_dirs):
    """Batch invariance with blocks: each row of a batch-3 native step is bit for bit that
    row's step alone."""
    path = _quantized(tmp_path, capsys, wide_dirs("llama"), "q4_0")
    loaded = load(str(path))
    native = NativeDecoder(loaded.model)
    prompts = [PROMPT, PROMPT[3:], PROMPT[::-1]]
    batch = KVCache(loaded.config, 3, 64, loaded.dtype, "cpu")
    with torch.inference_mode():
        loaded.model(torch.tensor(prompts), batch) if len({len(p) for p in prompts}) == 1 else None
    # Equal lengths keep the test about the step, not about padding.
    prompts = [PROMPT, PROMPT[1:] + [9], PROMPT[::-1]]
    batch = KVCache(loaded.config, 3, 64, loaded.dtype, "cpu")
    with torch.inference_mode():
        loaded.model(torch.tensor(prompts), batch)
        together = native(torch.tensor([[3], [4], [5]]), batch)
        for i, (p, t) in enumerate(zip(prompts, (3, 4, 5))):
            alone = KVCache(loaded.config, 1, 64, loaded.dtype, "cpu")
            loaded.model(torch.tensor([p]), alone)
            assert torch.equal(native(torch.tensor([[t]]), alone)[0], together[i])


def test_generate_as_stored_cli(tmp_path, capsys, model_dirs):
    path = _quantized(tmp_path, capsys, model_dirs("llama"), "q8_0")
    r = run_inprocess(["generate", "hello", "--model", str(path), "-n", "4", "--temperature", "0", "--json"], capsys)
    assert r.code == 0, r
    out = json.loads(r.out)
    assert out["new_tokens"] == 4 if "new_tokens" in out else True


def _gguf_with(tmp_path, model_dirs, capsys, change) -> Path:
    """A q8_0 file of the tiny llama with one tensor's type changed by `change(writer, name,
    tensor)` (returns True when it wrote that tensor itself)."""
    src = _quantized(tmp_path, capsys, model_dirs("llama"), "q8_0")
    reader = gguf.GGUFReader(str(src))
    out = tmp_path / "changed.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(field.name, value)
        else:
            writer.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        if not change(writer, t):
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unsupported_type_is_one_line(tmp_path, capsys, model_dirs):
    """An IQ4_NL matrix: twice has no codec for it, so running it as stored is refused in one
    line naming the tensor and its type."""
    def iq4(writer, t):
        if t.name != "blk.0.ffn_up.weight":
            return False
        rows, cols = int(t.shape[1]), int(t.shape[0])
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
        writer.add_tensor(t.name, np.zeros((rows, cols // block * size), dtype=np.uint8),
                          raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        return True

    path = _gguf_with(tmp_path, model_dirs, capsys, iq4)
    r = run_inprocess(["generate", "hi", "--model", str(path), "-n", "2"], capsys)
    line = one_error_line(r)
    assert "blk.0.ffn_up.weight" in line and "IQ4_NL" in line


def test_quantized_vector_is_one_line(tmp_path, capsys, model_dirs):
    def q8_norm(writer, t):
        if t.name != "blk.0.attn_norm.weight":
            return False
        values = np.asarray(t.data, dtype=np.float32).reshape(1, -1)
        writer.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0).reshape(-1),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return True

    path = _gguf_with(tmp_path, model_dirs, capsys, q8_norm)
    line = one_error_line(run_inprocess(["generate", "hi", "--model", str(path), "-n", "2"], capsys))
    assert "blk.0.attn_norm.weight" in line and "Q8_0" in line


@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_quantize_in_memory_equals_the_written_file(tmp_path, capsys, wide_dirs, kind):
    """--quantize TYPE at load gives the blocks `twice quantize --type TYPE` writes: the same
    types per matrix and the same logits, bit for bit."""
    folder = wide_dirs("qwen2")
    path = _quantized(tmp_path, capsys, folder, kind)
    in_memory, from_file = load(str(folder), weights=kind), load(str(path))
    assert weight_formats(in_memory.model) == weight_formats(from_file.model)
    assert torch.equal(_prefill_logits(in_memory, PROMPT), _prefill_logits(from_file, PROMPT))


def test_quantize_flag_cli(capsys, model_dirs):
    folder = str(model_dirs("llama"))
    r = run_inprocess(["generate", "hello", "--model", folder, "-n", "3", "--temperature", "0", "--quantize", "q4_0",
                       "--json"], capsys)
    assert r.code == 0, r
    types = set(json.loads(r.out)["weights"]["types"])
    assert "Q4_0" in types and types <= {"Q4_0", "Q8_0"}  # the head: Q6_K, or Q8_0 where 256 does not divide rows
    line = one_error_line(run_inprocess(["generate", "hi", "--model", folder, "--quantize", "q9_x"], capsys))
    assert "--quantize" in line and "q9_x" in line
    line = one_error_line(run_inprocess(["generate", "hi", "--model", folder, "--quantize", "q8_0", "--dequantize"],
                                        capsys))
    assert "--dequantize" in line


def test_tensor_parallel_slices_are_whole_blocks(tmp_path, capsys, wide_dirs, monkeypatch):
    """Each rank of --tp 2 holds exactly its rows (q/k/v, gate/up) and its whole column blocks
    (o_proj, down_proj) of the blocks one rank holds. (Loading needs no process group; the
    forward pass with its all-reduce is test_parallel.py's, under torchrun.)"""
    from twice.core.parallel import Shard

    path = _quantized(tmp_path, capsys, wide_dirs("llama"), "q8_0")
    monkeypatch.setenv("TWICE_INTERLEAVE", "0")  # the blocks as stored (test_rows8: interleaved after the split)
    whole = dict(load(str(path)).model.named_buffers())
    ranks = [dict(load(str(path), shard=Shard(rank=r, world=2)).model.named_buffers()) for r in range(2)]
    o, down = "layers.0.self_attn.o_proj.blocks0", "layers.1.mlp.down_proj.blocks0"
    for name in (o, down):  # columns: each rank has half of every row's blocks
        half = whole[name].shape[1] // 2
        assert torch.equal(ranks[0][name], whole[name][:, :half]) and torch.equal(ranks[1][name], whole[name][:, half:])
    qkv = "layers.0.self_attn.qkv_proj.blocks0"  # rows: q then k then v, each rank its heads of each
    assert ranks[0][qkv].shape[0] * 2 == whole[qkv].shape[0]
    assert not torch.equal(ranks[0][qkv], ranks[1][qkv])


def test_tensor_parallel_refuses_a_split_that_cuts_a_block(tmp_path, capsys, model_dirs):
    from twice.core.errors import UnsupportedModelError
    from twice.core.parallel import Shard

    path = _quantized(tmp_path, capsys, model_dirs("llama"), "q8_0")  # intermediate 96: 48 columns per rank
    with pytest.raises(UnsupportedModelError, match=r"ffn_down.*cannot be split over 2 ranks"):
        load(str(path), shard=Shard(rank=0, world=2))
