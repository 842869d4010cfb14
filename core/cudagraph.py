"""A decode step recorded once as a CUDA graph and replayed for every token.

A step of a small model is hundreds of small kernels. Launched one by one from Python,
each launch costs more host time than its kernel takes on the GPU, so the GPU idles
between them and decode runs far below the memory bandwidth. Recorded once, the whole
step (every layer and the head) is a single replay: no Python, no launches, no gaps.

A graph records addresses and sizes, not values, so one graph serves one cache (its K/V
tensors: batch and capacity) and reads what changes per token from small input tensors
written before each replay: the tokens and the column. Its outputs are overwritten by
the next replay; the engine samples from the logits before it steps again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .cache import KVCache

# run(tokens [B, T], column [1], starts [B] | None, cache) -> logits [B, V] (T = 1) or [B, T, V];
# pure tensor work (nothing on the host depends on the column), so that it can be recorded.
StepFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", KVCache], torch.Tensor]
# record(fn, device) -> (replay, outputs): run fn as a graph; replay() recomputes outputs in place.
Recorder = Callable[[Callable[[], torch.Tensor], torch.device], tuple[Callable[[], None], torch.Tensor]]

WARMUP_STEPS = 2  # before recording: compiles, and lets cuBLAS choose its kernels


def record_cuda_graph(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[Callable[[], None], torch.Tensor]:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


class CapturedStep:
    """`run` recorded for one cache and `width` tokens a row (1: a step; K + 1: a speculative
    verify pass). Warm-up passes run at the cache's last columns, which no token occupies yet
    (later tokens overwrite them; until then they are masked)."""

    def __init__(self, run: StepFn, cache: KVCache, keep: tuple[torch.Tensor, ...] = (),
                 record: Recorder = record_cuda_graph, width: int = 1):
        device = cache.k.device
        # Weak: when the engine drops this cache, the graph is dropped too (never replayed
        # on memory that was freed), instead of keeping a dead cache alive.
        self._k, self._v = weakref.ref(cache.k), weakref.ref(cache.v)
        self.starts = cache.starts  # read by the graph, so kept alive with it
        self.keep = keep  # other tensors it reads (RoPE tables) that their owner may replace
        self.width = width
        self.tokens = torch.zeros(cache.batch, width, dtype=torch.long, device=device)
        self.column = torch.full((1,), cache.capacity - width, dtype=torch.long, device=device)
        self.replay, self.logits = record(lambda: run(self.tokens, self.column, self.starts, cache), device)

    def alive(self) -> bool:
        return self._k() is not None and self._v() is not None

    def serves(self, cache: KVCache, width: int = 1) -> bool:
        return (self._k() is cache.k and self._v() is cache.v and self.starts is cache.starts
                and self.width == width)

    def __call__(self, tokens: torch.Tensor, column: int) -> torch.Tensor:
        self.tokens.copy_(tokens, non_blocking=True)
        self.column.fill_(column)
        self.replay()
        return self.logits


class CapturedSteps:
    """The recorded steps of the caches still in use, one per cache and width."""

    def __init__(self, run: StepFn, record: Recorder = record_cuda_graph):
        self.run, self.record = run, record
        self.steps: list[CapturedStep] = []

    def find(self, cache: KVCache, width: int = 1) -> CapturedStep | None:
        self.steps = [s for s in self.steps if s.alive()]
        return next((s for s in self.steps if s.serves(cache, width)), None)

    def capture(self, cache: KVCache, keep: tuple[torch.Tensor, ...] = (), width: int = 1) -> CapturedStep:
        step = self.find(cache, width)
        if step is None:
            step = CapturedStep(self.run, cache, keep, self.record, width)
            self.steps.append(step)
        return step
