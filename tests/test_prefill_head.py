"""The native prefill computes the head (final norm + the vocabulary matrix) for the rows
whose logits it returns only (NativeDecoder.virtual_rows' `last`, decode.c's first_logit):
its last logits and the cache it leaves are bit for bit those of the path that computed every
row's logits (verify over the same chunks), for a tied and an untied head, float and GGUF
q8_0 / q4_0 weights, one chunk or several. Tiny random models, one torch thread. (Beside
test_native_prefill.py, whose module needs AVX-512 BF16: these run wherever the native step
does.)"""

from __future__ import annotations

import pytest
import torch

import tiny
from twice.core import kernels
from twice.core.cache import KVCache
from twice.core.native_decode import PREFILL_CHUNK, NativeDecoder, supported
from twice.weights.load import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")

PROMPT = [(7 * i) % 200 + 3 for i in range(150)]  # 64 + 64 + 22 rows at PREFILL_CHUNK


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one thread (conftest.one_thread)."""


@pytest.fixture(scope="module")
def loaded(model_dirs, tmp_path_factory):
    files = tiny.gguf_files(tmp_path_factory.mktemp("prefill-head"), model_dirs)
    made = {}

    def get(family: str, kind: str | None):
        if (family, kind) not in made:
            ref = model_dirs(family) if kind is None else files(family, kind)
            made[family, kind] = load(str(ref), device="cpu", dtype="float32")
        return made[family, kind]

    return get


def _cache(m, capacity: int = len(PROMPT) + 8) -> KVCache:
    return KVCache(m.config, 1, capacity, m.dtype, "cpu", kv_heads=m.model.kv_heads)


def _every_row(native: NativeDecoder, ids: torch.Tensor, cache: KVCache, chunk: int) -> torch.Tensor:
    """The prefill as it was: verify over the chunks, every row's logits, the last row kept."""
    for begin in range(0, ids.numel(), chunk):
        logits = native.verify(ids[begin:begin + chunk], cache)
    return logits[-1:]


# llama: an untied head; qwen2: tied to the embedding (as SmolLM2's), in GGUF the head is
# token_embd's quantized rows
@pytest.mark.parametrize("family,kind", [("llama", None), ("qwen2", None), ("llama", "q8_0"), ("qwen2", "q8_0"),
                                         ("qwen2", "q4_0"), ("llama", "q4_0")])
@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 23])
def test_prefill_of_the_last_row_equals_every_rows_head(loaded, family, kind, chunk):
    m = loaded(family, kind)
    assert supported(m.model)
    assert m.config.tie_word_embeddings == (family == "qwen2")
    native = NativeDecoder(m.model)
    ids = torch.tensor(PROMPT)
    for n in (len(PROMPT), 1, chunk, chunk + 1):  # several chunks, one row, exactly one chunk, a 1-row tail
        want_cache, got_cache = _cache(m), _cache(m)
        want = _every_row(native, ids[:n], want_cache, chunk)
        got = native.prefill(ids[:n], got_cache, chunk)
        assert got.shape == (1, m.config.vocab_size) and torch.equal(got, want), n
        assert got_cache.length == want_cache.length == n
        assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v), n


@pytest.mark.parametrize("family,kind", [("qwen2", None), ("llama", "q4_0")])
def test_virtual_rows_give_the_last_rows_of_verify(loaded, family, kind):
    """`last` rows of a call (after a cached prefix): verify's last rows bit for bit, none for
    0, every row for None; a `last` outside [0, T] is refused with nothing written."""
    m = loaded(family, kind)
    native = NativeDecoder(m.model)
    tokens = torch.tensor(PROMPT[:9])
    base = _cache(m)
    native.prefill(torch.tensor(PROMPT[20:37]), base)
    want = native.verify(tokens, _copy(m, base))
    for last in (0, 1, 4, 9, None):
        cache = _copy(m, base)
        got = native.virtual_rows(tokens, cache, last=last)
        rows = 9 if last is None else last
        assert got.shape == (rows, m.config.vocab_size) and torch.equal(got, want[9 - rows:]), last
        assert cache.length == base.length + 9
    for bad in (-1, 10):
        cache = _copy(m, base)
        with pytest.raises(ValueError):
            native.virtual_rows(tokens, cache, last=bad)
        assert cache.length == base.length and torch.equal(cache.k, base.k)
    with pytest.raises(ValueError):
        native.prefill(torch.tensor([], dtype=torch.int64), _cache(m))


def _copy(m, cache: KVCache) -> KVCache:
    out = _cache(m, cache.capacity)
    out.k.copy_(cache.k)
    out.v.copy_(cache.v)
    out.length = cache.length
    return out


@pytest.mark.parametrize("family,kind", [("llama", None), ("llama", "q8_0")])
def test_prefill_past_256_tokens_only_for_int8_products_on_vnni(loaded, family, kind):
    """Past PREFILL_MAX tokens the native prefill serves float32 activations over GGUF blocks
    where the integer kernels use VNNI (there it beats the eager layers' float32 products at
    any length); float weights, and AVX2 builds, keep the 256-token limit."""
    from twice.core.native_decode import PREFILL_MAX

    m = loaded(family, kind)
    native = NativeDecoder(m.model)
    vnni = bool(native.lib.twq_x8_vnni())
    long = torch.zeros(1, PREFILL_MAX + 44, dtype=torch.int64)
    cache = _cache(m, PREFILL_MAX + 64)
    assert native.prefills(long[:, :PREFILL_MAX], cache)
    assert native.prefills(long, cache) == (vnni and kind is not None)
    assert not native.prefills(long, _cache(m, PREFILL_MAX + 8))  # it must fit
