"""The interleaved 8-row layout of the 32-value block types (core/quant/interleave.py, the x8
tiles of core/kernels/qdot_legacy.c, qweight's interleave after loading): the same values as
the rows as stored through every reader, the kernels within float rounding of the rows as
stored, batch invariant, and a model decodes the same tokens either way."""

import pytest
import torch
from test_quant import _random_blocks
from tiny import cpu_flags

from twice.core import kernels, quant
from twice.core.cache import KVCache
from twice.core.native_decode import NativeDecoder, supported
from twice.core.parallel import Shard
from twice.core.prompt_cache import fingerprint
from twice.core.qweight import BlockWeight, _Blocks, interleave_weights
from twice.core.quant import interleave as x8
from twice.weights.load import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native kernels, no interleaving")

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def _case(name, out, blocks, rows, seed):
    c = quant.codec(name)
    data = torch.from_numpy(_random_blocks(name, out, blocks, seed))
    g = torch.Generator().manual_seed(900 + seed)
    x = torch.randn(rows, blocks * 32, generator=g) * torch.rand(rows, 1, generator=g) * 2
    return c, data, x


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("out,blocks", [(8, 1), (16, 3), (40, 7), (24, 96)])
def test_layout_round_trip_and_dequantize(name, out, blocks):
    """interleave → deinterleave gives the bytes back; the torch reference (deinterleave, then
    the type's dequantizer), the native dequantizer (whole and any row range, groups cut in
    the middle) all equal the rows as stored, bit for bit."""
    c, data, _ = _case(name, out, blocks, 1, seed=TYPES.index(name) + out)
    il = x8.interleave(data, name)
    assert il.shape == data.shape and not torch.equal(il, data)
    assert torch.equal(x8.deinterleave(il, name), data)
    # any stored byte found in the layout without deinterleaving (a prompt cache's fingerprint)
    every = torch.arange(data.numel()).numpy()
    assert torch.equal(il.reshape(-1)[torch.from_numpy(x8.stored_positions(name, data.shape[1], every))],
                       data.reshape(-1))
    cx = x8.interleaved(c)
    assert (cx.name, cx.ggml_type, cx.rows_per_group) == (c.name, c.ggml_type + x8.X8, 8) and x8.base(cx) == c
    ref = quant.dequantize(data, name)
    assert torch.equal(x8.dequantize_part(il, cx), ref)
    n = blocks * 32
    assert torch.equal(kernels.dequantize_rows(il, cx.ggml_type, n), ref)
    for lo, hi in [(0, 1), (3, 5), (5, 13 if out > 8 else 8), (out - 1, out)]:
        assert torch.equal(kernels.dequantize_rows(il, cx.ggml_type, n, start=lo, stop=hi), ref[lo:hi]), (lo, hi)


@pytest.mark.parametrize("name", TYPES)
def test_x8_kernel_against_reference_and_rows_as_stored(name):
    """The AVX2 x8 tile against the scalar x8 reference (the same integers; with FMA in the
    build the same bits) and against the rows as stored, within 1e-5·Σ|w||x|."""
    c, data, x = _case(name, 48, 40, 19, seed=20 + TYPES.index(name))
    cx = x8.interleaved(c)
    il = x8.interleave(data, name)
    got = kernels.quant_matmul(x, il, cx.ggml_type)
    ref = kernels.quant_matmul(x, il, cx.ggml_type, reference=True)
    stored = kernels.quant_matmul(x, data, c.ggml_type)
    scale = x.abs() @ quant.dequantize(data, name).abs().T
    assert ((got - ref).abs() <= 1e-5 * scale + 1e-30).all()
    assert ((got - stored).abs() <= 1e-5 * scale + 1e-30).all()
    # the same result as the float product of the dequantized weights with the int8 activations' error
    assert ((got - x @ quant.dequantize(data, name).T).abs() <= 2e-2 * scale + 1e-6).all()


