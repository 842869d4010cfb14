"""The compiled decode path gives the same tokens as the eager path (and so as transformers)."""

import pytest
import torch

from test_kv_quant import kv_models  # noqa: F401  (fixtures: tiny models of whole-block head sizes)
from test_kv_quant2 import models  # noqa: F401
from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.fastpath import CAPACITY_BUCKET, IMPLEMENTS, CompiledDecoder, supported
from twice.weights.load import load

FAMILIES = ["llama3", "qwen3", "mistral", "gpt2"]  # tied+llama3 rope, q/k norm, sliding window, learned positions

# torch.compile: seconds a test; outside the default run, in CI (README: -m '').
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_matches_eager(model_dirs, family):
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    ids = list(range(7, 31))  # 24 tokens: mistral's window of 12 is crossed
    settings = GenerationSettings(max_new_tokens=40, ignore_eos=True)
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids)
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    a = list(eager.generate(Request(ids=ids), settings))[-1].result
    b = list(fast.generate(Request(ids=ids), settings))[-1].result
    assert b.token_ids == a.token_ids
    assert b.compile_seconds > 0 and b.cache.capacity % CAPACITY_BUCKET == 0
    # A second turn reuses the cache and the compiled graph (no new compile).
    more = ids + b.token_ids + [9, 10, 11]
    a2 = list(eager.generate(Request(ids=more), settings))[-1].result
    b2 = list(fast.generate(Request(ids=more), settings))[-1].result
    assert b2.token_ids == a2.token_ids and b2.reused_tokens == a2.reused_tokens > 0
    assert b2.compile_seconds == 0


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3", "phi3-long", "olmo2", "mixtral", "qwen3_moe",
                                    "qwen2_moe"])
def test_compiled_step_logits_equal_eager_logits(model_dirs, family):
    """qwen2's q/k/v biases; gemma's sandwich blocks, (1 + w) norms, scaled embeddings, both soft-caps and local RoPE;
    phi3's partial rotary, longrope past its original length and window; olmo2's post-norms and
    whole-projection q/k norms; the mixtures' routing, gathered experts (more than top-k, a
    dense layer among qwen3_moe's sparse ones) and qwen2_moe's gated shared expert: the
    compiled step's logits are eager's, step by step, and so are the keys it writes."""
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    assert supported(m.model), m.model.features() - IMPLEMENTS
    step = CompiledDecoder(m.model)
    ids = torch.tensor([list(range(3, 30))])  # 27 tokens: windows crossed, phi3-long past its 16
    a = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu")
    b = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu")
    with torch.inference_mode():
        m.model(ids, a)
        m.model(ids, b)
        tok = torch.tensor([[42]])
        for _ in range(6):
            la, lb = m.model(tok, a), step(tok, b)
            assert (la - lb).abs().max() < 1e-4
            tok = la.argmax(-1, keepdim=True)
    assert a.length == b.length
    assert torch.allclose(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length], atol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "gemma2", "qwen3_moe", "gpt2"])
def test_compiled_verify_pass_equals_eager(model_dirs, family):
    """Several tokens in one compiled pass (speculative decoding's verify): the logits of
    every position and the keys written are eager's, at widths 1..5; the pass compiles for
    widths 2 and 3 and the others reuse it (symbolic in the width)."""
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    step = CompiledDecoder(m.model)
    ids = torch.tensor([list(range(3, 20))])
    a = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu")
    b = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu")
    with torch.inference_mode():
        m.model(ids, a)
        m.model(ids, b)
        step.warmup(b, verify=True)
        assert step.is_warm(b) and step.is_warm(b, 4)
        for width in (1, 2, 5, 3, 4):
            new = list(range(40 + width, 40 + 2 * width))
            la = m.model(torch.tensor([new]), a, all_logits=True)[0]
            lb = step.verify(torch.tensor(new), b)
            assert lb.shape == la.shape and (la - lb).abs().max() < 1e-4, width
            assert a.length == b.length
    assert torch.allclose(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length], atol=1e-5)


