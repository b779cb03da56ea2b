"""remat doctor: tell a fragmentation OOM from a capacity OOM and say what to change; and the reference
skill's failure-diagnosis table as checks on bench and sweep results.

A CUDA allocation fails when no free block inside the reserved segments holds the request and the
device cannot give a new segment. If the bytes exist but in pieces (reserved far above allocated),
the fix is an allocator setting; if allocated memory itself reaches the limit, only using less (a
recompute plan, a smaller micro-batch, more GPUs) helps. The allocator's numbers tell which.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch

from remat.bench.result import BenchResult
from remat.config import (
    ConfigError,
    Problem,
    format_bytes,
    read_file,
    recorded_config,
    rule_cpu_offload_not_with_pipeline,
    rule_full_recompute_graph_scope,
)
from remat.memory.attribution import Attribution, Attributor
from remat.planner import NoPlanFits
from remat.planning import PlanResult

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
# Requests above this go to the large pool; the small pool's holes (<= 1 MiB blocks) cannot serve them.
SMALL_POOL_MAX = 1 << 20


# --- what a failure captures -----------------------------------------------------------------------


@dataclass(frozen=True)
class AllocatorState:
    """The caching allocator at a failure (or on request): bytes allocated and reserved, the limit,
    the failed request, and how the free bytes inside reserved segments are split."""

    allocated: int
    reserved: int
    limit: int  # device memory, or its per-process fraction
    request: int | None = None
    largest_free_block: int | None = None  # None: not known (an OOM message alone)
    segments: int = 0
    free_blocks: int = 0
    device_free: int | None = None  # free on the device (cudaMemGetInfo): other processes count
    expandable: bool = False  # segments already grow (expandable_segments is on)

    @property
    def gap(self) -> int:
        """Reserved but unallocated: cached holes inside this process's segments."""
        return max(self.reserved - self.allocated, 0)

    @property
    def headroom(self) -> int:
        """What the allocator could still reserve: up to the limit, and no more than the device has free."""
        room = max(self.limit - self.reserved, 0)
        return room if self.device_free is None else min(room, self.device_free)

    @property
    def available(self) -> int:
        """The most this allocator can hold: what it reserved plus what it could still reserve."""
        return self.reserved + self.headroom

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[str, Any], stats: Mapping[str, Any], limit: int,
                      request: int | None = None, *, device: int | None = None,
                      device_free: int | None = None) -> AllocatorState:
        """From `torch.cuda.memory._snapshot()` (or a pickle/JSON of it) and `memory_stats()` (may be
        empty: the blocks are counted instead)."""
        segments = [s for s in snapshot.get("segments", [])
                    if device is None or s.get("device", device) == device]
        blocks = [b for s in segments for b in s.get("blocks", [])]
        allocated = stats.get("allocated_bytes.all.current",
                              sum(b["size"] for b in blocks if b["state"] == "active_allocated"))
        reserved = stats.get("reserved_bytes.all.current", sum(s["total_size"] for s in segments))
        # Private pools (CUDA graphs) and, for a large request, the small pool cannot serve the request.
        serving = [s for s in segments if _default_pool(s)
                   and not (s.get("segment_type") == "small" and (request or 0) > SMALL_POOL_MAX)]
        holes = [run for s in serving for run in _free_runs(s.get("blocks", []))]
        return cls(allocated=allocated, reserved=reserved, limit=limit, request=request,
                   largest_free_block=max(holes, default=0), segments=len(segments),
                   free_blocks=sum(1 for s in segments for _ in _free_runs(s.get("blocks", []))),
                   device_free=device_free, expandable=any(s.get("is_expandable") for s in segments))

    @classmethod
    def from_oom_message(cls, message: str) -> AllocatorState:
        """From the text of a CUDA OOM error alone (a log line): no block sizes, but the allocation failed,
        so no free block held the request."""
        oom = parse_oom_message(message)
        if oom.limit is None or oom.allocated is None or oom.reserved is None:
            raise ValueError("the message does not give the device capacity, allocated and reserved bytes; "
                             "pass a snapshot (torch.cuda.memory._dump_snapshot) instead")
        return cls(allocated=oom.allocated, reserved=oom.reserved, limit=oom.limit, request=oom.request,
                   device_free=oom.free)


def _default_pool(segment: Mapping[str, Any]) -> bool:
    return tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)


