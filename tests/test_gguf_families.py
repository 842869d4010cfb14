"""GGUF for the families of issue 15: the tiny test models written as GGUF, by `twice quantize`
(lean tests) and by llama.cpp's own convert_hf_to_gguf.py (slow: a conversion takes ~6 s),
load as stored and through the float copy with their tokenizers, and give transformers'
logits and greedy tokens on the weights the file holds (each matrix round-tripped through its
type in the file by the `gguf` package).

The converter comes in llama-cpp-python's sdist (not in its wheel): tests/llamacpp.py finds it
(the README's test command downloads the sdist) and runs it; else the slow tests skip."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tiny
from llamacpp import convert
from clirun import run_inprocess
from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.gguf_file import read_gguf
from twice.weights.gguf_names import gguf_name, hf_name
from twice.core.models import GGUF_FORMS
from twice.weights.load import load

torch.set_grad_enabled(False)

# tiny.py's model → the llama.cpp architecture its GGUF has (added as each family's GGUF lands).
GGUF_FAMILIES = {"olmo2": "olmo2", "phi3": "phi3", "phi3-long": "phi3"}
# What llama.cpp's converter writes (tests/test_gguf_families2.py has the families after these).
CONVERTED = dict(GGUF_FAMILIES)

@pytest.fixture(autouse=True)
def _float_products(monkeypatch):
    """Eager products in float (the dequantized blocks): the reference the as-stored model
    must equal."""
    from twice.core import qweight

    monkeypatch.setattr(qweight, "KERNEL_ROWS", 0)


@pytest.fixture(scope="module")
def written(tmp_path_factory, model_dirs):
    """(family, kind) → the tiny model written by `twice quantize --type kind` (once per module)."""
    return tiny.gguf_files(tmp_path_factory.mktemp("families-gguf"), model_dirs)


def _round_trip(values: np.ndarray, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F32:
        return values
    return gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype).reshape(values.shape)


def reference(folder: Path, path: Path, arch: str):
    """transformers' model of `folder` with every weight round-tripped through the type `path`
    stores it in (a tied or absent head: the embedding's)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    types = {t.name: t.tensor_type for t in read_gguf(path).tensors}
    layers, model_type = model.config.num_hidden_layers, model.config.model_type
    assert GGUF_FORMS[model_type].arch == arch
    for name, p in model.named_parameters():
        g = gguf_name(name, model_type, layers)
        if g == "output.weight" and g not in types:
            g = "token_embd.weight"
        values = np.ascontiguousarray(p.detach().numpy(), dtype=np.float32)
        p.copy_(torch.from_numpy(np.ascontiguousarray(_round_trip(values, types[g]))))
    return model


def logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache(loaded.config, 1, 64, loaded.dtype, "cpu", kv_heads=loaded.model.kv_heads)
    with torch.inference_mode():
        return loaded.model(ids, cache, all_logits=True)[0].float()


def greedy(loaded, ids: torch.Tensor, n: int = 32) -> list[int]:
    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids)
    events = list(engine.generate(Request(ids=ids[0].tolist()), GenerationSettings(max_new_tokens=n, ignore_eos=True)))
    return events[-1].result.token_ids


