"""Run real training steps of a recipe under a recompute plan and measure them.

Timings are CUDA-event medians over the steps after warm-up; memory peaks are taken over those
steps, once the optimizer state exists. An out-of-memory error is a result, not a crash.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat import doctor
from remat.bench.golden import LAYOUT_FIELDS
from remat.bench.result import BenchResult, MemoryBreakdown, OomInfo
from remat.bench.spec import BenchSpec
from remat.config.plan import Plan, PlanLike
from remat.memory import peak_during
from remat.memory.measure import gradients_persist
from remat.memory.meter import held_tensors, storage_bytes
from remat.parallel import max_over_ranks, mean_over_ranks, of_highest_rank, rank, world_size
from remat.run import build, step
from remat.run.optimizer import main_grad_bytes
from remat.run.step import MockData
from remat.sites.apply import offloader_of, warn_if_nothing_offloaded
from remat.sites.calls import after_optimizer_step

# A run's progress: (run name, steps done, steps in all, what to show: the last loss, or OOM).
OnStep = Callable[[str, int, int, str], None]


def plan_name(plan: PlanLike) -> str:
    """A short label: none, mlp, core_attn+layernorm, full_uniform_1, plan."""
    if plan is None:
        return "none"
    if isinstance(plan, Plan):
        return "plan"
    if plan.recompute_granularity == "selective":
        name = "+".join(plan.recompute_modules or [])
    elif plan.recompute_granularity == "full":
        name = f"full_{plan.recompute_method}_{plan.recompute_num_layers}"
    else:
        name = "none"
    if plan.cpu_offloading:
        return f"{name}+offload_{plan.cpu_offloading_num_layers}"
    if plan.fine_grained_activation_offloading:
        return f"{name}+offload_{'+'.join(plan.offload_modules)}"
    return name


def _plan_record(plan: PlanLike) -> dict[str, Any]:
    if plan is None:
        return {}
    return plan.to_dict() if isinstance(plan, Plan) else plan.to_megatron()


class _Clock:
    """CUDA events on GPU (no sync inside a step); wall clock on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass
class _Steps:
    step: list[float] = field(default_factory=list)
    fwd_bwd: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    cpu_peak: int | None = None  # counted tensor bytes, where there is no CUDA allocator
    host_peak: int | None = None  # offloaded bytes held on the host at once, over the steady steps


def _iteration(
    model: nn.Module, spec: BenchSpec, data: MockData, optimizer: torch.optim.Optimizer | None, clock: _Clock
) -> tuple[torch.Tensor, Any, Any, Any]:
    """One iteration: every micro-batch's forward and backward, then the optimizer. Returns the
    loss (on the device, unsynchronized) and the clock marks at start, after backward, at end."""
    start = clock.mark()
    total = step.forward_backward(model, data, spec.micro_batches)
    mid = clock.mark()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_optimizer_step(model)
    return total, start, mid, clock.mark()


def _train(
    model: nn.Module, spec: BenchSpec, on_step: Callable[[int, float], None]
) -> tuple[_Steps, torch.optim.Optimizer | None]:
    data = MockData(spec)
    optimizer = step.make_optimizer(model, spec)
    clock, steps = _Clock(spec.device), _Steps()
    cuda = spec.device.startswith("cuda")
    offloader = offloader_of(model)
    for i in range(spec.max_steps):
        if i == spec.warmup_steps and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if i == spec.warmup_steps and offloader is not None:
            offloader.reset_stats()
        wall0 = time.perf_counter()
        total, start, mid, end = _iteration(model, spec, data, optimizer, clock)
        steps.losses.append(mean_over_ranks(total).item())  # the one host sync of a step
        steps.wall.append(time.perf_counter() - wall0)
        steps.step.append(clock.seconds(start, end))
        steps.fwd_bwd.append(clock.seconds(start, mid))
        on_step(i, steps.losses[-1])
    if not cuda:  # no allocator statistics: one more step with every tensor counted
        static = storage_bytes(held_tensors(model, optimizer))
        steps.cpu_peak = static + peak_during(lambda: _iteration(model, spec, data, optimizer, clock))[1]
    if offloader is not None:
        steps.host_peak = offloader.stats().peak_host_bytes
    return steps, optimizer


def _breakdown(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, spec: BenchSpec, peak: int
) -> MemoryBreakdown:
    weights = step.tensor_bytes(model.parameters())
    main_grads = main_grad_bytes(optimizer)  # held by the optimizer through the step
    grads = main_grads or step.tensor_bytes(p for p in model.parameters() if p.requires_grad)
    optim = step.optimizer_state_bytes(optimizer)
    # Gradients built during backward are part of what the rest of the peak holds.
    persist = bool(main_grads) or gradients_persist(optimizer, spec.micro_batches)
    activations = max(peak - weights - optim - (grads if persist else 0), 0)
    return MemoryBreakdown(weights, grads, optim, activations, grads_persist=persist)


def run_shape(spec: BenchSpec) -> dict[str, Any]:
    """The `shape` a result of this spec records, known before it runs."""
    layout = spec.layout
    sizes = (layout.dp, layout.tp, int(layout.sequence_split > 1), layout.pp, layout.virtual, layout.cp, layout.ep)
    return dict(
        **spec.model_config.record(),
        **{key: size for key, size in zip(LAYOUT_FIELDS, sizes, strict=True) if size > 1},
        micro_batch_size=spec.micro_batch_size,
        global_batch_size=spec.global_batch_size or spec.micro_batch_size,
        max_steps=spec.max_steps,
        task=spec.task,
        compute_dtype=spec.precision.compute_dtype,
        compile=spec.compile,
    )


