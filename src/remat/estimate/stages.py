"""estimate(): a recipe's peak memory per pipeline stage and its step time, from shapes alone.

The trace of `remat plan` runs here on the meta device: tensors have shapes and storage sizes but
no data, so a training step of a full-size model takes a fraction of a second on a CPU and every
number comes from the same window model the planner uses. What one GPU of a parallel run holds:

- tensor parallel: the family's shard (heads, query groups, FFN and padded vocabulary divided by
  tp); sequence parallel also runs norms and residuals on seq/tp tokens, with torch's all-gather
  before attention and MLP and reduce-scatter after them emulated by shape; with
  distribute_saved_activations, full recompute keeps 1/tp of each range's input (gathered back
  by shape for its replay);
- context parallel: seq/cp tokens per rank;
- pipeline parallel: the stage's layers (with virtual stages, its interleaved model chunks), the
  first stage with the embedding, the last with the final norm and loss head; under 1F1B stage k
  holds the saved activations of pp - k micro-batches (Megatron's interleaved schedule, more with
  virtual stages).

On the meta device SDPA would take its unfused path, so attention runs the fused kernel the
target would (cuDNN on CUDA, flash on CPU), which saves what that kernel saves; the family swaps
in pieces that allocate what the target's other fused kernels allocate. What belongs to no
tensor is added by the target's shape: cuBLAS's workspace for each thread that runs GEMMs. Step
time is the counted FLOPs at an assumed sustained rate (FP8 matmuls at twice it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from remat.config.model_sites import ModelSites
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan, PlanLike, check_plan, plan_pipeline_problems
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError, Problem, advise, warn
from remat.core.sizes import format_bytes
from remat.estimate.kernels import AdamWState, begin_state, target_kernels
from remat.estimate.spec import EstimateSpec, estimate_threshold_problems
from remat.memory.measure import Stepper, gradients_persist, trace, training_state_kept
from remat.memory.meter import storage_bytes
from remat.memory.prediction import Trace, offload_prediction_problems, resolve, unmeasured_problems
from remat.memory.windows import PlanningProblem
from remat.parallel.data_parallel import gathered_bytes
from remat.parallel.parallelize import parallelize_by_shape, sharded_state_bytes
from remat.run.build import distributes_saved_inputs
from remat.run.fp8 import to_fp8
from remat.run.optimizer import OptimizerPrecision, main_grad_bytes, make
from remat.run.spec import RunSpec, available_host_bytes
from remat.run.step import optimizer_state_bytes
from remat.sites.apply import find_sites, nothing_offloaded_advice


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage's peak allocated memory, by component, and its time per micro-batch."""

    stage: int
    layers: int
    in_flight: float  # micro-batches whose saved activations the stage holds at its peak
    weights: int
    grads: int  # gradients held from the step's start (accumulation); 0 when they are made fresh
    optimizer_state: int
    activations: int  # saved for backward, all micro-batches in flight (their stage inputs too)
    peak: int
    peak_window: str
    micro_batch_time_s: float
    host: int = 0  # offloaded to host memory, all micro-batches in flight
    workspaces: int = 0  # cuBLAS's, held from the first GEMM on

    @property
    def other(self) -> int:
        """Working memory of the peak window: recompute replays, the loss head, new gradients."""
        return self.peak - self.weights - self.grads - self.optimizer_state - self.activations - self.workspaces


@dataclass(frozen=True)
class Estimate:
    name: str
    stages: tuple[StageEstimate, ...]
    step_time_s: float  # 1F1B: micro-batches x the slowest stage's micro-batch time, plus the fill and drain

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peak_bytes": self.peak,
            "step_time_s": self.step_time_s,
            "stages": [{**dataclasses.asdict(s), "other": s.other} for s in self.stages],
        }