@pytest.mark.parametrize("name", TYPES)
def test_x8_is_batch_invariant(name):
    """Every activation row's result is the same bits alone (1 row) as in any batch of 2..19
    rows, on 1 and 2 threads (decode, verify and batched steps agree)."""
    c, data, x = _case(name, 40, 24, 19, seed=40 + TYPES.index(name))
    cx = x8.interleaved(c)
    il = x8.interleave(data, name)
    alone = torch.cat([kernels.quant_matmul(x[r:r + 1], il, cx.ggml_type) for r in range(19)])
    threads = torch.get_num_threads()
    try:
        for rows in range(2, 20):
            torch.set_num_threads(1 + rows % 2)
            assert torch.equal(kernels.quant_matmul(x[:rows], il, cx.ggml_type), alone[:rows]), rows
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", TYPES)
def test_x8_tile_is_the_scalar_reference_bit_for_bit(name):
    """Integer sums are exact and the float steps the same (fma(d·d_x, isum, acc) block after
    block), so the SIMD x8 tile (VNNI's dpbusd where the CPU has it, else AVX2's maddubs) is the
    scalar reference's bits at every tile size (1..8 activation rows), with all-zero, full-scale
    and one-sign activation blocks (Q8_0's w + 128 offset, Q4_0/Q5_0's offsets at their extremes)."""
    if "fma" not in cpu_flags():
        pytest.skip("the reference rounds as the tile only where the build has FMA")
    c, data, x = _case(name, 40, 6, 19, seed=90 + TYPES.index(name))
    x[0, :32] = 0.0
    x[1, 32:64] = 1.0
    x[2, 64:96] = -torch.arange(32.0)
    cx, il = x8.interleaved(c), x8.interleave(data, name)
    for rows in (1, 2, 3, 4, 7, 8, 11, 16, 19):  # tiles of up to 8 (16) rows where the build has them
        got = kernels.quant_matmul(x[:rows], il, cx.ggml_type)
        assert torch.equal(got, kernels.quant_matmul(x[:rows], il, cx.ggml_type, reference=True)), rows
    flags = cpu_flags()
    if {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags:
        assert kernels.library().twq_x8_vnni() == 1


def test_x8_needs_whole_groups():
    c, data, x = _case("Q4_1", 12, 2, 1, seed=3)
    with pytest.raises(ValueError, match="whole groups of 8"):
        kernels.quant_matmul(x, data, c.ggml_type + x8.X8)
    assert not x8.eligible(c, 12) and x8.eligible(c, 16) and not x8.eligible(quant.codec("Q5_K"), 16)
    with pytest.raises(ValueError, match="whole groups"):
        x8.interleave(data, "Q4_1")


def _block_modules(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _Blocks)]


def _layouts(model) -> set:
    return {c.rows_per_group for _, m in _block_modules(model.model) for c in m.codecs}


@pytest.fixture(scope="module")
def pairs(model_dirs):
    """kind → (the tiny llama quantized in memory, interleaved; the same as stored)."""
    made = {}

    def get(kind):
        if kind not in made:
            mp = pytest.MonkeyPatch()
            try:
                mp.setenv("TWICE_INTERLEAVE", "0")
                stored = load(str(model_dirs("llama")), device="cpu", dtype="float32", weights=kind)
            finally:
                mp.undo()
            made[kind] = (load(str(model_dirs("llama")), device="cpu", dtype="float32", weights=kind), stored)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q5_0"])
def test_an_interleaved_model_decodes_as_the_rows_as_stored(pairs, kind):
    """load() interleaves every eligible part (the embedding/tied head too); native decode of
    the interleaved model tracks its eager decode, and its greedy tokens are the as-stored
    model's."""
    m, stored = pairs(kind)
    assert _layouts(m) == {8} and _layouts(stored) == {1}
    assert supported(m.model)
    emb = m.model.embed_tokens
    assert isinstance(emb, _Blocks) and emb.codecs[0].rows_per_group == 8
    (x8_tokens, _), (stored_tokens, _) = native_greedy(m), native_greedy(stored)
    assert x8_tokens == stored_tokens


