"""The CPU fast path for decode of llama-family models: one native call per step.

A 135M-parameter model reads its weights in about 8 ms per token on a laptop-class core
pair; run as ~300 PyTorch ops (or 30 compiled graphs) a token costs twice that, the rest
being dispatch. kernels/decode.c runs every layer and the head in one call on the model's
own tensors (weights, rotary tables and the KV cache are shared, never copied), so the
engine's prefill, cache reuse, sampling and stopping stay exactly as they are.

It takes the same interface as fastpath.CompiledDecoder (supports / warmup / __call__),
needs no warm-up, and works for any cache capacity and any batch (rows left-padded as
the cache holds them): a batch reads each weight once for all its rows.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools

import torch

from . import kernels
from .cache import KVCache, key_bias
from .model import CausalLM
from .qweight import BlockWeight


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
                                                    "layers")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int64),
        # What the newer families need (decode.c's Dims; zero = llama's).
        ("cos_local", ctypes.c_void_p), ("sin_local", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("block", "norm", "act", "qk_full", "rot")] + [
        (name, ctypes.c_float) for name in ("attn_cap", "final_cap", "embed_scale", "pad_")] + [
        (name, ctypes.c_int64) for name in ("experts", "top_k", "moe_inter", "renorm", "float_weights")] + [
        ("kv_type", ctypes.c_int64),  # the cache's blocks (KV_TYPES), set per call; 0: the model dtype
        ("kv_unbias", ctypes.c_int64)]  # 1: the block cache stores keys minus the key bias (cache.offset_keys)


# The block caches decode.c reads as stored (core/cache.py's layout), by --kv-dtype name →
# ggml type id (decode.c's Dims.kv_type); a float cache must be in the model's dtype.
KV_TYPES = {"q8_0": 8, "q4_0": 2}


BLOCKS = {"block:llama": 0, "block:sandwich": 1, "block:post_norm": 2}
NORM_LLAMA, NORM_OFFSET1, NORM_WEIGHT_F32 = 0, 1, 2
ACTS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}


_VECTORS = ("in_norm", "qkv_bias", "q_norm", "k_norm", "o_bias", "post_norm", "gate_up_bias", "down_bias")
_MATRICES = ("qkv", "o", "gate_up", "down")
MAX_PARTS = 3
FLOAT_TYPE = -1  # a float matrix in the model's dtype (decode.c multiplies it with gemm)
# The block types decode.c multiplies (through qdot.c's q_gemm), by ggml type id.
BLOCK_TYPES = frozenset({0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14}
                        | {t + kernels.X8 for t in (2, 3, 6, 7, 8, 12, 14)})  # + their interleaved layout (qweight)


class _Part(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64)]


class _Weight(ctypes.Structure):
    # many: a stacked expert matrix of more than MAX_PARTS parts (a GGUF file's experts) points to its
    # parts there (decode.c's Weight); NULL: part[] holds them
    _fields_ = [("part", _Part * MAX_PARTS), ("parts", ctypes.c_int64), ("many", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in _VECTORS] + [(name, _Weight) for name in _MATRICES]
                + [("window", ctypes.c_int64), ("pre_ff_norm", ctypes.c_void_p), ("post_ff_norm", ctypes.c_void_p),
                   ("local", ctypes.c_int64), ("moe", ctypes.c_int64), ("router", _Weight),
                   ("experts_gate_up", _Weight), ("experts_down", _Weight),
                   # moe:shared: the shared expert's gate [1, hidden], its gated MLP; shared_inter 0 = none
                   ("shared_gate", _Weight), ("shared_gate_up", _Weight), ("shared_down", _Weight),
                   ("shared_inter", ctypes.c_int64)])


def _sparse(mlp) -> bool:
    """A router and stacked experts (experts.SparseMoE) rather than one gated MLP."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _weight_ok(w, dtype: torch.dtype, per_expert: int = 0) -> bool:
    """A matrix decode.c multiplies: a contiguous float tensor in the model's dtype, or at most
    MAX_PARTS parts of blocks it multiplies. A stacked expert matrix (`per_expert` rows an expert)
    may have any number of parts (a GGUF file's: an expert's gate and up rows lie in two tensors)
    so long as each expert's rows span at most MAX_PARTS of them (decode.c's sub_weight), and in a
    part of interleaved row groups (qweight's x8 layout) begin and end on a group's edge."""
    if not isinstance(w, BlockWeight):
        return w.dtype == dtype and w.is_contiguous()
    if not all(p.codec.ggml_type in BLOCK_TYPES and p.data.is_contiguous() for p in w.parts):
        return False
    if not per_expert:
        return len(w.parts) <= MAX_PARTS
    ends = list(itertools.accumulate(p.rows for p in w.parts))
    starts = [0] + ends[:-1]
    for lo in range(0, w.out_features, per_expert):
        hi = lo + per_expert
        first, last = bisect.bisect_right(ends, lo), bisect.bisect_left(starts, hi)  # parts [first, last) hold it
        if last - first > MAX_PARTS:
            return False
        for i in range(first, last):
            group = getattr(w.parts[i].codec, "rows_per_group", 1)
            if group > 1 and ((max(lo, starts[i]) - starts[i]) % group or (min(hi, ends[i]) - starts[i]) % group):
                return False
    return True


