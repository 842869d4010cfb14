"""The compiled decode path: one new token per row per step, each transformer block
compiled with torch.compile (inductor); on a GPU the whole step is also recorded once as
a CUDA graph per cache (cudagraph.py) and replayed for every token.

Why it is faster than the eager model on a CPU: decode is memory-bound, one read of every
weight per token, and aten's matrix-vector product streams a weight at ~10 GB/s here,
a quarter of what the memory allows. Written as a blocked multiply-and-sum, inductor
turns each projection into one fused, vectorized reduction that streams the weight once
at 2-3x that speed, and it fuses the norms, RoPE, the cache write and the attention
softmax, so the ~40 small kernels per layer that cost Python dispatch time in eager mode
become a handful. On a GPU the projections stay cuBLAS matrix products; what the step
loses there is launch time between small kernels, which fusing and the graph remove.

Shapes are static: the cache is allocated in buckets of CAPACITY_BUCKET tokens, the
attention reads the whole bucket under a mask (columns past the current position are
masked), and the column is a tensor, so a whole generation reuses one compiled graph,
and so do all layers (the block module is an argument, not a constant). On the CPU the
second bucket compiles once more, with the capacity symbolic (inductor's on-disk cache
makes later processes start fast); on a GPU the batch and capacity are symbolic from the
start, so one compile serves every bucket and batch size > 1.
The CPU step serves batch 1 (batches go to the native step); the GPU step any batch.
"""

from __future__ import annotations

import time

import torch

from . import kernels
from .cache import KVCache, offset_keys_of
from .cudagraph import CapturedSteps
from .device import synchronize
from .experts import SparseMoE, route
from .layers import ACTIVATIONS
from .model import CausalLM
from .qweight import BlockWeight, product
from .rope import apply_rotary

NATIVE = False  # set by CompiledDecoder: the native gemv kernel was built and loads
CAPACITY_BUCKET = 256
GEMV_BLOCK = 16  # rows reduced together: enough independent accumulators to keep the FMAs busy


# What the compiled step implements (family.py): gpt2's block and the blocks that wire
# themselves around an attention and an MLP (`wire`: llama's, gemma's sandwich, olmo2's
# post-norms), gated or a mixture of experts (with float experts, below), any activation.
IMPLEMENTS = frozenset({"block:llama", "block:gpt2", "block:sandwich", "block:post_norm", "qkv_bias", "o_bias",
                        "mlp_bias", "qk_norm", "qk_norm:full", "window", "norm:offset1", "embed_scale",
                        "attn_softcap", "final_softcap", "rope:local", "rope:partial", "moe", "moe:shared"}
                       | {f"act:{a}" for a in ACTIVATIONS})


def supported(model: CausalLM) -> bool:
    """The model's features are implemented here, and its experts (if any) are float: a
    step gathers the chosen experts' matrices by index on the device (_moe), which GGUF blocks,
    read per expert through the host, do not allow in a recorded step."""
    blocks = any(isinstance(w, BlockWeight) for m in model.modules() if isinstance(m, SparseMoE)
                 for w in (m.experts.gate_up_proj.weight, m.experts.down_proj.weight))
    return model.features() <= IMPLEMENTS and not blocks


