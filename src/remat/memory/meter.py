"""Meters: the bytes a device holds now and at its peak, with the peak reset at each mark.

On CUDA the caching allocator's own counters (what `max_memory_allocated` reports); on CPU the
storages ops create, counted by a dispatch mode, on top of the model's and optimizer's tensors.
What no op creates is not counted on CPU: Python numbers autograd saves as 0-dim tensors (8
bytes) and the CPU RNG state a recompute keeps (5 KiB), which beside an accelerator stay in host
memory. tests/unit/memory/test_trace.py checks the rest against the CPU allocator's own events.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from remat.engine import storage_key
from remat.memory.live import LiveBytes, NewStorages


class Meter(Protocol):
    def now(self) -> int: ...

    def take_peak(self) -> int:
        """The peak since the previous call (or the start); the next peak starts from now."""
        ...


class CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.reset_peak_memory_stats(device)

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def take_peak(self) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


class CpuMeter(AbstractContextManager):
    """Counts `static` tensors (weights, gradients, optimizer state that exist before) plus every
    storage created while the meter is entered and still alive."""

    def __init__(self, static: Iterable[torch.Tensor]) -> None:
        self.static = storage_bytes(static)
        self.live = LiveBytes()
        self._mode = NewStorages(self.live.created)

    def __enter__(self) -> CpuMeter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def now(self) -> int:
        return self.static + self.live.bytes

    def take_peak(self) -> int:
        peak = self.static + self.live.peak
        self.live.peak = self.live.bytes
        return peak


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a DTensor: FSDP2's parameters, their gradients and
    optimizer state), whose bytes are on this device; other tensors as they are."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t
    from torch.distributed.tensor import DTensor  # only a sharded run has one

    return t.to_local() if isinstance(t, DTensor) else t


def held_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What a step starts with: parameters, existing gradients, optimizer state."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique storages behind `tensors`."""
    local = [local_tensor(t) for t in tensors]
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in local}
    return sum(storages.values())
