"""core/quant's quantizers (issue 14 item 2) and core/quant/mixes.py (llama.cpp's mixtures).

- F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1: bit for bit `gguf.quants.quantize` (the numpy port of
  llama.cpp's quantize_row_*_ref), on rows with every edge a block can have.
- Q2_K..Q6_K (gguf 0.19 has no quantizer for them): bit for bit llama.cpp's C reference, through
  the sha256 of its bytes on a fixed input (computed from ggml-quants.c built with
  -ffp-contract=off) and (slow) against the C itself on fresh data, compiled from the ggml
  source in llama-cpp-python's sdist (tests/llamacpp.ggml_source; TWICE_GGML_SRC names another)
  or loaded from a built libggml-base.so (TWICE_GGML_LIB, or llama-cpp-python's);
  round trips within each type's error and clearly better than a plain absmax quantizer of the
  same bits; the packed scales decode to what was packed.
- The mixtures' per-tensor types against the rules, and against the real Qwen2.5-Coder-0.5B
  Q4_K_M file's header when it is in the user cache.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from llamacpp import ggml_source
from twice.core import quant
from twice.core.quant import kquants, mixes

GGUF_QUANTIZES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_TYPES]

# sha256 of llama.cpp's quantize_row_*_ref bytes on _golden_input() (ggml-quants.c of ggml
# d99724f, the same functions as llama-cpp-python 0.3.36 vendors, gcc -O2 -ffp-contract=off)
C_REFERENCE_SHA256 = {
    "Q4_0": "0d5e7e960cf1a8adb772db6a64e7539be9776267a36d0517354225bf15137c0a",
    "Q4_1": "c5dbbe0cba46b517d0523d304b80de75c7c74c071f156f286644e89e5f9b4ca3",
    "Q5_0": "5ad40c92378230c52d2f9a48a14d4647f3b08db1ba16a9264f05ddfe279e021b",
    "Q5_1": "8ef03252ae987b91204f503b18c96846579656f7f0cf7d67d7385ed3cc458407",
    "Q8_0": "595b66f5abb3f19e74fee474cbe6cc30c46149965b6f7232cf0393e8ef4dc302",
    "Q2_K": "ff37573d28e1f43e2a03f00aa9b21746274db64e72111a164d8fcf9afb0c21fd",
    "Q3_K": "2c0f1bf2e592823057be406c653fab4a2c51e1a9cf40fda84e471b234ec5ce4f",
    "Q4_K": "ff1e94e0272fe7932f0f91c7aeb4255934a43a2687e72ce57b7134e97f5d2c59",
    "Q5_K": "e1d41e161df11d0b3cbdf353ed0c56ed50c1d98ec4a84cfd8727d806be60b197",
    "Q6_K": "099361addbfedf0a05b3abac986b95a2cddbf9cdf0bdac9566d292c79ed34143",
}


def _golden_input() -> np.ndarray:
    """64 super-blocks (RandomState: a stream numpy keeps fixed) with the edge blocks."""
    rs = np.random.RandomState(14)
    x = rs.standard_normal((48, 256)) * np.exp(rs.uniform(-7, 3, (48, 1)))
    x = np.concatenate([x, rs.laplace(size=(8, 256)) * 0.02, rs.standard_t(3, size=(8, 256)) * 0.02])
    x[0] = 0                      # all zero
    x[1] = 1.5                    # constant, positive
    x[2] = -0.75                  # constant, negative
    x[3, :128] = 0                # half zero
    x[4] = np.abs(x[4])           # one sign only
    x[5] = -np.abs(x[5])
    x[6] = np.round(x[6] * 4) / 4  # on a grid: rounding ties
    x[7] = rs.randint(-8, 9, 256)  # small integers: ties again
    x[8] *= 1e-30                 # tiny: scales below fp16's range
    x[9, ::2] = 0
    x[10, :16] = 0                # a zero sub-block, a constant one
    x[10, 32:64] = 3.0
    x[11] = 3e4 * np.tanh(x[11])  # large, within fp16 scales
    return x.astype(np.float32)


def _edge_rows(block: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of 4 blocks each showing one edge case, for the 32-value types."""
    rows = []

    def row(*blocks):
        rows.append(np.concatenate([np.broadcast_to(np.asarray(b, np.float32), (block,)) for b in blocks]))

    g = lambda s=1.0: (rng.standard_normal(block) * s).astype(np.float32)  # noqa: E731
    row(0.0, 1.5, -0.75, g())                                   # zero and constant blocks
    row(g(1e4), g(3e4), g(1e-30), g(1e-41))                     # huge, tiny, subnormal
    ties = np.zeros(block, np.float32)
    ties[0], ties[1] = 2.0, -2.0                                # equal magnitudes, both signs
    row(ties, -ties, np.arange(block, dtype=np.float32) - 16, (np.arange(block) % 17 - 8).astype(np.float32))
    halves = np.float32(127) * np.ones(block, np.float32)
    halves[1:8] = [2.5, -3.5, 0.5, -0.5, 126.5, -1.5, 0.49999997]  # Q8_0 with d = 1: exact halves
    row(halves, np.float32(8) * np.sign(g()) + g(0.01), g(0.001) + 1000, -np.abs(g()))
    return np.stack(rows)