def native_greedy(model, steps: int = 12) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy tokens of the native step after a 17-token prompt, each step's logits
    checked against the eager layers' on a cache of their own (within 5% of the largest
    logit, as test_gguf_stored holds the step on blocks); the tokens and the last logits."""
    native = NativeDecoder(model.model)
    a, b = (KVCache(model.config, 1, 64, torch.float32, "cpu") for _ in range(2))
    ids = torch.tensor([list(range(3, 20))])
    tokens, worst, scale = [], 0.0, 0.0
    with torch.inference_mode():
        model.model(ids, a)
        model.model(ids, b)
        tok = torch.tensor([[42]])
        for _ in range(steps):
            la, lb = model.model(tok, a).float(), native(tok, b)
            worst = max(worst, (la - lb).abs().max().item())
            scale = max(scale, la.abs().max().item())
            tok = lb.argmax(-1, keepdim=True)
            tokens.append(int(tok))
    assert worst < 0.05 * scale, (worst, scale)
    return tokens, lb


def test_embedding_and_dequantize_after_interleave(pairs):
    """The embedding lookup (any ids, repeats, across groups) and dequantize of any row range
    give the as-stored model's values bit for bit; the weights' readouts are unchanged."""
    m, stored = pairs("q8_0")
    ids = torch.tensor([[0, 7, 8, 9, 511, 8, 3], [100, 101, 250, 0, 1, 2, 505]])
    assert torch.equal(m.model.embed_tokens(ids), stored.model.embed_tokens(ids))
    mods, refs = dict(_block_modules(m.model)), dict(_block_modules(stored.model))
    assert mods.keys() == refs.keys()
    for name, mod in mods.items():
        w, r = mod.weight, refs[name].weight
        assert w.formats() == r.formats() and w.nbytes == r.nbytes
        assert torch.equal(w.dequantize(), r.dequantize()), name
        assert torch.equal(w.dequantize(start=3, stop=w.out_features - 5), r.dequantize(start=3, stop=r.out_features - 5))
    # a prompt cache's fingerprint does not depend on the layout
    assert fingerprint(m.model) == fingerprint(stored.model)


def test_the_torch_reference_serves_when_the_kernels_do_not(pairs, monkeypatch):
    """Without the native dequantizer (kernels.dequantize_rows → None), the part's torch
    reference (un-interleave, dequantize) gives the same rows and products."""
    m, stored = pairs("q4_1")
    w = m.model.layers[0].mlp.down_proj.weight
    r = stored.model.layers[0].mlp.down_proj.weight
    monkeypatch.setattr(kernels, "dequantize_rows", lambda *a, **k: None)
    assert torch.equal(w.dequantize(start=5, stop=19), r.dequantize(start=5, stop=19))
    ids = torch.tensor([1, 9, 17, 9])
    assert torch.equal(m.model.embed_tokens.weight.rows(ids, torch.float32),
                       stored.model.embed_tokens.weight.rows(ids, torch.float32))


def test_twice_interleave_0_keeps_the_rows_as_stored(pairs, monkeypatch):
    m, stored = pairs("q4_1")
    assert _layouts(stored) == {1}
    monkeypatch.setenv("TWICE_INTERLEAVE", "0")
    assert interleave_weights(stored.model) == 0 and _layouts(stored) == {1}
    assert interleave_weights(m.model) == 0  # already interleaved: nothing more to do
    monkeypatch.delenv("TWICE_INTERLEAVE")
    assert interleave_weights(m.model) == 0


@pytest.mark.slow  # builds a transformers model (seconds)
def test_a_tensor_parallel_rank_interleaves_its_own_rows(tmp_path, tokenizer, monkeypatch):
    """Rank 0 of 2 (loaded in-process: only the weights are looked at): the split comes first,
    then each eligible part of the rank's rows is interleaved, with the values of the same
    rank as stored (columns split by whole blocks; rows whose share is not whole groups of 8
    stay as stored)."""
    from test_gguf_stored import _wide_model

    folder = str(_wide_model(tmp_path / "wide", "llama", tokenizer))  # columns split in whole blocks
    m = load(folder, device="cpu", dtype="float32", weights="q8_0", shard=Shard(0, 2))
    monkeypatch.setenv("TWICE_INTERLEAVE", "0")
    s = load(folder, device="cpu", dtype="float32", weights="q8_0", shard=Shard(0, 2))
    refs = dict(_block_modules(s.model))
    layouts = set()
    for name, mod in _block_modules(m.model):
        for i, c in enumerate(mod.codecs):
            rows = getattr(mod, f"blocks{i}").shape[0]
            assert c.rows_per_group == (8 if rows % 8 == 0 else 1), (name, rows)
            layouts.add(c.rows_per_group)
        assert torch.equal(mod.weight.dequantize(), refs[name].weight.dequantize()), name
    assert 8 in layouts


def test_blockweight_products_equal_the_kernel_on_a_bare_part():
    """A BlockWeight of an interleaved part and a part as stored (mixed, as a fused q/k/v of
    two types would be): products within rounding, dequantize equal."""
    from twice.core.qweight import Part

    c8, d8, x = _case("Q8_0", 16, 4, 3, seed=7)
    c4, d4, _ = _case("Q4_1", 12, 4, 1, seed=8)
    stored = BlockWeight([Part(c8, 16, d8), Part(c4, 12, d4)], 128)
    mixed = BlockWeight([Part(x8.interleaved(c8), 16, x8.interleave(d8, "Q8_0")), Part(c4, 12, d4)], 128)
    assert torch.equal(mixed.dequantize(), stored.dequantize())
    assert torch.equal(mixed.dequantize(start=10, stop=20), stored.dequantize(start=10, stop=20))
    scale = x.abs() @ stored.dequantize().abs().T
    assert ((mixed.matmul(x) - stored.matmul(x)).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.slow  # builds the kernels for an older CPU (seconds)
def test_the_portable_build_computes_the_same():
    """x86-64-v2 (no AVX2: the scalar x8 reference is the production path): dequantize the same
    bits, products within rounding of the native build's, batch invariant."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 CPU")
    lib = kernels._build(march="x86-64-v2")
    assert lib is not None
    for name in TYPES:
        c, data, x = _case(name, 24, 5, 6, seed=60 + TYPES.index(name))
        cx, il = x8.interleaved(c), x8.interleave(data, name)
        assert not lib.q_gemm_simd(cx.ggml_type)
        assert torch.equal(kernels.dequantize_rows(il, cx.ggml_type, 160, lib=lib), quant.dequantize(data, name))
        theirs = kernels.quant_matmul(x, il, cx.ggml_type, lib=lib)
        scale = x.abs() @ quant.dequantize(data, name).abs().T
        assert ((theirs - kernels.quant_matmul(x, il, cx.ggml_type)).abs() <= 1e-5 * scale + 1e-30).all(), name
        alone = torch.cat([kernels.quant_matmul(x[r:r + 1], il, cx.ggml_type, lib=lib) for r in range(6)])
        assert torch.equal(theirs, alone), name


