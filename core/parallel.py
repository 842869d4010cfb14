"""Tensor parallelism over torch.distributed (as gpt-fast's tp.py and Megatron do it).

Each of N ranks holds 1/N of the attention heads (q, k, v by heads; o by its input
columns) and 1/N of the MLP (gate/up by rows, down by its input columns), and so 1/N of
the KV cache. Two all-reduces per layer join the partial sums: after the attention's
output projection and after the MLP's down projection, each before its bias. Norms and
embeddings are replicated; an untied output head is split by vocabulary rows and its
logits gathered. Every rank then holds identical logits, so all ranks choose the same
token when they sample with the same seed.

Launch with torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT and
TORCHELASTIC_RUN_ID; RANK/WORLD_SIZE without the last are not a launch, and are ignored);
the backend is NCCL on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import DeviceError, UnsupportedModelError


@dataclass
class ReduceStats:
    """Time spent in all-reduces (wall time; on GPUs only when `synchronize` is set, since
    NCCL calls return before the reduction is done)."""

    seconds: float = 0.0
    calls: int = 0
    synchronize: bool = False


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group (rank 0 of 1 = no parallelism)."""

    rank: int = 0
    world: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None = the default group
    stats: ReduceStats = field(default_factory=ReduceStats, compare=False)

    @property
    def active(self) -> bool:
        return self.world > 1

    def part(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal share of `total` items."""
        if total % self.world:
            raise UnsupportedModelError(
                f"{what} ({total}) is not divisible by the tensor-parallel degree {self.world}; "
                f"use a --tp that divides it"
            )
        size = total // self.world
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.active:
            t = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            if self.stats.synchronize and x.is_cuda:
                torch.cuda.synchronize(x.device)
            self.stats.seconds += time.perf_counter() - t
            self.stats.calls += 1
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (rank order)."""
        if not self.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_int(self, value: int | None) -> int:
        """Rank 0's value, on every rank (e.g. a random seed all ranks must share)."""
        if not self.active:
            return int(value or 0)
        t = torch.tensor([int(value or 0)], dtype=torch.int64, device=_collective_device(self))
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())


SINGLE = Shard()


def _collective_device(shard: Shard) -> torch.device:
    backend = dist.get_backend(shard.group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# torchrun's elastic agent gives every worker it starts RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR/PORT and its run's id; RANK and WORLD_SIZE alone (left over in a shell, set
# by a scheduler for its own purposes) are no launch: joining a group on them would fail
# for want of MASTER_ADDR, or wait forever for ranks that were never started.
TORCHRUN_MARK = "TORCHELASTIC_RUN_ID"
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun() -> bool:
    return TORCHRUN_MARK in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def stray_launch_variables() -> list[str]:
    """The launch variables set in a process torchrun did not start (they are ignored)."""
    if launched_by_torchrun():
        return []
    return [name for name in LAUNCH_VARIABLES if name in os.environ]


def _env_int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(text)
    except (TypeError, ValueError):
        raise DeviceError(f"torchrun set {name}={text!r}, which is not a whole number") from None


@dataclass(frozen=True)
class Launch:
    """Where torchrun put this process (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1
    device: str = "auto"

    def tensor_parallel(self, degree: int) -> Shard:
        if degree == 1:
            return SINGLE
        if degree != self.world:
            raise DeviceError(
                f"--tp {degree} needs {degree} processes (torchrun --nproc-per-node {degree}); this run has {self.world}"
            )
        return Shard(rank=self.rank, world=self.world)


def init_from_env(device: str = "auto") -> Launch:
    """Join the process group torchrun describes; NCCL when this rank gets a GPU, gloo
    otherwise. Without torchrun: rank 0 of 1, nothing initialized."""
    if not launched_by_torchrun():
        return Launch(device=device)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_RANK", rank)
    if not (world >= 1 and 0 <= rank < world and local >= 0):
        raise DeviceError(f"torchrun set RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}: not a rank of the group")
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda under torchrun, but no CUDA GPU is visible")
        if local >= torch.cuda.device_count():
            raise DeviceError(f"local rank {local} has no GPU: this node has {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = "cpu"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world)
        except (RuntimeError, ValueError) as e:  # no MASTER_ADDR, an unreachable rendezvous, ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise DeviceError(f"cannot join torchrun's process group (rank {rank} of {world}): {first}") from None
    return Launch(rank=rank, world=world, device=device)


def gather_failures(launch: Launch, message: str | None) -> list[str]:
    """Every rank's failure message, "rank R: ..." (empty when none failed). Every rank must
    call it: it is also the barrier after which rank 0 may merge what the ranks wrote."""
    gathered: list = [None] * launch.world
    dist.all_gather_object(gathered, message)
    return [f"rank {rank}: {m}" for rank, m in enumerate(gathered) if m is not None]


def finish() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
