"""Running under torchrun: which rank prints, tensor-parallel setup, and the data-parallel
split and merge of `twice batch`.

Tensor parallel (`--tp N` with N processes): every rank runs the same loop on its shard of
the model; only rank 0 prints or writes. Data parallel (`twice batch` under torchrun
without --tp): every rank is a whole replica that takes every N-th prompt and writes its
own part file beside the output; rank 0 then merges the parts (and what an earlier run
left in the output) into the output, in input order, atomically.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

from twice.core.errors import PromptError, TwiceError


def start(device: str, tp: int):
    """(launch, shard) for this process; without torchrun, rank 0 of 1 and no shard."""
    from twice.core.parallel import SINGLE, init_from_env, launched_by_torchrun, stray_launch_variables

    if tp < 1:
        raise PromptError(f"--tp must be at least 1, got {tp}")
    if not launched_by_torchrun():
        if tp > 1:
            raise PromptError(f"--tp {tp} needs {tp} processes: launch with torchrun --nproc-per-node {tp} "
                              f"--no-python twice ... --tp {tp}")
        stray = stray_launch_variables()
        if stray:
            from .errors import notice

            notice(f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} set, but torchrun did not start this "
                   "process (no TORCHELASTIC_RUN_ID): running as one process")
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


def find_parts(output: Path) -> list[tuple[Path, int, int]]:
    """(path, rank, world) of every part file `OUTPUT.part-R-of-N` beside the output, of
    any N (a killed run of another size leaves its own), ordered by N then R."""
    pattern = re.compile(re.escape(output.name) + r"\.part-(\d{1,6})-of-(\d{1,6})")
    found = []
    try:
        names = os.listdir(output.parent if str(output.parent) else ".")
    except OSError:
        return []
    for name in names:
        m = pattern.fullmatch(name)
        if m and int(m.group(1)) < int(m.group(2)):
            found.append((output.with_name(name), int(m.group(1)), int(m.group(2))))
    return sorted(found, key=lambda f: (f[2], f[1]))


def merge_parts(output: Path, records: list, parts: list[Path] | None = None) -> int:
    """Write the output as the earlier output's lines plus every part's (default: all the
    part files beside it, of any N), one line per id, in input order; atomically (a
    temporary file beside it, then a rename, with the mode a one-process run gives a new
    file, or the old output's), so a crash leaves the old output and the parts, which
    --resume picks up; then remove the parts. Every file read must be ours (a torn last
    line is dropped: its prompt runs again). The caller holds the output's lock. Returns
    the lines written."""
    from twice.weights.safe_write import write_atomic

    from .batch_output import our_lines, read_ours

    order = {r.key: i for i, r in enumerate(records)}
    if parts is None:
        parts = [path for path, _, _ in find_parts(output)]
    lines: dict[str, bytes] = {}
    for source in [output, *parts]:
        if not os.path.lexists(source):
            continue
        data, _ = read_ours(source)
        for key, raw in our_lines(data, str(source)):
            lines.setdefault(key, raw)
    ordered = sorted(lines.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))
    try:
        write_atomic(output, b"".join(raw + b"\n" for _, raw in ordered), error=PromptError)  # its mode kept
    except OSError as e:
        raise TwiceError(f"cannot write {output}: {e.strerror or e}") from None
    for source in parts:
        try:
            source.unlink()
        except FileNotFoundError:
            pass
    return len(ordered)