def _base_record(spec: BenchSpec, plan: PlanLike, name: str | None) -> dict[str, Any]:
    gpu = torch.cuda.get_device_name() if spec.device.startswith("cuda") else "cpu"
    return dict(
        name=name or plan_name(plan),
        recipe=spec.recipe,
        config=_plan_record(plan),
        shape=run_shape(spec),
        device=spec.device.split(":")[0],
        gpu=gpu,
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=spec.command,
    )


def run_bench(
    spec: BenchSpec,
    plan: PlanLike = None,
    *,
    model: nn.Module | None = None,
    name: str | None = None,
    on_step: OnStep | None = None,
    on_oom: Callable[[torch.cuda.OutOfMemoryError], Any] | None = None,
) -> BenchResult:
    """Train `spec.max_steps` steps under `plan` and measure them. An out-of-memory error is a
    result (status "oom"), after which the memory it held is released; `on_oom` sees the error
    first, while the failed step's tensors are alive (remat doctor's `Doctor.observe`)."""
    model = model or build.build_model(spec)
    build.reset_parameters(spec, model)  # every run of a sweep starts from the same weights
    model.train()
    build.apply_plan(spec, model, plan)
    record = _base_record(spec, plan, name)
    report = on_step or (lambda *args: None)
    report(record["name"], 0, spec.max_steps, "")
    oom: OomInfo | None = None
    try:
        steps, optimizer = _train(
            model, spec, lambda i, loss: report(record["name"], i + 1, spec.max_steps, f"loss {loss:.4f}")
        )
    except torch.cuda.OutOfMemoryError as e:
        # measured while the failed step's tensors are still referenced by the traceback
        state = doctor.oom_state(e)  # this process's GPU: under torchrun, this rank's
        allocated, reserved = (
            (state.allocated, state.reserved)
            if state is not None
            else (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        )
        oom = OomInfo(allocated, reserved, str(e).split("\n")[0], *_place(spec), allocator=state)
        if on_oom is not None:
            on_oom(e)
    except (RuntimeError, MemoryError) as e:  # the CPU allocator's OOM is a plain RuntimeError
        if not _host_out_of_memory(e):
            raise
        oom = OomInfo(None, None, str(e).split("\n")[0] or type(e).__name__, *_place(spec))
    if oom is not None:
        step.release_memory(model)  # outside the except block, so the traceback's frames are gone
        report(record["name"], spec.max_steps, spec.max_steps, "OOM")
        return BenchResult(status="oom", oom=oom, **record)
    warn_if_nothing_offloaded(model)
    result = _measured(spec, model, steps, optimizer, record)
    del optimizer
    step.release_memory(model)
    return result


def _measured(
    spec: BenchSpec, model: nn.Module, steps: _Steps, optimizer: torch.optim.Optimizer | None, record: dict[str, Any]
) -> BenchResult:
    """The result of steps run to the end: steady-state times, throughput and the peak memory of
    the rank whose peak is the highest, with that rank's breakdown of it."""
    cuda = spec.device.startswith("cuda")
    config = spec.model_config
    steady = slice(spec.warmup_steps, None)
    step_s, fwd_bwd_s = statistics.median(steps.step[steady]), statistics.median(steps.fwd_bwd[steady])
    sequences = spec.micro_batch_size * spec.micro_batches
    # the model's FLOPs over the GPUs of one copy of it (a pipeline's stages)
    flops = spec.family.flops(config, config.seq_length, sequences) / spec.layout.model_parallel
    assert cuda or steps.cpu_peak is not None  # _train counts it where there is no CUDA allocator
    # the rank with the highest peak, and that rank's breakdown of it
    local_peak = torch.cuda.max_memory_allocated() if cuda else steps.cpu_peak or 0
    local = _breakdown(model, optimizer, spec, local_peak)
    peak, (weights, grads, optim, activations) = of_highest_rank(
        local_peak, [local.weights, local.grads, local.optimizer, local.activations]
    )
    return BenchResult(
        status="ok",
        step_time_s=step_s,
        fwd_bwd_time_s=fwd_bwd_s,
        tflops_per_gpu=flops / step_s / 1e12,
        tflops_fwd_bwd=flops / fwd_bwd_s / 1e12,
        tokens_per_s_per_gpu=sequences * config.seq_length / step_s,
        peak_allocated_bytes=peak,
        peak_reserved_bytes=max_over_ranks(torch.cuda.max_memory_reserved()) if cuda else None,
        peak_host_bytes=None if steps.host_peak is None else max_over_ranks(steps.host_peak),
        memory=MemoryBreakdown(weights, grads, optim, activations, local.grads_persist),
        losses=steps.losses,
        step_times_s=steps.step[steady],
        harness_overhead=max(0.0, 1 - sum(steps.step[steady]) / sum(steps.wall[steady])),
        **record,
    )


def _place(spec: BenchSpec) -> tuple[int | None, dict[str, int] | None]:
    """Under torchrun, this rank and its place on the pp x dp x cp x tp mesh; (None, None) in one process."""
    if world_size() == 1:
        return None, None
    here = rank()
    return here, spec.layout.coordinates(here)._asdict()


def _host_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or "can't allocate memory" in str(error)


def sweep(
    spec: BenchSpec,
    plans: Sequence[tuple[str, PlanLike]],
    *,
    on_step: OnStep | None = None,
    into: list[BenchResult] | None = None,
) -> list[BenchResult]:
    """Run every (name, plan) on one model in one process; OOMs are results, the rest go on. Each
    result is appended to `into` as it finishes (what an interrupted sweep has measured)."""
    results = [] if into is None else into
    model = build.build_model(spec)
    for name, plan in plans:
        results.append(run_bench(spec, plan, model=model, name=name, on_step=on_step))
    return results
