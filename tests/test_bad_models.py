"""Broken model folders and references: one clear line on stderr, exit code 2, no traceback."""

import json
import shutil
import struct

import pytest

from clirun import run_inprocess, run_subprocess


def copy_model(model_dirs, tmp_path, family="llama"):
    dest = tmp_path / "model"
    shutil.copytree(model_dirs(family), dest)
    return dest


def break_truncate(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return "truncated"


def break_header_length(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    return "corrupt safetensors header"


def break_header_json(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe!!"
    path.write_bytes(bytes(data))
    return "corrupt safetensors header"


def break_shape(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] + 8
    (folder / "config.json").write_text(json.dumps(cfg))
    return "has shape"


def break_model_type(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "bert"
    (folder / "config.json").write_text(json.dumps(cfg))
    from twice.core.models import FAMILIES

    return f"model_type \"bert\" is not supported; supported: {', '.join(sorted(FAMILIES))}"


def break_no_config(folder):
    (folder / "config.json").unlink()
    return "no config.json"


def break_config_json(folder):
    (folder / "config.json").write_text("{ not json")
    return "invalid JSON at line 1"


def break_zero_heads(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_attention_heads"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    return "num_attention_heads must be a positive integer"


def break_no_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    return "no tokenizer.json"


def break_tokenizer_json(folder):
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    return "cannot load tokenizer"


def break_pickle(folder):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    return "pickle checkpoints are refused"


def break_no_weights(folder):
    (folder / "model.safetensors").unlink()
    return "no model.safetensors"


def break_rope_type(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    return "rope type \"dynamic\" is not supported"


def break_missing_tensor(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return "missing tensors: model.layers.1.mlp.down_proj.weight"


def break_shard_index(folder):
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}})
    )
    return "names shard model-00001-of-00002.safetensors which is missing"


BREAKS = [break_truncate, break_header_length, break_header_json, break_shape, break_model_type, break_no_config,
          break_config_json, break_zero_heads, break_no_tokenizer, break_tokenizer_json, break_pickle,
          break_no_weights, break_rope_type, break_missing_tensor, break_shard_index]


@pytest.mark.parametrize("breaker", BREAKS, ids=lambda f: f.__name__[6:])
def test_broken_folder_gives_one_line_error(model_dirs, tmp_path, capsys, breaker):
    folder = copy_model(model_dirs, tmp_path)
    expected = breaker(folder)
    r = run_inprocess(["generate", "hi", "--model", str(folder), "-n", "2"], capsys)
    assert r.code == 2, r
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twice: error: "), r.err
    assert expected in lines[0]


def test_missing_folder(capsys, tmp_path):
    r = run_inprocess(["generate", "hi", "--model", str(tmp_path / "nope")], capsys)
    assert r.code == 2 and "no such folder" in r.err


@pytest.mark.slow
def test_hub_id_offline_and_not_cached(tmp_path):
    r = run_subprocess(["generate", "hi", "--model", "someorg/somemodel"],
                       env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.code == 2
    assert "Traceback" not in r.err
    assert r.err.strip() == ("twice: error: someorg/somemodel: not in the local Hugging Face cache, and the Hub "
                             "cannot be reached (offline or HF_HUB_OFFLINE=1)")


def test_hub_id_resolves_from_the_local_cache(model_dirs, tmp_path, monkeypatch):
    """A Hub id that is in HF_HOME's cache loads offline."""
    import huggingface_hub.constants as c

    repo = tmp_path / "hf" / "hub" / "models--someorg--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(model_dirs("llama"), snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    from twice.weights.resolve import resolve

    assert resolve("someorg/tiny") == snap


@pytest.mark.slow
def test_traceback_only_with_debug(model_dirs, tmp_path):
    folder = copy_model(model_dirs, tmp_path)
    break_truncate(folder)
    r = run_subprocess(["generate", "hi", "--model", str(folder)])
    assert r.code == 2 and "Traceback" not in r.err
    r = run_subprocess(["--debug", "generate", "hi", "--model", str(folder)])
    assert r.code != 0 and "Traceback" in r.err