def _gguf(x: np.ndarray, name: str) -> np.ndarray:
    out = gq.quantize(x, GGMLQuantizationType[name])
    return np.ascontiguousarray(out).view(np.uint8).reshape(x.shape[0], -1)


def _ours(x: np.ndarray, name: str) -> np.ndarray:
    return quant.quantize(torch.from_numpy(np.ascontiguousarray(x)), name).numpy()


# -- gguf's quantizers, bit for bit -------------------------------------------------------------

@pytest.mark.parametrize("name", GGUF_QUANTIZES)
def test_bit_exact_with_gguf_random_rows(name):
    rng = np.random.default_rng(GGUF_QUANTIZES.index(name))
    x = (rng.standard_normal((24, 1024)) * np.exp(rng.uniform(-9, 6, (24, 1)))).astype(np.float32)
    assert np.array_equal(_ours(x, name), _gguf(x, name))


# the high byte of each fp16 field (its sign bit is bit 7)
FP16_HIGH = {"Q8_0": [1], "Q4_0": [1], "Q4_1": [1, 3], "Q5_0": [1], "Q5_1": [1, 3]}


def _zero_signs_cleared(raw: np.ndarray, x: np.ndarray, name: str) -> np.ndarray:
    """The bytes with the sign of the fp16 fields cleared in blocks of zeros that hold a -0.0:
    there gguf's argmax/min/max and C's compare loops pick differently signed zeros (and numpy's
    min/max of signed zeros is unspecified); nothing else may differ."""
    if name not in FP16_HIGH:
        return raw
    c = quant.codec(name)
    blocks = x.reshape(-1, c.block_size)
    signed_zero = (blocks == 0).all(1) & np.signbit(blocks).any(1)
    out = raw.reshape(-1, c.type_size).copy()
    for off in FP16_HIGH[name]:
        out[signed_zero, off] &= 0x7F
    return out.reshape(raw.shape)


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
def test_bit_exact_with_gguf_edge_blocks(name):
    x = _edge_rows(32, np.random.default_rng(7))
    with np.errstate(all="ignore"):
        want = _gguf(x, name)
    got = _ours(x, name)
    assert got.shape == want.shape == (x.shape[0], quant.codec(name).row_bytes(x.shape[1]))
    assert np.array_equal(got, want)
    # blocks of signed zeros (and every edge of the golden input): equal but for those signs
    z = np.zeros((2, 128), np.float32)
    z[0, ::3] = -0.0
    z[1, :32] = -0.0
    for y in (z, _golden_input().reshape(8, -1)):
        with np.errstate(all="ignore"):
            want = _gguf(y, name)
        got = _ours(y, name)
        assert np.array_equal(_zero_signs_cleared(got, y, name), _zero_signs_cleared(want, y, name))


