"""GGUF for the families of issue 15, second part: phi3, gemma2 and gemma3 written by `twice
quantize`, read back by twice and loaded by llama.cpp. Each: transformers' logits on the weights the file holds, 32 greedy
tokens, as stored and through --dequantize. The helpers (the reference model with each weight
round-tripped through its type in the file, logits, greedy runs) are tests/test_gguf_families.py's;
llama.cpp's converter and llama-cpp-python are tests/llamacpp.py's (slow tests: real processes)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tiny
from llamacpp import convert, llama_logits
from test_gguf_families import IDS, TEXTS, _float_products, hf_greedy, load_tokenizer, logits, reference, tensor_table  # noqa: F401
from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.gguf_file import read_gguf
from twice.weights.load import load

torch.set_grad_enabled(False)

# tiny.py's model → the llama.cpp architecture twice quantize writes for it.
WRITTEN = {"phi3": "phi3", "phi3-long": "phi3"}


# The f32 and q8_0 files of phi3 against transformers (as stored and dequantized) are
# tests/test_gguf_families.py's, over its GGUF_FAMILIES.


@pytest.fixture(scope="module")
def written(tmp_path_factory, model_dirs):
    """(family, kind) → the tiny model written by `twice quantize --type kind` (once per module),
    named "tiny random model": llama.cpp sets token attributes by general.name, and for a name
    with "phi3" in it looks up Phi-3's "</s>", which the tiny vocabulary does not have."""
    return tiny.gguf_files(tmp_path_factory.mktemp("families2-gguf"), model_dirs, name="tiny random model")


def greedy(loaded, ids: torch.Tensor, n: int = 32) -> list[int]:
    """32 greedy tokens on the eager layers: with _float_products, blocks multiply as their float
    values (the native step's 8-bit activations are tests/test_native_*.py's, and may flip a
    near-tie of the tiny random models)."""
    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids, native=False)
    events = list(engine.generate(Request(ids=ids[0].tolist()), GenerationSettings(max_new_tokens=n, ignore_eos=True)))
    return events[-1].result.token_ids


# phi3-long: transformers' generate switches longrope's factors for every position once the
# sequence passes original_max_position_embeddings (tests/test_gguf_families.py says why).
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_twice_quantize_greedy_tokens_equal_generate(model_dirs, written, kind):
    path = written("phi3", kind)
    ids = IDS[:, :7]
    want = hf_greedy(reference(model_dirs("phi3"), path, "phi3"), ids)
    assert greedy(load(str(path), device="cpu", dtype="float32"), ids) == want
    assert greedy(load(str(path), weights="dequantize", device="cpu", dtype="float32"), ids) == want


