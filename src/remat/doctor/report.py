"""remat doctor: tell a fragmentation OOM from a capacity OOM and say what to change.

A CUDA allocation fails when no free block inside the reserved segments holds the request and the
device cannot give a new segment. If the bytes exist but in pieces (reserved far above allocated),
the fix is an allocator setting; if allocated memory itself reaches the limit, only using less (a
recompute plan, a smaller micro-batch, more GPUs) helps. The allocator's numbers tell which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import torch

from remat import parallel
from remat.core.sizes import format_bytes
from remat.doctor.allocator import AllocatorState, capture, oom_state
from remat.memory.attribution import Attribution, Attributor
from remat.parallel.launch import rank_words
from remat.planner import NoPlanFits, PlanResult

EXPANDABLE_SEGMENTS = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"

# --- classifier thresholds -------------------------------------------------------------------------
# A gap (reserved - allocated) under this share of the limit is the allocator's ordinary slack, not
# "reserved far above allocated": rounding (2 MiB blocks, 20 MiB+ segments) and the freed
# intermediates a step leaves in split segments mid-step (unused whole segments are already released
# before an OOM is raised). A request that fails with less than this in holes means the step has
# outgrown the device; an allocator setting would move the OOM a few allocations later.
MIN_FRAGMENTATION_GAP = 0.05
# Without a request size: allocated within this share of the limit is at capacity ...
NEAR_LIMIT = 0.05
# ... and a largest hole under this share of the gap means the free bytes are there but in pieces.
MAX_HOLE_SHARE = 0.5
# The budget a recompute plan must fit: the planner predicts peak *allocated* bytes, and reserved
# runs a few percent above that even without fragmentation (rounding, per-stream blocks).
PLAN_BUDGET_SHARE = 0.95


# --- classification ----------------------------------------------------------------------------------

Kind = Literal["fragmentation", "capacity", "fits"]


@dataclass(frozen=True)
class Diagnosis:
    kind: Kind
    state: AllocatorState
    explanation: str

    def evidence(self) -> dict[str, int | None]:
        s = self.state
        return {
            "allocated": s.allocated,
            "reserved": s.reserved,
            "gap": s.gap,
            "largest free block": s.largest_free_block,
            "request": s.request,
            "limit": s.limit,
            "headroom": s.headroom,
        }

    def __str__(self) -> str:
        numbers = ", ".join(f"{k} {'?' if v is None else format_bytes(v)}" for k, v in self.evidence().items())
        return f"{self.kind}: {self.explanation}\n  {numbers}"


def classify(state: AllocatorState) -> Diagnosis:
    """Fragmentation: the free bytes would hold the request but no free block does. Capacity: allocated
    plus the request reaches what the allocator can have. Fits: the request can be served now."""
    s, f = state, format_bytes
    if s.request is None:
        return _classify_without_request(s)
    largest, r = s.largest_free_block, s.request
    if (largest is not None and largest >= r) or s.headroom >= r:
        where = "a free block" if largest is not None and largest >= r else "the unreserved headroom"
        return Diagnosis("fits", s, f"{where} holds the {f(r)} request now; nothing is short")
    if s.gap + s.headroom >= r and s.gap >= MIN_FRAGMENTATION_GAP * s.limit:
        hole = "no free block held it" if largest is None else f"the largest free block is {f(largest)}"
        return Diagnosis(
            "fragmentation",
            s,
            (
                f"{f(s.gap)} reserved but unallocated (+{f(s.headroom)} unreserved) would hold the {f(r)} request,"
                f" but {hole}: the memory is there, in pieces"
            ),
        )
    if s.allocated + r <= s.available:  # the gap is under MIN_FRAGMENTATION_GAP: ordinary slack
        return Diagnosis(
            "capacity",
            s,
            (
                f"allocated {f(s.allocated)} + the {f(r)} request leaves {f(s.available - s.allocated - r)} of the"
                f" {f(s.available)} the allocator can have; the {f(s.gap)} in holes is ordinary slack (under"
                f" {MIN_FRAGMENTATION_GAP:.0%} of the limit): the step needs less memory"
            ),
        )
    outside = s.limit - s.available
    other = f"; {f(outside)} of the limit is held outside this allocator" if outside > s.gap else ""
    return Diagnosis(
        "capacity",
        s,
        (
            f"allocated {f(s.allocated)} + the {f(r)} request exceeds the {f(s.available)}"
            f" the allocator can have{other}: the step needs less memory, not a better allocator"
        ),
    )


def _classify_without_request(s: AllocatorState) -> Diagnosis:
    f = format_bytes
    if s.allocated >= (1 - NEAR_LIMIT) * s.limit:
        return Diagnosis(
            "capacity", s, f"allocated {f(s.allocated)} is within {NEAR_LIMIT:.0%} of the {f(s.limit)} limit"
        )
    if (
        s.gap >= MIN_FRAGMENTATION_GAP * s.limit
        and s.largest_free_block is not None
        and s.largest_free_block < MAX_HOLE_SHARE * s.gap
    ):
        return Diagnosis(
            "fragmentation",
            s,
            f"{f(s.gap)} reserved but unallocated, in {s.free_blocks} holes of at most {f(s.largest_free_block)}",
        )
    return Diagnosis("fits", s, "no failed request, and neither the limit nor split holes is near")


# --- recommendations ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    what: str  # one line: what to change
    setting: str  # the exact setting, flags or command
    why: str  # the numbers behind it
    plan: PlanResult | None = None  # the plan to save (`plan.plan.save(path)`) when one was solved

    def __str__(self) -> str:
        return f"{self.what}: {self.setting}\n    {self.why}"


PlanFn = Callable[[int], PlanResult]  # budget bytes -> the fastest plan that fits (NoPlanFits if none)


_RUN_FLAGS = "[the run's -mr/-sl/-mb/... flags]"


def recommend(
    diagnosis: Diagnosis,
    *,
    plan_fn: PlanFn | None = None,
    micro_batch_size: int | None = None,
    run_flags: str | None = None,
) -> list[Recommendation]:
    """What to change, best first: the allocator setting for fragmentation; for capacity the fastest
    recompute plan that fits (from `plan_fn`, or the `remat plan` command to find it, with the
    run's `run_flags` when known), then a smaller micro-batch and more parallelism when no plan fits."""
    s = diagnosis.state
    if diagnosis.kind == "fits":
        return []
    if diagnosis.kind == "fragmentation" and not s.expandable:
        largest = "?" if s.largest_free_block is None else format_bytes(s.largest_free_block)
        return [
            Recommendation(
                "let segments grow instead of leaving holes (set before the process starts)",
                EXPANDABLE_SEGMENTS,
                f"{format_bytes(s.gap)} reserved but unallocated, largest free block {largest}, request "
                f"{format_bytes(s.request or 0)}",
            )
        ]
    budget = int(s.available * PLAN_BUDGET_SHARE)
    need = s.allocated + (s.request or 0)
    if plan_fn is None:
        # sized by how far the need is over the budget: none when it is not (fragmentation with
        # expandable segments already on), where a plan that leaves more room is the answer
        shrink = (
            _shrink("allocated + the request (a lower bound: the step failed part way)", need, budget, micro_batch_size)
            if need > budget
            else []
        )
        return [
            Recommendation(
                "find the fastest recompute plan that fits",
                f"remat plan {run_flags or _RUN_FLAGS} --memory-budget {budget / 2**30:.1f}GiB -o plan.yaml --verify",
                f"{PLAN_BUDGET_SHARE:.0%} of the {format_bytes(s.available)}"
                " this allocator can have; the planner predicts peak allocated memory",
            ),
            *shrink,
        ]
    try:
        result = plan_fn(budget)
    except NoPlanFits as nofit:
        return _shrink("the lowest peak any plan reaches", nofit.lowest.peak_bytes, budget, micro_batch_size)
    return [_plan_recommendation(result)]


def _plan_recommendation(result: PlanResult) -> Recommendation:
    p = result.prediction
    why = (
        f"predicted peak {format_bytes(p.peak_bytes)} (in {p.peak_window}) under the "
        f"{format_bytes(result.budget_bytes)} budget, step {p.step_time_s * 1e3:.1f} ms"
    )
    if result.config is None:
        return Recommendation(
            "run the per-layer plan (save it with result.plan.save('plan.yaml'))",
            "remat bench --config plan.yaml",
            why,
            result,
        )
    return Recommendation("recompute as this Megatron config", megatron_flags(result.config), why, result)


def megatron_flags(config: Any) -> str:
    """Megatron Bridge's flags for a RecomputeConfig's recompute settings."""
    if config.recompute_granularity == "selective":
        return f"--recompute_modules {','.join(config.recompute_modules)}"
    if config.recompute_granularity == "full":
        return f"--recompute_method {config.recompute_method} -rl {config.recompute_num_layers}"
    return "no recompute (the step fits without it)"


MAX_SPLIT = 64  # the most GPUs _shrink proposes splitting a model over; more means a wrong size given


def _shrink(what: str, need: int, budget: int, micro_batch_size: int | None) -> list[Recommendation]:
    """Smaller micro-batch and more GPUs, sized by how far `need` is over the budget."""
    ratio = need / budget
    gap = f"{what}, {format_bytes(need)}, is {ratio:.2f}x the {format_bytes(budget)} budget"
    out = []
    if micro_batch_size is not None and micro_batch_size > 1:
        mb = max(1, math.floor(micro_batch_size / ratio))
        out.append(
            Recommendation(
                "lower the micro-batch size (raise gradient accumulation to keep the global batch)",
                f"-mb {mb}",
                f"{gap}; activations scale with the micro-batch, weights do not: check -mb {mb} with remat plan",
            )
        )
    n = max(2, 1 << math.ceil(math.log2(ratio)))
    if n > MAX_SPLIT:  # no parallel layout helps: the budget or the device size given is likely wrong
        out.append(
            Recommendation(
                "check the memory the device has",
                "--limit / --memory-budget",
                f"{gap}: more than {MAX_SPLIT} GPUs' worth; check the device size or budget given before "
                f"changing the model's layout",
            )
        )
        return out
    out.append(
        Recommendation(
            f"spread the model over {n}x the GPUs",
            f"-tp {n} --sequence_parallel, or -pp {n}, or -cp {n}",
            f"{gap}; tp+sp splits weights and activations, pp the layers, cp the sequence: `remat estimate` "
            f"with these flags predicts each before launching",
        )
    )
    return out


# --- watching a training loop ------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    diagnosis: Diagnosis
    recommendations: list[Recommendation]
    message: str = ""  # the OOM's first line, when there was one
    attribution: Attribution | None = None  # who held the allocated memory (when the model was watched)
    rank: int | None = None  # under torchrun: the rank whose numbers these are
    coordinates: Mapping[str, int] | None = None  # its place on the pp x dp x cp x tp mesh, when known

    @property
    def where(self) -> str:
        """' on rank 1 (pp 0, dp 1, cp 0, tp 0)' under torchrun, else nothing."""
        return "" if self.rank is None else f" on {rank_words(self.rank, self.coordinates)}"

    def __str__(self) -> str:
        lines = [f"remat doctor{self.where}: {self.diagnosis}"]
        lines += [f"  {i}. {r}" for i, r in enumerate(self.recommendations, 1)]
        if self.attribution is not None:
            lines += [f"  {what}: {format_bytes(nbytes)}" for what, nbytes in attribution_rows(self)]
        return "\n".join(lines)


def attribution_rows(report: Report) -> list[tuple[str, int]]:
    """The attribution, then what it leaves of allocated (transients, the failed step's working
    memory) and the allocator's slack (reserved but unallocated)."""
    a, s = report.attribution, report.diagnosis.state
    if a is None:
        return []
    return [*a.rows(), ("other allocated", s.allocated - a.total), ("allocator slack", s.reserved - s.allocated)]


def report_of(
    state: AllocatorState,
    message: str = "",
    *,
    rank: int | None = None,
    coordinates: Mapping[str, int] | None = None,
    plan_fn: PlanFn | None = None,
    micro_batch_size: int | None = None,
    run_flags: str | None = None,
    attribution: Attribution | None = None,
) -> Report:
    """Classify one process's allocator numbers and recommend; under torchrun `rank` (and its
    `coordinates`) names whose numbers they are, which need not be rank 0's."""
    diagnosis = classify(state)
    return Report(
        diagnosis,
        recommend(diagnosis, plan_fn=plan_fn, micro_batch_size=micro_batch_size, run_flags=run_flags),
        message.split("\n")[0],
        attribution,
        rank,
        coordinates,
    )


def _this_rank() -> int | None:
    return parallel.rank() if parallel.world_size() > 1 else None


def diagnose(
    device: torch.device | int | str | None = None,
    request_bytes: int | None = None,
    *,
    plan_fn: PlanFn | None = None,
    micro_batch_size: int | None = None,
) -> Report:
    """Capture the allocator now (this rank's, under torchrun), classify, recommend."""
    return report_of(
        capture(device, request_bytes), rank=_this_rank(), plan_fn=plan_fn, micro_batch_size=micro_batch_size
    )


@dataclass
class Doctor:
    """Diagnoses a CUDA OOM raised inside `with` (or passed to `observe`) while its tensors are still alive."""

    device: torch.device | int | str | None = None
    on_oom: Callable[[Report], Any] | None = print
    reraise: bool = True
    plan_fn: PlanFn | None = None
    micro_batch_size: int | None = None
    run_flags: str | None = None  # the recipe and run flags a `remat plan` command should repeat
    model: torch.nn.Module | None = None  # watched: what its sites save is attributed
    optimizer: torch.optim.Optimizer | None = None
    report: Report | None = field(default=None, init=False)
    _attributor: Attributor | None = field(default=None, init=False, repr=False)

    def attribute(self) -> Attribution | None:
        """Who holds the memory now (inside `with`, for a watched model)."""
        return self._attributor.attribute() if self._attributor is not None else None

    def observe(self, error: BaseException) -> Report:
        """Diagnose an OOM: the allocator's state when CUDA is there, else the message's numbers
        (ValueError when it has none); under torchrun, this rank's."""
        state = oom_state(error, self.device)
        if state is None:
            raise ValueError("the OOM's message does not give the device capacity, allocated and reserved bytes")
        self.report = report_of(
            state,
            str(error),
            rank=_this_rank(),
            plan_fn=self.plan_fn,
            micro_batch_size=self.micro_batch_size,
            run_flags=self.run_flags,
            attribution=self.attribute(),
        )
        if self.on_oom is not None:
            self.on_oom(self.report)
        return self.report

    def __enter__(self) -> Doctor:
        if self.model is not None:
            self._attributor = Attributor(self.model, self.optimizer).__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        try:
            if not isinstance(error, torch.cuda.OutOfMemoryError):
                return False
            try:
                self.observe(error)
            except ValueError:  # a message without the allocator's numbers: let the OOM itself through
                return False
            return not self.reraise
        finally:
            if self._attributor is not None:
                self._attributor.__exit__(None, None, None)
                self._attributor = None


def watch(
    model: torch.nn.Module | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    on_oom: Callable[[Report], Any] | None = print,
    reraise: bool = True,
    plan_fn: PlanFn | None = None,
    micro_batch_size: int | None = None,
) -> Doctor:
    """`with remat.doctor.watch(model, optimizer=opt) as doc:` around a training loop: an OOM inside
    is diagnosed (`doc.report`, with the allocated memory attributed to weights, grads, optimizer
    state and what each site of each layer saved), handed to `on_oom`, and re-raised unless
    `reraise=False`; `doc.attribute()` on request."""
    param = next(model.parameters(), None) if model is not None else None
    device = param.device if param is not None and param.device.type == "cuda" else None
    return Doctor(device, on_oom, reraise, plan_fn, micro_batch_size, model=model, optimizer=optimizer)