def test_zero_blocks_take_cs_zero_signs():
    z = np.zeros((1, 64), np.float32)
    z[0, 0] = -0.0  # first block starts with -0.0, the second is all +0.0
    for name in ("Q4_0", "Q5_0"):  # d = max / -k from max = +0: -0.0 in both blocks
        raw = _ours(z, name).reshape(2, -1)
        assert raw[:, :2].tolist() == [[0, 0x80], [0, 0x80]]
    raw = _ours(z, "Q4_1").reshape(2, -1)  # m = the first smallest value: -0.0, then +0.0
    assert raw[:, 2:4].tolist() == [[0, 0x80], [0, 0]]
    assert _ours(z, "Q8_0").reshape(2, -1)[:, :2].tolist() == [[0, 0], [0, 0]]


def test_q8_0_ties_round_away_from_zero():
    x = _edge_rows(32, np.random.default_rng(7))[3:4, :32]
    q = _ours(x, "Q8_0")[0, 2:].view(np.int8)
    assert q[:8].tolist() == [127, 3, -4, 1, -1, 127, -2, 0]


def test_bf16_nan_payload_like_gguf():
    x = np.array([[np.nan, -np.nan, 1.0, 3.3895314e38]], np.float32)
    got = quant.CODECS["BF16"].quantize_blocks(torch.from_numpy(x).reshape(-1, 1)).numpy().reshape(1, -1)
    with np.errstate(all="ignore"):
        assert np.array_equal(got, _gguf(x, "BF16"))


# -- the C reference, bit for bit ---------------------------------------------------------------

@pytest.mark.parametrize("name", QUANTIZED)
def test_bit_exact_with_c_reference_golden(name):
    got = _ours(_golden_input().reshape(1, -1), name)
    assert hashlib.sha256(got.tobytes()).hexdigest() == C_REFERENCE_SHA256[name]


_STUBS = r"""
#include <stddef.h>
#include <stdlib.h>
/* the four ggml symbols ggml-quants.c refers to outside the row quantizers */
void ggml_abort(const char *file, int line, const char *fmt, ...) { abort(); }
size_t ggml_row_size(int type, long ne) { abort(); }
const char *ggml_type_name(int type) { abort(); }
size_t ggml_type_size(int type) { abort(); }
"""


def _ggml_library() -> Path | None:
    """A built libggml-base.so exporting quantize_row_*_ref: TWICE_GGML_LIB, or llama-cpp-python's
    where it is installed in this environment (located, not imported)."""
    if os.environ.get("TWICE_GGML_LIB"):
        return Path(os.environ["TWICE_GGML_LIB"])
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib" / "libggml-base.so"
    return lib if lib.is_file() else None