def test_phi3_keys_and_factor_tensors(model_dirs, written):
    """The keys and tensors Phi3MiniModel writes: rotated dimensions, original context, window,
    attention factor; longrope's factors as F32 tensors."""
    import math

    path = written("phi3-long", "q8_0")
    meta = read_gguf(path).metadata
    assert meta["phi3.rope.dimension_count"] == 12 and meta["phi3.rope.scaling.original_context_length"] == 16
    assert meta["phi3.attention.sliding_window"] == 12
    assert meta["phi3.rope.scaling.attn_factor"] == pytest.approx(math.sqrt(1 + math.log(64 / 16) / math.log(16)))
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert tensors["rope_factors_long.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert np.allclose(np.asarray(tensors["rope_factors_long.weight"].data), [1.0, 1.5, 2.5, 4.0, 6.0, 9.0])
    assert np.allclose(np.asarray(tensors["rope_factors_short.weight"].data), [1.0, 1.1, 1.3, 1.6, 2.0, 2.5])
    assert tensors["blk.0.attn_qkv.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert read_gguf(written("phi3", "f32")).metadata["phi3.attention.sliding_window"] == 0


# -- slow: llama.cpp loads twice's files ----------------------------------------------------


def _with_long_factors(folder: Path, into: Path) -> Path:
    """A copy of the phi3 folder whose short factors are its long ones."""
    import json
    import shutil

    shutil.copytree(folder, into)
    config = json.loads((into / "config.json").read_text())
    config["rope_parameters"]["short_factor"] = config["rope_parameters"]["long_factor"]
    (into / "config.json").write_text(json.dumps(config))
    return into


@pytest.mark.slow
@pytest.mark.parametrize("family", WRITTEN)
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_llama_cpp_loads_twice_quantize_output(model_dirs, written, tmp_path, family, kind):
    """llama.cpp's logits on twice's file are transformers' on the weights it holds (within its
    f16 KV cache's rounding; q8_0: the activations' 8-bit rounding too). Two llama.cpp choices
    the reference follows: it picks longrope's factors by its context size, not by the
    sequence's length (measured: its logits at n_ctx 64 are the long factors', for originals of
    64 and 16), and it runs no Phi-3 sliding window (models/phi3.cpp: "Phi SWA is currently
    disabled"), so the prompt stays within phi3-long's window of 12. Measured, of logits up to
    2.3: f32 1.1e-3."""
    path = written(family, kind)
    ids = IDS[0, :12].tolist()
    got, n_vocab = llama_logits(path, ids)
    assert n_vocab == read_gguf(path).metadata["phi3.vocab_size"]
    folder = _with_long_factors(model_dirs(family), tmp_path / "long")
    want = reference(folder, path, WRITTEN[family])(torch.tensor([ids])).logits[0]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= {"f32": 1e-3, "q8_0": 0.05}[kind] * scale


# -- gemma2 / gemma3 ------------------------------------------------------------------------

GEMMA = {"gemma2": "gemma2", "gemma3": "gemma3"}


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory, model_dirs):
    """tiny.py's gemma models as a GGUF can hold them: llama.cpp has no query_pre_attn_scalar
    key (it scales queries by head_dim ** -0.5 below the 27B), so the copies say
    query_pre_attn_scalar = head_dim (tiny.py's 24 and 32 are unlike head_dim on purpose);
    llama.cpp's gemma2 takes its head from the embedding, so the gemma2 copy ties it (the
    checkpoint's lm_head dropped). Weights otherwise the same."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("gemma-gguf")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            folder = Path(shutil.copytree(model_dirs(family), root / family))
            config = json.loads((folder / "config.json").read_text())
            config["query_pre_attn_scalar"] = config["head_dim"]
            if family == "gemma2":
                config["tie_word_embeddings"] = True
                tensors = load_file(folder / "model.safetensors")
                tensors.pop("lm_head.weight", None)
                save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
            (folder / "config.json").write_text(json.dumps(config))
            made[family] = folder
        return made[family]

    return get


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory, gemma_dirs):
    return tiny.gguf_files(tmp_path_factory.mktemp("gemma-files"), gemma_dirs, name="tiny random model")


@pytest.mark.parametrize("family", GEMMA)
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_gemma_file_as_stored_and_dequantized_equals_transformers(gemma_dirs, gemma_files, family, kind):
    """Sandwich norms (+1 in the file, -1 on reading), soft-caps, windows crossed by the prompt
    (24 tokens, window 8), gemma3's local RoPE base and linear scaling: transformers' logits."""
    path = gemma_files(family, kind)
    assert read_gguf(path).metadata["general.architecture"] == GEMMA[family]
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    want = reference(gemma_dirs(family), path, GEMMA[family])(IDS).logits[0]
    assert (logits(floats, IDS) - want).abs().max() < 1e-4
    torch.testing.assert_close(logits(stored, IDS), logits(floats, IDS), rtol=1e-5, atol=1e-5)
    original = load_tokenizer(gemma_dirs(family))
    assert [stored.tokenizer.encode(t) for t in TEXTS] == [original.encode(t) for t in TEXTS]


@pytest.mark.parametrize("family", GEMMA)
def test_gemma_greedy_tokens_equal_generate(gemma_dirs, gemma_files, family):
    path = gemma_files(family, "q8_0")
    ids = IDS[:, :7]
    want = hf_greedy(reference(gemma_dirs(family), path, GEMMA[family]), ids)
    assert greedy(load(str(path), device="cpu", dtype="float32"), ids) == want
    assert greedy(load(str(path), weights="dequantize", device="cpu", dtype="float32"), ids) == want


def test_gemma_keys_and_norms(gemma_dirs, gemma_files):
    """The keys llama.cpp reads; every norm holds w + 1 (as llama.cpp's converter writes it)."""
    from safetensors.torch import load_file

    g2, g3 = read_gguf(gemma_files("gemma2", "f32")).metadata, read_gguf(gemma_files("gemma3", "f32")).metadata
    assert (g2["gemma2.attn_logit_softcapping"], g2["gemma2.final_logit_softcapping"]) == (5.0, 3.0)
    assert g2["gemma2.attention.sliding_window"] == 8 and g2["gemma2.attention.key_length"] == 16
    assert g2["gemma2.attention.sliding_window_pattern"] == [True, False, True, False]
    assert g3["gemma3.attention.sliding_window_pattern"] == [True, True, False, True, True]
    assert g3["gemma3.rope.freq_base_swa"] == 10000.0 and g3["gemma3.rope.freq_base"] == 1e6
    assert (g3["gemma3.rope.scaling.type"], g3["gemma3.rope.scaling.factor"]) == ("linear", 4.0)
    assert g3["gemma3.final_logit_softcapping"] == 3.0 and "gemma3.attn_logit_softcapping" not in g3
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(gemma_files("gemma3", "f32"))).tensors}
    hf = load_file(gemma_dirs("gemma3") / "model.safetensors")
    for g, h in (("blk.2.post_ffw_norm.weight", "model.layers.2.post_feedforward_layernorm.weight"),
                 ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
                 ("output_norm.weight", "model.norm.weight")):
        np.testing.assert_array_equal(tensors[g], hf[h].float().numpy() + 1)


