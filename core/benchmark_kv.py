"""`twice bench --kv`: decode speed against context length, one column per KV cache type.

The prompt of the longest context (random token ids, one row) is prefilled once in the model's
dtype (chunks of 512); for each --kv-dtype its keys and values are encoded as that cache stores
them (decode speed does not depend on the values: re-encoding spares a prefill per dtype),
copied into every row of a batch cache, and the decode step is
timed at each context length by setting the cache back to that many columns (the first N
columns of the longest prefill are exactly the cache of its first N tokens). Each timing is
the median over `repeats` rounds of `steps` decode steps (one untimed round first), the kv
dtypes' caches of one context timed in alternating rounds (the order reversed every round), so
a change in the machine's load or bandwidth falls on all of them alike; through the step the
engine would use for that cache (native, else eager: `path`).

Per point: KV bytes (cache.bytes_per_token · batch · context: q8_0 34 bytes per 32 values),
decode tokens/s (batch ÷ step time), the bytes one step reads (weights once + each row's K and
V up to the mean position of the timed steps) and the KV share of those bytes; `speedup` is the
step's speed against the first kv dtype of the sweep at the same context.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .cache import KVCache, offset_keys_of
from .device import synchronize
from .engine import Engine

CONTEXTS = (512, 1024, 2048, 4096)
KV_DTYPES = ("auto", "q8_0", "q4_0")
PREFILL_CHUNK = 512


@dataclass
class KvPoint:
    kv_dtype: str  # as the cache names it (float32, bfloat16, q8_0, q4_0)
    context: int
    batch: int
    kv_bytes: int  # K and V of `context` tokens in every row
    kv_bytes_per_token: int
    step_s: float  # median decode step
    decode_tokens_per_s: float  # batch / step_s
    bytes_read_per_step: int
    kv_share: float  # KV bytes read / all bytes read, per step
    path: str  # native | eager
    speedup: float = 1.0  # decode tok/s ÷ the sweep's first kv dtype's at this context

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def sweep(model, contexts=CONTEXTS, kv_dtypes=KV_DTYPES, batch: int = 1, steps: int = 16, repeats: int = 3,
          progress=None, prefilled: KVCache | None = None) -> list[KvPoint]:
    """`prefilled`: a one-row cache in the model's dtype holding at least max(contexts) tokens
    (prefill(): several sweeps over one prompt, scripts/bench_kv.py)."""
    say = progress or (lambda message: None)
    contexts = sorted(set(contexts))
    top = contexts[-1]
    config = model.config
    one = prefilled if prefilled is not None else prefill(model, top + steps, top, say)
    one = one.k[:, :, :, : top + steps], one.v[:, :, :, : top + steps]
    first_param = next(model.parameters())
    dev, dtype = first_param.device, first_param.dtype
    engines = {kv: Engine(model, None, kv_dtype=kv) for kv in kv_dtypes}
    tokens = torch.full((batch, 1), 7, device=dev)
    by_kv: dict = {kv: [] for kv in kv_dtypes}
    for n in contexts:  # the caches of every kv dtype at once, timed in alternating rounds
        caches, steppers = {}, {}
        for kv, engine in engines.items():
            cache = KVCache(config, batch, n + steps, dtype, dev, kv_heads=model.kv_heads, kv_dtype=engine.kv_dtype)
            offset_keys_of(cache, model)  # a block cache stores keys minus the key bias, as the model's writes do
            # every row: the prompt's keys as this cache stores them
            cache.k.copy_(cache.encode_keys(one[0][:, :, :, : n + steps]).expand_as(cache.k))
            cache.v.copy_(cache.encode(one[1][:, :, :, : n + steps]).expand_as(cache.v))
            native = bool(engine.fast and engine.fast.supports(cache) and engine.fast.is_warm(cache))
            caches[kv], steppers[kv] = cache, (engine.fast if native else model, native)
        say(f"--kv-dtype {', '.join(kv_dtypes)}: {steps} steps at {n:,} tokens, batch {batch}, "
            f"{repeats} alternating rounds")
        times: dict = {kv: [] for kv in kv_dtypes}
        for r in range(repeats + 1):
            for kv in (kv_dtypes if r % 2 else tuple(reversed(kv_dtypes))):
                cache, (step, _) = caches[kv], steppers[kv]
                cache.length = n
                synchronize(dev)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(tokens, cache)
                synchronize(dev)
                if r:
                    times[kv].append((time.perf_counter() - t0) / steps)
        for kv, cache in caches.items():
            step_s = statistics.median(times[kv])
            per_token = cache.bytes_per_token
            kv_read = batch * per_token * int(n + steps / 2)
            read = engines[kv].weight_bytes + kv_read
            by_kv[kv].append(KvPoint(cache.kv_dtype, n, batch, per_token * batch * n, per_token, step_s,
                                     batch / step_s, read, kv_read / read, "native" if steppers[kv][1] else "eager"))
        del caches, steppers
    points = [p for kv in kv_dtypes for p in by_kv[kv]]
    del one
    first = {p.context: p for p in points if p.kv_dtype == points[0].kv_dtype}
    for p in points:
        p.speedup = p.decode_tokens_per_s / first[p.context].decode_tokens_per_s
    return points


@torch.inference_mode()
def prefill(model, capacity: int, tokens: int, progress=None) -> KVCache:
    """One row of `tokens` random token ids prefilled in the model's dtype (chunks of 512)."""
    (progress or (lambda message: None))(f"prefilling {tokens:,} tokens")
    engine = Engine(model, None)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    one = KVCache(model.config, 1, capacity, engine.dtype, engine.device, kv_heads=model.kv_heads)
    engine._prefill(ids.to(engine.device), one, PREFILL_CHUNK)
    return one
