"""core/quant.py: GGUF block dequantizers, bit for bit against the gguf package."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from twice.core import quant

ALL = [n for n, c in quant.CODECS.items() if c.quantized]
# types the gguf package can quantize (the rest get random valid block bytes)
QUANTIZABLE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# byte offsets of the fp16 fields in each block (everything else is free bits)
FP16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def _gguf_type(name):
    return GGMLQuantizationType[name]


def _ours(raw: np.ndarray, name: str) -> torch.Tensor:
    return quant.dequantize(torch.from_numpy(np.ascontiguousarray(raw)), name)


def _theirs(raw: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gq.dequantize(raw, _gguf_type(name))))


def _random_blocks(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random block bytes with finite fp16 scale fields (every bit pattern of the quants)."""
    c = quant.codec(name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, c.type_size), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        scale = (rng.standard_normal((rows, blocks_per_row)) * 0.05).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * c.type_size)


@pytest.mark.parametrize("name", ALL)
def test_registry_matches_gguf_sizes_and_ids(name):
    c = quant.codec(name)
    t = _gguf_type(name)
    assert (c.block_size, c.type_size) == GGML_QUANT_SIZES[t]
    assert c.ggml_type == int(t)
    assert quant.BY_GGML_TYPE[int(t)] is c
    assert quant.codec(name.lower()) is c


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_bit_exact_on_gguf_quantized_rows(name):
    rng = np.random.default_rng(14)
    c = quant.codec(name)
    x = (rng.standard_normal((5, 4 * c.block_size)) * rng.uniform(0.01, 3.0, (5, 1))).astype(np.float32)
    x[0, : c.block_size] = 0.0  # an all-zero block (d = 0)
    x[1, c.block_size: 2 * c.block_size] = 1.5  # a constant block
    raw = gq.quantize(x, _gguf_type(name))
    assert raw.dtype == np.uint8 and raw.shape == (5, 4 * c.type_size)
    ours = _ours(raw, name)
    theirs = _theirs(raw, name)
    assert ours.dtype == torch.float32 and ours.shape == (5, 4 * c.block_size)
    assert torch.equal(ours, theirs)
    # and it is a dequantization of x: close to it
    assert torch.allclose(ours, torch.from_numpy(x), atol=float(np.abs(x).max()) * 0.15)


@pytest.mark.parametrize("name", ALL)
def test_bit_exact_on_random_block_bytes(name):
    raw = _random_blocks(name, rows=3, blocks_per_row=5, seed=ALL.index(name))
    ours = _ours(raw, name)
    theirs = _theirs(raw, name)
    c = quant.codec(name)
    assert ours.shape == (3, 5 * c.block_size)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_leading_dims_and_single_row(name):
    c = quant.codec(name)
    raw = _random_blocks(name, rows=6, blocks_per_row=2, seed=3)
    flat = _ours(raw, name)
    stacked = quant.dequantize(torch.from_numpy(raw).reshape(2, 3, -1), name)
    assert stacked.shape == (2, 3, 2 * c.block_size)
    assert torch.equal(stacked.reshape(6, -1), flat)
    one = quant.dequantize(torch.from_numpy(raw[0].copy()), name)
    assert one.shape == (2 * c.block_size,)
    assert torch.equal(one, flat[0])
    # a non-contiguous row view gives the same values
    wide = torch.from_numpy(np.concatenate([raw, raw], axis=1))
    assert torch.equal(quant.dequantize(wide[:, : raw.shape[1]], name), flat)


def test_q4_1_layout_by_hand():
    # d = 2, m = -1; qs[j] = (hi << 4) | lo with lo = j % 16, hi = 15 - j % 16
    d = np.array([2.0], np.float16).view(np.uint8)
    m = np.array([-1.0], np.float16).view(np.uint8)
    qs = np.array([((15 - j) << 4) | j for j in range(16)], np.uint8)
    raw = torch.from_numpy(np.concatenate([d, m, qs]))
    want = [2.0 * j - 1.0 for j in range(16)] + [2.0 * (15 - j) - 1.0 for j in range(16)]
    assert quant.dequantize(raw, "Q4_1").tolist() == want


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_wrong_byte_count_is_one_line_value_error(name):
    c = quant.codec(name)
    with pytest.raises(ValueError) as e:
        quant.dequantize(torch.zeros(2, c.type_size * 3 + 1, dtype=torch.uint8), name)
    msg = str(e.value)
    assert "\n" not in msg and name in msg and str(c.type_size) in msg


def test_bad_dtype_and_unknown_type():
    with pytest.raises(ValueError) as e:
        quant.dequantize(torch.zeros(34, dtype=torch.int8), "Q8_0")
    assert "\n" not in str(e.value) and "uint8" in str(e.value)
    with pytest.raises(ValueError) as e:
        quant.dequantize(torch.zeros(34, dtype=torch.uint8), "Q7_9")
    assert "\n" not in str(e.value) and "Q7_9" in str(e.value)


@pytest.mark.parametrize("name", list(quant.CODECS))
def test_reference_dequantizers_follow_the_data_device(name):
    """The torch reference serves block-stored weights on a GPU: no constant may stay on the
    CPU (the meta device stands in for one: a CPU constant beside it is an error)."""
    c = quant.codec(name)
    data = torch.empty(3, 2 * c.type_size, dtype=torch.uint8, device="meta")
    out = quant.dequantize(data, name)
    assert out.device.type == "meta" and out.shape == (3, 2 * c.block_size)