@pytest.mark.parametrize("edit, words", [
    ({"query_pre_attn_scalar": 24}, "query_pre_attn_scalar 24 has no GGUF form"),
    ({"tie_word_embeddings": False}, "gemma2 with an untied lm_head has no GGUF form"),
    ({"hidden_activation": "gelu"}, "gemma with hidden_activation 'gelu' has no GGUF form"),
])
def test_gemma_without_a_gguf_form_is_one_line(gemma_dirs, model_dirs, tmp_path, capsys, edit, words):
    """What llama.cpp's gemma2 cannot run as transformers does: refused in one line, exit 2,
    nothing written."""
    import json
    import shutil

    from clirun import run_inprocess

    folder = Path(shutil.copytree(gemma_dirs("gemma2"), tmp_path / "model"))
    if "tie_word_embeddings" in edit:
        folder = Path(shutil.copytree(model_dirs("gemma2"), tmp_path / "untied"))
        edit = {**edit, "query_pre_attn_scalar": 16}
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    out = tmp_path / "out.gguf"
    r = run_inprocess(["quantize", str(folder), str(out), "--type", "q8_0"], capsys)
    assert r.code == 2, r
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("twice: error: ") and words in lines[0], r.err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == []
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_gpt2_with_exact_gelu_is_one_line(model_dirs, tmp_path, capsys):
    """llama.cpp's gpt2 runs the tanh-approximated GELU whatever the file says: a GPT-2 whose
    activation_function is the exact "gelu" has no file that runs as it does."""
    import json
    import shutil

    from clirun import run_inprocess

    folder = Path(shutil.copytree(model_dirs("gpt2"), tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "activation_function": "gelu"}))
    r = run_inprocess(["quantize", str(folder), str(tmp_path / "out.gguf"), "--type", "f32"], capsys)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert r.code == 2 and len(lines) == 1 and "activation 'gelu' has no GGUF form" in lines[0], r.err
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", GEMMA)
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_llama_cpp_loads_twice_gemma(gemma_dirs, gemma_files, family, kind):
    """llama.cpp reads twice's gemma files as transformers computes the model: the +1 norms,
    caps, sliding layers from the per-layer flags, gemma3's local base and scaled global RoPE
    (24 tokens cross the window of 8). Within its f16 KV cache's rounding, the same at every
    position (measured, of logits capped at 3.0: f32 4.3e-3 / 3.6e-3 for gemma2 / gemma3);
    q8_0 adds its 8-bit activations on these large random weights (initializer_range 0.5:
    0.19 of 3.0)."""
    path = gemma_files(family, kind)
    ids = IDS[0].tolist()
    got, _ = llama_logits(path, ids)
    want = reference(gemma_dirs(family), path, GEMMA[family])(torch.tensor([ids])).logits[0]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= {"f32": 2e-3, "q8_0": 0.1}[kind] * scale