def test_speculation_verifies_through_the_compiled_pass(model_dirs, monkeypatch):
    """With --compile (no native step), --lookup's verify passes run the compiled pass, and
    greedy output is plain greedy's."""
    m = load(str(model_dirs("llama3")), device="cpu", dtype="float32")
    calls = []
    original = CompiledDecoder.verify
    monkeypatch.setattr(CompiledDecoder, "verify", lambda self, t, c: calls.append(t.numel()) or original(self, t, c))
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # repeats itself: lookup proposes
    settings = GenerationSettings(max_new_tokens=24, ignore_eos=True)
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    plain = list(fast.generate(Request(ids=ids), settings))[-1].result
    looked = list(fast.generate(Request(ids=ids), GenerationSettings(max_new_tokens=24, ignore_eos=True, lookup=True,
                                                                    draft_tokens=4), reuse_cache=False))[-1].result
    assert looked.token_ids == plain.token_ids and looked.decode_path == "compiled"
    assert calls and max(calls) > 1 and looked.speculation["proposals"] > 0


@pytest.mark.parametrize("source, family, kv", [
    ("models", "qwen2-bias", "q8_0"),  # keys stored minus an offset; a verify pass too
    ("kv_models", "gemma2-hd32", "q4_0"), ("kv_models", "llama-hd64", "bfloat16"),  # a float cache of another dtype
])
def test_compiled_step_on_other_kv_dtypes_equals_eager(request, source, family, kv):
    """--kv-dtype with the compiled step: blocks written in the step as KVCache.write writes
    them (keys minus the key offset) and read back dequantized; a float cache of another dtype
    cast. Logits are eager's on the same cache step by step; the blocks written are eager's but
    where the two steps' keys differ in their last bits on a rounding boundary (counted)."""
    m = load(str(request.getfixturevalue(source)(family)), device="cpu", dtype="float32")
    step = CompiledDecoder(m.model)
    ids = torch.tensor([list(range(3, 20))])
    a = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu", kv_dtype=kv)
    b = KVCache(m.config, 1, CAPACITY_BUCKET, torch.float32, "cpu", kv_dtype=kv)
    assert step.supports(b)
    flips = 0
    with torch.inference_mode():
        m.model(ids, a)
        m.model(ids, b)
        verify = family == "qwen2-bias"
        step.warmup(b, verify=verify)
        tok = torch.tensor([[42]])
        for _ in range(5):
            b.k.copy_(a.k)
            b.v.copy_(a.v)
            la, lb = m.model(tok, a), step(tok, b)
            col = slice(a.length - 1, a.length)
            flips += int((a.k[..., col, :] != b.k[..., col, :]).sum() + (a.v[..., col, :] != b.v[..., col, :]).sum())
            assert (la - lb).abs().max() < 1e-4
            tok = la.argmax(-1, keepdim=True)
        if verify:
            new = [50, 51, 52]
            la = m.model(torch.tensor([new]), a, all_logits=True)[0]
            lb = step.verify(torch.tensor(new), b)
            assert (la - lb).abs().max() < 1e-4
            assert b.key_offset is not None and torch.equal(a.key_offset, b.key_offset)
    assert flips <= 4, flips


def test_engine_decodes_gemma3_compiled(model_dirs):
    m = load(str(model_dirs("gemma3")), device="cpu", dtype="float32")
    settings = GenerationSettings(max_new_tokens=24, ignore_eos=True)
    ids = list(range(7, 31))
    a = list(Engine(m.model, m.tokenizer, m.eos_token_ids).generate(Request(ids=ids), settings))[-1].result
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    b = list(fast.generate(Request(ids=ids), settings))[-1].result
    assert b.decode_path == "compiled" and b.token_ids == a.token_ids