# What decode.c implements (family.py): llama-style blocks (RMSNorm before attention and
# MLP, fused q/k/v, RoPE from the model's tables, a SiLU-gated MLP), with these options, and
# what the newer families add; each is listed here only once a test runs a family that uses
# it against that family's eager layers (tests/test_native_families.py).
IMPLEMENTS = frozenset({"block:llama", "act:silu", "act:swish", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
                        "window",
                        "block:post_norm", "qk_norm:full", "block:sandwich", "norm:offset1",
                        "act:gelu_pytorch_tanh", "embed_scale", "attn_softcap", "final_softcap", "rope:local",
                        "rope:partial", "moe", "moe:shared"})


def _block_norms(block, kind: int) -> dict:
    """The norm weights decode.c's Layer takes, by its names, for a block of this kind."""
    def get(name):
        return getattr(getattr(block, name, None), "weight", None)

    if kind == BLOCKS["block:llama"]:
        return {"in_norm": get("input_layernorm"), "post_norm": get("post_attention_layernorm")}
    if kind == BLOCKS["block:sandwich"]:
        return {"in_norm": get("input_layernorm"), "post_norm": get("post_attention_layernorm"),
                "pre_ff_norm": get("pre_feedforward_layernorm"), "post_ff_norm": get("post_feedforward_layernorm")}
    return {"post_norm": get("post_attention_layernorm"), "post_ff_norm": get("post_feedforward_layernorm")}


def _block_kind(features: frozenset[str]) -> int | None:
    kinds = [BLOCKS[f] for f in features if f in BLOCKS]
    return kinds[0] if len(kinds) == 1 else None


def _activation(features: frozenset[str]) -> int | None:
    acts = {ACTS.get(f.removeprefix("act:")) for f in features if f.startswith("act:")}
    return acts.pop() if len(acts) == 1 and None not in acts else None