def bucketed(capacity: int) -> int:
    return -(-capacity // CAPACITY_BUCKET) * CAPACITY_BUCKET


def gemv(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias), for compiled code only. On a GPU, or for several rows,
    a plain matrix product (cuBLAS there). On the CPU at batch 1, accumulated in float32:
    the native kernel where it was built (kernels/gemv.c, AVX-512 BF16 dot products), else
    one fused inductor reduction."""
    if x.dim() != 2:  # [B, T, in]: the rows flattened
        return gemv(x.reshape(-1, x.shape[-1]), linear).view(*x.shape[:-1], -1)
    w, bias = linear.weight, linear.bias
    if isinstance(w, BlockWeight):  # blocks: the weight's own product (dequantized tiles, or the int8 kernel)
        return product(x, w, bias)
    if w.device.type != "cpu" or x.shape[0] != 1:
        return torch.nn.functional.linear(x, w, bias)
    out, inn = w.shape
    if NATIVE and w.dtype in (torch.float32, torch.bfloat16):
        y = torch.ops.twice.gemv(x, w)
    elif out % GEMV_BLOCK:
        y = (w.float() * x.float()).sum(-1).view(1, out)
    else:
        y = (w.view(out // GEMV_BLOCK, GEMV_BLOCK, inn).float() * x.float().view(1, 1, inn)).sum(-1).view(1, out)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class _BlockHead:
    """The head as gemv() reads a linear layer: a block-stored weight and no bias."""

    def __init__(self, weight: BlockWeight):
        self.weight, self.bias = weight, None


def _encode(fmt, x: torch.Tensor) -> torch.Tensor:
    """Values [..., D] as a block cache stores them (KVCache.encode's codec, bit for bit)."""
    blocks = fmt.codec.quantize_blocks(x.to(torch.float32).reshape(-1, fmt.block))
    return blocks.reshape(*x.shape[:-1], -1)


def _decode(fmt, stored: torch.Tensor, d: int) -> torch.Tensor:
    """Stored blocks [..., bytes] → float32 values [..., D] (KVCache.decode)."""
    return fmt.codec.dequantize_blocks(stored.reshape(-1, fmt.block_bytes)).reshape(*stored.shape[:-1], d)


def _stored(store, k, v, k_cache, v_cache, at):
    """Write this pass's keys and values at columns `at` of a layer's cache and return every
    cached key and value as floats [B, kv_heads, S, D]. `store`: None for a float cache (of the
    model's dtype or another), else (its KVFormat, the layer's key offset [kv_heads, D] or None):
    blocks written as KVCache.write writes them (keys minus the offset), read back with the
    offset added, as KVCache.decode_keys does."""
    if store is None:
        k_cache.index_copy_(2, at, k.to(k_cache.dtype))
        v_cache.index_copy_(2, at, v.to(v_cache.dtype))
        return k_cache.float(), v_cache.float()
    fmt, offset = store
    shift = None if offset is None else offset.view(1, *offset.shape[:1], 1, -1)
    k_cache.index_copy_(2, at, _encode(fmt, k if shift is None else k.to(torch.float32) - shift))
    v_cache.index_copy_(2, at, _encode(fmt, v))
    keys, values = _decode(fmt, k_cache, k.shape[-1]), _decode(fmt, v_cache, v.shape[-1])
    return (keys if shift is None else keys + shift), values


def _attention(attn, x, k_cache, v_cache, column, cos, sin, mask, store=None):
    """attn: CachedSelfAttention; x [B, T, hidden] (T = 1 a step, K + 1 a speculative verify
    pass); k/v_cache [B, kv_heads, S, D] (this layer, written in place at columns `column`
    .. `column` + T - 1, column [1]; blocks [B, kv_heads, S, bytes] with `store`, _stored);
    cos/sin [B, 1, T, rotary dim] (None: no RoPE); mask [B, T, S] bool."""
    b, t, d = x.shape[0], x.shape[1], attn.head_dim
    rope = None if cos is None else (lambda y: apply_rotary(y, cos, sin))
    q, k, v = attn.qkv(x, rope, gemv)  # [B, heads, T, D], [B, kv_heads, T, D]
    at = column + torch.arange(t, device=column.device)
    keys, values = _stored(store, k, v, k_cache, v_cache, at)
    # Query heads that share a KV head are grouped: [B, kv_heads, n_rep, T, D] against
    # [B, kv_heads, S, D]. Written as products summed in float32 rather than matrix products,
    # so that inductor reads each cached key and value once in its stored dtype, converting
    # in registers, instead of first writing a float32 copy of the whole bucket (on a GPU at
    # batch 32, as many bytes again as the weights).
    qg = q.view(b, attn.kv_heads, attn.heads // attn.kv_heads, t, 1, d).float()
    scores = (qg * keys[:, :, None, None]).sum(-1) * attn.scale  # [B, kv_heads, n_rep, T, S]
    if attn.softcap is not None:  # gemma2: tanh(s / cap) · cap before the mask
        scores = torch.tanh(scores / attn.softcap) * attn.softcap
    probs = torch.softmax(scores.masked_fill(~mask.view(b, 1, 1, t, -1), float("-inf")), dim=-1)
    out = (probs.unsqueeze(-1) * values[:, :, None, None]).sum(-2)  # [B, kv_heads, n_rep, T, D]
    out = out.to(x.dtype).permute(0, 3, 1, 2, 4).reshape(b, t, attn.q_size)
    return gemv(out, attn.o_proj)


def _mlp(mlp, x):
    """A GatedMLP on gemv's products."""
    gate, up = gemv(x, mlp.gate_up_proj).split(mlp.intermediate, dim=-1)
    return gemv(mlp.act(gate) * up, mlp.down_proj)


def _moe(moe, x):
    """A SparseMoE (experts.py) on x [B, T, hidden] with no host work: the router as eager routes,
    each row's top_k experts' matrices gathered by index from the stacked weights (only those
    are read) and multiplied as one batched product, their outputs weighted and added in
    increasing expert order (eager's order, each cast to the activation dtype as it is added),
    then the shared expert where there is one."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [B·T, hidden]
    weights, chosen = route(gemv(x, moe.gate), moe.top_k, moe.renormalize, moe.float_weights)
    chosen, order = torch.sort(chosen, dim=-1)
    weights = weights.gather(-1, order)
    ex, b, k = moe.experts, x.shape[0], moe.top_k
    i, h = ex.intermediate, ex.hidden
    ids = chosen.reshape(-1)  # [B·k]
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [B·k, hidden, 1]
    gu = torch.bmm(ex.gate_up_proj.weight.view(ex.experts, 2 * i, h).index_select(0, ids), xs).squeeze(-1)
    gate, up = gu.split(i, dim=-1)
    y = torch.bmm(ex.down_proj.weight.view(ex.experts, h, i).index_select(0, ids),
                  (ex.act(gate) * up).unsqueeze(-1)).squeeze(-1).view(b, k, h)
    y = y * weights.unsqueeze(-1)
    out = torch.zeros_like(x)
    for j in range(k):
        out = out + y[:, j].to(x.dtype)
    if moe.shared_expert is not None:
        out = out + torch.sigmoid(gemv(x, moe.shared_expert_gate)) * _mlp(moe.shared_expert, x)
    return out.view(shape)


def _wired_block(block, x, k_cache, v_cache, column, cos, sin, mask, store):
    """A block as its family wires it (llama's, gemma's sandwich, olmo2's post-norms: `wire`)
    around this step's attention and MLP (gated, or a mixture's)."""
    mlp = (lambda h: _moe(block.mlp, h)) if isinstance(block.mlp, SparseMoE) else (lambda h: _mlp(block.mlp, h))
    return block.wire(x, lambda h: _attention(block.self_attn, h, k_cache, v_cache, column, cos, sin, mask, store),
                      mlp)


def _gpt2_block(block, x, k_cache, v_cache, column, cos, sin, mask, store):
    x = x + _attention(block.attn, block.ln_1(x), k_cache, v_cache, column, None, None, mask, store)
    mlp = block.mlp
    return x + gemv(mlp.act(gemv(block.ln_2(x), mlp.c_fc)), mlp.c_proj)


def _head(norm, head: torch.nn.Linear, x):
    return gemv(norm(x), head)


class CompiledDecoder:
    """Decode steps for the caches of `model` (batch 1 on the CPU, any batch on a GPU),
    compiled on first use; on a GPU each cache's step is recorded as a CUDA graph."""

    def __init__(self, model: CausalLM):
        global NATIVE
        NATIVE = kernels.available()  # builds it once, before any graph is traced
        self.model = model
        self.gpt2 = "block:gpt2" in model.features()
        self.cpu = next(model.parameters()).device.type == "cpu"
        block_fn = _gpt2_block if self.gpt2 else _wired_block
        # GPU: symbolic batch and capacity from the start, so that rows finishing (a smaller
        # batch) or a new bucket never stall decoding with a compile (batch 1 gets its own).
        # CPU: static for the first bucket (the reductions unroll), symbolic from the second
        # on (torch.compile's automatic dynamic shapes), so a growing chat compiles twice.
        dynamic = None if self.cpu else True
        # Compiled code is cached per function, and every model family and decoder in the
        # process adds entries to the same two functions' caches: allow more than the
        # default 8 before torch refuses (with fullgraph=True, an error).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.block = torch.compile(block_fn, fullgraph=True, dynamic=dynamic)
        self.head = torch.compile(_head, fullgraph=True, dynamic=dynamic)
        # The head reads the (possibly tied) output matrix through a Linear-shaped view.
        head = model.lm_head_weight
        if isinstance(head, BlockWeight):  # a tied block-stored head: its embedding module serves
            self.head_linear = _BlockHead(head)
        else:
            self.head_linear = torch.nn.Linear(1, 1, bias=False, device="meta")
            self.head_linear.weight = torch.nn.Parameter(head, requires_grad=False)
        self.graphs = None if self.cpu else CapturedSteps(self.run)
        self.warm: set[tuple] = set()
        self.compile_seconds = 0.0

    def supports(self, cache: KVCache) -> bool:
        """Any KV dtype (--kv-dtype: blocks are written and read in the step, _stored); batch 1
        on the CPU, any batch on a GPU; a bucketed capacity."""
        return (cache.batch == 1 or not self.cpu) and cache.capacity % CAPACITY_BUCKET == 0

    def _key(self, cache: KVCache, width: int = 1) -> tuple:
        """What a new compile follows: a step (width 1) or a verify pass of several tokens
        (width > 1: one compile serves every width, symbolic in it)."""
        if not self.cpu:
            return (cache.batch == 1, cache.k.dtype, width > 1)
        return (cache.capacity, cache.k.dtype, cache.starts is not None, width > 1)

    def is_warm(self, cache: KVCache, width: int = 1) -> bool:
        """Compiled for this cache's shape (recording a GPU graph is quick, not a compile)."""
        return self._key(cache, width) in self.warm

    def warmup(self, cache: KVCache, verify: bool = False) -> float:
        """Compile for this cache's shape (once per shape) and, on a GPU, record its graph
        (once per cache); with `verify` also the pass of several tokens speculative decoding
        verifies with (widths 2 and 3: the second marks the width symbolic, so K + 1 up to the
        capacity needs no further compile). Returns the seconds it took. Runs at the cache's
        last columns, which no token occupies yet (later tokens overwrite them; until then
        they are masked)."""
        widths = (1, 2, 3) if verify and cache.batch == 1 else (1,)
        unrecorded = self.graphs is not None and self.graphs.find(cache) is None
        todo = [w for w in widths if w <= cache.capacity and (not self.is_warm(cache, w) or (w == 1 and unrecorded))]
        if not todo:
            return 0.0
        t = time.perf_counter()
        offset_keys_of(cache, self.model)  # a block cache's key offsets, before the first trace reads them
        with torch.inference_mode():
            tables = self._tables(cache)
            for w in todo:
                if self.graphs is not None and w == 1:
                    self.graphs.capture(cache, tables)
                else:
                    last = torch.full((1,), cache.capacity - w, dtype=torch.long, device=cache.k.device)
                    self.run(torch.zeros(cache.batch, w, dtype=torch.long, device=cache.k.device), last, cache.starts,
                             cache)
        synchronize(cache.k.device)
        self.warm.update(self._key(cache, w) for w in todo)
        seconds = time.perf_counter() - t
        self.compile_seconds += seconds
        return seconds

    def _ropes(self) -> dict:
        """The RoPE tables by a block's `local_rope` (gemma3's sliding layers have their own)."""
        local = getattr(self.model, "rope_local", None)
        return {False: self.model.rope} if local is None else {False: self.model.rope, True: local}

    def _tables(self, cache: KVCache) -> tuple[torch.Tensor, ...]:
        """RoPE tables long enough for the cache (the graph keeps the ones it reads)."""
        if self.gpt2:
            return ()
        out = []
        for table in self._ropes().values():
            table.ensure(cache.capacity)
            out += [table.cos, table.sin]
        return tuple(out)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B, 1] at column cache.length → logits [B, V]; advances the cache."""
        column = cache.length
        if self.graphs is not None:
            logits = self.graphs.capture(cache, self._tables(cache))(tokens, column)
        else:
            self._tables(cache)
            logits = self.run(tokens, torch.tensor([column]), cache.starts, cache)
        cache.length = column + 1
        return logits

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """T tokens of a batch-1 cache in one compiled pass (speculative decoding's verify, as
        NativeDecoder.verify): token t is written at column cache.length + t and attends up to
        it; logits [T, V]. Advances the cache by T (a caller rolls back by truncating it). On
        a GPU each width's pass is recorded once per cache, as the step is."""
        ids = tokens.reshape(1, -1).to(device=cache.k.device, dtype=torch.long)
        column, width = cache.length, ids.shape[1]
        if cache.batch != 1 or column + width > cache.capacity:
            raise ValueError(f"verify runs a batch-1 cache with room for {width} tokens")
        if self.graphs is not None:
            logits = self.graphs.capture(cache, self._tables(cache), width)(ids, column)
        else:
            self._tables(cache)
            logits = self.run(ids, torch.tensor([column]), cache.starts, cache)
        cache.length = column + width
        return logits.view(width, -1)

    def run(self, tokens: torch.Tensor, column: torch.Tensor, starts: torch.Tensor | None,
            cache: KVCache) -> torch.Tensor:
        """One pass, all on tensors (nothing on the host depends on the column, so that a
        GPU can record it): tokens [B, T] written at columns `column` [1] .. column + T - 1 →
        logits [B, V] (T = 1, a step) or [B, T, V]."""
        model, (b, t) = self.model, tokens.shape
        cols = torch.arange(cache.capacity, device=column.device)
        at = column + torch.arange(t, device=column.device)  # [T] the new tokens' columns
        # Token j of row r sees columns [starts[r], column + j]; its position is its distance from starts[r].
        visible = (cols.view(1, -1) <= at.view(-1, 1)).expand(b, -1, -1)  # [B, T, S]
        positions = at.expand(b, -1)  # [B, T]
        if starts is not None:
            visible = visible & (cols.view(1, 1, -1) >= starts.view(-1, 1, 1))
            positions = positions - starts.view(-1, 1)
        masks = {None: visible}
        for window in model.windows:
            if window is not None:
                masks[window] = visible & (at.view(1, -1, 1) - cols.view(1, 1, -1) < window)
        if self.gpt2:
            x = model.wte(tokens) + model.wpe.weight.index_select(0, positions.reshape(-1)).view(b, t, -1)
            blocks, norm = model.h, model.ln_f
        else:
            x = model.embed_tokens(tokens)
            if getattr(model, "embed_scale", None) is not None:  # gemma: sqrt(hidden) in the activation dtype
                x = x * model.embed_scale
            flat = positions.reshape(-1)
            tables = {local: (r.cos.index_select(0, flat).view(b, 1, t, -1),
                              r.sin.index_select(0, flat).view(b, 1, t, -1)) for local, r in self._ropes().items()}
            blocks, norm = model.layers, model.norm
        quantized, offsets = getattr(cache, "quantized", False), getattr(cache, "key_offset", None)
        for i, block in enumerate(blocks):
            window = (block.attn if self.gpt2 else block.self_attn).window
            cos, sin = (None, None) if self.gpt2 else tables[getattr(block, "local_rope", False)]
            store = (cache.format, None if offsets is None else offsets[i]) if quantized else None
            x = self.block(block, x, cache.k[i], cache.v[i], column, cos, sin, masks[window], store)
        logits = model.finish_logits(self.head(norm, self.head_linear, x))
        return logits[:, 0] if t == 1 else logits