def test_quantized_experts_stay_eager(model_dirs):
    # GGUF blocks are read per expert through the host: not a step the graph can hold
    m = load(str(model_dirs("qwen3_moe")), device="cpu", dtype="float32", weights="q8_0")
    assert not supported(m.model)
    engine = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    r = list(engine.generate(Request(ids=list(range(5, 15))), GenerationSettings(max_new_tokens=3)))[-1].result
    assert r.decode_path == "eager"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 576), (37, 1536), (3, 95)])
def test_native_gemv_equals_matmul(dtype, shape):
    from twice.core import kernels

    if not kernels.available():
        pytest.skip("no C compiler here: the fast path uses inductor's reduction instead")
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(*shape, generator=g).to(dtype)
    x = torch.randn(1, shape[1], generator=g).to(dtype)
    want = x.float() @ w.float().T
    got = torch.ops.twice.gemv(x, w)
    assert got.dtype == torch.float32 and got.shape == (1, shape[0])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_compiled_decode_without_native_kernel_matches_eager(model_dirs, monkeypatch):
    from twice.core import kernels

    monkeypatch.setitem(kernels._STATE, "lib", None)  # as on a machine with no C compiler
    m = load(str(model_dirs("llama3")), device="cpu", dtype="float32")
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True)
    ids = list(range(5, 20))
    a = list(Engine(m.model, m.tokenizer, m.eos_token_ids).generate(Request(ids=ids), settings))[-1].result
    b = list(Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False).generate(Request(ids=ids), settings))[-1].result
    assert b.token_ids == a.token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_step_serves_a_left_padded_batch(model_dirs, family):
    """The step as a GPU records it (several rows, each from its own start, the column a
    tensor): logits equal the eager layers' on a left-padded batch, windows crossed."""
    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    step = CompiledDecoder(m.model)
    lengths = [5, 24, 17]
    width = max(lengths)
    rows = [[(7 * r + 3 * i) % 250 + 1 for i in range(n)] for r, n in enumerate(lengths)]
    tokens = torch.tensor([[0] * (width - len(ids)) + ids for ids in rows])
    caches = []
    for _ in range(2):
        cache = KVCache(m.config, len(rows), CAPACITY_BUCKET, torch.float32, "cpu")
        cache.starts = torch.tensor([width - n for n in lengths])
        caches.append(cache)
    a, b = caches
    with torch.inference_mode():
        tok = m.model(tokens, a).argmax(-1, keepdim=True)
        m.model(tokens, b)
        for _ in range(6):
            la, lb = m.model(tok, a), step(tok, b)
            assert (la - lb).abs().max() < 1e-4
            tok = la.argmax(-1, keepdim=True)
    assert a.length == b.length == width + 6
    for row, start in enumerate(a.starts.tolist()):
        assert torch.allclose(a.k[:, row, :, start : a.length], b.k[:, row, :, start : b.length], atol=1e-5)


def test_a_compiled_step_that_cannot_be_built_falls_back_to_eager(model_dirs, monkeypatch):
    """No compiler toolchain, a device that refuses the graph: one notice, and the same
    tokens from the eager layers."""
    from twice.core.engine import Notice

    def broken(self, cache):
        raise RuntimeError("inductor needs a C++ compiler\nsecond line")

    monkeypatch.setattr(CompiledDecoder, "warmup", broken)
    m = load(str(model_dirs("gpt2")), device="cpu", dtype="float32")
    settings = GenerationSettings(max_new_tokens=10, ignore_eos=True)
    ids = list(range(5, 20))
    a = list(Engine(m.model, m.tokenizer, m.eos_token_ids).generate(Request(ids=ids), settings))[-1].result
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    events = list(fast.generate(Request(ids=ids), settings))
    notices = [e.message for e in events if isinstance(e, Notice)]
    assert any("unavailable here (RuntimeError: inductor needs a C++ compiler)" in n for n in notices), notices
    assert all("\n" not in n for n in notices)
    assert events[-1].result.token_ids == a.token_ids and events[-1].result.decode_path == "eager"
    assert fast.decode_path == "eager" and fast.fast is None


