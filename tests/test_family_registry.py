"""The family registry (core/family.py, core/models.py): one FAMILY per family module, found
by model_type; decode steps chosen by declared features."""

import importlib

import pytest
import torch

from twice.core import fastpath, native_decode
from twice.core.config import config_from_dict
from twice.core.errors import UnsupportedModelError
from twice.core.models import FAMILIES, family
from twice.weights.load import load


def test_every_model_type_names_its_transformers_config():
    transformers = pytest.importorskip("transformers")
    for model_type, fam in FAMILIES.items():
        assert model_type in fam.model_types
        name = fam.hf_config[model_type]
        assert getattr(transformers, name)().model_type == model_type, (model_type, name)


def test_each_family_module_declares_one_family():
    seen = {}
    for fam in FAMILIES.values():
        seen.setdefault(id(fam), fam)
    modules = {importlib.import_module(f.model.__module__) for f in seen.values()}
    assert all(m.FAMILY.model in [f.model for f in seen.values()] for m in modules)
    assert len(modules) == len(seen)  # no module registers two families


def test_unknown_model_type_lists_the_registry():
    with pytest.raises(UnsupportedModelError) as e:
        config_from_dict({"model_type": "bert"})
    assert str(e.value).endswith("supported: " + ", ".join(sorted(FAMILIES)))


@pytest.mark.parametrize("family, changes", [
    *((f, {}) for f in ("llama", "llama3", "mistral", "qwen2", "qwen3", "gpt2", "phi3", "olmo2", "mixtral",
                        "qwen3_moe", "qwen2_moe", "gemma2", "gemma3")),
    ("llama", {"attention_bias": True}), ("llama", {"mlp_bias": True}), ("llama", {"tie_word_embeddings": True}),
    ("llama", {"head_dim": 32}), ("qwen3", {"attention_bias": True}), ("olmo2", {"attention_bias": True}),
    ("gpt2", {"n_inner": 32, "tie_word_embeddings": False}), ("gemma3", {"attention_bias": True}),
    ("qwen2_moe", {"qkv_bias": False}), ("qwen3_moe", {"attention_bias": True}),
])
def test_parameter_count_is_transformers_for_every_variant(family, changes):
    # the count --timing, info and the size checks use, against the model transformers builds
    # from the same config (no checkpoint needed: from_config)
    import tiny
    from transformers import AutoModelForCausalLM

    cfg = tiny.hf_config(family)
    for key, value in changes.items():
        setattr(cfg, key, value)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert config_from_dict(cfg.to_dict()).parameter_count() == sum(p.numel() for p in hf.parameters())


def test_parameter_count_is_the_familys(model_dirs):
    for name in ("llama", "gpt2"):
        ours = load(str(model_dirs(name)), device="cpu", dtype="float32")
        assert ours.config.parameter_count() == family(ours.config.model_type).parameter_count(ours.config)
        stored = {p.data_ptr(): p.numel() for p in ours.model.parameters()}
        assert ours.config.parameter_count() == sum(stored.values())


def test_a_feature_no_step_implements_runs_eager(model_dirs, monkeypatch):
    """A model declaring a feature the steps do not know decodes through the eager layers."""
    from twice.core.engine import Engine

    ours = load(str(model_dirs("llama")), device="cpu", dtype="float32")
    declared = ours.model.features()
    assert declared == {"block:llama", "act:silu"}
    assert fastpath.supported(ours.model)
    monkeypatch.setattr(type(ours.model), "features", lambda self: declared | {"something-new"})
    assert not native_decode.supported(ours.model)
    assert not fastpath.supported(ours.model)
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids, compile=True)
    assert engine.decode_path == "eager"
    with torch.inference_mode():
        assert engine.fast is None


@pytest.mark.slow  # a transformers model per family
@pytest.mark.parametrize("name", [f for f in __import__("tiny").FAMILIES if f != "gpt2"])
def test_benchmark_twin_is_the_same_model(model_dirs, name):
    """core/benchmark.hf_twin (the benchmarks' transformers side) builds the same model as ours,
    windows, layer types and the family's own fields included."""
    from twice.core.benchmark import hf_twin
    from twice.core.cache import KVCache

    ours = load(str(model_dirs(name)), device="cpu", dtype="float32")
    twin = hf_twin(ours.model)
    ids = torch.randint(3, 400, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = ours.model(ids, KVCache(ours.config, 1, 32, torch.float32, "cpu"), all_logits=True)
        want = twin(ids).logits
    assert (got - want).abs().max() < 1e-4


def _string_constants(path, functions=None):
    """The string literals of a module's code (docstrings and comments left out), or of only
    the named functions."""
    import ast

    tree = ast.parse(path.read_text())
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in functions] if functions \
        else [tree]
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return {c.value for node in nodes for c in ast.walk(node)
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and id(c) not in docs}


def test_gguf_reader_and_writer_keep_no_list_of_families():
    """How llama.cpp's files hold a family is its own file's GgufForm: the GGUF reader, the
    name table and the writer's model parts name no model_type or architecture of their own
    (a new family with a GGUF form needs no edit there)."""
    from pathlib import Path

    import twice.weights as weights
    from twice.core.models import GGUF_FORMS

    names = set(GGUF_FORMS) | {f.arch for f in GGUF_FORMS.values()}
    root = Path(weights.__file__).parent
    for module in ("gguf.py", "gguf_names.py", "gguf_load.py"):
        assert not names & _string_constants(root / module), module
    writer = _string_constants(root / "gguf_write.py", {"write_gguf", "_check_supported", "_model_metadata",
                                                        "_shared_metadata", "_plan", "memory_types", "_rope_freqs",
                                                        "_longrope_factors"})
    assert not names & writer

