"""What every worker does under torchrun: join the gloo group, compute its results on every rank,
and have rank 0 save them to the file named by argv[1]."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def run(results: Callable[[], dict[str, Any]]) -> None:
    dist.init_process_group("gloo")
    found = results()
    if dist.get_rank() == 0:
        torch.save(found, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


def refused_unchanged(model: torch.nn.Module, layout: Callable[[torch.nn.Module], Any], what: str) -> str:
    """The ConfigError `layout(model)` raises, checked to have left every weight and buffer as it was."""
    from remat.core.problems import ConfigError

    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        layout(model)
    except ConfigError as err:
        after = model.state_dict()
        assert all(type(after[k]) is torch.Tensor and torch.equal(after[k], v) for k, v in before.items())
        return str(err)
    raise AssertionError(f"{what} took it")
