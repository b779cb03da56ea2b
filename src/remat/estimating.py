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
time is the counted FLOPs at an assumed sustained rate.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from remat.apply import find_sites, nothing_offloaded_advice
from remat.layer_plan import Plan, PlanLike, check_plan, plan_pipeline_problems, rank_layers
from remat.layout import ModelLayout
from remat.memory.measure import DEFAULT_HOST_GBPS, Stepper, gradients_persist, trace, training_state_kept
from remat.memory.meter import storage_bytes
from remat.memory.windows import PlanningProblem
from remat.memory.prediction import Trace, offload_prediction_problems, resolve, unmeasured_problems
from remat.models import Target
from remat.models.family import on_tokens_argument, on_tokens_output
from remat.problems import ConfigError, Problem, advise, one_of
from remat.recompute import RecomputeConfig, TrainingFacts
from remat.sizes import format_bytes
from remat.optimizer import OptimizerPrecision, main_grad_bytes, make
from remat.parallel.data_parallel import gathered_bytes, shard_bytes
from remat.parallel.tensor_parallel import distribute_saved_inputs_by_shape
from remat.step import RunSpec, available_host_bytes, distributes_saved_inputs, optimizer_state_bytes

ESTIMATE_TARGETS: tuple[str, ...] = ("cuda", "cpu")
# Sustained bf16 dense throughput assumed for estimated step times, about what remat's plans reach
# on an H200 (benchmarks/README.md).
DEFAULT_TFLOPS = 600.0
# cuBLAS keeps a workspace per handle, allocated through torch's caching allocator and held for the
# process's life; torch makes a handle per thread that runs GEMMs: the forward's and autograd's CUDA
# backward thread. Each took 32 MiB on an H200 with torch 2.11 (benchmarks/investigations/README.md).
DEFAULT_CUBLAS_WORKSPACE = 32 * 2**20
CUBLAS_HANDLES = 2


def cublas_workspace_bytes(config: str | None) -> int:
    """One cuBLAS handle's workspace for a CUBLAS_WORKSPACE_CONFIG value (':SIZE:COUNT' pairs, SIZE in
    KiB, summed), or the default where it is unset."""
    if config is None:
        return DEFAULT_CUBLAS_WORKSPACE
    if not re.fullmatch(r"(:\d+:\d+)+", config.strip()):
        raise ConfigError([Problem("CUBLAS_WORKSPACE_CONFIG", f"cannot read {config!r}; cuBLAS takes ':SIZE:COUNT'"
                                                              " pairs with SIZE in KiB, like ':4096:8' (32 MiB): fix"
                                                              " or unset it, or give the size as cublas_workspace"
                                                              " (--cublas_workspace)")])
    numbers = [int(n) for n in config.strip().split(":")[1:]]
    return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2]))


def estimate_problems(target: str, tflops: float, host_gbps: float = DEFAULT_HOST_GBPS,
                      cublas_workspace: int | None = None) -> Iterator[Problem]:
    """The settings of a shapes-only estimate (`remat estimate`) beyond the step's."""
    if not tflops > 0:
        yield Problem("tflops", f"is {tflops}; give the sustained TFLOP/s one GPU reaches, e.g. 600")
    if not host_gbps > 0:
        yield Problem("host_gbps", f"is {host_gbps}; give the host link's bandwidth each way in GB/s, "
                                   f"e.g. {DEFAULT_HOST_GBPS:g}")
    if cublas_workspace is not None and cublas_workspace < 0:
        yield Problem("cublas_workspace", f"is {cublas_workspace} bytes; give 0 or more (one cuBLAS handle's"
                                          " workspace)")
    if cublas_workspace is not None and target != "cuda":
        yield Problem("cublas_workspace", f"counts only on the cuda target, not {target!r}; drop it")



def estimate_threshold_problems(thresholds: Iterable[int]) -> Iterator[Problem]:
    """One estimate traces offload at one min_offloaded_tensor_size."""
    if len(distinct := sorted(set(thresholds))) > 1:
        yield Problem("min_offloaded_tensor_size", f"the offload plans use thresholds {distinct}; one estimate "
                                                   "traces one: give them the same")


