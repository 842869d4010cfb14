"""Qwen2-MoE's shared expert in the native decode step (issue 15: "moe:shared").

decode.c runs a qwen2_moe sparse layer as the routed experts' sum plus sigmoid(x · shared_gate) times
the shared expert (a gated MLP through the same gated_mlp function as a dense layer's), so tiny.py's
qwen2_moe decodes natively: in float32, bfloat16, Q8_0 blocks quantized at load (`--quantize q8_0`)
and twice's own GGUF files (Q8_0, and F32 blocks in a bfloat16 model: the shared gate as GGUF
stores it). Against the eager layers (test_native_decode's tolerances), transformers' greedy tokens,
each row of a batch alone and verify's virtual rows against sequential steps (bit for bit), on 1
and 2 threads. Tiny random models, one torch thread unless a test says two.
"""

from __future__ import annotations

import pytest
import torch
from test_native_decode import _step_by_step
from test_native_families import step_with_unchosen_experts_poisoned

from twice.core import kernels, native_decode
from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.core.experts import SparseMoE
from twice.core.native_decode import NativeDecoder, supported
from twice.weights.load import load

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch"),
              pytest.mark.usefixtures("one_thread")]

torch.set_grad_enabled(False)

# kind → (source, load options): tiny.py's qwen2_moe folder (sliding layers: llama.cpp's qwen2moe
# has none, so the GGUF files are written from the same model without them), as the CLI loads them.
KINDS = {
    "f32": ("folder", dict(dtype="float32")),
    "bf16": ("folder", dict(dtype="bfloat16")),
    "q8_0": ("folder", dict(dtype="float32", weights="q8_0")),
    "gguf-q8_0": ("q8_0", dict(dtype="float32")),
    "gguf-f32": ("f32", dict(dtype="float32")),
    "gguf-f32-as-bf16": ("f32", dict(dtype="bfloat16")),
}
FLOAT32_OF = {"bf16": "f32", "gguf-f32-as-bf16": "gguf-f32"}  # a bfloat16 kind → its float32 twin


