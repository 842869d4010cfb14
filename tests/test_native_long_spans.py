"""The native decode step over spans longer than one chunk of keys (decode.c ATT_CHUNK, 1024):
a row's attention then runs as several units of work, merged by their softmax maxima and
sums. Against eager over ~3,100 cached tokens (three chunks) for every attention kernel
(float32 and bfloat16 caches on 16-lane vectors, q8_0 and q4_0 blocks, gemma2's soft-capped
scalar path with its sliding layers, head sizes 64 and 128), and a long row in a batch with a
short one bit for bit as alone."""

import pytest
import torch

import tiny
from twice.core import kernels
from twice.core.cache import KVCache
from twice.core.native_decode import NativeDecoder
from twice.weights.load import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")
torch.set_grad_enabled(False)

LONG = 3100  # cached tokens before the steps: chunks of 1024, 1024 and the rest


@pytest.fixture(scope="module")
def long_dirs(tmp_path_factory, tokenizer):
    """tiny.py's families with room for LONG positions."""
    root, built = tmp_path_factory.mktemp("long"), {}

    def get(family: str):
        if family not in built:
            built[family] = tiny.make_model(root / family, family, tokenizer, seed=4, max_position_embeddings=4096)
        return built[family]

    return get


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, tiny.VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family, dtype, kv, tolerance", [
    ("llama-hd64", "float32", None, 1e-4),
    ("qwen3-hd128", "float32", None, 1e-4),
    ("llama-hd64", "bfloat16", None, 0.05),
    ("qwen3-hd128", "bfloat16", None, 0.05),
    ("llama-hd64", "float32", "q8_0", 1e-4),
    ("qwen3-hd128", "float32", "q4_0", 1e-4),
    ("gemma2", "float32", None, 1e-4),
])
def test_native_steps_over_long_spans_equal_eager(long_dirs, family, dtype, kv, tolerance):
    m = load(str(long_dirs(family)), device="cpu", dtype=dtype)
    step = NativeDecoder(m.model)
    torch_dtype = getattr(torch, dtype)
    a, b = (KVCache(m.config, 1, LONG + 8, torch_dtype, "cpu", kv_dtype=kv) for _ in range(2))
    prompt = _ids(LONG, seed=1)
    m.model(prompt, a)
    m.model(prompt, b)
    tok = torch.tensor([[42]])
    for _ in range(4):
        want, got = m.model(tok, a).float(), step(tok, b)
        assert (want - got).abs().max() < tolerance * max(1.0, want.abs().max().item())
        tok = want.argmax(-1, keepdim=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_row_in_a_batch_equals_itself_alone_bit_for_bit(long_dirs, dtype):
    """One row past two chunks beside one within a chunk: where a row's keys split depends on
    its own span only, so its logits and the keys it writes are those it computes alone."""
    m = load(str(long_dirs("qwen3-hd128")), device="cpu", dtype=dtype)
    step = NativeDecoder(m.model)
    torch_dtype = getattr(torch, dtype)
    prompts = [_ids(LONG, seed=2)[0].tolist(), _ids(40, seed=3)[0].tolist()]
    width = LONG
    batch = KVCache(m.config, 2, width + 8, torch_dtype, "cpu")
    batch.starts = torch.tensor([width - len(p) for p in prompts])
    alone = [KVCache(m.config, 1, len(p) + 8, torch_dtype, "cpu") for p in prompts]
    for i, p in enumerate(prompts):
        m.model(torch.tensor([p]), alone[i])
        batch.k[:, i, :, width - len(p): width] = alone[i].k[:, 0, :, : len(p)]
        batch.v[:, i, :, width - len(p): width] = alone[i].v[:, 0, :, : len(p)]
    batch.length = width
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        tokens = torch.randint(0, m.config.vocab_size, (2, 1), generator=g)
        together = step(tokens, batch)
        for i in range(2):
            assert torch.equal(together[i], step(tokens[i: i + 1], alone[i])[0]), i


@pytest.mark.slow
@pytest.mark.parametrize("march,needs", [("x86-64-v3", "avx2"), ("skylake-avx512", "avx512f")])
def test_builds_for_older_cpus_merge_long_spans_alike(long_dirs, march, needs):
    """The chunks of a long span through the kernels a CPU without AVX-512 BF16 (or without
    AVX-512) runs: float keys on the scalar or 16-lane path, q8_0 blocks on the AVX2 tile."""
    import platform

    if platform.machine() != "x86_64" or needs not in tiny.cpu_flags():
        pytest.skip(f"needs an x86-64 CPU with {needs}")
    lib = kernels._build(march=march)
    assert lib is not None
    m = load(str(long_dirs("llama-hd64")), device="cpu", dtype="float32")
    step = NativeDecoder(m.model)
    step.lib = lib
    for kv in (None, "q8_0"):
        a, b = (KVCache(m.config, 1, LONG + 8, torch.float32, "cpu", kv_dtype=kv) for _ in range(2))
        prompt = _ids(LONG, seed=6)
        m.model(prompt, a)
        m.model(prompt, b)
        tok = torch.tensor([[7]])
        for _ in range(3):
            want, got = m.model(tok, a), step(tok, b)
            assert (want - got).abs().max() < 1e-4, kv
            tok = want.argmax(-1, keepdim=True)