@pytest.fixture(scope="module")
def gemma3_converted(tmp_path_factory, gemma_dirs):
    """outtype → llama.cpp's converter on the gemma3 copy (its tiny byte-level BPE: Gemma3Model
    reads tokenizer.json where there is no tokenizer.model). The converter writes no sliding
    pattern (llama.cpp then makes every 6th layer global), so this copy says
    sliding_window_pattern 6: its 5 layers all slide."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("gemma3-converted")
    folder = Path(shutil.copytree(gemma_dirs("gemma3"), root / "gemma3"))
    config = json.loads((folder / "config.json").read_text())
    config.update(sliding_window_pattern=6, layer_types=["sliding_attention"] * config["num_hidden_layers"])
    (folder / "config.json").write_text(json.dumps(config))
    made: dict[str, Path] = {}

    def get(outtype: str) -> tuple[Path, Path]:
        if outtype not in made:
            made[outtype] = convert(folder, root / f"gemma3-{outtype}.gguf", outtype)
        return folder, made[outtype]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_converter_gemma3_file_gives_transformers_logits_and_tokens(gemma3_converted, outtype):
    """The converter's gemma3 file (norms + 1, freq_base_swa, linear global scaling, no pattern
    key), as stored and dequantized: transformers' logits (measured: 0.0 in f32) and 32 greedy
    tokens on the weights it holds."""
    folder, path = gemma3_converted(outtype)
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    model = reference(folder, path, "gemma3")
    want = model(IDS).logits[0]
    assert (logits(floats, IDS) - want).abs().max() < 1e-4
    torch.testing.assert_close(logits(stored, IDS), logits(floats, IDS), rtol=1e-5, atol=1e-5)
    ids = IDS[:, :7]
    assert greedy(stored, ids) == greedy(floats, ids) == hf_greedy(model, ids)


@pytest.mark.slow
def test_twice_writes_the_converters_gemma3_tensors(gemma3_converted, tmp_path):
    """twice quantize --type f32 of the same folder writes the converter's tensors byte for byte."""
    from twice.weights.gguf_write import write_gguf

    folder, theirs = gemma3_converted("f32")
    ours = write_gguf(folder, tmp_path / "ours.gguf", "f32").path

    assert tensor_table(ours) == tensor_table(theirs)


# -- mixtral (llama.cpp: the llama architecture with stacked experts) -------------------------

_MOE_IN_MEMORY = {"mlp.gate.weight": "ffn_gate_inp", "mlp.experts.gate_up_proj": "ffn_gate_exps",
                  "mlp.experts.down_proj": "ffn_down_exps"}


def moe_reference(folder: Path, path: Path, arch: str = "llama"):
    """transformers' mixtral with every weight round-tripped through its type in `path` (its
    experts stacked in memory: gate_up_proj [experts, 2 · inter, hidden] rows of hidden values,
    as the file's ffn_gate_exps / ffn_up_exps rows; down_proj as ffn_down_exps)."""
    import re

    from test_gguf_families import _round_trip
    from transformers import AutoModelForCausalLM

    from twice.weights.gguf_names import gguf_name

    from twice.core.models import GGUF_FORMS

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert GGUF_FORMS[model.config.model_type].arch == arch
    types = {t.name: t.tensor_type for t in read_gguf(path).tensors}
    for name, p in model.named_parameters():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m and m[2] in _MOE_IN_MEMORY:
            g = f"blk.{m[1]}.{_MOE_IN_MEMORY[m[2]]}.weight"
        else:
            g = gguf_name(name, model.config.model_type, model.config.num_hidden_layers)
        values = np.ascontiguousarray(p.detach().numpy(), dtype=np.float32)
        flat = values.reshape(-1, values.shape[-1])
        p.copy_(torch.from_numpy(np.ascontiguousarray(_round_trip(flat, types[g]))).reshape(p.shape))
    return model