def replaying_recorder(recorded: list):
    """A stand-in for CUDA graph recording: warms up like it, then every replay reruns the
    step into the same output tensor (what a graph's replay does to its outputs)."""
    from twice.core.cudagraph import WARMUP_STEPS

    def record(fn, device):
        for _ in range(WARMUP_STEPS):
            fn()
        out = fn()
        recorded.append(out)
        return (lambda: out.copy_(fn())), out

    return record


def test_a_draft_steps_compiled_too(model_dirs, tmp_path, tokenizer):
    """--draft with --compile (no native step): the draft gets the compiled step as well, made
    ready before the request's clock (compile time apart), its catch-ups one compiled pass; the
    target's greedy tokens are plain greedy's, with a draft that agrees (itself) and one that
    does not."""
    import tiny

    m = load(str(model_dirs("llama3")), device="cpu", dtype="float32")
    other = load(str(tiny.make_model(tmp_path / "draft", "llama3", tokenizer, seed=1)), device="cpu", dtype="float32")
    settings = GenerationSettings(max_new_tokens=20, ignore_eos=True, draft_tokens=3)
    ids = list(range(7, 31))
    plain = list(Engine(m.model, m.tokenizer, m.eos_token_ids).generate(Request(ids=ids), settings))[-1].result
    for draft in (m.model, other.model):
        engine = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False, draft=draft)
        assert engine.draft.compiled
        r = list(engine.generate(Request(ids=ids), settings))[-1].result
        assert r.token_ids == plain.token_ids and r.decode_path == "compiled"
        assert r.speculation["proposals"] > 0 and r.compile_seconds > 0
        assert engine.draft.ready(len(ids) + 20)
        again = list(engine.generate(Request(ids=ids), settings, reuse_cache=False))[-1].result
        assert again.token_ids == plain.token_ids and again.compile_seconds == 0
    assert r.speculation["accepted"] < r.speculation["proposals"]  # the other draft disagrees at times


def test_recorded_verify_passes(model_dirs):
    """As on a GPU: --lookup's verify passes are recorded once per cache and width (the
    recording simulated on the CPU), replayed with new tokens at new columns, and greedy output
    is plain greedy's."""
    from twice.core.cudagraph import CapturedSteps

    m = load(str(model_dirs("llama3")), device="cpu", dtype="float32")
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    recorded = []
    fast.fast.cpu = False
    fast.fast.graphs = CapturedSteps(fast.fast.run, replaying_recorder(recorded))
    ids = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    plain = list(Engine(m.model, m.tokenizer, m.eos_token_ids).generate(
        Request(ids=ids), GenerationSettings(max_new_tokens=24, ignore_eos=True)))[-1].result
    looked = list(fast.generate(Request(ids=ids), GenerationSettings(max_new_tokens=24, ignore_eos=True, lookup=True,
                                                                    draft_tokens=4)))[-1].result
    assert looked.token_ids == plain.token_ids and looked.speculation["proposals"] > 0
    widths = sorted(step.width for step in fast.fast.graphs.steps)
    assert widths[0] == 1 and widths[-1] > 1 and len(widths) == len(set(widths)) == len(recorded)