def hf_greedy(model, ids: torch.Tensor, n: int = 32) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def tensor_table(path: Path) -> dict:
    """Every tensor of a GGUF file: name -> (shape, bytes), for byte-for-byte comparisons."""
    return {t.name: (tuple(int(d) for d in t.shape), np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


IDS = torch.tensor([list(range(5, 5 + 24))])
TEXTS = tiny.CORPUS[:7] + ["<|im_start|>user\nHi<|im_end|>\n"]


# -- lean: the name table and twice's own files -------------------------------------------


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_every_checkpoint_tensor_has_a_gguf_name_and_back(model_dirs, family):
    """Every tensor the family's targets() read has a GGUF name in the one table, and that name
    reads back as the same checkpoint name."""
    ours = load(str(model_dirs(family)), device="cpu", dtype="float32")
    model_type, layers = ours.config.model_type, ours.config.num_hidden_layers
    assert GGUF_FORMS[model_type].arch == GGUF_FAMILIES[family]
    for hf in ours.model.targets():
        g = gguf_name(hf, model_type, layers)
        assert g is not None, hf
        assert hf_name(g, layers, model_type) == hf


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_twice_quantize_f32_equals_transformers(model_dirs, written, family):
    path = written(family, "f32")
    assert read_gguf(path).metadata["general.architecture"] == GGUF_FAMILIES[family]
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    want = reference(model_dirs(family), path, GGUF_FAMILIES[family])(IDS).logits[0]
    assert (logits(stored, IDS) - want).abs().max() < 1e-4
    assert (logits(floats, IDS) - want).abs().max() < 1e-4
    assert [stored.tokenizer.encode(t) for t in TEXTS] == [load_tokenizer(model_dirs(family)).encode(t) for t in TEXTS]


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_twice_quantize_q8_0_as_stored_equals_dequantized_and_transformers(model_dirs, written, family):
    path = written(family, "q8_0")
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    a, b = logits(stored, IDS), logits(floats, IDS)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    want = reference(model_dirs(family), path, GGUF_FAMILIES[family])(IDS).logits[0]
    assert (b - want).abs().max() < 1e-4


def load_tokenizer(folder: Path):
    from twice.weights.tokenizer import Tokenizer

    return Tokenizer(folder)


# -- slow: llama.cpp's converter ------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory, model_dirs):
    root = tmp_path_factory.mktemp("converted")
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, outtype: str) -> Path:
        if (family, outtype) not in made:
            folder = model_dirs(family)
            if family.startswith("phi3"):  # the converter reads a byte-level BPE for Phi-4's tokenizer class only
                import shutil

                folder = Path(shutil.copytree(folder, root / family, dirs_exist_ok=True))
                tiny.set_json(folder / "tokenizer_config.json", tokenizer_class="GPT2Tokenizer")
            made[family, outtype] = convert(folder, root / f"{family}-{outtype}.gguf", outtype)
        return made[family, outtype]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", CONVERTED)
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_converter_file_gives_transformers_logits(model_dirs, converted, family, outtype):
    """The converter's file, as stored and through the float copy: transformers' logits on
    the weights it holds; its tokenizer encodes every text as the original does."""
    path = converted(family, outtype)
    arch = CONVERTED[family]
    assert read_gguf(path).metadata["general.architecture"] == arch
    stored = load(str(path), device="cpu", dtype="float32")
    floats = load(str(path), weights="dequantize", device="cpu", dtype="float32")
    want = reference(model_dirs(family), path, arch)(IDS).logits[0]
    assert (logits(floats, IDS) - want).abs().max() < 1e-4
    torch.testing.assert_close(logits(stored, IDS), logits(floats, IDS), rtol=1e-5, atol=1e-5)
    original = load_tokenizer(model_dirs(family))
    assert [stored.tokenizer.encode(t) for t in TEXTS] == [original.encode(t) for t in TEXTS]


@pytest.mark.slow
# phi3-long: transformers' generate switches longrope's factors for every position once the
# sequence passes original_max_position_embeddings, keys cached before included (the family's
# matter, tests/test_family_phi3.py); its logits are checked above.
@pytest.mark.parametrize("family", [f for f in CONVERTED if f != "phi3-long"])
def test_converter_file_greedy_tokens_equal_generate(model_dirs, converted, family):
    path = converted(family, "f32")
    stored = load(str(path), device="cpu", dtype="float32")
    ids = IDS[:, :7]
    assert greedy(stored, ids) == hf_greedy(reference(model_dirs(family), path, CONVERTED[family]), ids)


@pytest.mark.slow
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_converter_and_twice_write_the_same_tensors(converted, written, capsys, tmp_path, family):
    """twice quantize writes the converter's tensor names and shapes (an f32 file: the same
    values too), and `twice quantize` of the converter's f32 file to q8_0 writes the bytes
    quantizing the folder does."""
    ours, theirs = tensor_table(written(family, "f32")), tensor_table(converted(family, "f32"))
    theirs.pop("output.weight", None) if "output.weight" not in ours else None
    assert ours == theirs
    again = tmp_path / "again.gguf"
    r = run_inprocess(["quantize", str(converted(family, "f32")), str(again), "--type", "q8_0"], capsys)
    assert r.code == 0, r
    assert tensor_table(again) == tensor_table(written(family, "q8_0"))