@pytest.fixture(scope="module")
def mixtral_files(tmp_path_factory, model_dirs):
    """kind → (folder, file): tiny mixtral (8 experts, top-2) without its window (llama.cpp's
    llama architecture has none; a window is refused in one line) and `twice quantize`'s file."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("mixtral-gguf")
    folder = Path(shutil.copytree(model_dirs("mixtral"), root / "mixtral"))
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = None
    (folder / "config.json").write_text(json.dumps(config))
    files = tiny.gguf_files(root, lambda _: folder, name="tiny random model")
    return lambda kind: (folder, files("mixtral", kind))


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_mixtral_file_as_stored_and_dequantized_equals_transformers(mixtral_files, kind):
    """Stacked ffn_{gate,up,down}_exps read into the stacked gate|up and down matrices (expert e's
    rows contiguous), router F32, q/k permuted as llama: transformers' logits and greedy tokens."""
    folder, path = mixtral_files(kind)
    meta = read_gguf(path).metadata
    assert (meta["general.architecture"], meta["llama.expert_count"], meta["llama.expert_used_count"]) == ("llama", 8, 2)
    tensors = {t.name: t for t in read_gguf(path).tensors}
    assert tuple(reversed(tensors["blk.0.ffn_gate_exps.weight"].shape)) == (8, 96, 64)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    model = moe_reference(folder, path)
    want = model(IDS).logits[0]
    assert (logits(floats, IDS) - want).abs().max() < 1e-4
    torch.testing.assert_close(logits(stored, IDS), logits(floats, IDS), rtol=1e-5, atol=1e-5)
    ids = IDS[:, :7]
    assert greedy(stored, ids) == greedy(floats, ids) == hf_greedy(model, ids)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_llama_cpp_loads_twice_mixtral(mixtral_files, kind):
    folder, path = mixtral_files(kind)
    ids = IDS[0].tolist()
    got, _ = llama_logits(path, ids)
    want = moe_reference(folder, path)(torch.tensor([ids])).logits[0]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= {"f32": 2e-3, "q8_0": 0.1}[kind] * scale


@pytest.mark.slow
def test_converter_mixtral_is_what_twice_writes_and_reads(mixtral_files, tmp_path):
    """llama.cpp's converter on the same folder: the tensors twice quantize writes, byte for
    byte (f32), and twice reads its q8_0 file as transformers computes it."""
    folder, ours = mixtral_files("f32")

    assert tensor_table(convert(folder, tmp_path / "theirs.gguf", "f32")) == tensor_table(ours)
    theirs = convert(folder, tmp_path / "theirs-q8_0.gguf", "q8_0")
    stored = load(str(theirs), device="cpu", dtype="float32")
    assert (logits(stored, IDS) - moe_reference(folder, theirs)(IDS).logits[0]).abs().max() < 1e-4


# -- qwen3_moe (llama.cpp's qwen3moe) ---------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3moe_files(tmp_path_factory, tokenizer):
    """kind → (folder, file): tiny.py's qwen3_moe sizes (8 experts, top-3, renormalized) with
    every layer sparse, as llama.cpp's qwen3moe has them (tiny.py's has a dense layer: refused
    in one line), and `twice quantize`'s file."""
    return _variant_files(tmp_path_factory, tokenizer, "qwen3_moe", "qwen3moe",
                          mlp_only_layers=[], decoder_sparse_step=1)


def _variant_files(tmp_path_factory, tokenizer, family: str, arch: str, **fields):
    """kind → (folder, file): tiny.py's `family` with `fields` changed (its config rebuilt, so
    that derived fields such as layer_types follow), saved, and `twice quantize`'s file of it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"{arch}-gguf")
    folder = root / family
    base = {k: v for k, v in tiny.hf_config(family).to_dict().items() if k != "layer_types"}
    config = AutoConfig.for_model(**{**base, **fields})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    tiny.save_tokenizer(folder, tokenizer)
    files = tiny.gguf_files(root, lambda _: folder, name="tiny random model")
    return lambda kind: (folder, files(arch, kind))


def _qwen_reference(folder: Path, path: Path):
    """moe_reference for qwen3_moe's names (the same stacked experts in memory)."""
    return moe_reference(folder, path, arch="qwen3moe")


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_qwen3moe_file_as_stored_and_dequantized_equals_transformers(qwen3moe_files, kind):
    folder, path = qwen3moe_files(kind)
    meta = read_gguf(path).metadata
    assert (meta["general.architecture"], meta["qwen3moe.expert_count"], meta["qwen3moe.expert_used_count"],
            meta["qwen3moe.expert_feed_forward_length"]) == ("qwen3moe", 8, 3, 32)
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    model = _qwen_reference(folder, path)
    want = model(IDS).logits[0]
    assert (logits(floats, IDS) - want).abs().max() < 1e-4
    torch.testing.assert_close(logits(stored, IDS), logits(floats, IDS), rtol=1e-5, atol=1e-5)
    ids = IDS[:, :7]
    assert greedy(stored, ids) == greedy(floats, ids) == hf_greedy(model, ids)


