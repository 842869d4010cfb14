"""The native attention over Q8_0/Q4_0 blocks in bfloat16 models (kernels/decode.c,
attend_heads_blocks_bf16 on CPUs with AVX-512 BF16 and VBMI, head size 64; elsewhere the float32
path, which meets these bounds too): the stored integers meet the bf16 probabilities in dot
products, each value block's scale folded into the probability it meets, and the query in integer
ones (with AVX-512 VNNI: the query rounded to int8 per 32-value block, d = max|q|/127 as Q8_0's,
meets the keys' integers exactly; without, the bf16 query meets them as bf16). The reference is
exact attention (float64) on the dequantized blocks and the query the kernel scores with (the
int8-rounded one where kv_attend_int8_query says so: that rounding, like llama.cpp's of the query
to the keys' dot type, is the path's, not the probabilities'). Eager's bf16 SDPA on the blocks
dequantized to bf16 rounds e^(s − max) and d·q to bf16 each, the native path rounds e^(s − max)·d
once and the output to bf16, so both sit within two bf16 roundings of their reference (half an ulp
each, ≤ 2^-8 relative): |native − exact| ≤ 2^-7 · max|V| (measured ≤ 0.0048 · max|V|), and no
more than twice eager's own error plus one rounding of the output (measured: up to 4.8× eager's
where that is small, never above the sum). Against exact attention on the unrounded query the
int8 path is off by up to ~0.018 · max|V| here (keys up to 10 times a standard normal's size: the
query's rounding moves the scores by up to ~0.14): the bounds hold only with the rounded query,
which is what makes them catch a wrong block constant or scale. Spans cover the 16-key tiles'
tails and odd counts (a value pair's missing partner), runs of 4 query heads and their remainders.
"""

import ctypes
import math

import pytest
import torch

from twice.core import kernels, quant

native_only = pytest.mark.skipif(not kernels.available(), reason="no C compiler: decode stays in PyTorch")
KV = {"q8_0": 8, "q4_0": 2}


def _attend(kv: str, bf16: bool, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, n: int, scale: float):
    lib = kernels.library()
    lib.kv_attend.restype = ctypes.c_int
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.kv_attend.argtypes = [i64, i64, i64, i64, i64, ctypes.c_float, p, p, p, p]
    group, D = q.shape
    out = torch.empty(group, D)
    q = q.contiguous()
    assert lib.kv_attend(KV[kv], int(bf16), group, D, n, scale, q.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                         out.data_ptr()) == 0
    return out


def _case(kv: str, group: int, n: int, D: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + n)
    keys = torch.randn(n, D, generator=g) * torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)].unsqueeze(1)
    values = torch.randn(n, D, generator=g) * torch.logspace(-2, 1, D)[torch.randperm(D, generator=g)]
    if n > 3:
        values[1] = 0.0  # a zero scale
        keys[2, :32] *= 1e-6  # a subnormal fp16 scale
    q = (torch.randn(group, D, generator=g) * 0.7).to(torch.bfloat16).float()  # bf16 values, as a bf16 model's
    kc = quant.quantize(keys.reshape(-1).contiguous(), kv.upper()).contiguous()
    vc = quant.quantize(values.reshape(-1).contiguous(), kv.upper()).contiguous()
    kd = quant.dequantize(kc, kv.upper()).reshape(n, D)
    vd = quant.dequantize(vc, kv.upper()).reshape(n, D)
    return q, kc, vc, kd, vd


def _int8_query() -> bool:
    lib = kernels.library()
    lib.kv_attend_int8_query.restype = ctypes.c_int
    return bool(lib.kv_attend_int8_query())


def _q_int8(q: torch.Tensor) -> torch.Tensor:
    """q as the int8 key pass scores with: per 32-value block, d = max|q|/127 and round(q/d)
    (ties to even, as vcvtps2dq), d times that, all as float32 computes it."""
    g = q.reshape(q.shape[0], -1, 32).float()
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv).double() * d.double()).reshape(q.shape)


def _exact(q, kd, vd, scale):
    p = torch.softmax(q.double() @ kd.double().T * scale, dim=-1)
    return p @ vd.double()


@native_only
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
def test_bf16_attention_on_blocks_within_bf16_rounding_of_exact(kv, group):
    D, scale = 64, 1.0 / math.sqrt(64)
    int8 = _int8_query()
    for n in (1, 2, 3, 15, 16, 17, 31, 32, 33, 100, 257, 1023, 2047):
        q, kc, vc, kd, vd = _case(kv, group, n, D)
        exact = _exact(_q_int8(q) if int8 else q, kd, vd, scale)
        got = _attend(kv, True, q, kc, vc, n, scale).double()
        assert torch.equal(got, got.to(torch.bfloat16).double())  # rounded to the model dtype
        err = (got - exact).abs().max().item()
        vmax = vd.abs().max().item()
        assert err <= 2 ** -7 * vmax, (n, err, vmax)

        # eager: SDPA in bf16 on the blocks dequantized to bf16, against its own reference
        eager = torch.nn.functional.scaled_dot_product_attention(
            q.to(torch.bfloat16)[None], kd.to(torch.bfloat16)[None], vd.to(torch.bfloat16)[None], scale=scale)[0]
        eager_err = (eager.double() - _exact(q, kd, vd, scale)).abs().max().item()
        out_ulp = 2 ** -8 * exact.abs().max().item()  # one bf16 rounding of the largest output
        assert err <= 2 * eager_err + out_ulp, (n, err, eager_err)


@native_only
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_float32_attention_on_blocks_is_exact_up_to_sum_order(kv):
    for n in (1, 17, 33, 1023):
        q, kc, vc, kd, vd = _case(kv, 3, n)
        exact = _exact(q, kd, vd, 0.125)
        got = _attend(kv, False, q, kc, vc, n, 0.125).double()
        assert (got - exact).abs().max().item() <= 1e-5 * vd.abs().max().item()
