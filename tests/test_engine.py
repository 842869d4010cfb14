"""Engine behaviour that does not need transformers: cache sizes, streaming, sampling, stops."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tiny
from twice.core.cache import KVCache
from twice.core.config import config_from_dict
from twice.core.engine import Engine, GenerationSettings, PrefillStart, Request, TokenEvent
from twice.core.errors import PromptError
from twice.core.sampling import SamplingParams
from twice.core.stopping import StopMatcher
from twice.weights.load import load
from twice.weights.tokenizer import Tokenizer


def engine_for(model_dirs, family="llama"):
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    return Engine(m.model, m.tokenizer, m.eos_token_ids)


def run(engine, request, **kw):
    events = list(engine.generate(request, GenerationSettings(**kw)))
    return events, events[-1].result


@pytest.mark.parametrize(
    "layers,heads,kv_heads,head_dim,dtype",
    [(30, 9, 3, 64, torch.float32), (2, 4, 4, 16, torch.bfloat16), (28, 16, 8, 128, torch.float16)],
)
def test_cache_bytes_follow_the_formula(layers, heads, kv_heads, head_dim, dtype):
    cfg = config_from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": heads * head_dim,
                            "intermediate_size": 8, "num_hidden_layers": layers, "num_attention_heads": heads,
                            "num_key_value_heads": kv_heads, "head_dim": head_dim})
    e = torch.empty((), dtype=dtype).element_size()
    cache = KVCache(cfg, batch=3, capacity=50, dtype=dtype, device="cpu")
    assert cache.bytes_allocated == 2 * layers * 3 * 50 * kv_heads * head_dim * e
    assert cache.k.shape == (layers, 3, kv_heads, 50, head_dim)  # GQA: kv heads stored, not query heads
    cache.length = 17
    assert cache.bytes_in_use == 2 * layers * 3 * 17 * kv_heads * head_dim * e
    assert cache.bytes_per_token == 2 * layers * kv_heads * head_dim * e


def test_engine_reports_cache_formula_and_sizes_cache_from_request(model_dirs):
    engine = engine_for(model_dirs)
    events, result = run(engine, Request(text="Hello world"), max_new_tokens=10, ignore_eos=True)
    c = engine.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert result.cache.bytes_per_token == per_token
    assert result.cache.tokens == result.prompt_tokens + 10 - 1  # the last token is never fed back
    assert result.cache.bytes_in_use == per_token * result.cache.tokens
    assert result.cache.capacity >= result.prompt_tokens + 9
    assert result.cache.bytes_allocated == per_token * result.cache.capacity
    assert result.cache.capacity <= c.max_position_embeddings


STREAM_PROMPTS = ["Emoji: 😀 🚀", "日本語のテキスト", "Café naïve Ångström", "🧑‍💻 ❤️ ∑ ∫"]


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_equals_full_decode(model_dirs, seed):
    engine = engine_for(model_dirs)
    prompt = STREAM_PROMPTS[seed % len(STREAM_PROMPTS)]
    events, result = run(engine, Request(text=prompt), max_new_tokens=40, ignore_eos=True,
                         sampling=SamplingParams(temperature=1.5, seed=seed))
    deltas = [e.text for e in events if isinstance(e, TokenEvent)]
    full = engine.tokenizer.decode(result.token_ids)
    assert "".join(deltas) == full == result.text
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=tiny.VOCAB - 1), max_size=30))
def test_text_stream_property(tmp_path_factory, ids):
    tok = _shared_tokenizer(tmp_path_factory)
    stream = tok.stream()
    pieces = [stream.step(i) for i in ids] + [stream.finish()]
    full = tok.decode(ids)
    assert "".join(pieces) == full
    # Only an incomplete character at the very end may show as U+FFFD early.
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces)
    # after a context: the text the ids add to the context's own text
    context, rest = ids[:3], ids[3:]
    after = tok.stream(context)
    added = "".join(after.step(i) for i in rest) + after.finish()
    base = tok.decode(context)
    if not base.endswith("\ufffd"):
        assert added == tok.decode(context + rest)[len(base):]


_TOK = {}


def _shared_tokenizer(factory):
    if "t" not in _TOK:
        folder = factory.mktemp("tok")
        tiny.save_tokenizer(folder, tiny.train_tokenizer())
        _TOK["t"] = Tokenizer(folder)
    return _TOK["t"]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(model_dirs):
    engine = engine_for(model_dirs)
    req = Request(text="Once upon a time")
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=1234)
    a = run(engine, req, max_new_tokens=24, ignore_eos=True, sampling=sampled)[1].token_ids
    b = run(engine, req, max_new_tokens=24, ignore_eos=True, sampling=sampled)[1].token_ids
    c = run(engine, req, max_new_tokens=24, ignore_eos=True,
            sampling=SamplingParams(temperature=1.0, seed=99))[1].token_ids
    assert a == b
    assert a != c  # a different seed differs (24 random tokens from a flat distribution)
    greedy = run(engine, req, max_new_tokens=24, ignore_eos=True)[1].token_ids
    top1 = run(engine, req, max_new_tokens=24, ignore_eos=True,
               sampling=SamplingParams(temperature=0.8, top_k=1, seed=5))[1].token_ids
    assert top1 == greedy


def test_repetition_penalty_changes_greedy_output(model_dirs):
    engine = engine_for(model_dirs)
    req = Request(text="the the the the")
    plain = run(engine, req, max_new_tokens=30, ignore_eos=True)[1].token_ids
    penalized = run(engine, req, max_new_tokens=30, ignore_eos=True,
                    sampling=SamplingParams(repetition_penalty=5.0))[1].token_ids
    assert plain != penalized
    assert len(set(penalized)) >= len(set(plain))


def test_stops_on_eos_and_on_stop_strings(model_dirs):
    engine = engine_for(model_dirs)
    req = Request(text="Hello")
    _, free = run(engine, req, max_new_tokens=30, ignore_eos=True)
    # Make the 5th generated token an eos token: generation must end there.
    engine.eos = frozenset({free.token_ids[4]})
    first = free.token_ids.index(free.token_ids[4])
    _, r = run(engine, req, max_new_tokens=30)
    assert r.finish_reason == "eos" and r.token_ids == free.token_ids[: first + 1]
    engine.eos = frozenset()
    # A stop string taken from the middle of the free text: output ends right before it.
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        _, r = run(engine, req, max_new_tokens=30, ignore_eos=True, stop=(stop,))
        assert r.finish_reason == "stop"
        assert r.text == text[: text.index(stop)]


def test_stop_matcher_never_leaks_a_partial_stop():
    m = StopMatcher(["</end>", "STOP"])
    out = []
    for piece in ["Hello </", "en", "d", "> tail"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped
    m = StopMatcher(["</end>"])
    assert m.feed("a</e")[0] == "a"
    assert m.feed("x")[0] == "</ex"


def test_session_cache_reuses_the_common_prefix(model_dirs):
    engine = engine_for(model_dirs)
    first = engine.tokenizer.encode("The first turn of a conversation goes here.")
    events, r1 = run(engine, Request(ids=first), max_new_tokens=8, ignore_eos=True)
    second = first + r1.token_ids + engine.tokenizer.encode(" And a follow up question?")
    events, r2 = run(engine, Request(ids=second), max_new_tokens=8, ignore_eos=True)
    start = next(e for e in events if isinstance(e, PrefillStart))
    assert start.reused_tokens == len(first) + 8 - 1  # everything fed before
    assert r2.reused_tokens == start.reused_tokens
    # Same tokens as a fresh engine computing from scratch:
    fresh = engine_for(model_dirs)
    assert run(fresh, Request(ids=second), max_new_tokens=8, ignore_eos=True)[1].token_ids == r2.token_ids


def test_prompt_errors(model_dirs):
    engine = engine_for(model_dirs)
    with pytest.raises(PromptError, match="empty"):
        list(engine.generate(Request(text=""), GenerationSettings()))
    too_long = [5] * (engine.context_length + 3)
    with pytest.raises(PromptError, match="4 tokens too many"):
        list(engine.generate(Request(ids=too_long), GenerationSettings()))
    with pytest.raises(PromptError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(PromptError, match="top-p"):
        SamplingParams(top_p=1.5)
    # max_new_tokens beyond the context is clamped, with a notice
    ids = [5] * (engine.context_length - 4)
    events = list(engine.generate(Request(ids=ids), GenerationSettings(max_new_tokens=100, ignore_eos=True)))
    assert "lowered from 100 to 4" in events[0].message
    assert events[-1].result.generated_tokens == 4 and events[-1].result.finish_reason == "context"


def test_prefill_chunks_give_the_same_tokens(model_dirs):
    engine = engine_for(model_dirs, "mistral")
    ids = engine.tokenizer.encode("A longer prompt that is split into several prefill chunks of a few tokens " * 2)
    whole = run(engine, Request(ids=ids), max_new_tokens=12, ignore_eos=True)[1].token_ids
    engine.reset()
    chunked = run(engine, Request(ids=ids), max_new_tokens=12, ignore_eos=True, prefill_chunk=5)[1].token_ids
    assert whole == chunked