def _norm_modules(model: CausalLM) -> list:
    out = [model.norm]
    for block in model.layers:
        out += [getattr(block, n, None) for n in ("input_layernorm", "post_attention_layernorm",
                                                  "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        out += [block.self_attn.q_norm, block.self_attn.k_norm]
    return [m for m in out if m is not None]


def _norm_reference(kind: int, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    f = x.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    if kind == NORM_OFFSET1:
        return (f * (1.0 + w.float())).to(x.dtype)
    if kind == NORM_WEIGHT_F32:
        return (w * f).to(x.dtype)
    return w * f.to(x.dtype)


@torch.inference_mode()
def norm_kind(model: CausalLM) -> int | None:
    """Which of decode.c's RMSNorms the model's norms compute: Gemma's (1 + w) where the model
    declares "norm:offset1", else llama's (round, then scale) or OLMo 2's (scale in float32,
    then round), which differ only in bfloat16. Measured on probe rows through every norm
    module (all agree with one kind to rounding, or no kind fits: None), so no norm runs
    natively that the eager layers compute another way."""
    kinds = [NORM_OFFSET1] if "norm:offset1" in model.features() else [NORM_LLAMA, NORM_WEIGHT_F32]
    eps = model.config.rms_norm_eps
    norms = _norm_modules(model)
    probes = {}
    for m in norms:
        key = (m.weight.shape[0], m.weight.dtype)
        if key not in probes:
            g = torch.Generator().manual_seed(key[0])
            probes[key] = (torch.randn(3, key[0], generator=g) * 3).to(key[1])
    for kind in kinds:
        if all(torch.allclose(m(probes[m.weight.shape[0], m.weight.dtype]).float(),
                              _norm_reference(kind, probes[m.weight.shape[0], m.weight.dtype], m.weight, eps).float(),
                              rtol=1e-5, atol=1e-6)
               for m in norms):
            return kind
    return None


def supported(model: CausalLM) -> bool:
    """Models whose features decode.c implements, on the CPU in float32 or bfloat16, on one
    rank, where the native kernels build, with every matrix either a float tensor in the
    model's dtype or blocks of a type decode.c multiplies, and every norm one decode.c
    computes (norm_kind). Anything else decodes through PyTorch."""
    features = model.features()
    if not features <= IMPLEMENTS:
        return False
    dtype = model.norm.weight.dtype
    if model.norm.weight.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    kind, act = _block_kind(features), _activation(features)
    if kind is None or act is None or model.config.head_dim > 1024:
        return False
    matrices = [model.lm_head_weight, model.embed_tokens.weight]
    experts = set()
    for block in model.layers:
        a, m = block.self_attn, block.mlp
        matrices += [a.qkv_proj.weight, a.o_proj.weight]
        if _sparse(m):  # "moe": router + stacked experts (a router bias is not implemented)
            if "moe" not in features or m.gate.bias is not None:
                return False
            ex = m.experts
            experts.add((ex.experts, m.top_k, ex.intermediate, m.renormalize, m.float_weights))
            matrices.append(m.gate.weight)
            if not (_weight_ok(ex.gate_up_proj.weight, dtype, 2 * ex.intermediate)
                    and _weight_ok(ex.down_proj.weight, dtype, ex.hidden)):
                return False
            shared = getattr(m, "shared_expert", None)
            if shared is not None:  # "moe:shared": a gated MLP without biases behind a one-row sigmoid gate
                g = m.shared_expert_gate
                if ("moe:shared" not in features or g.bias is not None or shared.gate_up_proj.bias is not None
                        or shared.down_proj.bias is not None or g.weight.shape[0] != 1):
                    return False
                matrices += [g.weight, shared.gate_up_proj.weight, shared.down_proj.weight]
        else:
            matrices += [m.gate_up_proj.weight, m.down_proj.weight]
        if any(w is None for w in _block_norms(block, kind).values()):
            return False
        if "qk_norm" in features or "qk_norm:full" in features:
            sizes = (a.q_size, a.kv_size) if "qk_norm:full" in features else (a.head_dim, a.head_dim)
            if a.q_norm is None or a.k_norm is None or (a.q_norm.weight.numel(), a.k_norm.weight.numel()) != sizes:
                return False
    if len(experts) > 1 or any(not 0 < k <= e for e, k, *_ in experts):
        return False  # one expert shape for every sparse layer (decode.c's Dims holds one)
    tables = [getattr(model, "rope", None)] + ([getattr(model, "rope_local", None)] if "rope:local" in features else [])
    if any(t is None for t in tables) or len({t.cos.shape[-1] for t in tables}) != 1:
        return False
    width = tables[0].cos.shape[-1]  # rope:partial: only the first `width` dimensions of a head rotate
    if width % 2 or width > model.config.head_dim or (width < model.config.head_dim and "rope:partial" not in features):
        return False
    if len({b.self_attn.softcap if "attn_softcap" in features else None for b in model.layers}) != 1:
        return False  # one attention cap for every layer (decode.c's Dims holds one)
    return (all(p.is_contiguous() and p.dtype == dtype for p in model.parameters())
            and all(_weight_ok(w, dtype) for w in matrices)
            and kernels.available() and norm_kind(model) is not None)


def _pointer(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("native decode needs contiguous weights")
    return t.data_ptr()


def _describe(w, keep: list | None = None) -> _Weight:
    """A matrix as decode.c's Weight: its stored parts (one float part for a float matrix). More
    than MAX_PARTS (a stacked expert matrix: _weight_ok) go into an array appended to `keep`,
    which the caller holds as long as decode.c may read it."""
    out = _Weight()
    if isinstance(w, BlockWeight):
        parts = [_Part(_pointer(p.data), p.codec.ggml_type, p.rows) for p in w.parts]
        if len(parts) > MAX_PARTS:
            many = (_Part * len(parts))(*parts)
            keep.append(many)
            out.many = ctypes.addressof(many)
        else:
            for i, p in enumerate(parts):
                out.part[i] = p
        out.parts = len(parts)
    else:
        out.part[0] = _Part(_pointer(w), FLOAT_TYPE, w.shape[0])
        out.parts = 1
    return out


# Prefill through the native step's virtual rows (NativeDecoder.prefill): prompts of at most
# PREFILL_MAX tokens, PREFILL_CHUNK a call (the integer kernels' batch sizes; beyond, the
# eager layers dequantize tiles into float matrix products).
PREFILL_CHUNK = 64
PREFILL_MAX = 256
# ...except float32 activations over block-quantized matrices on a CPU whose integer kernels
# use VNNI: there the integer dot products run at about twice float32's multiply-add rate
# and the native prefill beats the eager layers at any length measured (Zen 4, Qwen2.5-Coder
# 1.5B Q4_K_M, 2 threads: 2,048 tokens 148.5 against 61.3 tok/s; in bf16 the eager layers'
# 215.9 beat it, and on AVX2 without VNNI the eager layers won beyond 256 tokens).
PREFILL_MAX_INT8 = 1 << 30


class NativeDecoder:
    """Decode steps for batch-1 caches of a llama-family `model` (see `supported`)."""

    compile_seconds = 0.0

    def __init__(self, model: CausalLM):
        c = model.config
        self.model = model
        self.lib = kernels.library()
        self.dtype = model.norm.weight.dtype
        layers = model.layers
        attn0 = layers[0].self_attn
        dense = [b.mlp for b in layers if not _sparse(b.mlp)]
        sparse = [b.mlp for b in layers if _sparse(b.mlp)]
        features = model.features()
        kind = _block_kind(features)
        self.dims = _Dims(hidden=c.hidden_size, heads=attn0.heads, kv_heads=attn0.kv_heads, head_dim=c.head_dim,
                          inter=dense[0].intermediate if dense else c.intermediate_size, vocab=model.lm_head_weight.shape[0], layers=len(layers),
                          eps=c.rms_norm_eps, scale=attn0.scale, bf16=int(self.dtype == torch.bfloat16),
                          block=kind, norm=norm_kind(model), act=_activation(features),
                          qk_full=int("qk_norm:full" in features),
                          attn_cap=layers[0].self_attn.softcap if "attn_softcap" in features else 0.0,
                          final_cap=model.options.final_logit_softcapping if "final_softcap" in features else 0.0,
                          embed_scale=float(model.embed_scale) if "embed_scale" in features else 0.0)
        if sparse:
            s = sparse[0]
            self.dims.experts, self.dims.top_k, self.dims.moe_inter = s.experts.experts, s.top_k, s.experts.intermediate
            self.dims.renorm, self.dims.float_weights = int(s.renormalize), int(s.float_weights)
        self.local = "rope:local" in features
        width = model.rope.cos.shape[-1]
        self.dims.rot = width if width != c.head_dim else 0
        self.layers = (_Layer * len(layers))()
        self._parts: list = []  # the part arrays of stacked experts with many parts (_describe)
        self.key_biases = [found for block in layers if (found := key_bias(block.self_attn)) is not None]
        for i, block in enumerate(layers):
            a, m = block.self_attn, block.mlp
            moe = _sparse(m)
            vectors = {
                "in_norm": None, "qkv_bias": a.qkv_proj.bias,
                "q_norm": a.q_norm.weight if a.q_norm is not None else None,
                "k_norm": a.k_norm.weight if a.k_norm is not None else None,
                "o_bias": a.o_proj.bias, "post_norm": None,
                "gate_up_bias": None if moe else m.gate_up_proj.bias, "down_bias": None if moe else m.down_proj.bias,
                "pre_ff_norm": None, "post_ff_norm": None,
            }
            vectors.update(_block_norms(block, kind))
            for name, t in vectors.items():
                setattr(self.layers[i], name, _pointer(t))
            matrices = {"qkv": a.qkv_proj.weight, "o": a.o_proj.weight}
            if moe:  # decode.c reads expert e's rows of the stacked matrices (experts.py's layout)
                self.layers[i].moe = 1
                matrices.update(router=m.gate.weight, experts_gate_up=m.experts.gate_up_proj.weight,
                                experts_down=m.experts.down_proj.weight)
                if getattr(m, "shared_expert", None) is not None:  # moe:shared (qwen2_moe)
                    matrices.update(shared_gate=m.shared_expert_gate.weight,
                                    shared_gate_up=m.shared_expert.gate_up_proj.weight,
                                    shared_down=m.shared_expert.down_proj.weight)
                    self.layers[i].shared_inter = m.shared_expert.intermediate
            else:
                matrices.update(gate_up=m.gate_up_proj.weight, down=m.down_proj.weight)
            for name, w in matrices.items():
                setattr(self.layers[i], name, _describe(w, self._parts))
            self.layers[i].window = a.window or 0
            self.layers[i].local = int(self.local and block.local_rope)
        self.final_norm = _pointer(model.norm.weight)
        self.head = _describe(model.lm_head_weight)
        self.embed = _describe(model.embed_tokens.weight)
        blocks = all(t != FLOAT_TYPE and t % kernels.X8 not in (0, 1, 30)  # GGUF blocks, not F32/F16/BF16
                     for layer in self.layers for t in (layer.qkv.part[0].type, layer.o.part[0].type))
        self.prefill_max = (PREFILL_MAX_INT8 if blocks and self.dtype == torch.float32 and self.lib.twq_x8_vnni()
                            else PREFILL_MAX)

    def supports(self, cache: KVCache) -> bool:
        """The cache is one decode.c reads: the model's dtype, or blocks of a KV_TYPES type
        (anything else decodes eagerly)."""
        if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
            return False
        if getattr(cache, "quantized", False):
            return cache.kv_dtype in KV_TYPES and cache.dtype == self.dtype and cache.head_dim % 32 == 0
        return cache.k.dtype == self.dtype

    def is_warm(self, cache: KVCache) -> bool:
        return True

    def warmup(self, cache: KVCache) -> float:
        return 0.0

    steps_rows = True  # __call__ takes `rows` (core/scheduler.py: free rows are not computed)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: KVCache, rows: list[int] | None = None) -> torch.Tensor:
        """tokens [B, 1] at column cache.length → logits [B, V] float32; advances the cache.
        `rows`: only these rows of the cache (B of them, in this order) run, the others are
        neither computed nor written (a scheduler's free rows cost nothing); each row's
        result is the same bits either way (batch invariance)."""
        column = cache.length
        if column >= cache.capacity:
            raise ValueError(f"cache holds {cache.capacity} tokens; {column} + 1 do not fit")
        ids = tokens.reshape(-1).to(torch.int64).contiguous()
        want = cache.batch if rows is None else len(rows)
        if ids.numel() != want:
            raise ValueError(f"{ids.numel()} tokens for {want} rows")
        cache_rows = None
        if rows is not None:
            cache_rows = torch.tensor(rows, dtype=torch.int64)
            if want and not (0 <= int(cache_rows.min()) and int(cache_rows.max()) < cache.batch):
                raise ValueError(f"a row outside the cache of {cache.batch} rows")
        logits = self._step(ids, cache, column, column + 1, cache_rows)
        cache.length = column + 1
        return logits

    def verify(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """T tokens of a batch-1 cache in ONE native call, as T "virtual rows": token t is
        written at column cache.length + t and attends up to it, so the logits [T, V] float32
        are bit for bit those of T sequential steps (the matrix kernels are batch invariant).
        Advances the cache by T; a caller rolls back by truncating it, as after eager steps."""
        return self.virtual_rows(tokens, cache)

    @torch.inference_mode()
    def virtual_rows(self, tokens: torch.Tensor, cache: KVCache, last: int | None = None) -> torch.Tensor:
        """`verify`'s call; `last`: only the last `last` rows' logits [last, V] (0: none,
        [0, V]), bit for bit those rows of verify's: the head (final norm and the vocabulary
        matrix, SmolLM2's largest) runs for those rows only, every row's keys and values are
        written as before (prefill wants one row of its last call, none of the others)."""
        column = cache.length
        ids = tokens.reshape(-1).to(torch.int64).contiguous()
        count = ids.numel()
        if cache.batch != 1:
            raise ValueError(f"verify runs a batch-1 cache, not {cache.batch} rows")
        if count < 1 or column + count > cache.capacity:
            raise ValueError(f"cache holds {cache.capacity} tokens; {column} + {count} do not fit")
        if last is not None and not 0 <= last <= count:
            raise ValueError(f"the logits of the last {last} of {count} rows")
        rows = torch.zeros(count, dtype=torch.int64)
        columns = torch.arange(column, column + count, dtype=torch.int64)
        logits = self._step(ids, cache, column, column + count, rows, columns, last)
        cache.length = column + count
        return logits

    def prefill(self, tokens: torch.Tensor, cache: KVCache, chunk: int | None = None) -> torch.Tensor:
        """A short prompt's tokens [T] (or [1, T]) at a batch-1 cache's end as virtual rows,
        at most PREFILL_CHUNK (or `chunk`) a call: the last position's logits [1, V] float32.
        Bit for bit what T single steps give, however the tokens are cut into calls (a
        chunked prefill in serve equals generate's); several times faster than the eager
        layers for the prompts of a chat turn or a served request (one C call per chunk
        instead of ~10 small ops per layer, the batched tiles for every matrix). Only the
        last row of the last call computes the head (`virtual_rows`' `last`): SmolLM2's
        49,152-row head was ~21% of a 125-token prefill when every row computed it."""
        ids = tokens.reshape(-1)
        n = ids.numel()
        if n < 1:
            raise ValueError("prefill needs at least one token")
        step = min(chunk or PREFILL_CHUNK, PREFILL_CHUNK)
        for begin in range(0, n, step):
            logits = self.virtual_rows(ids[begin:begin + step], cache, last=1 if begin + step >= n else 0)
        return logits

    def prefills(self, tokens: torch.Tensor, cache: KVCache) -> bool:
        """Whether `prefill` serves these tokens [1, T] at this cache: batch 1, a prompt of at
        most `prefill_max` tokens (PREFILL_MAX, or PREFILL_MAX_INT8) that fits (longer ones go
        through the eager layers' matrix products, which beat T virtual rows there)."""
        n = tokens.shape[-1]
        # longrope: a prompt from position 0 past the boundary takes the long factors at every
        # position (rope.py, as transformers), where single steps use the short ones below it
        boundary = getattr(self.model.rope, "boundary", None)
        return (tokens.dim() == 2 and tokens.shape[0] == 1 and cache.batch == 1 and 0 < n <= self.prefill_max
                and cache.length + n <= cache.capacity and self.supports(cache)
                and not (boundary is not None and cache.length == 0 and n > boundary))

    def _step(self, ids: torch.Tensor, cache: KVCache, column: int, end: int, cache_rows: torch.Tensor | None = None,
              columns: torch.Tensor | None = None, last: int | None = None) -> torch.Tensor:
        """One decode_step call: ids [R] → logits [R, V] (`last`: those of the last `last`
        rows only, [last, V]); columns up to end - 1 are written."""
        starts = cache.starts.to(torch.int64).contiguous() if cache.starts is not None else None
        rope = self.model.rope
        rope.ensure(end)  # positions are column - start < end
        if self.local:
            local = self.model.rope_local
            local.ensure(end)
            self.dims.cos_local, self.dims.sin_local = local.cos.data_ptr(), local.sin.data_ptr()
        self.dims.kv_type = KV_TYPES[cache.kv_dtype] if getattr(cache, "quantized", False) else 0
        if self.dims.kv_type and self.dims.attn_cap == 0:
            for layer, bias in self.key_biases:  # as the eager layers do before their first write
                cache.offset_keys(layer, bias)
        self.dims.kv_unbias = int(self.dims.kv_type != 0 and getattr(cache, "key_offset", None) is not None)
        count = ids.numel()
        wanted = count if last is None else last
        logits = torch.empty(wanted, self.dims.vocab, dtype=torch.float32)
        status = self.lib.decode_step(
            ctypes.byref(self.dims), self.layers, self.final_norm, ctypes.byref(self.head), ctypes.byref(self.embed),
            ids.data_ptr(), ids.numel(), rope.cos.data_ptr(), rope.sin.data_ptr(), cache.k.data_ptr(),
            cache.v.data_ptr(), cache.capacity, column, starts.data_ptr() if starts is not None else None,
            cache.batch, cache_rows.data_ptr() if cache_rows is not None else None,
            columns.data_ptr() if columns is not None else None, logits.data_ptr() if wanted else None,
            count - wanted, torch.get_num_threads(),
        )
        if status == -2:
            raise ValueError(f"a token id is outside the vocabulary of {self.dims.vocab}")
        if status == -3:
            raise ValueError(f"a row or column is outside the cache of {cache.batch} x {cache.capacity}")
        if status != 0:
            raise MemoryError("native decode could not allocate its scratch buffers")
        return logits