@pytest.mark.parametrize("family, words", [("qwen3_moe", "qwen3_moe with dense layers"),
                                           ("qwen3_moe-nonorm", "qwen3_moe with norm_topk_prob false")])
def test_qwen3moe_without_a_gguf_form_is_one_line(model_dirs, tmp_path, capsys, family, words):
    from clirun import run_inprocess

    out = tmp_path / "out.gguf"
    r = run_inprocess(["quantize", str(model_dirs(family)), str(out), "--type", "q8_0"], capsys)
    assert r.code == 2, r
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("twice: error: ") and words in lines[0], r.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_llama_cpp_and_the_converter_on_qwen3moe(qwen3moe_files, tmp_path):
    """llama.cpp loads twice's file (f32: within its f16 KV cache's rounding); its converter
    writes the same tensors byte for byte."""
    folder, path = qwen3moe_files("f32")
    got, _ = llama_logits(path, IDS[0].tolist())
    want = _qwen_reference(folder, path)(IDS).logits[0]
    assert float((got - want).abs().max()) <= 2e-3 * float(want.abs().max())

    assert tensor_table(convert(folder, tmp_path / "theirs.gguf", "f32")) == tensor_table(path)


# -- qwen2_moe (llama.cpp's qwen2moe: a shared expert beside the routed ones) ------------------


@pytest.fixture(scope="module")
def qwen2moe_files(tmp_path_factory, tokenizer):
    """kind → (folder, file): tiny.py's qwen2_moe sizes (6 experts, top-2, a shared expert of 64
    behind its sigmoid gate, q/k/v biases) without its sliding layers (llama.cpp's qwen2moe has
    none: refused in one line) and with an untied head, and `twice quantize`'s file."""
    return _variant_files(tmp_path_factory, tokenizer, "qwen2_moe", "qwen2moe", use_sliding_window=False,
                          tie_word_embeddings=False)


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_qwen2moe_file_as_stored_and_dequantized_equals_transformers(qwen2moe_files, kind):
    folder, path = qwen2moe_files(kind)
    meta = read_gguf(path).metadata
    assert (meta["general.architecture"], meta["qwen2moe.expert_count"], meta["qwen2moe.expert_used_count"],
            meta["qwen2moe.expert_feed_forward_length"], meta["qwen2moe.expert_shared_feed_forward_length"]) \
        == ("qwen2moe", 6, 2, 32, 64)
    tensors = {t.name: t for t in read_gguf(path).tensors}
    for name in ("blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.attn_q.bias"):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32, name
    assert "output.weight" in tensors
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    assert stored.config.model_type == "qwen2_moe" and not stored.config.options.renormalize
    model = moe_reference(folder, path, arch="qwen2moe")
    want = model(IDS).logits[0]
    assert (logits(floats, IDS) - want).abs().max() < 1e-4
    torch.testing.assert_close(logits(stored, IDS), logits(floats, IDS), rtol=1e-5, atol=1e-5)
    ids = IDS[:, :7]
    assert greedy(stored, ids) == greedy(floats, ids) == hf_greedy(model, ids)


@pytest.mark.slow
def test_llama_cpp_and_the_converter_on_qwen2moe(qwen2moe_files, tmp_path):
    """llama.cpp loads twice's file (f32: within its f16 KV cache's rounding); its converter
    writes the same tensors byte for byte."""
    folder, path = qwen2moe_files("f32")
    got, _ = llama_logits(path, IDS[0].tolist())
    want = moe_reference(folder, path, arch="qwen2moe")(IDS).logits[0]
    assert float((got - want).abs().max()) <= 2e-3 * float(want.abs().max())

    assert tensor_table(convert(folder, tmp_path / "theirs.gguf", "f32")) == tensor_table(path)


# -- gemma2 with a SentencePiece tokenizer, through llama.cpp's converter ---------------------


