"""The native causal attention of a fresh prompt (kernels/prefill.c) computes what SDPA
computes, in bf16 and fp32, and prefill uses it."""

import platform

import pytest
import torch
import torch.nn.functional as F
from tiny import cpu_flags

from twice.core import kernels
from twice.core.attention import CausalAfter, Step
from twice.core.benchmark import shape_config
from twice.core.cache import KVCache
from twice.core.engine import Engine, GenerationSettings, Request
from twice.weights.load import load


pytestmark = pytest.mark.skipif(not (kernels.available() and platform.machine() == "x86_64"
                                     and "avx512_bf16" in cpu_flags()),
                                reason="needs the native kernels on a CPU with AVX-512 BF16")


def _sdpa(q, k, v, scale):
    b, h, t, d = q.shape
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != h)
    return out.transpose(1, 2).reshape(b, t, h * d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,h,kv,t,d", [(1, 9, 3, 1, 64), (1, 9, 3, 5, 64), (2, 4, 2, 37, 64), (1, 6, 2, 100, 128),
                                        (1, 5, 1, 64, 64), (2, 2, 2, 17, 128), (1, 9, 3, 300, 64), (1, 3, 3, 2, 128)])
def test_native_causal_attention_equals_sdpa(b, h, kv, t, d, dtype):
    """Query tiles of 1–4, key blocks of 1–4 and their tails, odd key counts, GQA groups;
    q as attend gets it (a transposed view), k/v as rows of a larger cache."""
    g = torch.Generator().manual_seed(b * 1000 + h * 100 + t + d)
    q = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    cache_k, cache_v = (torch.randn(b, kv, t + 7, d, generator=g).to(dtype) for _ in range(2))
    k, v = cache_k[:, :, :t], cache_v[:, :, :t]
    scale = d ** -0.5
    got, want = kernels.causal_attention(q, k, v, scale), _sdpa(q, k, v, scale)
    assert got.shape == want.shape == (b, t, h * d) and got.dtype == dtype
    if dtype == torch.float32:
        assert (got - want).abs().max() < 1e-5
    else:  # the same arithmetic up to summation order: equal bits mostly, else one bf16 step apart
        assert (got.float() - want.float()).abs().max() <= 0.02
        assert (got == want).float().mean() > 0.85


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,h,kv,t,column,d", [(1, 9, 3, 5, 3, 64), (2, 4, 2, 37, 20, 64), (1, 6, 2, 9, 100, 128),
                                               (1, 5, 1, 2, 1, 64), (1, 2, 2, 64, 64, 128)])
def test_new_tokens_after_cached_ones_equal_sdpa(b, h, kv, t, column, d, dtype):
    """A later chunk of a prompt or a chat turn: token t sees keys [0, column + t]."""
    g = torch.Generator().manual_seed(column * 100 + t + d)
    q = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(b, kv, column + t + 5, d, generator=g).to(dtype)[:, :, : column + t] for _ in range(2))
    allowed = torch.arange(column + t)[None, :] <= torch.arange(column, column + t)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=d ** -0.5, enable_gqa=kv != h)
    want = want.transpose(1, 2).reshape(b, t, h * d)
    got = kernels.causal_attention(q, k, v, d ** -0.5, column)
    if dtype == torch.float32:
        assert (got - want).abs().max() < 1e-5
    else:
        assert (got.float() - want.float()).abs().max() <= 0.02 and (got == want).float().mean() > 0.85
    assert kernels.causal_attention(q, k[:, :, :-1], v[:, :, :-1], d ** -0.5, column) is None  # keys ≠ column + t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("column,t,starts", [(0, 20, [0, 5, 12]), (4, 9, [0, 3, 7]), (0, 37, [36, 0, 17])])
def test_left_padded_rows_equal_sdpa_with_steps_mask(column, t, starts, dtype):
    """Rows that start later (left padding, as a batch of prompts holds them): the kernel
    against SDPA with the mask Step builds (a padding query sees only itself)."""
    b, h, kv, d = len(starts), 4, 2, 64
    g = torch.Generator().manual_seed(column + t)
    q = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(b, kv, column + t, d, generator=g).to(dtype) for _ in range(2))
    cache = KVCache(shape_config("tiny"), b, column + t, dtype, "cpu")
    cache.length, cache.starts = column, torch.tensor(starts)
    step = Step.build(cache, t, {None})
    mask = step.masks[None]
    assert isinstance(mask, CausalAfter) and mask.column == column
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask, scale=0.125, enable_gqa=True)
    want = want.transpose(1, 2).reshape(b, t, h * d)
    got = kernels.causal_attention(q, k, v, 0.125, column, mask.starts)
    if dtype == torch.float32:
        assert (got - want).abs().max() < 1e-5
    else:
        assert (got.float() - want.float()).abs().max() <= 0.02 and (got == want).float().mean() > 0.85