@pytest.fixture(scope="module")
def c_reference(tmp_path_factory):
    src = ggml_source()
    cc = shutil.which("gcc") or shutil.which("cc")
    if src is not None and cc is not None:
        out = tmp_path_factory.mktemp("ggmlref")
        (out / "stubs.c").write_text(_STUBS)
        lib = out / "libggmlquants.so"
        subprocess.run([cc, "-O2", "-ffp-contract=off", "-fPIC", "-shared", f"-I{src / 'include'}",
                        f"-I{src / 'src'}", f"-I{src / 'src' / 'ggml-cpu'}", str(src / "src" / "ggml-quants.c"),
                        str(out / "stubs.c"), "-o", str(lib), "-lm"], check=True, capture_output=True)
    else:
        lib = _ggml_library()
        if lib is None:
            pytest.skip("no ggml source (the README's test command downloads llama-cpp-python's sdist, "
                        "which holds one; or set TWICE_GGML_SRC or TWICE_GGML_LIB) to compare with llama.cpp's C reference")
    so = ctypes.CDLL(str(lib))

    def run(x: np.ndarray, name: str) -> np.ndarray:
        c = quant.codec(name)
        x = np.ascontiguousarray(x, np.float32)
        dst = np.zeros(x.size // c.block_size * c.type_size, np.uint8)
        fn = getattr(so, f"quantize_row_{name.lower().replace('_k', '_K')}_ref")
        fn(x.ctypes.data_as(ctypes.c_void_p), dst.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
        return dst.reshape(x.shape[0], -1)

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANTIZED)
def test_bit_exact_with_compiled_c_reference(c_reference, name):
    x = _golden_input().reshape(1, -1)
    assert hashlib.sha256(c_reference(x, name).tobytes()).hexdigest() == C_REFERENCE_SHA256[name]
    rng = np.random.default_rng(QUANTIZED.index(name) + 100)
    for scale in (0.02, 1.0, 300.0):
        y = (rng.standard_normal((64, 2048)) * scale * np.exp(rng.uniform(-2, 2, (64, 1)))).astype(np.float32)
        y[:, :256] = rng.laplace(size=(64, 256)) * scale
        assert np.array_equal(_ours(y, name), c_reference(y, name)), (name, scale)


# -- round trips and packing --------------------------------------------------------------------

# RMS error / RMS of a row, for Gaussian rows (measured: Q2_K 0.297, Q3_K 0.151, Q4_K 0.071,
# Q5_K 0.036, Q6_K 0.0177), and the share of a naive absmax quantizer's error (float scales, the
# same bits, sub-blocks of 16 or 32) the type must stay under (measured 0.51, 0.76, 0.74, 0.80, 0.92)
ERROR_BOUND = {"Q2_K": (0.31, 0.6), "Q3_K": (0.16, 0.82), "Q4_K": (0.075, 0.8), "Q5_K": (0.038, 0.85),
               "Q6_K": (0.0186, 0.96)}
BASELINE = {"Q2_K": (2, 16), "Q3_K": (3, 16), "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16)}


def _absmax(x: torch.Tensor, bits: int, sub: int) -> torch.Tensor:
    b = x.reshape(-1, sub)
    d = b.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)
    return (torch.where(d > 0, (b / d).round(), torch.zeros_like(b)) * d).reshape(x.shape)


def _rel_rms(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((y - x).pow(2).mean(-1).sqrt() / x.pow(2).mean(-1).sqrt()).mean())


@pytest.mark.parametrize("name", K_TYPES)
def test_k_round_trip_error_within_bound_and_beats_absmax(name):
    g = torch.Generator().manual_seed(14)
    x = torch.randn(16, 2048, generator=g) * 0.02
    raw = quant.quantize(x, name)
    y = quant.dequantize(raw, name)
    theirs = torch.from_numpy(gq.dequantize(raw.numpy(), GGMLQuantizationType[name]))
    assert torch.equal(y, theirs)  # gguf reads our bytes as we do
    bound, share = ERROR_BOUND[name]
    err = _rel_rms(x, y)
    assert err < bound
    assert err < share * _rel_rms(x, _absmax(x, *BASELINE[name]))
    # heavy tails too: the search must not lose to the naive quantizer there either
    t = torch.distributions.StudentT(3.0).sample((8, 2048)) * 0.02
    assert _rel_rms(t, quant.dequantize(quant.quantize(t, name), name)) < _rel_rms(t, _absmax(t, *BASELINE[name]))


# the largest error on the golden input's edge blocks, relative to the block's largest value
# (measured: Q2_K 0.333, Q3_K 0.226, Q4_K 0.064, Q5_K 0.032, Q6_K 0.023)
EDGE_BOUND = {"Q2_K": 0.4, "Q3_K": 0.3, "Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.035}


@pytest.mark.parametrize("name", K_TYPES)
def test_k_edge_blocks_round_trip(name):
    x = torch.from_numpy(_golden_input())
    y = quant.dequantize(quant.quantize(x, name), name)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(256))  # an all-zero block stays exactly zero
    rel = (y - x).abs().amax(1) / x.abs().amax(1).clamp_min(1e-30)
    assert bool((rel[1:3] < 1e-3).all())  # constant blocks
    assert bool((rel[:12] < EDGE_BOUND[name]).all()), rel[:12]


def test_k_scale_packing_decodes_to_what_was_packed():
    g = torch.Generator().manual_seed(3)
    ls = torch.randint(0, 64, (50, 8), generator=g, dtype=torch.int32)
    lm = torch.randint(0, 64, (50, 8), generator=g, dtype=torch.int32)
    sc, mn = kquants.k_scale_min(kquants._pack_k_scales(ls, lm))
    assert torch.equal(sc.int(), ls) and torch.equal(mn.int(), lm)
    # Q3_K: a block of d = 1 and all values 1 (3rd bit set) dequantizes to its scales - 32
    l = torch.randint(0, 64, (50, 16), generator=g, dtype=torch.int32)
    block = torch.zeros(50, 110, dtype=torch.uint8)
    block[:, :32] = 0xFF                                   # hmask: the 3rd bit set, q = 4 + low
    block[:, 32:96] = 0                                    # low 2 bits 0 -> q = 0... minus 0
    block[:, 32:96] = 0b01010101                           # low bits 1 everywhere -> q = 1
    block[:, 96:108] = kquants._pack_q3_scales(l)
    block[:, 108:110] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    y = quant.dequantize(block.reshape(-1), "Q3_K").reshape(50, 16, 16)
    assert torch.equal(y, (l - 32).float()[:, :, None].expand(50, 16, 16))


# -- the public quantize() ----------------------------------------------------------------------

def test_quantize_shapes_and_leading_dims():
    x = torch.randn(2, 3, 512)
    raw = quant.quantize(x, "q4_k")
    assert raw.dtype == torch.uint8 and raw.shape == (2, 3, 288)
    assert torch.equal(raw.reshape(6, -1), quant.quantize(x.reshape(6, 512), "Q4_K"))
    assert torch.equal(quant.quantize(x[0, 0], "Q4_K"), raw[0, 0])
    assert quant.quantize(x.to(torch.bfloat16), "Q8_0").shape == (2, 3, 544)
    assert quant.quantize(torch.zeros(0, 64), "Q4_0").shape == (0, 36)

@pytest.mark.parametrize("name", ["Q5_0", "Q5_K", "F16"])
def test_quantize_works_a_part_at_a_time(monkeypatch, name):
    x = torch.randn(5, 1024)
    whole = quant.quantize(x, name)
    monkeypatch.setattr(quant, "_MAX_PART_VALUES", 700)  # parts of 3, 2 or 700 blocks
    assert torch.equal(quant.quantize(x, name), whole)


def test_k_quantizers_work_a_chunk_at_a_time(monkeypatch):
    big = torch.randn(7, 256)
    whole = quant.quantize(big, "Q6_K")
    monkeypatch.setattr(kquants, "_CHUNK", 2)
    assert torch.equal(quant.quantize(big, "Q6_K"), whole)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_quantize_on_worker_threads_equals_one_thread(monkeypatch, name):
    x = torch.randn(9, 1024)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = quant.quantize(x, name)
        monkeypatch.setattr(quant, "_free_cores", lambda: 3)
        monkeypatch.setattr(quant, "_MIN_PART_VALUES", 1024)
        torch.set_num_threads(3)
        assert torch.equal(quant.quantize(x, name), alone)  # in 3 parts of 3 rows
        assert torch.get_num_threads() == 3
        with pytest.raises(ValueError):
            quant.quantize(torch.full((2, 1024), float("nan")), name)
        assert torch.get_num_threads() == 3  # restored on the way out of a refusal too
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("x, name, words", [
    (torch.ones(2, 100), "Q4_K", "100 values"),
    (torch.ones(2, 48), "Q8_0", "48 values"),
    (torch.tensor([[float("nan")] * 32]), "Q8_0", "NaN or infinity"),
    (torch.tensor([[float("inf")] + [0.0] * 255]), "Q6_K", "NaN or infinity"),
    (torch.full((1, 32), 6e5), "Q4_0", "too large"),
    (torch.full((1, 32), -1e5), "Q4_1", "too large"),
    (torch.full((1, 4), 7e4), "F16", "too large"),
    (torch.ones(1, 32, dtype=torch.int32), "Q8_0", "float tensor"),
    (torch.tensor(1.0), "Q8_0", "at least one dimension"),
    (torch.ones(1, 32), "Q7_K", "Q7_K"),
])
def test_quantize_refusals_are_one_line(x, name, words):
    with pytest.raises(ValueError) as e:
        quant.quantize(x, name)
    msg = str(e.value)
    assert "\n" not in msg and words in msg


def test_every_codec_has_a_quantizer():
    for c in quant.CODECS.values():
        assert c.quantize_blocks is not None
        out = c.quantize_blocks(torch.zeros(2, c.block_size))
        assert out.dtype == torch.uint8 and out.shape == (2, c.type_size)


# -- mixtures -----------------------------------------------------------------------------------

def _types(mixture, n_layers=32, hidden=4096, ffn=11008, **kw):
    """Per-tensor types for a dense llama-shaped model (torch shapes: rows of `hidden`, ffn_down of `ffn`)."""
    names = {"token_embd.weight": (32000, hidden), "output.weight": (32000, hidden), "output_norm.weight": (hidden,)}
    for i in range(n_layers):
        for part, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden // 4, hidden)),
                            ("attn_v", (hidden // 4, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn)),
                            ("attn_norm", (hidden,))):
            names[f"blk.{i}.{part}.weight"] = shape
    return {n: mixes.tensor_type(mixture, n, n_layers, s, "llama", **kw) for n, s in names.items()}


def test_use_more_bits_layers():
    assert [i for i in range(32) if mixes.use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29,
                                                                    30, 31]
    assert [i for i in range(24) if mixes.use_more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]


def test_q4_k_m_rules():
    t = _types("q4_k_m", tied_embeddings=False)
    more = {i for i in range(32) if mixes.use_more_bits(i, 32)}
    for i in range(32):
        want = "Q6_K" if i in more else "Q4_K"
        assert t[f"blk.{i}.attn_v.weight"] == want and t[f"blk.{i}.ffn_down.weight"] == want
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert t[f"blk.{i}.{part}.weight"] == "Q4_K"
        assert t[f"blk.{i}.attn_norm.weight"] == "F32"
    assert t["output.weight"] == "Q6_K" and t["token_embd.weight"] == "Q4_K" and t["output_norm.weight"] == "F32"
    # a model without output.weight: the embedding is the output matrix too
    assert mixes.tensor_type("q4_k", "token_embd.weight", 32, (32000, 4096), "llama") == "Q6_K"


def test_other_mixture_rules():
    t = _types("q5_k_m", tied_embeddings=False)
    assert t["blk.0.attn_v.weight"] == t["blk.31.ffn_down.weight"] == "Q6_K"
    assert t["blk.4.attn_v.weight"] == t["blk.4.ffn_down.weight"] == t["blk.4.attn_q.weight"] == "Q5_K"
    t = _types("q4_k_s", tied_embeddings=False)
    assert [t[f"blk.{i}.attn_v.weight"] for i in (3, 4)] == ["Q5_K", "Q4_K"]
    assert [t[f"blk.{i}.ffn_down.weight"] for i in (3, 4)] == ["Q5_K", "Q4_K"]
    t = _types("q3_k_m", tied_embeddings=False)
    assert [t[f"blk.{i}.attn_v.weight"] for i in (1, 2)] == ["Q5_K", "Q4_K"]
    assert [t[f"blk.{i}.ffn_down.weight"] for i in (1, 2, 20)] == ["Q5_K", "Q4_K", "Q4_K"]
    assert t["blk.5.attn_output.weight"] == "Q4_K" and t["blk.5.attn_q.weight"] == "Q3_K"
    t = _types("q2_k", tied_embeddings=False, n_gqa=4)
    assert (t["blk.5.attn_v.weight"], t["blk.5.ffn_down.weight"], t["blk.5.attn_output.weight"]) == ("Q4_K", "Q3_K",
                                                                                                     "Q3_K")
    assert mixes.tensor_type("q2_k", "blk.5.attn_v.weight", 32, (1024, 4096), "llama", n_gqa=1) == "Q3_K"
    for mix, out in (("q6_k", "Q6_K"), ("q8_0", "Q8_0"), ("q4_0", "Q6_K"), ("q5_1", "Q6_K")):
        t = _types(mix, tied_embeddings=False)
        base = mixes.MIXTURES[mix]
        assert t["output.weight"] == out
        assert {t[f"blk.{i}.{p}.weight"] for i in range(32) for p in ("attn_v", "ffn_down", "attn_q")} == {base}
    assert _types("f16")["blk.3.attn_v.weight"] == "F16" and _types("f16")["blk.3.attn_norm.weight"] == "F32"


def test_row_length_fallbacks():
    # rows of 896 (Qwen2.5-0.5B): not whole 256-value blocks
    t = _types("q4_k_m", n_layers=24, hidden=896, ffn=4864, tied_embeddings=False)
    assert t["blk.0.attn_q.weight"] == "Q5_0" and t["blk.0.attn_v.weight"] == "Q8_0"
    assert t["blk.0.ffn_down.weight"] == "Q6_K" and t["blk.4.ffn_down.weight"] == "Q4_K"  # rows of 4864 = 19 * 256
    assert t["output.weight"] == "Q8_0"
    assert mixes.tensor_type("q5_k_m", "blk.4.attn_q.weight", 24, (896, 896), "qwen2") == "Q5_1"
    assert mixes.tensor_type("q2_k", "blk.4.attn_q.weight", 24, (896, 896), "qwen2") == "Q4_0"
    assert mixes.tensor_type("q4_k_m", "blk.4.attn_q.weight", 24, (100, 100), "qwen2") == "F16"
    assert mixes.tensor_type("q8_0", "blk.4.attn_q.weight", 24, (100, 100), "qwen2") == "F16"
    for kind in {mixes.tensor_type(m, "blk.4.attn_q.weight", 24, (896, 896), "qwen2") for m in mixes.MIXTURES}:
        mixes.check_row(kind, 896)


def test_check_row_and_bad_names():
    mixes.check_row("Q4_K", 4096)
    mixes.check_row("f16", 7)
    for kind, n in (("Q4_K", 896), ("Q8_0", 48), ("Q4_0", 0)):
        with pytest.raises(ValueError) as e:
            mixes.check_row(kind, n)
        assert "\n" not in str(e.value) and f"{n} values" in str(e.value) and kind in str(e.value)
    with pytest.raises(ValueError, match="unknown quantization mixture 'q4_k_x'"):
        mixes.tensor_type("q4_k_x", "output.weight", 2, (10, 256), "llama")
    with pytest.raises(ValueError, match="layer 40"):
        mixes.tensor_type("q4_k_m", "blk.40.attn_v.weight", 32, (1024, 4096), "llama")
    assert mixes.mixture_name("Q4_K") == "q4_k_m" and mixes.mixture_name(" q6_k ") == "q6_k"


def _user_cache() -> Path:
    if os.environ.get("TWICE_CACHE"):
        return Path(os.environ["TWICE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "twice"


# found at import, before conftest points TWICE_CACHE at a per-test folder
_QWEN = sorted(glob.glob(str(_user_cache() / "gguf" / "qwen2.5-coder-*-instruct-q4_k_m-*.gguf")))


@pytest.mark.skipif(not _QWEN, reason="the Qwen2.5-Coder Q4_K_M files are not in the user cache")
@pytest.mark.parametrize("path", _QWEN, ids=lambda p: Path(p).name.split("-instruct")[0])
def test_mixture_matches_real_q4_k_m_file(path):
    from twice.weights.gguf_file import read_gguf

    g = read_gguf(Path(path))
    meta = g.metadata
    arch = meta["general.architecture"]
    n_layers = int(meta[f"{arch}.block_count"])
    n_gqa = int(meta[f"{arch}.attention.head_count"]) // int(meta[f"{arch}.attention.head_count_kv"])
    names = {t.name for t in g.tensors}
    wrong = []
    for t in g.tensors:
        got = mixes.tensor_type("q4_k_m", t.name, n_layers, tuple(reversed(t.shape)), arch,
                                tied_embeddings="output.weight" not in names, n_gqa=n_gqa, order="name")
        if got != GGMLQuantizationType(t.tensor_type).name:
            wrong.append((t.name, GGMLQuantizationType(t.tensor_type).name, got))
    assert not wrong and len(g.tensors) > 200
