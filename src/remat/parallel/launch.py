"""Runs launched by torchrun: the world it started, the process group, and the few numbers a
benchmark agrees on across ranks. `remat bench -ng N` starts torchrun itself, and reads what a
failed rank left for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


def launched_world() -> int:
    """How many processes torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start(device: str) -> None:
    """Join torchrun's process group (NCCL on CUDA, each rank on its local GPU; gloo on CPU)."""
    if launched_world() == 1 or dist.is_initialized():
        return
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")


def stop(failed: bool = False) -> None:
    """Leave the process group: after a barrier, or at once when this rank `failed`, so that it
    exits and torchrun stops the ranks still waiting for it in a collective."""
    if dist.is_initialized():
        if not failed:
            dist.barrier()
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def max_over_ranks(value: int) -> int:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def of_highest_rank(key: int, values: Sequence[int]) -> tuple[int, list[int]]:
    """The `key` and `values` of the rank whose `key` is the highest (e.g. its peak memory and
    that peak's breakdown), so that numbers reported together come from one rank."""
    if not dist.is_initialized():
        return key, list(values)
    row = torch.tensor([key, *values], dtype=torch.int64, device=_collective_device())
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    highest = max(rows, key=lambda r: int(r[0])).tolist()
    return highest[0], highest[1:]


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar over the ranks (gloo has no AVG: a sum, divided)."""
    if not dist.is_initialized():
        return t
    total = t.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rank_words(rank: int, coordinates: Mapping[str, int] | None = None) -> str:
    """'rank 1 (pp 0, dp 1, cp 0, tp 0)': a rank and, when known, its place on the mesh."""
    place = ", ".join(f"{dim} {index}" for dim, index in (coordinates or {}).items())
    return f"rank {rank} ({place})" if place else f"rank {rank}"


# The folder where ranks leave records for the remat process that started torchrun. A rank that
# fails cannot gather anything to rank 0: the others may wait in a collective it will never join,
# until torchrun stops them.
RECORDS = "REMAT_RANK_RECORDS"
# What torchrun runs on each rank: remat's command line (a test runs a script that simulates a GPU).
RANK_PROGRAM: tuple[str, ...] = ("-m", "remat")


def _records() -> Path | None:
    """The folder of records, when a remat process started torchrun."""
    folder = os.environ.get(RECORDS)
    return Path(folder) if folder else None


def leave(name: str, record: Any) -> bool:
    """Leave `record` (JSON) under `name` for the remat process that started torchrun; False when
    none did (a torchrun started by hand), so that the rank says it itself."""
    folder = _records()
    if folder is None:
        return False
    target = folder / f"{name}.json"
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_text(json.dumps(record))
    partial.replace(target)  # whole or absent: torchrun may stop this process at any moment
    return True


def left_by_ranks() -> bool:
    """Whether a rank left a record for the remat process that started torchrun: a rank whose
    collective then fails has lost a peer that failed first."""
    folder = _records()
    return folder is not None and any(folder.glob("*.json"))


class Launch(NamedTuple):
    status: int  # torchrun's exit status
    records: dict[str, Any]  # what the ranks left (`leave`), by name


def torchrun(nproc: int, argv: Sequence[str]) -> Launch:
    """Run `remat ARGV` under torchrun on this machine with `nproc` processes: its exit status and
    the records its ranks left."""
    with tempfile.TemporaryDirectory(prefix="remat-ranks-") as folder:
        status = subprocess.call(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                *RANK_PROGRAM,
                *argv,
            ],
            env={**os.environ, RECORDS: folder},
        )
        left = sorted(Path(folder).glob("*.json"))
        return Launch(status, {path.stem: json.loads(path.read_text()) for path in left})
