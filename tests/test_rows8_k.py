"""Q4_K and Q6_K in the interleaved 8-row layout (core/quant/interleave.py, the x8 tile of
core/kernels/qdot_kquants.c): the same values as the rows as stored through every reader, the
AVX2 tile the scalar x8 reference's bits (with FMA in the build), within float rounding of the
rows as stored, batch invariant, and a Q4_K model's native step tracks the rows as stored."""

import platform

import pytest
import torch
from test_quant import _random_blocks
from test_rows8 import native_greedy
from tiny import cpu_flags, save_tokenizer

from twice.core import kernels, quant
from twice.core.native_decode import supported
from twice.core.qweight import BlockWeight, Part, _Blocks
from twice.core.quant import interleave as x8
from twice.weights.load import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: no native kernels, no interleaving")

Q4_K = quant.codec("Q4_K")
X8_TYPE = Q4_K.ggml_type + x8.X8
K_TYPES = ("Q4_K", "Q6_K")  # the K types with an x8 layout


def _case(out, blocks, rows, seed, name="Q4_K"):
    data = torch.from_numpy(_random_blocks(name, out, blocks, seed))
    g = torch.Generator().manual_seed(900 + seed)
    x = torch.randn(rows, blocks * 256, generator=g) * torch.rand(rows, 1, generator=g) * 2
    return data, x


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("out,blocks", [(8, 1), (16, 3), (40, 2)])
def test_layout_round_trip_and_dequantize(out, blocks, name):
    """interleave → deinterleave gives the bytes back; q_interleave (in place) writes the torch
    layout; the torch reference and the native dequantizer (whole, any row range) equal the
    rows as stored bit for bit."""
    codec = quant.codec(name)
    xt = codec.ggml_type + x8.X8
    data, _ = _case(out, blocks, 1, seed=out + blocks, name=name)
    il = x8.interleave(data, name)
    assert il.shape == data.shape and not torch.equal(il, data)
    assert torch.equal(x8.deinterleave(il, name), data)
    # any stored byte found in the layout without deinterleaving (a prompt cache's fingerprint)
    every = torch.arange(data.numel()).numpy()
    assert torch.equal(il.reshape(-1)[torch.from_numpy(x8.stored_positions(name, data.shape[1], every))],
                       data.reshape(-1))
    mine = data.clone()
    assert kernels.interleave_rows(mine, codec.ggml_type, blocks * 256) and torch.equal(mine, il)
    cx = x8.interleaved(codec)
    assert (cx.name, cx.ggml_type, cx.rows_per_group) == (name, xt, 8) and x8.base(cx) == codec
    ref = quant.dequantize(data, name)
    assert torch.equal(x8.dequantize_part(il, cx), ref)
    n = blocks * 256
    assert torch.equal(kernels.dequantize_rows(il, xt, n), ref)
    for lo, hi in [(0, 1), (3, 5), (5, 13 if out > 8 else 8), (out - 1, out)]:
        assert torch.equal(kernels.dequantize_rows(il, xt, n, start=lo, stop=hi), ref[lo:hi]), (lo, hi)


@pytest.mark.parametrize("name", K_TYPES)
def test_x8_tile_against_reference_and_rows_as_stored(name):
    """The SIMD x8 tile gives the scalar x8 reference's bits (the same integers, the same fused
    multiply-adds), and is within 1e-5·Σ|w||x| of the rows as stored (their AVX2 tile sums 8
    lanes a row) and of the float product."""
    codec = quant.codec(name)
    xt = codec.ggml_type + x8.X8
    data, x = _case(48, 5, 19, seed=20, name=name)
    il = x8.interleave(data, name)
    got = kernels.quant_matmul(x, il, xt)
    ref = kernels.quant_matmul(x, il, xt, reference=True)
    if "fma" in cpu_flags():
        assert torch.equal(got, ref)
    stored = kernels.quant_matmul(x, data, codec.ggml_type)
    scale = x.abs() @ quant.dequantize(data, name).abs().T
    assert ((got - ref).abs() <= 1e-5 * scale + 1e-30).all()
    assert ((got - stored).abs() <= 1e-5 * scale + 1e-30).all()
    assert ((got - x @ quant.dequantize(data, name).T).abs() <= 2e-2 * scale + 1e-6).all()