@pytest.mark.slow  # builds the kernels for an older CPU (seconds)
def test_the_avx2_build_is_the_same_bits():
    """x86-64-v3 (AVX2, FMA, no VNNI: the maddubs x8 tile) gives this build's bits (on a CPU
    with VNNI: the dpbusd tile's) for every type and tile size."""
    import platform

    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("needs an x86-64 CPU with AVX2")
    lib = kernels._build(march="x86-64-v3")
    assert lib is not None and lib.twq_x8_vnni() == 0
    for name in TYPES:
        c, data, x = _case(name, 40, 9, 7, seed=100 + TYPES.index(name))
        cx, il = x8.interleaved(c), x8.interleave(data, name)
        for rows in (1, 2, 3, 4, 7):
            theirs = kernels.quant_matmul(x[:rows], il, cx.ggml_type, lib=lib)
            assert torch.equal(theirs, kernels.quant_matmul(x[:rows], il, cx.ggml_type)), (name, rows)


@pytest.mark.parametrize("name", TYPES)
def test_the_native_interleave_writes_the_torch_layout(name):
    """q_interleave (in place, what loading uses) gives the bytes of interleave.interleave."""
    c, data, _ = _case(name, 40, 9, 1, seed=70 + TYPES.index(name))
    mine = data.clone()
    assert kernels.interleave_rows(mine, c.ggml_type, 9 * 32)
    assert torch.equal(mine, x8.interleave(data, name))
    with pytest.raises(ValueError):
        kernels.interleave_rows(data[:12].contiguous(), c.ggml_type, 9 * 32)