@pytest.fixture(scope="module")
def gguf_variant(tmp_path_factory, tokenizer):
    from test_gguf_families2 import _variant_files

    return _variant_files(tmp_path_factory, tokenizer, "qwen2_moe", "qwen2moe", use_sliding_window=False,
                          tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen2moe(model_dirs, gguf_variant):
    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            source, options = KINDS[kind]
            path = model_dirs("qwen2_moe") if source == "folder" else gguf_variant(source)[1]
            loaded[kind] = load(str(path), device="cpu", **options)
        return loaded[kind]

    return get


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def test_every_sparse_layer_hands_decode_c_its_shared_expert(qwen2moe):
    m = qwen2moe("f32")
    assert {"moe", "moe:shared"} <= m.model.features() <= native_decode.IMPLEMENTS and supported(m.model)
    native = NativeDecoder(m.model)
    sparse = [i for i, b in enumerate(m.model.layers) if isinstance(b.mlp, SparseMoE)]
    assert sparse and all(native.layers[i].shared_inter == m.config.options.shared_intermediate for i in sparse)
    assert m.config.options.shared_intermediate not in (m.config.options.expert_intermediate, m.config.intermediate_size)
    assert Engine(m.model, m.tokenizer, m.eos_token_ids).decode_path == "native"


def _bfloat16_distances(m16, m32, steps: int = 20) -> tuple[float, float]:
    """Eager float32, eager bfloat16 and native bfloat16 from the same prompt, fed eager float32's
    greedy tokens: the largest logit distance of eager bf16, and of native bf16, from float32."""
    native = NativeDecoder(m16.model)
    caches = [KVCache(m32.config, 1, 64, dt, "cpu") for dt in (torch.float32, torch.bfloat16, torch.bfloat16)]
    ids = torch.tensor([list(range(3, 20))])
    eager16 = native16 = 0.0
    with torch.inference_mode():
        m32.model(ids, caches[0])
        m16.model(ids, caches[1])
        m16.model(ids, caches[2])
        tok = torch.tensor([[42]])
        for _ in range(steps):
            want = m32.model(tok, caches[0]).float()
            eager16 = max(eager16, (m16.model(tok, caches[1]).float() - want).abs().max().item())
            native16 = max(native16, (native(tok, caches[2]) - want).abs().max().item())
            tok = want.argmax(-1, keepdim=True)
    return eager16, native16


@pytest.mark.parametrize("kind", list(KINDS))
def test_native_step_equals_eager(qwen2moe, kind):
    """Step by step from the same prefilled cache, 20 tokens (the window of 12 is crossed): float32
    weights and blocks within 1e-4 and the same greedy token. bfloat16: both round at the same
    points but add in other orders, and a router amplifies that (a near-tie picks another expert;
    eager bf16 itself is ~0.1 from float32 here): native bf16 about as close to float32 as eager
    bf16 is (test_native_families' bar)."""
    m = qwen2moe(kind)
    assert supported(m.model), kind
    if m.model.norm.weight.dtype == torch.float32:
        worst, gap, _, _ = _step_by_step(m, torch.float32, steps=20)
        assert worst < 1e-4 and gap == 0, (worst, gap)
    else:
        eager16, native16 = _bfloat16_distances(m, qwen2moe(FLOAT32_OF[kind]))
        assert native16 < max(0.05, 1.5 * eager16), (native16, eager16)


def test_the_shared_expert_moves_the_logits_far_beyond_the_tolerance(qwen2moe):
    """The comparison above would see a step that left the shared expert out: without it (each
    Layer's shared_inter 0) the native logits move by far more than 1e-4."""
    m = qwen2moe("f32")
    with_shared, without = NativeDecoder(m.model), NativeDecoder(m.model)
    for layer in without.layers:
        layer.shared_inter = 0
    a, b = (KVCache(m.config, 1, 64, torch.float32, "cpu") for _ in range(2))
    with torch.inference_mode():
        for c in (a, b):
            m.model(torch.tensor([list(range(3, 20))]), c)
        moved = (with_shared(torch.tensor([[42]]), a) - without(torch.tensor([[42]]), b)).abs().max().item()
    assert moved > 1e-2


@pytest.mark.parametrize("kind", ["f32", "gguf-q8_0"])
def test_greedy_tokens_equal_eager_and_transformers(qwen2moe, model_dirs, gguf_variant, kind):
    """32 greedy tokens: the engine's native step = its eager step = transformers' generate (on the
    weights the file holds, for the GGUF file: test_gguf_families2's reference)."""
    from test_gguf_families import hf_greedy

    m = qwen2moe(kind)
    ids = list(range(5, 12))
    settings = GenerationSettings(max_new_tokens=32, ignore_eos=True)
    fast = Engine(m.model, m.tokenizer, m.eos_token_ids)
    eager = Engine(m.model, m.tokenizer, m.eos_token_ids, native=False)
    a = list(fast.generate(Request(ids=ids), settings))[-1].result
    b = list(eager.generate(Request(ids=ids), settings))[-1].result
    assert (a.decode_path, b.decode_path) == ("native", "eager")
    if kind == "f32":
        from test_models import hf_model

        reference = hf_model(model_dirs("qwen2_moe"))
    else:
        from test_gguf_families2 import moe_reference

        folder, path = gguf_variant("q8_0")
        reference = moe_reference(folder, path, arch="qwen2moe")
    want = hf_greedy(reference, torch.tensor([ids]))
    assert a.token_ids == b.token_ids == want and len(want) == 32


# Three prompts of 15, 24 and 6 tokens: left padding of 9, 0 and 18 columns.
PROMPTS = [list(range(5, 20)), list(range(20, 44)), list(range(50, 56))]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0"])
def test_batch_of_three_rows_equals_each_row_alone_bit_for_bit(qwen2moe, kind, threads):
    """The same prompt keys/values in a left-padded 3-row cache and in three caches of their own:
    6 steps of random tokens (rows sharing an expert run it together; the shared expert runs over
    all rows) give each row's logits and keys/values bit for bit."""
    m = qwen2moe(kind)
    step = NativeDecoder(m.model)
    dtype = m.model.norm.weight.dtype
    width = max(map(len, PROMPTS))
    batch = KVCache(m.config, len(PROMPTS), width + 8, dtype, "cpu")
    batch.starts = torch.tensor([width - len(p) for p in PROMPTS])
    alone = [KVCache(m.config, 1, len(p) + 8, dtype, "cpu") for p in PROMPTS]
    g = torch.Generator().manual_seed(3)
    before = _threads(threads)
    try:
        with torch.inference_mode():
            for i, p in enumerate(PROMPTS):
                m.model(torch.tensor([p]), alone[i])
                batch.k[:, i, :, width - len(p): width] = alone[i].k[:, 0, :, : len(p)]
                batch.v[:, i, :, width - len(p): width] = alone[i].v[:, 0, :, : len(p)]
            batch.length = width
            for _ in range(6):
                tokens = torch.randint(0, m.config.vocab_size, (len(PROMPTS), 1), generator=g)
                together = step(tokens, batch)
                for i, p in enumerate(PROMPTS):
                    assert torch.equal(together[i], step(tokens[i: i + 1], alone[i])[0]), i
                    n = alone[i].length
                    assert torch.equal(batch.k[:, i, :, width - len(p): batch.length], alone[i].k[:, 0, :, :n])
                    assert torch.equal(batch.v[:, i, :, width - len(p): batch.length], alone[i].v[:, 0, :, :n])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["f32", "bf16", "gguf-q8_0"])