@pytest.mark.parametrize("family", ["llama3", "mistral", "gpt2"])
def test_recorded_steps_through_the_engine(model_dirs, family):
    """The engine as it runs on a GPU (any batch through the compiled step, one recorded
    step per cache, static inputs and outputs), with the recording simulated on the CPU:
    the eager tokens at batch 1, on a second turn, and in a batch whose rows finish at
    different steps (each smaller batch is a new cache, so a new recording); recordings of
    caches that were dropped are forgotten."""
    import gc

    from twice.core.cudagraph import CapturedSteps

    m = load(str(model_dirs(family)), device="cpu", dtype="float32")
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids)
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    recorded = []
    fast.fast.cpu = False  # serve batches, as on a GPU
    fast.fast.graphs = CapturedSteps(fast.fast.run, replaying_recorder(recorded))
    settings = GenerationSettings(max_new_tokens=16, ignore_eos=True)
    ids = list(range(7, 31))
    a = list(eager.generate(Request(ids=ids), settings))[-1].result
    b = list(fast.generate(Request(ids=ids), settings))[-1].result
    assert b.token_ids == a.token_ids and b.decode_path == "compiled" and len(recorded) == 1
    more = ids + b.token_ids + [9, 10, 11]
    a2 = list(eager.generate(Request(ids=more), settings))[-1].result
    b2 = list(fast.generate(Request(ids=more), settings))[-1].result
    assert b2.token_ids == a2.token_ids and b2.reused_tokens > 0
    prompts = [Request(ids=ids[:n]) for n in (5, 24, 11)]
    per_row = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 4)]
    want = {e.row: e.result.token_ids for e in eager.generate_batch(prompts, per_row) if hasattr(e, "result")}
    before = len(recorded)
    got = {e.row: e.result.token_ids for e in fast.generate_batch(prompts, per_row) if hasattr(e, "result")}
    assert got == want
    assert len(recorded) - before == 3  # batches of 3, 2 and 1 rows
    gc.collect()
    fast.fast.graphs.find(fast.cache)
    # The 3- and 2-row caches were replaced as rows finished: their recordings are gone.
    # Left: the session cache's, and the 1-row cache's (this stand-in's replay holds its
    # cache; a CUDA graph holds only addresses).
    assert len(fast.fast.graphs.steps) == 2


def test_a_shape_met_mid_request_is_not_compiled_there(model_dirs):
    """A batch (eager on the CPU) that finishes down to one row: that row's cache shape
    was not made ready at the request's start, so it goes on eagerly instead of stalling
    the request to compile; the tokens are the eager ones."""
    m = load(str(model_dirs("gpt2")), device="cpu", dtype="float32")
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids)
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True, native=False)
    prompts = [Request(ids=list(range(7, 7 + n))) for n in (5, 12)]
    per_row = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (3, 9)]
    want = {e.row: e.result.token_ids for e in eager.generate_batch(prompts, per_row) if hasattr(e, "result")}
    got = {e.row: e.result for e in fast.generate_batch(prompts, per_row) if hasattr(e, "result")}
    assert {row: r.token_ids for row, r in got.items()} == want
    assert fast.fast.warm == set() and got[1].decode_path == "eager" and fast.fast.compile_seconds == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", ["llama3", "gpt2", "gemma3", "qwen3_moe"])  # every wired option; a mixture
def test_cuda_graph_decode_matches_eager(model_dirs, family):
    """On a GPU: the recorded step gives the eager tokens at batch 1 and in a padded batch,
    one graph per cache, replayed for every token."""
    m = load(str(model_dirs(family)), device="cuda", dtype="float32")
    settings = GenerationSettings(max_new_tokens=20, ignore_eos=True)
    ids = list(range(7, 31))
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids)
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids, compile=True)
    assert fast.decode_path == "compiled"
    a = list(eager.generate(Request(ids=ids), settings))[-1].result
    b = list(fast.generate(Request(ids=ids), settings))[-1].result
    assert b.token_ids == a.token_ids and b.decode_path == "compiled"
    assert len(fast.fast.graphs.steps) == 1
    prompts = [Request(ids=ids[:n]) for n in (5, 24, 11)]
    want = [e.result.token_ids for e in eager.generate_batch(prompts, [settings] * 3) if hasattr(e, "result")]
    got = [e.result.token_ids for e in fast.generate_batch(prompts, [settings] * 3) if hasattr(e, "result")]
    assert got == want
