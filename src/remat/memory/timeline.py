"""timeline(): memory after every op of one training step, each layer's forward and backward marked."""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.engine.storage import FP8_DTYPES
from remat.memory.live import LiveBytes, NewStorages
from remat.memory.measure import Stepper, gradients_persist, training_state_kept
from remat.memory.meter import Meter
from remat.memory.prediction import resolve
from remat.sites.apply import apply, find_sites


@dataclass(frozen=True)
class Timeline:
    """Memory after every op of one training step, with the windows marked where they begin."""

    allocated: tuple[int, ...]
    reserved: tuple[int, ...] | None  # the caching allocator's (CUDA only)
    marks: tuple[tuple[int, str], ...]  # (op index, window name): fwd i, head, bwd i, tail, optimizer
    peaks: dict[str, int]  # each window's peak, as the trace measures it
    # of `allocated`, the bytes in FP8 dtypes (FP8 training's casts); None where not counted
    fp8: tuple[int, ...] | None = None

    def fp8_at_peak(self) -> int | None:
        """The FP8 bytes live where allocated memory peaks."""
        return None if self.fp8 is None else self.fp8[self.allocated.index(max(self.allocated))]


class _Samples:
    """Allocated (and on CUDA reserved) bytes, appended as the step goes."""

    def __init__(self, meter: Meter, cuda: bool) -> None:
        self.meter, self.cuda = meter, cuda
        self.allocated: list[int] = []
        self.reserved: list[int] = []
        self.fp8_live = LiveBytes()
        self.fp8: list[int] = []

    def sample(self, allocated: int | None = None) -> None:
        self.allocated.append(self.meter.now() if allocated is None else allocated)
        self.fp8.append(self.fp8_live.bytes)
        if self.cuda:
            self.reserved.append(torch.cuda.memory_reserved())

    def every_op(self) -> ExitStack:
        """Sample after every op, FP8 storages counted as ops create them (before the sample)."""
        modes = ExitStack()
        modes.enter_context(NewStorages(self.fp8_live.created, only=lambda t: t.dtype in FP8_DTYPES))
        modes.enter_context(_EveryOp(self))
        return modes


class _EveryOp(TorchDispatchMode):
    def __init__(self, samples: _Samples) -> None:
        super().__init__()
        self.samples = samples

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.samples.sample()
        return out


def timeline(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    plan: RecomputeConfig | Plan | None = None,
    micro_batches: int = 1,
    seed: int = 0,
    per_op: bool = True,
) -> Timeline:
    """Allocated (and on CUDA reserved) bytes after every op of one training step on `batch`
    (input_ids, labels) under `plan`, the step `trace` measures, with each layer's forward and
    backward marked. With compiled regions pass per_op=False: samples then come at each window's
    start and peak only (a dispatch mode watching every op would run compiled regions eagerly and
    change what they save); the FP8 bytes are then not counted."""
    resolved = resolve(plan, find_sites(model).model_sites)
    stepper = Stepper(
        model,
        batch,
        optimizer,
        gradients_persist(optimizer, micro_batches),
        seed,
        min_offloaded=resolved.min_offloaded_tensor_size,
    )
    marks: list[tuple[int, str]] = []
    found: list[_Samples] = []

    def sample(meter: Meter) -> Any:
        found.append(_Samples(meter, stepper.cuda))
        return found[0].every_op() if per_op else nullcontext()

    def on_mark(name: str, peak: int) -> None:
        samples = found[0]
        if not per_op:  # the window that ended reached `peak`; the next one starts from now
            samples.sample(peak)
            samples.sample()
        marks.append((len(samples.allocated) - (0 if per_op else 1), name))

    try:
        with training_state_kept(model, optimizer):
            stepper.step()  # gradients and optimizer state exist, as in a steady step
            record = stepper.measure(resolved, on_mark, sample)
    finally:
        apply(model, None)
    (samples,) = found
    return Timeline(
        tuple(samples.allocated),
        tuple(samples.reserved) if stepper.cuda else None,
        tuple(m for m in marks if m[1] != "end"),
        dict(record.peaks),
        tuple(samples.fp8) if per_op else None,
    )