def test_verify_equals_sequential_native_steps_bit_for_bit(qwen2moe, kind, threads):
    """K + 1 = 9 tokens as virtual rows of one call = 9 single steps, logits and cache."""
    m = qwen2moe(kind)
    native = NativeDecoder(m.model)
    dtype = m.model.norm.weight.dtype
    tokens = [42, 7, 99, 5, 13, 60, 21, 8, 77]
    a, b = (KVCache(m.config, 1, 64, dtype, "cpu") for _ in range(2))
    before = _threads(threads)
    try:
        with torch.inference_mode():
            for c in (a, b):
                m.model(torch.tensor([list(range(3, 20))]), c)
            steps = torch.cat([native(torch.tensor([[t]]), a) for t in tokens])
            one = native.verify(torch.tensor(tokens), b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, steps)
    assert a.length == b.length == 17 + len(tokens)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_a_batch_1_step_reads_only_the_chosen_experts_and_the_shared_one(qwen2moe, monkeypatch):
    """Every routed expert eager routing does not choose for the step set to NaN: the native step
    gives eager's logits, finite (the shared expert is read on every step)."""
    want, got = step_with_unchosen_experts_poisoned(qwen2moe("f32"), monkeypatch)
    assert torch.isfinite(got).all() and (got - want).abs().max() < 1e-4


def test_a_router_bias_still_keeps_the_model_eager(model_dirs):
    """decode.c has no router bias: a sparse layer with one is refused (and the engine decodes eagerly)."""
    m = load(str(model_dirs("qwen2_moe")), device="cpu", dtype="float32")
    mlp = next(b.mlp for b in m.model.layers if isinstance(b.mlp, SparseMoE))
    mlp.gate.bias = torch.nn.Parameter(torch.zeros(mlp.gate.weight.shape[0]))
    assert not supported(m.model)
    assert Engine(m.model, m.tokenizer, m.eos_token_ids).decode_path == "eager"



@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, tokenizer):
    """(family, kind) → twice's GGUF file of tiny.py's mixtral (without its window) or qwen3_moe
    (every layer sparse): the forms llama.cpp has (test_gguf_families2's variants)."""
    from test_gguf_families2 import _variant_files

    fields = {"mixtral": ("llama", dict(sliding_window=None)),
              "qwen3_moe": ("qwen3moe", dict(mlp_only_layers=[], decoder_sparse_step=1))}
    made = {}

    def get(family: str, kind: str):
        if family not in made:
            arch, changes = fields[family]
            made[family] = _variant_files(tmp_path_factory, tokenizer, family, arch, **changes)
        return made[family](kind)[1]

    return get


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_gguf_experts_of_every_moe_family_run_natively(moe_gguf, family, kind):
    """A GGUF file's experts are views of its ffn_{gate,up,down}_exps tensors (an expert's gate and
    up rows in two of them: 2 · experts parts of one stacked matrix, more than a Weight holds):
    decode.c takes such a matrix's parts from an array, so mixtral's and qwen3_moe's files decode
    natively too (they decoded eagerly before). Q8_0: = eager within 1e-4; Q4_K_M: the native
    step multiplies 8-bit activations (qdot.c) where eager multiplies floats, so within 0.05, and
    verify = sequential steps bit for bit."""
    m = load(str(moe_gguf(family, kind)), device="cpu", dtype="float32")
    stacked = next(b.mlp for b in m.model.layers if isinstance(b.mlp, SparseMoE)).experts.gate_up_proj.weight
    assert len(stacked.parts) > native_decode.MAX_PARTS and supported(m.model)
    assert Engine(m.model, m.tokenizer, m.eos_token_ids).decode_path == "native"
    worst, gap, _, _ = _step_by_step(m, torch.float32, steps=12)
    if kind == "q8_0":
        assert worst < 1e-4 and gap == 0, (worst, gap)
        return
    assert worst < 0.05, worst
    native, tokens = NativeDecoder(m.model), [42, 7, 99, 5, 13]
    a, b = (KVCache(m.config, 1, 64, torch.float32, "cpu") for _ in range(2))
    with torch.inference_mode():
        for c in (a, b):
            m.model(torch.tensor([list(range(3, 20))]), c)
        steps = torch.cat([native(torch.tensor([[t]]), a) for t in tokens])
        assert torch.equal(native.verify(torch.tensor(tokens), b), steps)