def test_what_it_does_not_read_is_left_to_sdpa():
    q = torch.randn(1, 2, 8, 64).bfloat16()
    k = v = torch.randn(1, 2, 8, 64).bfloat16()
    assert kernels.causal_attention(q.half(), k.half(), v.half(), 0.125) is None  # float16
    assert kernels.causal_attention(q[..., :32], k[..., :32], v[..., :32], 0.125) is None  # head size 32
    assert kernels.causal_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, 0.125) is None  # layout
    lib = kernels._build(march="skylake-avx512")  # AVX-512 without BF16: the kernel declines
    assert lib is not None
    out = torch.empty(1, 8, 128, dtype=torch.bfloat16)
    assert lib.causal_attention(1, q.data_ptr(), *q.stride()[:3], k.data_ptr(), v.data_ptr(), *k.stride()[:2],
                                out.data_ptr(), 1, 2, 2, 8, 64, 0, None, 0.125, 2) == -1


def _count_calls(monkeypatch, name: str) -> list[bool]:
    """kernels.`name` wrapped: each call appends whether the kernel ran (not None)."""
    calls, real = [], getattr(kernels, name)

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["llama-hd64", "qwen3-hd128"])
def test_prefill_with_native_attention_tracks_sdpa(model_dirs, family, dtype, monkeypatch):
    """Whole-model prefill logits (every position) with the kernel and with SDPA."""
    m = load(str(model_dirs(family)), device="cpu", dtype=dtype)
    ids = torch.arange(3, 3 + 70).reshape(1, 70)
    calls = _count_calls(monkeypatch, "causal_attention")
    with torch.inference_mode():
        native = m.model(ids, KVCache(m.config, 1, 80, m.dtype, "cpu"), all_logits=True).float()
        assert calls and all(calls)  # every layer took the kernel
        monkeypatch.setattr(kernels, "causal_attention", lambda *args: None)
        sdpa = m.model(ids, KVCache(m.config, 1, 80, m.dtype, "cpu"), all_logits=True).float()
    assert (native - sdpa).abs().max() < (0.05 if dtype == "bfloat16" else 1e-4)
    assert (native.argmax(-1) == sdpa.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_chunked_prefill_and_a_second_turn_take_the_kernel(model_dirs, dtype, monkeypatch):
    """Chunks after the first (and so a chat turn after cached ones) attend through the
    kernel with their column, and give the logits of one whole prefill."""
    m = load(str(model_dirs("llama-hd64")), device="cpu", dtype=dtype)
    ids = torch.arange(3, 3 + 70).reshape(1, 70)
    columns = []
    real = kernels.causal_attention

    def counted(q, k, v, scale, column=0, starts=None):
        out = real(q, k, v, scale, column, starts)
        columns.append(column if out is not None else None)
        return out

    monkeypatch.setattr(kernels, "causal_attention", counted)
    with torch.inference_mode():
        cache = KVCache(m.config, 1, 80, m.dtype, "cpu")
        parts = [m.model(ids[:, a:b], cache, all_logits=True).float() for a, b in ((0, 30), (30, 55), (55, 70))]
        chunked = torch.cat(parts, dim=1)
        whole = m.model(ids, KVCache(m.config, 1, 80, m.dtype, "cpu"), all_logits=True).float()
    layers = m.config.num_hidden_layers
    assert columns == [0] * layers + [30] * layers + [55] * layers + [0] * layers
    assert (chunked - whole).abs().max() < (0.05 if dtype == "bfloat16" else 1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_padded_batch_takes_the_kernel_and_equals_each_prompt_alone(model_dirs, dtype, monkeypatch):
    """Where decode is not batch-invariant (the eager step; with the native step each prompt
    is prefilled alone, test_batch_invariance.py), generate_batch left-pads prompts of
    different lengths into one prefill, through the kernel: each row's last logits track
    its prompt's alone, and in float32 every row's greedy tokens are those of its prompt
    alone (in bf16 the eager step's rows may part at near ties)."""
    m = load(str(model_dirs("llama-hd64")), device="cpu", dtype=dtype)
    engine = Engine(m.model, m.tokenizer, m.eos_token_ids, native=False)
    assert not engine.batch_invariant
    prompts = [list(range(3, 8)), list(range(10, 29)), list(range(40, 51))]
    settings = [GenerationSettings(max_new_tokens=n, ignore_eos=True) for n in (12, 6, 9)]
    alone = [list(engine.generate(Request(ids=p), s, reuse_cache=False))[-1].result.token_ids
             for p, s in zip(prompts, settings)]
    padded = []
    real = kernels.causal_attention

    def counted(q, k, v, scale, column=0, starts=None):
        out = real(q, k, v, scale, column, starts)
        padded.append(starts is not None and out is not None)
        return out

    monkeypatch.setattr(kernels, "causal_attention", counted)
    batched = {e.row: e.result.token_ids for e in engine.generate_batch([Request(ids=p) for p in prompts], settings)
               if type(e).__name__ == "Done"}
    assert any(padded)  # the padded prefill went through the kernel
    if dtype == "float32":
        assert [batched[i] for i in range(3)] == alone
    width = max(map(len, prompts))
    cache = KVCache(m.config, 3, width, m.model.lm_head_weight.dtype, "cpu")
    cache.starts = torch.tensor([width - len(p) for p in prompts])
    with torch.inference_mode():
        together = m.model(torch.tensor([[0] * (width - len(p)) + p for p in prompts]), cache).float()
        for i, p in enumerate(prompts):
            own = m.model(torch.tensor([p]), KVCache(m.config, 1, len(p), cache.k.dtype, "cpu")).float()
            assert (together[i] - own[0]).abs().max() < (0.05 if dtype == "bfloat16" else 1e-4)


# -- a block cache (--kv-dtype q8_0|q4_0) read as stored -------------------------------------
def _block_cache(kv, dtype, b, kvh, d, capacity, offset, seed):
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=kvh, head_dim=d)
    cache = KVCache(config, b, capacity, dtype, "cpu", kv_dtype=kv)
    if offset:  # a model with a key bias: keys stored minus it (layer 1 only; layer 0's offset is zero)
        cache.offset_keys(1, torch.randn(kvh * d, generator=g) * 30)
    for layer in range(2):
        k, v = (torch.randn(b, kvh, capacity, d, generator=g).to(dtype) * 2 for _ in range(2))
        cache.store(layer, 0, k, v)
    return cache


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,h,kvh,t,column,d,offset,starts", [
    (1, 9, 3, 37, 0, 64, False, None), (1, 9, 3, 5, 40, 64, True, None), (2, 4, 2, 17, 20, 128, True, None),
    (1, 6, 2, 1, 63, 128, False, None), (3, 4, 1, 20, 0, 64, True, [0, 5, 12]), (2, 2, 2, 9, 4, 64, False, [3, 0])])