@pytest.mark.parametrize("name", K_TYPES)
def test_x8_is_batch_invariant(name):
    """Every activation row's result is the same bits alone as in any batch of 2..19 rows, on
    1 and 2 threads."""
    codec = quant.codec(name)
    xt = codec.ggml_type + x8.X8
    data, x = _case(40, 3, 19, seed=40, name=name)
    il = x8.interleave(data, name)
    alone = torch.cat([kernels.quant_matmul(x[r:r + 1], il, xt) for r in range(19)])
    threads = torch.get_num_threads()
    try:
        for rows in range(2, 20):
            torch.set_num_threads(1 + rows % 2)
            assert torch.equal(kernels.quant_matmul(x[:rows], il, xt), alone[:rows]), rows
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", K_TYPES)
def test_rows_not_a_multiple_of_8_stay_as_stored(name):
    """12 rows are not eligible (a group is whole); the kernel refuses them in the x8 layout;
    a BlockWeight of an x8 part and a part as stored multiplies and dequantizes as stored."""
    codec = quant.codec(name)
    xt = codec.ggml_type + x8.X8
    assert not x8.eligible(codec, 12) and x8.eligible(codec, 16)
    data, x = _case(12, 2, 3, seed=3, name=name)
    with pytest.raises(ValueError, match="whole groups of 8"):
        kernels.quant_matmul(x, data, xt)
    with pytest.raises(ValueError, match="whole groups"):
        x8.interleave(data, name)
    d16, _ = _case(16, 2, 1, seed=4, name=name)
    stored = BlockWeight([Part(codec, 16, d16), Part(codec, 12, data)], 512)
    mixed = BlockWeight([Part(x8.interleaved(codec), 16, x8.interleave(d16, name)), Part(codec, 12, data)], 512)
    assert torch.equal(mixed.dequantize(), stored.dequantize())
    assert torch.equal(mixed.dequantize(start=10, stop=20), stored.dequantize(start=10, stop=20))
    scale = x.abs() @ stored.dequantize().abs().T
    assert ((mixed.matmul(x) - stored.matmul(x)).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, tokenizer):
    """A tiny llama whose every matrix is 256 values wide (Q4_K's super-block)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("wide-llama")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.08, bos_token_id=0, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    save_tokenizer(folder, tokenizer)
    return folder


def test_the_kernels_declare_which_layouts_loading_applies():
    """Loading interleaves what the library says its tiles read at least as fast at every batch:
    the 32-value types and Q4_K wherever the kernels build, Q6_K only with the 512-bit two-group
    tile (AVX-512 VNNI), no type without an x8 layout."""
    flags = cpu_flags()
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K"):
        assert kernels.x8_at_load(quant.codec(name).ggml_type), name
    zmm = {"avx512_vnni", "avx512bw", "avx512vl"} <= flags
    assert kernels.x8_at_load(quant.codec("Q6_K").ggml_type) == zmm
    assert not kernels.x8_at_load(quant.codec("Q5_K").ggml_type)


@pytest.mark.slow  # makes and quantizes a model (seconds)
@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_a_k_model_native_step_tracks_the_rows_as_stored(wide_llama, monkeypatch, kind):
    """load(weights=KIND) interleaves every part the kernels take interleaved at load; the
    native step stays available, tracks the eager decode of the same model, and its greedy
    tokens are TWICE_INTERLEAVE=0's."""
    name = kind.upper()
    monkeypatch.setenv("TWICE_INTERLEAVE", "0")
    stored = load(str(wide_llama), device="cpu", dtype="float32", weights=kind)
    monkeypatch.setenv("TWICE_INTERLEAVE", "1")
    m = load(str(wide_llama), device="cpu", dtype="float32", weights=kind)
    layouts = {(c.name, c.rows_per_group) for _, mod in m.model.named_modules() if isinstance(mod, _Blocks)
               for c in mod.codecs}
    at_load = kernels.x8_at_load(quant.codec(name).ggml_type)
    assert ((name, 8) in layouts) == at_load and ((name, 1) in layouts) == (not at_load), layouts
    assert all(c.rows_per_group == 1 for mod in stored.model.modules() if isinstance(mod, _Blocks) for c in mod.codecs)
    assert supported(m.model) and supported(stored.model)
    (x8_tokens, x8_last), (stored_tokens, stored_last) = native_greedy(m), native_greedy(stored)
    assert x8_tokens == stored_tokens
    assert (x8_last - stored_last).abs().max() <= 1e-3 * stored_last.abs().max()


@pytest.mark.slow  # builds the kernels twice for older CPUs (seconds)
def test_older_builds_compute_the_same():
    """x86-64-v3 (AVX2, FMA, no VNNI: maddubs for dpbusd) gives this build's bits; x86-64-v2
    (the scalar x8 reference is the production path) dequantizes the same bits and multiplies
    within rounding, batch invariant."""
    if platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 CPU")
    data, x = _case(24, 3, 7, seed=60)
    il = x8.interleave(data, "Q4_K")
    mine = kernels.quant_matmul(x, il, X8_TYPE)
    if {"avx2", "fma", "f16c"} <= cpu_flags():
        v3 = kernels._build(march="x86-64-v3")
        assert v3 is not None and v3.q_gemm_simd(X8_TYPE)
        # without the 512-bit two-group tile, Q6_K's rows stay as stored at load; Q4_K's do not
        assert kernels.x8_at_load(quant.codec("Q4_K").ggml_type, lib=v3)
        assert not kernels.x8_at_load(quant.codec("Q6_K").ggml_type, lib=v3)
        for rows in (1, 2, 3, 4, 7):
            assert torch.equal(kernels.quant_matmul(x[:rows], il, X8_TYPE, lib=v3), mine[:rows]), rows
    v2 = kernels._build(march="x86-64-v2")
    assert v2 is not None and not v2.q_gemm_simd(X8_TYPE)
    assert torch.equal(kernels.dequantize_rows(il, X8_TYPE, 768, lib=v2), quant.dequantize(data, "Q4_K"))
    theirs = kernels.quant_matmul(x, il, X8_TYPE, lib=v2)
    scale = x.abs() @ quant.dequantize(data, "Q4_K").abs().T
    assert ((theirs - mine).abs() <= 1e-5 * scale + 1e-30).all()
    assert torch.equal(theirs, torch.cat([kernels.quant_matmul(x[r:r + 1], il, X8_TYPE, lib=v2) for r in range(7)]))