def _free_runs(blocks: Iterable[Mapping[str, Any]]) -> Iterator[int]:
    """Sizes of contiguous free ("inactive") runs of blocks, in address order within one segment."""
    run = 0
    for block in blocks:
        if block["state"] == "inactive":
            run += block["size"]
        elif run:
            yield run
            run = 0
    if run:
        yield run


def capture(device: torch.device | int | str | None = None, request_bytes: int | None = None) -> AllocatorState:
    """The allocator's state now on a CUDA device; RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: there is no allocator state to capture")
    chosen = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    index = torch.cuda.current_device() if chosen.index is None else chosen.index
    free, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(index)  # newer torch only
    return AllocatorState.from_snapshot(torch.cuda.memory._snapshot(), torch.cuda.memory_stats(index),
                                        int(total * fraction), request_bytes, device=index, device_free=free)


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """A snapshot written by `torch.cuda.memory._dump_snapshot` (a pickle: load only your own) or as JSON."""
    p = Path(path)
    snapshot = read_file(p, json.loads, "JSON") if p.suffix.lower() == ".json" else read_file(p, pickle.loads, "pickle")
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise ConfigError([Problem(str(p), "is not a memory snapshot (no 'segments' list); write one with "
                                           "torch.cuda.memory._dump_snapshot")])
    if (flaw := _segments_flaw(snapshot["segments"])) is not None:
        raise ConfigError([Problem(str(p), f"is not a memory snapshot ({flaw}); write one with "
                                           "torch.cuda.memory._dump_snapshot")])
    return snapshot


def _segments_flaw(segments: list[Any]) -> str | None:
    """The first place where `segments` lacks what classifying reads, or None."""
    for i, segment in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(segment, dict) or not isinstance(segment.get("total_size"), int):
            return f"{where} has no integer 'total_size'"
        blocks = segment.get("blocks", [])
        if not isinstance(blocks, list):
            return f"{where}.blocks is not a list"
        for j, block in enumerate(blocks):
            if not (isinstance(block, dict) and isinstance(block.get("size"), int)
                    and isinstance(block.get("state"), str)):
                return f"{where}.blocks[{j}] has no integer 'size' and 'state' name"
    return None


# --- the OOM message ------------------------------------------------------------------------------

_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB|TiB)"
_UNIT = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# Each field as torch >= 2.1 writes it, then as torch < 2.1 did ("(GPU 0; 79.15 GiB total capacity; ...)").
_FIELDS = {
    "request": (rf"Tried to allocate {_SIZE}",),
    "capacity": (rf"total capacity of {_SIZE}", rf"{_SIZE} total capacity"),
    "free": (rf"of which {_SIZE} is free", rf"{_SIZE} free"),
    "allowed": (rf"{_SIZE} allowed",),  # set_per_process_memory_fraction
    "allocated": (rf"{_SIZE} is allocated by PyTorch", rf"{_SIZE} already allocated"),
    "unallocated": (rf"{_SIZE} is reserved by PyTorch but unallocated",),
    "reserved": (rf"{_SIZE} reserved in total by PyTorch",),
}


@dataclass(frozen=True)
class OomMessage:
    """The numbers of a CUDA out-of-memory message (to the message's two decimals); None: not given."""

    request: int | None
    capacity: int | None
    free: int | None
    allowed: int | None = None
    allocated: int | None = None
    reserved: int | None = None

    @property
    def limit(self) -> int | None:
        return self.allowed if self.allowed is not None else self.capacity


def parse_oom_message(message: str) -> OomMessage:
    """Read 'CUDA out of memory. Tried to allocate 2.00 GiB ...' in the formats of torch 1.x-2.0 and 2.1+."""
    found: dict[str, int | None] = {}
    for name, patterns in _FIELDS.items():
        match = next(filter(None, (re.search(p, message) for p in patterns)), None)
        found[name] = round(float(match.group(1)) * _UNIT[match.group(2)]) if match else None
    unallocated = found.pop("unallocated")
    if found["reserved"] is None and found["allocated"] is not None and unallocated is not None:
        found["reserved"] = found["allocated"] + unallocated  # torch >= 2.1 gives the split, not the sum
    return OomMessage(**found)


# --- classification ----------------------------------------------------------------------------------

Kind = Literal["fragmentation", "capacity", "fits"]


@dataclass(frozen=True)
class Diagnosis:
    kind: Kind
    state: AllocatorState
    explanation: str

    def evidence(self) -> dict[str, int | None]:
        s = self.state
        return {"allocated": s.allocated, "reserved": s.reserved, "gap": s.gap,
                "largest free block": s.largest_free_block, "request": s.request, "limit": s.limit,
                "headroom": s.headroom}

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
        return Diagnosis("fragmentation", s, (
            f"{f(s.gap)} reserved but unallocated (+{f(s.headroom)} unreserved) would hold the {f(r)} request,"
            f" but {hole}: the memory is there, in pieces"))
    if s.allocated + r <= s.available:  # the gap is under MIN_FRAGMENTATION_GAP: ordinary slack
        return Diagnosis("capacity", s, (
            f"allocated {f(s.allocated)} + the {f(r)} request leaves {f(s.available - s.allocated - r)} of the"
            f" {f(s.available)} the allocator can have; the {f(s.gap)} in holes is ordinary slack (under"
            f" {MIN_FRAGMENTATION_GAP:.0%} of the limit): the step needs less memory"))
    outside = s.limit - s.available
    other = f"; {f(outside)} of the limit is held outside this allocator" if outside > s.gap else ""
    return Diagnosis("capacity", s, (
        f"allocated {f(s.allocated)} + the {f(r)} request exceeds the {f(s.available)}"
        f" the allocator can have{other}: the step needs less memory, not a better allocator"))


def _classify_without_request(s: AllocatorState) -> Diagnosis:
    f = format_bytes
    if s.allocated >= (1 - NEAR_LIMIT) * s.limit:
        return Diagnosis("capacity", s, f"allocated {f(s.allocated)} is within {NEAR_LIMIT:.0%} of the"
                                        f" {f(s.limit)} limit")
    if (s.gap >= MIN_FRAGMENTATION_GAP * s.limit and s.largest_free_block is not None
            and s.largest_free_block < MAX_HOLE_SHARE * s.gap):
        return Diagnosis("fragmentation", s, f"{f(s.gap)} reserved but unallocated, in {s.free_blocks} holes"
                                             f" of at most {f(s.largest_free_block)}")
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


def recommend(diagnosis: Diagnosis, *, plan_fn: PlanFn | None = None,
              micro_batch_size: int | None = None, run_flags: str | None = None) -> list[Recommendation]:
    """What to change, best first: the allocator setting for fragmentation; for capacity the fastest
    recompute plan that fits (from `plan_fn`, or the `remat plan` command to find it, with the
    run's `run_flags` when known), then a smaller micro-batch and more parallelism when no plan fits."""
    s = diagnosis.state
    if diagnosis.kind == "fits":
        return []
    if diagnosis.kind == "fragmentation" and not s.expandable:
        largest = "?" if s.largest_free_block is None else format_bytes(s.largest_free_block)
        return [Recommendation(
            "let segments grow instead of leaving holes (set before the process starts)", EXPANDABLE_SEGMENTS,
            f"{format_bytes(s.gap)} reserved but unallocated, largest free block {largest}, request "
            f"{format_bytes(s.request or 0)}")]
    budget = int(s.available * PLAN_BUDGET_SHARE)
    need = s.allocated + (s.request or 0)
    if plan_fn is None:
        # sized by how far the need is over the budget: none when it is not (fragmentation with
        # expandable segments already on), where a plan that leaves more room is the answer
        shrink = _shrink("allocated + the request (a lower bound: the step failed part way)", need, budget,
                         micro_batch_size) if need > budget else []
        return [Recommendation(
            "find the fastest recompute plan that fits", f"remat plan {run_flags or _RUN_FLAGS} "
            f"--memory-budget {budget / 2**30:.1f}GiB -o plan.yaml --verify",
            f"{PLAN_BUDGET_SHARE:.0%} of the {format_bytes(s.available)}"
            " this allocator can have; the planner predicts peak allocated memory"), *shrink]
    try:
        result = plan_fn(budget)
    except NoPlanFits as nofit:
        return _shrink("the lowest peak any plan reaches", nofit.lowest.peak_bytes, budget, micro_batch_size)
    return [_plan_recommendation(result)]


def _plan_recommendation(result: PlanResult) -> Recommendation:
    p = result.prediction
    why = (f"predicted peak {format_bytes(p.peak_bytes)} (in {p.peak_window}) under the "
           f"{format_bytes(result.budget_bytes)} budget, step {p.step_time_s * 1e3:.1f} ms")
    if result.config is None:
        return Recommendation("run the per-layer plan (save it with result.plan.save('plan.yaml'))",
                              "remat bench --config plan.yaml", why, result)
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
        out.append(Recommendation(
            "lower the micro-batch size (raise gradient accumulation to keep the global batch)", f"-mb {mb}",
            f"{gap}; activations scale with the micro-batch, weights do not: check -mb {mb} with remat plan"))
    n = max(2, 1 << math.ceil(math.log2(ratio)))
    if n > MAX_SPLIT:  # no parallel layout helps: the budget or the device size given is likely wrong
        out.append(Recommendation(
            "check the memory the device has", "--limit / --memory-budget",
            f"{gap}: more than {MAX_SPLIT} GPUs' worth; check the device size or budget given before "
            f"changing the model's layout"))
        return out
    out.append(Recommendation(
        f"spread the model over {n}x the GPUs", f"-tp {n} --sequence_parallel, or -pp {n}, or -cp {n}",
        f"{gap}; tp+sp splits weights and activations, pp the layers, cp the sequence: `remat estimate` "
        f"with these flags predicts each before launching"))
    return out


# --- watching a training loop ------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    diagnosis: Diagnosis
    recommendations: list[Recommendation]
    message: str = ""  # the OOM's first line, when there was one
    attribution: Attribution | None = None  # who held the allocated memory (when the model was watched)

    def __str__(self) -> str:
        lines = [f"remat doctor: {self.diagnosis}"]
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


def diagnose(device: torch.device | int | str | None = None, request_bytes: int | None = None, *,
             plan_fn: PlanFn | None = None, micro_batch_size: int | None = None) -> Report:
    """Capture the allocator now, classify, recommend."""
    diagnosis = classify(capture(device, request_bytes))
    return Report(diagnosis, recommend(diagnosis, plan_fn=plan_fn, micro_batch_size=micro_batch_size))


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
        """Diagnose an OOM: the allocator's state when CUDA is there, else the message's numbers."""
        message = str(error)
        oom = parse_oom_message(message)
        try:
            state = capture(self.device, oom.request)
        except RuntimeError:
            state = AllocatorState.from_oom_message(message)
        if oom.allowed is not None and oom.allowed < state.limit:  # older torch cannot read the fraction back
            state = dataclasses.replace(state, limit=oom.allowed)
        diagnosis = classify(state)
        self.report = Report(diagnosis, recommend(diagnosis, plan_fn=self.plan_fn,
                                                  micro_batch_size=self.micro_batch_size,
                                                  run_flags=self.run_flags),
                             message.split("\n")[0], self.attribute())
        if self.on_oom is not None:
            self.on_oom(self.report)
        return self.report

    def __enter__(self) -> Doctor:
        if self.model is not None:
            self._attributor = Attributor(self.model, self.optimizer).__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
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


def watch(model: torch.nn.Module | None = None, *, optimizer: torch.optim.Optimizer | None = None,
          on_oom: Callable[[Report], Any] | None = print, reraise: bool = True, plan_fn: PlanFn | None = None,
          micro_batch_size: int | None = None) -> Doctor:
    """`with remat.doctor.watch(model, optimizer=opt) as doc:` around a training loop: an OOM inside
    is diagnosed (`doc.report`, with the allocated memory attributed to weights, grads, optimizer
    state and what each site of each layer saved), handed to `on_oom`, and re-raised unless
    `reraise=False`; `doc.attribute()` on request."""
    param = next(model.parameters(), None) if model is not None else None
    device = param.device if param is not None and param.device.type == "cuda" else None
    return Doctor(device, on_oom, reraise, plan_fn, micro_batch_size, model=model, optimizer=optimizer)


# --- the skill's failure-diagnosis table, on bench and sweep results ----------------------------------

# Every threshold the checks use, with where it comes from.
MLP_SLOWDOWN = 0.15  # the skill's ">15% GPU utilization drop" (-16.4% measured on Llama-3-70B)
LARGE_FFN = 3.0  # ffn_hidden / hidden at or above this is a large FFN (Llama-3: 14336/4096 = 28672/8192 = 3.5)
LAYERNORM_PEAK_MOVE = 0.01  # a layernorm-only change moving the peak less than this moved nothing
SLOWER_MARGIN = 0.005  # slower than this is beyond the run-to-run noise of a median step time


@dataclass(frozen=True)
class Finding:
    check: str
    symptom: str
    cause: str
    confirmed_by: str  # the numbers the check used
    fix: str


def _modules(result: BenchResult) -> frozenset[str] | None:
    """The selective labels of a plain recompute config (empty: none); None for full recompute,
    offloading or per-layer plans, which the module comparisons leave out."""
    c = result.config
    if c.get("cpu_offloading") or c.get("fine_grained_activation_offloading") or "layers" in c:
        return None
    if c.get("recompute_granularity") == "selective":
        return frozenset(c.get("recompute_modules") or [])
    return frozenset() if c.get("recompute_granularity") is None else None


def _comparable(results: Sequence[BenchResult]) -> Iterator[dict[frozenset[str], BenchResult]]:
    """Results of one recipe, shape and GPU, by their selective labels."""
    groups: dict[str, dict[frozenset[str], BenchResult]] = {}
    for r in results:
        labels = _modules(r)
        if labels is not None:
            key = json.dumps([r.recipe, r.gpu, r.shape], sort_keys=True)
            groups.setdefault(key, {})[labels] = r
    yield from groups.values()


def _speed(r: BenchResult) -> tuple[float, str] | None:
    if r.status != "ok":
        return None
    if r.tflops_per_gpu is not None:
        return r.tflops_per_gpu, "TFLOP/s"
    return (r.tokens_per_s_per_gpu, "tokens/s") if r.tokens_per_s_per_gpu is not None else None


def check_mlp_slowdown(results: Sequence[BenchResult]) -> list[Finding]:
    findings = []
    for group in _comparable(results):
        base = group.get(frozenset())
        for labels, r in group.items():
            ffn, hidden = r.shape.get("ffn_hidden_size"), r.shape.get("hidden_size")
            fast, slow = _speed(base) if base else None, _speed(r)
            if "mlp" not in labels or not (fast and slow and ffn and hidden) or ffn / hidden < LARGE_FFN:
                continue
            drop = 1 - slow[0] / fast[0]
            if drop > MLP_SLOWDOWN:
                rest = ",".join(sorted(labels - {"mlp"}))
                offload = "" if r.config.get("pipeline_model_parallel_size", 1) > 1 else ", or offload (-ol N)"
                findings.append(Finding(
                    "mlp recompute cost", f"{r.name}: {drop:.1%} lower throughput than no recompute",
                    "mlp recompute reruns a large FFN in backward",
                    f"{r.name} {slow[0]:.4g} vs none {fast[0]:.4g} {slow[1]} (-{drop:.1%} > {MLP_SLOWDOWN:.0%});"
                    f" ffn/hidden {ffn}/{hidden} = {ffn / hidden:.2f} >= {LARGE_FFN:g}",
                    f"drop mlp ({f'--recompute_modules {rest}' if rest else 'no recompute'}), lower -mb"
                    f"{offload}; `remat plan --memory-budget` finds the cheapest plan that fits"))
    return findings


def _peak(r: BenchResult) -> int | None:
    return r.peak_allocated_bytes if r.status == "ok" else None


def check_layernorm_peak(results: Sequence[BenchResult]) -> list[Finding]:
    findings = []
    for group in _comparable(results):
        for labels, after in group.items():
            before = group.get(labels - {"layernorm"})
            if "layernorm" not in labels or before is None:
                continue
            fix = "recompute a module that holds more (mlp), or whole layers (-rl N); `remat plan` picks one"
            if before.status == after.status == "oom":
                findings.append(Finding(
                    "layernorm alone", f"{after.name}: still OOM after adding layernorm",
                    "layernorm activations are too small to move the peak",
                    f"{before.name} OOM at {format_bytes(before.oom.allocated_bytes)} allocated, {after.name} OOM at"
                    f" {format_bytes(after.oom.allocated_bytes)}" if before.oom and after.oom else "both OOM", fix))
                continue
            a, b = _peak(before), _peak(after)
            if a and b is not None and abs(a - b) / a < LAYERNORM_PEAK_MOVE:
                findings.append(Finding(
                    "layernorm alone", f"{after.name}: peak memory did not move after adding layernorm",
                    "layernorm activations are too small to move the peak",
                    f"peak {format_bytes(a)} ({before.name}) -> {format_bytes(b)} ({after.name}),"
                    f" {(b - a) / a:+.2%} (under {LAYERNORM_PEAK_MOVE:.0%})", fix))
    return findings


def _rule_findings(results: Sequence[BenchResult], rule: Any, check: str, symptom: str,
                   cause: str, facts: Callable[[Any], str]) -> list[Finding]:
    """A config.py rule run on each result's recorded config (results from other harnesses may hold
    configs remat itself refuses); the rule's message says what to change."""
    findings = []
    for r in results:
        if "layers" in r.config:  # a per-layer plan: no Megatron keys
            continue
        config = recorded_config(r.config)
        findings += [Finding(check, f"{r.name}: {symptom}", cause, facts(config), p.message) for p in rule(config)]
    return findings


def check_full_recompute_graphs(results: Sequence[BenchResult]) -> list[Finding]:
    return _rule_findings(
        results, rule_full_recompute_graph_scope, "full recompute + CUDA graphs",
        "AssertionError: full recompute is only supported with full iteration CUDA graph",
        "layer-level recompute with module-scoped graph capture",
        lambda c: (f"recompute_granularity={c.recompute_granularity}, cuda_graph_impl={c.facts.cuda_graph_impl},"
                   f" cuda_graph_scope={c.facts.cuda_graph_scope or '[] (whole layers)'}"))


def check_offload_pipeline(results: Sequence[BenchResult]) -> list[Finding]:
    return _rule_findings(
        results, rule_cpu_offload_not_with_pipeline, "CPU offload + pipeline",
        "ValueError: PP + CPU offloading", "cpu_offloading=True with pipeline_model_parallel_size > 1",
        lambda c: (f"cpu_offloading={c.cpu_offloading} ({c.cpu_offloading_num_layers} layers),"
                   f" pipeline_model_parallel_size={c.facts.pipeline_model_parallel_size}"))


def check_mlp_core_attn(results: Sequence[BenchResult]) -> list[Finding]:
    findings = []
    for group in _comparable(results):
        alone, both = group.get(frozenset({"mlp"})), group.get(frozenset({"mlp", "core_attn"}))
        if not (alone and both):
            continue
        fast, slow = _speed(alone), _speed(both)
        if not (fast and slow) or 1 - slow[0] / fast[0] <= SLOWER_MARGIN:
            continue
        a, b = _peak(alone), _peak(both)
        peaks = f"; peak {format_bytes(a)} -> {format_bytes(b)}" if a and b else ""
        findings.append(Finding(
            "mlp+core_attn", f"{both.name} slower than {alone.name}", "double recompute overhead",
            f"{both.name} {slow[0]:.4g} vs {alone.name} {fast[0]:.4g} {slow[1]} ({slow[0] / fast[0] - 1:+.1%},"
            f" beyond {SLOWER_MARGIN:.1%}){peaks}", "use --recompute_modules mlp alone"))
    return findings


def check_oom_kind(results: Sequence[BenchResult]) -> list[Finding]:
    """The skill's Llama-3-70B lesson: rule out fragmentation before recomputing more. Each OOM whose
    recorded message gives the allocator's numbers is classified."""
    findings = []
    for r in results:
        if r.oom is None:
            continue
        try:
            diagnosis = classify(AllocatorState.from_oom_message(r.oom.message))
        except ValueError:  # a message without the numbers (torch < 2.1 multi-line, or another harness)
            continue
        advice = recommend(diagnosis)
        fix = advice[0].setting if advice else "nothing: the request fits now"
        findings.append(Finding("OOM kind", f"{r.name}: out of memory", f"{diagnosis.kind}",
                                diagnosis.explanation, fix))
    return findings


CHECKS: tuple[Callable[[Sequence[BenchResult]], list[Finding]], ...] = (
    check_oom_kind, check_mlp_slowdown, check_layernorm_peak, check_full_recompute_graphs,
    check_offload_pipeline, check_mlp_core_attn,
)


def check_results(results: Sequence[BenchResult]) -> list[Finding]:
    """Every check of the skill's failure-diagnosis table on a bench or sweep's results."""
    return [finding for check in CHECKS for finding in check(results)]


def load_results(path: str | Path) -> list[BenchResult]:
    """`remat bench --json` (one result) or `remat sweep --json` (a list)."""
    data = read_file(Path(path), json.loads, "JSON")
    if data == []:
        raise ConfigError([Problem(str(path), "holds no results; pass what `remat bench --json` or `remat sweep "
                                              "--json` wrote")])
    try:
        return [BenchResult.from_dict(d) for d in (data if isinstance(data, list) else [data])]
    except (TypeError, AttributeError) as err:
        raise ConfigError([Problem(str(path), f"is not a remat bench result ({err}); pass what `remat bench "
                                              "--json` or `remat sweep --json` wrote")]) from None
