"""Running under torchrun: which rank prints, tensor-parallel setup, and the data-parallel
split and merge of `twice batch`.

Tensor parallel (`--tp N` with N processes): every rank runs the same loop on its shard of
the model; only rank 0 prints or writes. Data parallel (`twice batch` under torchrun
without --tp): every rank is a whole replica that takes every N-th prompt and writes its
own part file beside the output; rank 0 then merges the parts (and what an earlier run
left in the output) into the output, in input order, atomically.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

from twice.core.errors import PromptError, TwiceError


def start(device: str, tp: int):
    """(launch, shard) for this process; without torchrun, rank 0 of 1 and no shard."""
    from twice.core.parallel import SINGLE, init_from_env, launched_by_torchrun

    if tp < 1:
        raise PromptError(f"--tp must be at least 1, got {tp}")
    if not launched_by_torchrun():
        if tp > 1:
            raise PromptError(f"--tp {tp} needs {tp} processes: launch with torchrun --nproc-per-node {tp} "
                              f"--no-python twice ... --tp {tp}")
        from twice.core.parallel import Launch

        return Launch(device=device), SINGLE
    launch = init_from_env(device)
    shard = launch.tensor_parallel(tp) if tp > 1 else SINGLE
    if shard.active:
        # One draw from rank 0 seeds every rank's `random`: unseeded sampling then picks the
        # same tokens everywhere, as tensor parallelism requires.
        random.seed(shard.broadcast_int(random.getrandbits(62)))
    return launch, shard


def finish(launch) -> None:
    from twice.core.parallel import finish as finish_group

    if launch.world > 1:
        finish_group()


def all_ok(launch, error: BaseException | None) -> list[str]:
    """Every rank's failure message (empty when all ranks succeeded); also a barrier."""
    from twice.core.parallel import gather_failures

    return gather_failures(launch, None if error is None else (str(error) or type(error).__name__))


def part_path(output: Path, rank: int, world: int) -> Path:
    return output.with_name(f"{output.name}.part-{rank}-of-{world}")


def my_share(records: list, rank: int, world: int) -> list:
    """Every world-th record, starting at this rank (input order decides who takes what)."""
    return [r for i, r in enumerate(records) if i % world == rank]


def merge_parts(output: Path, records: list, world: int) -> int:
    """Write the output as the earlier output's lines plus every rank's part, one line per
    id, in input order; atomically (a temporary file beside it, then a rename), so a crash
    leaves the old output and the parts, which --resume picks up. Returns the lines written."""
    order = {r.key: i for i, r in enumerate(records)}
    sources = [output] + [part_path(output, rank, world) for rank in range(world)]
    lines: dict[str, bytes] = {}
    for source in sources:
        if not source.is_file():
            continue
        for raw in source.read_bytes().split(b"\n"):
            try:
                obj = json.loads(raw)
                key = str(obj["id"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed run: its prompt is run again on --resume
            lines.setdefault(key, raw)
    ordered = sorted(lines.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".merge")
    try:
        with os.fdopen(fd, "wb") as f:
            for _, raw in ordered:
                f.write(raw + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise TwiceError(f"cannot write {output}: {e.strerror or e}") from None
    for source in sources[1:]:
        try:
            source.unlink()
        except FileNotFoundError:
            pass
    return len(ordered)