def estimate(
    spec: EstimateSpec,
    plans: Sequence[tuple[str, PlanLike]] = (("none", None),),
    progress: Callable[[str], None] | None = None,
) -> list[Estimate]:
    """Predict every plan's memory per stage and step time for `spec`, one trace per kind of stage.

    A plan is a RecomputeConfig (lowered onto each stage's layers as Megatron does), a per-layer
    Plan over all layers, or None.
    """
    pp = spec.layout.pp
    model_sites = find_sites(spec.family.build(spec.model_config, device="meta")).model_sites
    problems = [
        p for _, plan in plans if isinstance(plan, Plan) for p in _plan_problems(plan, model_sites, spec.layout)
    ]
    if problems:  # every error before the first trace
        raise ConfigError(problems)
    lowered = [_lowered(plan, model_sites) for _, plan in plans]
    offloading = [p for p in lowered if p.offloads()]
    thresholds = {p.min_offloaded_tensor_size for p in offloading}
    if problems := list(estimate_threshold_problems(thresholds)):
        raise ConfigError(problems)
    stage_plans = [[rank_plan(plan, spec, k) for k in range(pp)] for _, plan in plans]
    rank_sites = [
        dataclasses.replace(model_sites, labels=tuple(model_sites.labels[i] for i in stage_layers(spec, k)))
        for k in range(pp)
    ]
    problems = [p for whole in lowered for p in unmeasured_problems(whole, model_sites, bool(offloading))]
    stages_lowered = [
        _lowered(stage, sites) for per_stage in stage_plans for stage, sites in zip(per_stage, rank_sites)
    ]
    problems += [p for s in stages_lowered for p in offload_prediction_problems(s.layers, s.full_recompute)]
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    offload = thresholds.pop() if thresholds else None
    # a plan that splits full recompute's kept inputs over tp ranks runs another model: traced apart
    traced = {
        split: trace_stages(spec, progress, offload, split_inputs=split)
        for split in sorted({distributes_saved_inputs(plan) for _, plan in plans})
    }
    out = []
    for (name, plan), per_stage, whole in zip(plans, stage_plans, lowered):
        result = predict_stages(name, spec, traced[distributes_saved_inputs(plan)], per_stage)
        out.append(result)
        if whole.offloads():  # as a run under the plan would say after its steps
            advise(nothing_offloaded_advice(sum(s.host for s in result.stages), whole.min_offloaded_tensor_size))
    return out


def trace_stages(
    spec: EstimateSpec,
    progress: Callable[[str], None] | None = None,
    offload_threshold: int | None = None,
    device: str = "meta",
    split_inputs: bool = False,
) -> list[StageTrace]:
    """Each pipeline rank's trace (`trace_stage`), traced once per kind: first, middle or last,
    with the same kinds of layers (an MoE model's dense first layers make a middle rank apart)."""
    pp = spec.layout.pp
    labels = find_sites(spec.family.build(spec.model_config, device="meta")).model_sites.labels
    kinds = [(k == 0, k == pp - 1, tuple(labels[i] for i in stage_layers(spec, k))) for k in range(pp)]
    first_of_kind = {kind: k for k, kind in reversed(list(enumerate(kinds)))}
    traced = {
        kind: trace_stage(spec, k, progress, offload_threshold, device, split_inputs)
        for kind, k in sorted(first_of_kind.items(), key=lambda item: item[1])
    }
    return [traced[kind] for kind in kinds]


def predict_stages(
    name: str, spec: EstimateSpec, traced: Sequence[StageTrace], stage_plans: Sequence[PlanLike]
) -> Estimate:
    """Each rank's memory under its plan, and the step's time under the layout's schedule."""
    stages = [t.predict(k, plan, spec) for k, (t, plan) in enumerate(zip(traced, stage_plans))]
    return Estimate(
        name, tuple(stages), spec.layout.step_time([s.micro_batch_time_s for s in stages], spec.micro_batches)
    )


def stage_layers(spec: EstimateSpec, stage: int) -> tuple[int, ...]:
    """The whole model's layers pipeline rank `stage` holds: its virtual stages' back to back."""
    return spec.layout.rank_layers(spec.model_config.num_layers, stage)


# ---- one rank's shapes ----


@dataclass(frozen=True)
class StageTrace:
    trace: Trace
    weights: int
    optimizer_state: int
    input_bytes: int  # the hidden states a later stage receives and holds until its backward
    output_bytes: int  # the hidden states a stage sends on: freed once sent, as Megatron does
    grads: int  # gradients held through the step: main gradients, or the weights' own across micro-batches
    # FSDP2: its sharded training state and gathered parameters, less the whole model's state the trace held
    sharding: int = 0

    def predict(self, stage: int, plan: PlanLike, spec: EstimateSpec) -> StageEstimate:
        p = self.trace.predict(plan)
        flight = spec.layout.in_flight(stage, spec.micro_batches)
        per_micro_batch = p.saved_bytes + self.input_bytes - self.output_bytes
        return StageEstimate(
            stage=stage,
            layers=self.trace.model_sites.num_layers,
            in_flight=flight,
            weights=self.weights,
            grads=self.grads,
            optimizer_state=self.optimizer_state,
            activations=round(flight * per_micro_batch),
            peak=round(p.peak_bytes + self.input_bytes + (flight - 1) * per_micro_batch)
            + spec.workspace_bytes
            + self.sharding,
            peak_window=p.peak_window,
            micro_batch_time_s=p.step_time_s,
            host=round(flight * p.host_bytes),
            workspaces=spec.workspace_bytes,
        )

    def problem(self, stage: int, spec: EstimateSpec) -> PlanningProblem:
        """What the planner solves for this stage: its windows hold, besides one micro-batch's
        step, its input and the other micro-batches in flight, whose saved bytes every choice
        lowers too. The peak of any plan is `predict`'s."""
        flight = spec.layout.in_flight(stage, spec.micro_batches)
        per_micro_batch = self.trace.baseline_saved_bytes + self.input_bytes - self.output_bytes
        return dataclasses.replace(
            self.trace.problem(),
            others_in_flight=flight - 1,
            held_bytes=self.input_bytes + (flight - 1) * per_micro_batch + spec.workspace_bytes + self.sharding,
        )