@dataclass(frozen=True)
class EstimateSpec(RunSpec):
    """One rank of a training run, described by shapes: the step's settings, the parallel layout
    (`facts`: tp, sp, pp, vpp, cp) and the target whose kernels and speed to assume."""

    device: str = "cuda"  # the target: whose fused kernels (attention, RMSNorm) and workspaces to count
    tflops: float = DEFAULT_TFLOPS
    host_gbps: float = DEFAULT_HOST_GBPS  # times offload copies, each way
    # bytes of one cuBLAS handle's workspace; None: from CUBLAS_WORKSPACE_CONFIG, else torch's default
    cublas_workspace: int | None = None
    # what cuBLAS holds on the target through the step (no tensor's, so no trace sees it); set once
    # from the above, so later changes to the environment do not move an estimate
    workspace_bytes: int = field(init=False, default=0)

    @classmethod
    def of_run(cls, spec: RunSpec, **settings: Any) -> "EstimateSpec":
        """The shapes of a run of `spec`, on its kind of device."""
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(RunSpec) if f.name != "device"}
        # a run's data parallelism is FSDP2's
        # (under the distributed optimizer, sharded as Megatron's: counted as such)
        fields["precision"] = dataclasses.replace(
            spec.precision, use_torch_fsdp2=spec.fully_sharded and not spec.precision.use_distributed_optimizer)
        return cls(**fields, device="cuda" if spec.device.startswith("cuda") else "cpu", **settings)

    @property
    def fully_sharded(self) -> bool:
        """FSDP2 only where asked for (--use_torch_fsdp2); Megatron's data parallelism otherwise."""
        return self.precision.use_torch_fsdp2 and super().fully_sharded

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        yield from estimate_problems(self.device, self.tflops, self.host_gbps, self.cublas_workspace)
        try:
            object.__setattr__(self, "workspace_bytes", self._workspace_bytes())  # frozen: set once here
        except ConfigError as err:
            yield from err.problems

    def _device_problems(self) -> Iterator[Problem]:
        if self.device not in ESTIMATE_TARGETS:
            yield Problem("target", f"{self.device!r} is not a target; use one of {one_of(ESTIMATE_TARGETS)}")

    @property
    def target(self) -> Target:
        return "cuda" if self.device.startswith("cuda") else "cpu"

    def _workspace_bytes(self) -> int:
        if self.target != "cuda":
            return 0
        per_handle = (cublas_workspace_bytes(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
                      if self.cublas_workspace is None else self.cublas_workspace)
        return CUBLAS_HANDLES * per_handle


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
        return {"name": self.name, "peak_bytes": self.peak, "step_time_s": self.step_time_s,
                "stages": [{**dataclasses.asdict(s), "other": s.other} for s in self.stages]}


def estimate(spec: EstimateSpec, plans: Sequence[tuple[str, PlanLike]] = (("none", None),),
             progress: Callable[[str], None] | None = None) -> list[Estimate]:
    """Predict every plan's memory per stage and step time for `spec`, one trace per kind of stage.

    A plan is a RecomputeConfig (lowered onto each stage's layers as Megatron does), a per-layer
    Plan over all layers, or None.
    """
    pp = spec.stages
    layout = find_sites(spec.family.build(spec.model_config, device="meta")).layout
    problems = [p for _, plan in plans if isinstance(plan, Plan)
                for p in _plan_problems(plan, layout, spec.facts)]
    if problems:  # every error before the first trace
        raise ConfigError(problems)
    lowered = [_lowered(plan, layout) for _, plan in plans]
    offloading = [p for p in lowered if p.offloads()]
    thresholds = {p.min_offloaded_tensor_size for p in offloading}
    if problems := list(estimate_threshold_problems(thresholds)):
        raise ConfigError(problems)
    stage_plans = [[rank_plan(plan, spec, k) for k in range(pp)] for _, plan in plans]
    rank_layouts = [dataclasses.replace(layout, labels=tuple(layout.labels[i] for i in stage_layers(spec, k)))
                    for k in range(pp)]
    problems = [p for whole in lowered for p in unmeasured_problems(whole, layout, bool(offloading))]
    stages_lowered = [_lowered(stage, rank_layout) for per_stage in stage_plans
                      for stage, rank_layout in zip(per_stage, rank_layouts)]
    problems += [p for s in stages_lowered for p in offload_prediction_problems(s.layers, s.full_recompute)]
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    offload = thresholds.pop() if thresholds else None
    # a plan that splits full recompute's kept inputs over tp ranks runs another model: traced apart
    traced = {split: trace_stages(spec, progress, offload, split_inputs=split)
              for split in sorted({distributes_saved_inputs(plan) for _, plan in plans})}
    out = []
    for (name, plan), per_stage, whole in zip(plans, stage_plans, lowered):
        result = predict_stages(name, spec, traced[distributes_saved_inputs(plan)], per_stage)
        out.append(result)
        if whole.offloads():  # as a run under the plan would say after its steps
            advise(nothing_offloaded_advice(sum(s.host for s in result.stages), whole.min_offloaded_tensor_size))
    return out


def trace_stages(spec: EstimateSpec, progress: Callable[[str], None] | None = None,
                 offload_threshold: int | None = None, device: str = "meta",
                 split_inputs: bool = False) -> list[StageTrace]:
    """Each pipeline rank's trace (`trace_stage`), traced once per kind: first, middle or last,
    with the same kinds of layers (an MoE model's dense first layers make a middle rank apart)."""
    pp = spec.stages
    labels = find_sites(spec.family.build(spec.model_config, device="meta")).layout.labels
    kinds = [(k == 0, k == pp - 1, tuple(labels[i] for i in stage_layers(spec, k))) for k in range(pp)]
    first_of_kind = {kind: k for k, kind in reversed(list(enumerate(kinds)))}
    traced = {kind: trace_stage(spec, k, progress, offload_threshold, device, split_inputs)
              for kind, k in sorted(first_of_kind.items(), key=lambda item: item[1])}
    return [traced[kind] for kind in kinds]


def predict_stages(name: str, spec: EstimateSpec, traced: Sequence[StageTrace],
                   stage_plans: Sequence[PlanLike]) -> Estimate:
    """Each rank's memory under its plan, and the step's time: under 1F1B the steady state runs
    the micro-batches at the pace of the slowest stage, and filling and draining the pipeline
    passes once through the others (in 1/v steps with v virtual stages)."""
    stages = [t.predict(k, plan, spec) for k, (t, plan) in enumerate(zip(traced, stage_plans))]
    times = [s.micro_batch_time_s for s in stages]
    virtual = spec.facts.virtual_pipeline_model_parallel_size or 1
    return Estimate(name, tuple(stages), spec.micro_batches * max(times) + (sum(times) - max(times)) / virtual)


# ---- one rank's shapes -----------------------------------------------------------------------

def stage_layers(spec: EstimateSpec, stage: int) -> tuple[int, ...]:
    """The whole model's layers pipeline rank `stage` holds: its virtual stages' back to back."""
    return tuple(rank_layers(spec.model_config.num_layers, spec.stages,
                             spec.facts.virtual_pipeline_model_parallel_size, stage))


def in_flight(stage: int, facts: TrainingFacts, micro_batches: int) -> float:
    """Micro-batches of this stage's activations alive at its peak under 1F1B: Megatron's warm-up
    count plus the one in steady state, in model chunks for the interleaved schedule."""
    pp, v = facts.pipeline_model_parallel_size, facts.virtual_pipeline_model_parallel_size or 1
    if v == 1:
        return float(min(pp - stage, micro_batches))
    chunks = min((pp - stage - 1) * 2 + (v - 1) * pp + 1, micro_batches * v)
    return chunks / v


class _SeqGather(torch.autograd.Function):
    """All-gather along the sequence (dim 1) by shape; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, n: int) -> Tensor:  # type: ignore[override]
        ctx.n = n
        return x.repeat(1, n, 1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad.unflatten(1, (ctx.n, -1)).sum(1), None


class _SeqScatter(torch.autograd.Function):
    """Reduce-scatter (or split) along the sequence by shape; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, n: int) -> Tensor:  # type: ignore[override]
        ctx.n = n
        return x.unflatten(1, (n, -1))[:, 0].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad.repeat(1, ctx.n, 1), None