def test_block_caches_are_read_as_stored_bit_for_bit(kv, dtype, b, h, kvh, t, column, d, offset, starts):
    """The kernel over a Q8_0/Q4_0 cache's layer as stored (odd key counts, GQA, a later
    chunk, left padding, a key offset) gives the bits it gives over the cache's own decode
    of those columns (what the eager layers attended to before)."""
    from twice.core.attention import attend_blocks

    cache = _block_cache(kv, dtype, b, kvh, d, column + t + 6, offset, seed=t * 7 + column + d)
    g = torch.Generator().manual_seed(column + t)
    q = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    rows = torch.tensor(starts) if starts is not None else None
    end = column + t
    for layer in range(2):
        keys, values = cache.attended(layer, end, dtype)
        want = kernels.causal_attention(q, keys.contiguous(), values.contiguous(), d ** -0.5, column, rows)
        offset_of = cache.key_offset[layer] if cache.key_offset is not None else None
        got = kernels.causal_attention_blocks(q, cache.k[layer], cache.v[layer], cache.format.ggml_type,
                                              d ** -0.5, column, rows, offset_of)
        assert want is not None and got is not None and torch.equal(got, want), (layer, (got - want).abs().max())
        mask = "causal" if column == 0 and rows is None else CausalAfter(column, None, rows)
        assert torch.equal(attend_blocks(q, cache, layer, end, mask, d ** -0.5), want)


def test_a_block_prefill_reads_the_blocks_and_gives_the_decoded_logits(model_dirs, monkeypatch):
    """A whole model's prefill and a later chunk on a q8_0 cache: every layer attends through
    the block kernel (no decoded copy made), the logits bit for bit those over the decoded copy."""
    from twice.core import attention

    m = load(str(model_dirs("llama-hd64")), device="cpu", dtype="bfloat16")
    ids = torch.arange(3, 3 + 70).reshape(1, 70)

    def run():
        cache = KVCache(m.config, 1, 80, m.dtype, "cpu", kv_dtype="q8_0")
        with torch.inference_mode():
            return torch.cat([m.model(ids[:, a:z], cache, all_logits=True) for a, z in ((0, 50), (50, 70))], dim=1)

    calls = _count_calls(monkeypatch, "causal_attention_blocks")
    native = run()
    assert calls and all(calls) and len(calls) == 2 * m.config.num_hidden_layers
    monkeypatch.setattr(attention, "attend_blocks", lambda *args: None)  # the decoded copy, as before
    assert torch.equal(native, run())