@pytest.mark.slow
def test_converter_gemma2_with_sentencepiece_gives_transformers_tokens_and_logits(gemma_dirs, tmp_path):
    """llama.cpp's converter on a gemma2 folder whose tokenizer is SentencePiece (Gemma2Model
    reads tokenizer.model; no space prefix; the vocabulary padded to the model's 512): twice
    rebuilds the tokenizer from the file with transformers' encodings of the folder, and gives
    transformers' logits (f32) and greedy tokens."""
    import shutil

    from transformers import AutoTokenizer

    folder = Path(shutil.copytree(gemma_dirs("gemma2"), tmp_path / "gemma2-spm"))
    tiny.spm_tokenizer(folder, "gemma")
    path = convert(folder, tmp_path / "gemma2-spm.gguf", "f32", pre=None)
    meta = read_gguf(path).metadata
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is False
    stored = load(str(path), device="cpu", dtype="float32")
    theirs = AutoTokenizer.from_pretrained(folder)
    texts = TEXTS + ["<start_of_turn>user\nHi there<end_of_turn>\n", "  two  spaces\tand\ttabs 0123456789"]
    assert [stored.tokenizer.encode(t) for t in texts] == [theirs.encode(t) for t in texts]
    for t in texts:
        ids = theirs.encode(t)
        assert stored.tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True), t
    model = reference(folder, path, "gemma2")
    assert (logits(stored, IDS) - model(IDS).logits[0]).abs().max() < 1e-4
    ids = IDS[:, :7]
    assert greedy(stored, ids) == hf_greedy(model, ids)


# -- what a file holds that only some models of a family have --------------------------------


@pytest.fixture(scope="module")
def llama_bias_files(tmp_path_factory, tokenizer):
    """llama with attention_bias and mlp_bias: llama.cpp's llama loads both (each optional)."""
    return _variant_files(tmp_path_factory, tokenizer, "llama", "llama", attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def phi3_rotary_files(tmp_path_factory, tokenizer):
    """phi3 with head_dim 44 rotating 30 dimensions: 30 / 44 as a float gives int(44 · f) = 29."""
    return _variant_files(tmp_path_factory, tokenizer, "phi3", "phi3", hidden_size=88, num_attention_heads=2,
                          num_key_value_heads=1,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.69})


@pytest.fixture(scope="module")
def qwen2_yarn_files(tmp_path_factory, tokenizer):
    """qwen2 with YaRN (factor 4 over an original context of 16: the tests' prompts cross it)."""
    return _variant_files(tmp_path_factory, tokenizer, "qwen2", "qwen2", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})


@pytest.mark.parametrize("variant", ["llama_bias_files", "phi3_rotary_files", "qwen2_yarn_files"])
def test_files_of_optional_features_read_back_as_written(request, variant):
    """What `twice quantize` writes of these reads back as the same model: the llama's
    biases (q/k ones permuted as its weights are), phi3's rotated dimensions, qwen2's YaRN."""
    folder, path = request.getfixturevalue(variant)("f32")
    arch = read_gguf(path).metadata["general.architecture"]
    want = reference(folder, path, arch)(IDS).logits[0]
    assert (logits(load(str(path), device="cpu", dtype="float32"), IDS) - want).abs().max() < 1e-4


@pytest.mark.slow
def test_llama_cpp_runs_yarn_as_transformers(qwen2_yarn_files):
    """YaRN read from a file means what llama.cpp runs: its logits on twice's file are
    transformers' on the folder (float32; llama.cpp's RoPE kernel rounds its own way)."""
    from llamacpp import llama_logits

    folder, path = qwen2_yarn_files("f32")
    ids = IDS[0].tolist()
    theirs, vocab = llama_logits(path, ids)
    want = reference(folder, path, "qwen2")(IDS).logits[0]
    assert (theirs[:, :want.shape[1]] - want).abs().max() < 5e-3


@pytest.mark.parametrize("extra, words", [({"attention_factor": 1.5}, "attention_factor 1.5 has no GGUF form"),
                                          ({"truncate": False}, "truncate false has no GGUF form")])
def test_yarn_llama_cpp_cannot_express_is_one_line(model_dirs, tmp_path, capsys, extra, words):
    import json
    import shutil

    from clirun import run_inprocess

    folder = Path(shutil.copytree(model_dirs("qwen2"), tmp_path / "model"))
    config = json.loads((folder / "config.json").read_text())
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16, **extra}
    config.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    r = run_inprocess(["quantize", str(folder), str(tmp_path / "out.gguf"), "--type", "f32"], capsys)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert r.code == 2 and len(lines) == 1 and words in lines[0], r.err
    assert not (tmp_path / "out.gguf").exists()