def _sequence_parallel(spec: EstimateSpec, model: nn.Module) -> None:
    """Hooks where torch's SequenceParallel / Colwise / Rowwise styles communicate, by shape."""
    tp = spec.facts.tensor_model_parallel_size
    points = spec.family.sequence_parallel(model, tp)

    def gather(x: Tensor) -> Tensor:
        return _SeqGather.apply(x, tp)

    def scatter(x: Tensor) -> Tensor:
        return _SeqScatter.apply(x, tp)

    for block in points.blocks:
        on_tokens_argument(block, gather)
        on_tokens_output(block, scatter)
    for module in points.split_after:
        on_tokens_output(module, scatter)
    for module in points.gather_after:
        on_tokens_output(module, gather)
    for module in points.split_before:
        on_tokens_argument(module, scatter)
    for module in points.gather_before:
        on_tokens_argument(module, gather)


class _TargetKernels(TorchFunctionMode):
    """On meta tensors torch takes its unfused paths; run what the `target` device would run:
    fused attention (cuDNN on CUDA, flash on CPU)."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not args or not isinstance(args[0], Tensor) or args[0].device.type != "meta":
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self._fused(args, kwargs):
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _fused(self, args: tuple, kwargs: dict) -> bool:
        """Whether the target runs SDPA fused: flash and cuDNN take one head dim for q, k and v
        (MLA's v is narrower), and CPU flash no dropout; torch runs those unfused, as meta does."""
        if len(args) < 3 or args[0].shape[-1] != args[2].shape[-1]:
            return False
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return self.target == "cuda" or not dropout

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> Tensor:
        if self.target == "cuda":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, attn_mask, True, dropout_p, is_causal, False, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


class _AdamWState(torch.optim.Optimizer):
    """What fused AdamW (the bench's on CUDA) holds: two moments per parameter, updated in place
    (no temporaries). Meta tensors cannot run the fused kernel; memory is all the estimate needs."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _begin_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The state a steady step's optimizer holds, made by one step on zero gradients (meta: no data);
    the trace puts back the state it finds, which the stage's estimate then counts."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


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
        flight = in_flight(stage, spec.facts, spec.micro_batches)
        per_micro_batch = p.saved_bytes + self.input_bytes - self.output_bytes
        return StageEstimate(
            stage=stage, layers=self.trace.layout.num_layers, in_flight=flight, weights=self.weights,
            grads=self.grads, optimizer_state=self.optimizer_state,
            activations=round(flight * per_micro_batch),
            peak=round(p.peak_bytes + self.input_bytes + (flight - 1) * per_micro_batch) + spec.workspace_bytes
            + self.sharding,
            peak_window=p.peak_window, micro_batch_time_s=p.step_time_s, host=round(flight * p.host_bytes),
            workspaces=spec.workspace_bytes)

    def problem(self, stage: int, spec: EstimateSpec) -> PlanningProblem:
        """What the planner solves for this stage: its windows hold, besides one micro-batch's
        step, its input and the other micro-batches in flight, whose saved bytes every choice
        lowers too. The peak of any plan is `predict`'s."""
        flight = in_flight(stage, spec.facts, spec.micro_batches)
        per_micro_batch = self.trace.baseline_saved_bytes + self.input_bytes - self.output_bytes
        return dataclasses.replace(self.trace.problem(), others_in_flight=flight - 1,
                                   held_bytes=self.input_bytes + (flight - 1) * per_micro_batch + spec.workspace_bytes
                                   + self.sharding)


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
    family, split = spec.family, spec.parallel.sequence_split
    shard = family.shard(spec.model_config, dataclasses.replace(spec.parallel, layers=stage_layers(spec, stage)))
    first, last = stage == 0, stage == spec.stages - 1
    on_meta = device == "meta"
    torch.manual_seed(spec.seed + stage)
    model = family.build(shard, dtype=spec.dtype, device=device, pre_process=first, post_process=last)
    model.train()
    if on_meta or spec.compile:
        family.use_kernels(model, spec.target, compiled=spec.compile, shapes_only=on_meta)
    if split > 1:
        _sequence_parallel(spec, model)
    if split_inputs:
        distribute_saved_inputs_by_shape(model, spec.facts.tensor_model_parallel_size)
    b, s = spec.micro_batch_size, shard.seq_length
    labels = torch.randint(0, shard.vocab_size, (b, s), device=device)
    if first:
        inputs = torch.randint(0, shard.vocab_size, (b, s), device=device)
    else:
        inputs = torch.randn(b, s // split, shard.hidden_size, dtype=spec.dtype, device=device, requires_grad=True)
    optimizer: torch.optim.Optimizer | None = None
    if spec.optimizer:  # on CPU the bench's AdamW loops over the tensors, which runs on meta as it is
        shards = spec.data_parallel if spec.precision.use_distributed_optimizer else 1
        cuda_on_meta = on_meta and spec.target == "cuda"
        # under FSDP2, AdamW on its shards: traced on the whole model, then taken by shape (trace_stage)
        precision = OptimizerPrecision() if spec.fully_sharded else spec.precision
        optimizer = make(model.parameters(), precision, fused=device.startswith("cuda"), shards=shards,
                         inner=_AdamWState if cuda_on_meta else None)
        _begin_state(model, optimizer)
    hidden = inputs if not first else torch.empty(b, s // split, shard.hidden_size, dtype=spec.dtype, device=device)
    return _StageModel(model, inputs, labels, optimizer, hidden)


def trace_stage(spec: EstimateSpec, stage: int, progress: Callable[[str], None] | None = None,
                offload_threshold: int | None = None, device: str = "meta", split_inputs: bool = False) -> StageTrace:
    """Trace pipeline rank `stage`'s shard, on the meta device (shapes, counted FLOPs) or on the
    target device (its own memory and time); with `offload_threshold`, offload too (storages of
    that many elements or more); `split_inputs`: as `_stage_model`."""
    shard = _stage_model(spec, stage, device, split_inputs)
    note = progress or (lambda what: None)
    with _TargetKernels(spec.target):
        offload: dict[str, Any] = {} if offload_threshold is None else dict(
            offload=True, min_offloaded_tensor_size=offload_threshold, host_bytes_per_s=spec.host_gbps * 1e9)
        timing: dict[str, Any] = dict(timing_repeats=1, flops_per_s=spec.tflops * 1e12) if device == "meta" else {}
        measured = trace(shard.model, (shard.inputs, shard.labels), optimizer=shard.optimizer,
                         micro_batches=spec.micro_batches, **timing, **offload,
                         progress=lambda what: note(f"stage {stage}: {what}"))
    hidden_bytes = shard.hidden.untyped_storage().nbytes()
    weights = storage_bytes(shard.model.parameters())
    main_grads = main_grad_bytes(shard.optimizer)
    persist = gradients_persist(shard.optimizer, spec.micro_batches)
    grads = main_grads or (weights if persist else 0)
    optimizer = optimizer_state_bytes(shard.optimizer)
    sharding = 0
    if spec.fully_sharded:
        traced_state = weights + grads + optimizer
        weights = fsdp2_held_bytes(spec, shard.model)
        grads, optimizer = (weights if persist else 0), (2 * weights if shard.optimizer is not None else 0)
        sharding = weights + grads + optimizer + gathered_bytes(shard.model, spec.dtype) - traced_state
    return StageTrace(measured, weights, optimizer, 0 if stage == 0 else hidden_bytes,
                      0 if stage == spec.stages - 1 else hidden_bytes, grads, sharding)


def fsdp2_held_bytes(spec: EstimateSpec, model: nn.Module) -> int:
    """Bytes of `model` (one rank's share) FSDP2 leaves this rank: its routed experts sharded over
    the ranks holding the same experts (dp x cp / ep), everything else over dp x cp."""
    replicas = spec.data_parallel * spec.context_parallel
    experts = {p for module in spec.family.routed_experts(model) for p in module.parameters()}
    rest = [p for p in model.parameters() if p not in experts]
    return (shard_bytes(rest, replicas, spec.state_dtype)
            + shard_bytes(experts, replicas // spec.expert_parallel, spec.state_dtype))


def step_peak(spec: RunSpec, plan: PlanLike) -> int:
    """The peak allocated bytes of one step of `spec` under `plan` on its device (weights,
    gradients and optimizer state included), from one step on shapes alone: a second or two,
    where `estimate` traces every action. What a run checks before it allocates anything."""
    shape = EstimateSpec.of_run(spec)
    shard = _stage_model(shape, 0, split_inputs=distributes_saved_inputs(plan))
    resolved = resolve(rank_plan(plan, shape, 0), find_sites(shard.model).layout)
    stepper = Stepper(shard.model, (shard.inputs, shard.labels), shard.optimizer,
                      gradients_persist(shard.optimizer, shape.micro_batches), seed=0,
                      min_offloaded=resolved.min_offloaded_tensor_size)
    with _TargetKernels(shape.target), training_state_kept(shard.model, shard.optimizer):
        stepper.step()  # the state a steady step starts from
        record = stepper.measure(resolved)
    return max(record.peaks.values()) + shape.workspace_bytes


# Of the host memory available, what a CPU run may plan to use: the rest is for Python, the
# allocator's slack and whatever else the machine runs.
HOST_SHARE = 0.8
# Model FLOPs of a step past which a CPU run takes minutes (a TFLOP: ten seconds a step at ~0.1 TFLOP/s).
CPU_MAX_STEP_FLOPS = 1e12


def cpu_run_problems(spec: RunSpec, plans: Sequence[tuple[str, PlanLike]],
                     extra_bytes: int = 0) -> Iterator[Problem]:
    """A CPU run that would take minutes a step, or whose step (plus `extra_bytes` it keeps
    besides) would not fit the host's free memory: refused before it allocates, instead of
    failing minutes in or being killed by the OS."""
    if spec.device != "cpu":
        return
    config = spec.model_config
    flops = spec.family.flops(config, config.seq_length, spec.micro_batch_size * spec.micro_batches)
    if flops > CPU_MAX_STEP_FLOPS:
        yield Problem("device", f"a step is {flops / 1e12:,.0f} TFLOP of model FLOPs, seconds or more a step on a"
                                " CPU; lower -sl, -mb or --num_layers, or run on a GPU")
        return
    available = available_host_bytes()
    if available is None:
        return
    for name, plan in plans:
        need = step_peak(spec, plan) + extra_bytes
        if need > HOST_SHARE * available:
            yield Problem("memory", f"{name}: a step needs about {format_bytes(need)} at its peak (predicted from"
                                    f" shapes), more than the {format_bytes(available)} this machine has free;"
                                    " lower -sl, -mb or --num_layers, or run on a GPU")


def rank_plan(plan: PlanLike, spec: EstimateSpec, stage: int) -> PlanLike:
    """A whole-model plan as one stage sees it: a config lowered onto the stage's chunks of
    layers, a per-layer plan cut to the layers of the stage's chunks. The stage's trace runs its
    chunks back to back: the embedding before rank 0's first chunk, the loss head after the last
    rank's last chunk, as Megatron runs them."""
    facts = spec.facts
    per_stage = spec.model_config.num_layers // facts.pipeline_model_parallel_size
    if isinstance(plan, RecomputeConfig):
        stage_facts = dataclasses.replace(plan.facts, num_layers=per_stage, pipeline_model_parallel_size=1,
                                          virtual_pipeline_model_parallel_size=None)
        # Megatron lowers recompute_num_layers per virtual chunk: keep that many chunks
        return _per_chunk(plan, stage_facts, facts.virtual_pipeline_model_parallel_size or 1)
    if isinstance(plan, Plan) and spec.stages > 1:
        return plan.cut(rank_layers(len(plan.layers), facts.pipeline_model_parallel_size,
                                    facts.virtual_pipeline_model_parallel_size, stage))
    return plan


def _plan_problems(plan: Plan, layout: ModelLayout, facts: TrainingFacts) -> list[Problem]:
    """A per-layer plan checked against the whole model and its pipeline chunks."""
    try:
        check_plan(plan.layers, plan.full_recompute, layout)
    except ConfigError as err:
        return err.problems
    return list(plan_pipeline_problems(plan, facts))


def _lowered(plan: PlanLike, layout: ModelLayout) -> Plan:
    if plan is None:
        return Plan.none(layout.num_layers)
    return Plan.from_config(plan, layout) if isinstance(plan, RecomputeConfig) else plan


def _per_chunk(plan: RecomputeConfig, stage_facts: TrainingFacts, chunks: int) -> RecomputeConfig:
    if chunks > 1:  # a stage's virtual chunks act as pipeline stages of its own layers
        stage_facts = dataclasses.replace(stage_facts, pipeline_model_parallel_size=chunks)
    return dataclasses.replace(plan, facts=stage_facts)