@dataclass
class _StageModel:
    """One pipeline stage's shard on the meta device, with its batch and optimizer."""

    model: nn.Module
    inputs: Tensor
    labels: Tensor
    optimizer: torch.optim.Optimizer | None
    hidden: Tensor  # the hidden states the stage receives or sends


def _stage_model(spec: EstimateSpec, stage: int, device: str = "meta", split_inputs: bool = False) -> _StageModel:
    """One pipeline rank's shard of the model: on "meta" (shapes: the target's kernels by shape),
    or on the target device itself, with weights and a random batch, to trace for real.
    `split_inputs` (meta only): full recompute keeps 1/tp of each range's input
    (distribute_saved_activations)."""
    family, layout, split = spec.family, spec.layout, spec.layout.sequence_split
    shard = family.shard(spec.model_config, layout, stage_layers(spec, stage))
    first, last = stage == 0, stage == layout.pp - 1
    on_meta = device == "meta"
    torch.manual_seed(spec.seed + stage)
    model = family.build(shard, dtype=spec.dtype, device=device, pre_process=first, post_process=last)
    model.train()
    to_fp8(model, spec.precision, stage_layers(spec, stage), spec.model_config.num_layers)
    if on_meta or spec.compile:
        family.use_kernels(model, spec.target, compiled=spec.compile, shapes_only=on_meta)
    parallelize_by_shape(model, family, layout, split_inputs=split_inputs)
    b, s = spec.micro_batch_size, shard.seq_length
    labels = torch.randint(0, shard.vocab_size, (b, s), device=device)
    if first:
        inputs = torch.randint(0, shard.vocab_size, (b, s), device=device)
    else:
        inputs = torch.randn(b, s // split, shard.hidden_size, dtype=spec.dtype, device=device, requires_grad=True)
    optimizer: torch.optim.Optimizer | None = None
    if spec.optimizer:  # on CPU the bench's AdamW loops over the tensors, which runs on meta as it is
        shards = layout.dp if spec.optimizer_precision.use_distributed_optimizer else 1
        cuda_on_meta = on_meta and spec.target == "cuda"
        # under FSDP2, AdamW on its shards: traced on the whole model, then taken by shape (trace_stage)
        precision = OptimizerPrecision() if spec.fully_sharded else spec.optimizer_precision
        optimizer = make(
            model.parameters(),
            precision,
            fused=device.startswith("cuda"),
            shards=shards,
            inner=AdamWState if cuda_on_meta else None,
        )
        begin_state(model, optimizer)
    hidden = inputs if not first else torch.empty(b, s // split, shard.hidden_size, dtype=spec.dtype, device=device)
    return _StageModel(model, inputs, labels, optimizer, hidden)


def trace_stage(
    spec: EstimateSpec,
    stage: int,
    progress: Callable[[str], None] | None = None,
    offload_threshold: int | None = None,
    device: str = "meta",
    split_inputs: bool = False,
) -> StageTrace:
    """Trace pipeline rank `stage`'s shard, on the meta device (shapes, counted FLOPs) or on the
    target device (its own memory and time); with `offload_threshold`, offload too (storages of
    that many elements or more); `split_inputs`: as `_stage_model`."""
    shard = _stage_model(spec, stage, device, split_inputs)
    note = progress or (lambda what: None)
    with target_kernels(spec.target, shard.model):
        offload: dict[str, Any] = (
            {}
            if offload_threshold is None
            else dict(offload=True, min_offloaded_tensor_size=offload_threshold, host_bytes_per_s=spec.host_gbps * 1e9)
        )
        timing: dict[str, Any] = dict(timing_repeats=1, flops_per_s=spec.tflops * 1e12) if device == "meta" else {}
        measured = trace(
            shard.model,
            (shard.inputs, shard.labels),
            optimizer=shard.optimizer,
            micro_batches=spec.micro_batches,
            **timing,
            **offload,
            progress=lambda what: note(f"stage {stage}: {what}"),
        )
    hidden_bytes = shard.hidden.untyped_storage().nbytes()
    weights = storage_bytes(shard.model.parameters())
    main_grads = main_grad_bytes(shard.optimizer)
    persist = gradients_persist(shard.optimizer, spec.micro_batches)
    grads = main_grads or (weights if persist else 0)
    optimizer = optimizer_state_bytes(shard.optimizer)
    sharding = 0
    if spec.fully_sharded:
        traced_state = weights + grads + optimizer
        weights = sharded_state_bytes(shard.model, spec.family, spec.layout, spec.state_dtype)
        grads, optimizer = (weights if persist else 0), (2 * weights if shard.optimizer is not None else 0)
        sharding = weights + grads + optimizer + gathered_bytes(shard.model, spec.dtype) - traced_state
    return StageTrace(
        measured,
        weights,
        optimizer,
        0 if stage == 0 else hidden_bytes,
        0 if stage == spec.layout.pp - 1 else hidden_bytes,
        grads,
        sharding,
    )


def step_peak(spec: RunSpec, plan: PlanLike) -> int:
    """The peak allocated bytes of one step of `spec` under `plan` on its device (weights,
    gradients and optimizer state included), from one step on shapes alone: a second or two,
    where `estimate` traces every action. What a run checks before it allocates anything."""
    shape = EstimateSpec.of_run(spec)
    shard = _stage_model(shape, 0, split_inputs=distributes_saved_inputs(plan))
    resolved = resolve(rank_plan(plan, shape, 0), find_sites(shard.model).model_sites)
    stepper = Stepper(
        shard.model,
        (shard.inputs, shard.labels),
        shard.optimizer,
        gradients_persist(shard.optimizer, shape.micro_batches),
        seed=0,
        min_offloaded=resolved.min_offloaded_tensor_size,
    )
    with target_kernels(shape.target, shard.model), training_state_kept(shard.model, shard.optimizer):
        stepper.step()  # the state a steady step starts from
        record = stepper.measure(resolved)
    return max(record.peaks.values()) + shape.workspace_bytes


# Of the host memory available, what a CPU run may plan to use: the rest is for Python, the
# allocator's slack and whatever else the machine runs.
HOST_SHARE = 0.8
# Model FLOPs of a step past which a CPU run takes minutes (a TFLOP: ten seconds a step at ~0.1 TFLOP/s).
CPU_MAX_STEP_FLOPS = 1e12


def cpu_run_problems(spec: RunSpec, plans: Sequence[tuple[str, PlanLike]], extra_bytes: int = 0) -> Iterator[Problem]:
    """A CPU run that would take minutes a step, or whose step (plus `extra_bytes` it keeps
    besides) would not fit the host's free memory: refused before it allocates, instead of
    failing minutes in or being killed by the OS."""
    if spec.device != "cpu":
        return
    config = spec.model_config
    flops = spec.family.flops(config, config.seq_length, spec.micro_batch_size * spec.micro_batches)
    if flops > CPU_MAX_STEP_FLOPS:
        yield Problem(
            "device",
            f"a step is {flops / 1e12:,.0f} TFLOP of model FLOPs, seconds or more a step on a"
            " CPU; lower -sl, -mb or --num_layers, or run on a GPU",
        )
        return
    available = available_host_bytes()
    if available is None:
        return
    for name, plan in plans:
        try:
            need = step_peak(spec, plan) + extra_bytes
        except ConfigError as err:  # no prediction: run unchecked, as a plain PyTorch run would
            warn(f"not checked against this machine's free memory: {err.problems[0].message}")
            return
        if need > HOST_SHARE * available:
            yield Problem(
                "memory",
                f"{name}: a step needs about {format_bytes(need)} at its peak (predicted from"
                f" shapes), more than the {format_bytes(available)} this machine has free;"
                " lower -sl, -mb or --num_layers, or run on a GPU",
            )


def rank_plan(plan: PlanLike, spec: EstimateSpec, stage: int) -> PlanLike:
    """A whole-model plan as one stage sees it: a config lowered onto the stage's chunks of
    layers, a per-layer plan cut to the layers of the stage's chunks. The stage's trace runs its
    chunks back to back: the embedding before rank 0's first chunk, the loss head after the last
    rank's last chunk, as Megatron runs them."""
    layout = spec.layout
    if isinstance(plan, RecomputeConfig):
        # Megatron lowers recompute_num_layers per virtual chunk: the stage's chunks act as stages of its layers
        return plan.on_layers(spec.model_config.num_layers // layout.pp, stages=layout.virtual)
    if isinstance(plan, Plan) and layout.pp > 1:
        return plan.cut(layout.rank_layers(len(plan.layers), stage))
    return plan


def _plan_problems(plan: Plan, model_sites: ModelSites, layout: ParallelLayout) -> list[Problem]:
    """A per-layer plan checked against the whole model and its pipeline chunks."""
    try:
        check_plan(plan.layers, plan.full_recompute, model_sites)
    except ConfigError as err:
        return err.problems
    return list(plan_pipeline_problems(plan, layout))


def _lowered(plan: PlanLike, model_sites: ModelSites) -> Plan:
    if plan is None:
        return Plan.none(model_sites.num_layers)
    return Plan.from_config(plan, model_sites) if isinstance(plan, RecomputeConfig) else plan
