"""What one benchmark run measured, as a plain serializable record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from remat.core.timing import spread
from remat.doctor import AllocatorState

Status = Literal["ok", "oom"]
# How far apart the step times of one CPU process and another run for the same tiny recipe: tens of
# percent (40-48% measured on a 2-core machine), far beyond the spread within either run; CPU
# timings are told apart only beyond this, a factor of two.
CPU_TIMING_NOISE = 1.0
# Said under CPU timings wherever they are shown (a sweep's table, plan --verify's)
CPU_TIMING_CAVEAT = (
    "step time on CPU: one process runs tens of percent faster than another, and more under load; memory is exact"
)


@dataclass
class MemoryBreakdown:
    """Bytes by owner. `activations` is the rest of the step's peak: saved activations, recompute
    transients, the loss head, workspaces, and the gradients being built when they do not
    persist across the step (one micro-batch with an optimizer step)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    # False: the gradients are built during backward, so the part of them alive at the peak is
    # inside `activations` (their share of the peak is not counted again)
    grads_persist: bool = True


@dataclass
class OomInfo:
    """Where an out-of-memory run stopped, and under torchrun on which rank: its numbers, not rank 0's."""

    allocated_bytes: int | None  # None: the host's allocator, which reports neither
    reserved_bytes: int | None
    message: str
    rank: int | None = None  # the rank that ran out of memory (None: one process)
    coordinates: dict[str, int] | None = None  # its place on the pp x dp x cp x tp mesh
    allocator: AllocatorState | None = None  # its allocator as remat doctor reads it (None: not known)


@dataclass
class BenchResult:
    """One configuration's run: timings are medians over the steady steps after warm-up."""

    name: str  # short label of the recompute config, e.g. "none", "mlp", "full_block_2"
    recipe: str
    status: Status
    config: dict[str, Any]  # Megatron keys of the recompute config, or a per-layer plan
    shape: dict[str, Any]  # num_layers, hidden_size, seq_length, micro/global batch size, ...
    device: str  # "cuda" or "cpu"
    gpu: str  # device name ("cpu" on CPU)
    torch: str
    date: str  # ISO 8601, UTC
    command: str
    step_time_s: float | None = None  # whole step: all micro-batches and the optimizer
    fwd_bwd_time_s: float | None = None  # forward+backward of all micro-batches of a step
    tflops_per_gpu: float | None = None  # model FLOPs / step_time_s
    tflops_fwd_bwd: float | None = None  # model FLOPs / fwd_bwd_time_s (the anchor's measure)
    tokens_per_s_per_gpu: float | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_host_bytes: int | None = None  # host memory holding offloaded activations (None: no offload)
    memory: MemoryBreakdown | None = None
    losses: list[float] = field(default_factory=list)  # one per step, warm-up included
    step_times_s: list[float] = field(default_factory=list)  # the steady steps', in order
    harness_overhead: float | None = None  # fraction of wall time spent outside measured steps
    oom: OomInfo | None = None

    @property
    def step_spread(self) -> float | None:
        """Step-to-step noise of the steady steps, relative to the median step time
        (timing.spread); None without two of them."""
        if len(self.step_times_s) < 2 or self.step_time_s is None or not self.step_time_s > 0:
            return None
        return spread(self.step_times_s) / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """A result as `to_dict` wrote it; ValueError naming what is missing or malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"it is {type(data).__name__}, not a mapping of a result's fields")
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"it has no {', '.join(missing)}")
        data = dict(data)
        try:
            if data.get("memory") is not None:
                data["memory"] = MemoryBreakdown(**data["memory"])
            if data.get("oom") is not None:
                oom = dict(data["oom"])
                allocator = oom.pop("allocator", None)
                data["oom"] = OomInfo(**oom, allocator=None if allocator is None else AllocatorState(**allocator))
        except TypeError as err:
            raise ValueError(f"its memory or oom record is malformed ({err})") from None
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def timing_noise(*results: BenchResult) -> float | None:
    """The relative difference in step time that noise alone can make between these runs: the
    sum of their step spreads, and on CPU at least CPU_TIMING_NOISE; None when a GPU run has no
    spread recorded."""
    spreads = [r.step_spread for r in results]
    cpu = any(r.device == "cpu" for r in results)
    if any(spread is None for spread in spreads):
        return CPU_TIMING_NOISE if cpu else None
    noise = sum(spread for spread in spreads if spread is not None)
    return max(noise, CPU_TIMING_NOISE) if cpu else noise
