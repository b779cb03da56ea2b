"""estimate(): a recipe's peak memory per pipeline stage and its step time, from shapes alone.

The trace of `remat plan` runs here on the meta device: tensors have shapes and storage sizes but
no data, so a training step of a full-size model takes a fraction of a second on a CPU and every
number comes from the same window model the planner uses. What one GPU of a parallel run holds:

- tensor parallel: heads, query groups, FFN and (padded) vocabulary divided by tp; sequence
  parallel also runs norms and residuals on seq/tp tokens, with torch's all-gather before
  attention and MLP and reduce-scatter after them emulated by shape;
- context parallel: seq/cp tokens per rank;
- pipeline parallel: the stage's layers (with virtual stages, its interleaved model chunks), the
  first stage with the embedding, the last with the final norm and loss head; under 1F1B stage k
  holds the saved activations of pp - k micro-batches (Megatron's interleaved schedule, more with
  virtual stages).

On the meta device SDPA would take its unfused path, so attention runs the fused kernel the
target would (cuDNN on CUDA, flash on CPU), which saves what that kernel saves. For CUDA, RMSNorm
(and with compiled regions SwiGLU and the QKV split) runs remat's Triton-backed Functions, which
allocate on meta and launch nothing. What belongs to no tensor is added by the target's shape:
cuBLAS's workspace for each thread that runs GEMMs. Step time is the counted FLOPs at an assumed
sustained rate.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from remat.apply import find_sites
from remat.bench.run import adamw, optimizer_state_bytes
from remat.config import (
    CUBLAS_HANDLES,
    DEFAULT_HOST_GBPS,
    DEFAULT_TFLOPS,
    ConfigError,
    ModelLayout,
    Problem,
    RecomputeConfig,
    TrainingFacts,
    advise,
    check_plan,
    cublas_workspace_bytes,
    estimate_threshold_problems,
    estimate_problems,
    offload_prediction_problems,
    micro_batch_tokens_problems,
    nothing_offloaded_advice,
    parallel_shape_problems,
    pipeline_range_problems,
)
from remat.memory.meter import storage_bytes
from remat.memory.trace import Trace, gradients_persist, trace, unmeasured_problems
from remat.models import LlamaConfig, LlamaModel, build, recipe_config, rmsnorm, rope, swiglu
from remat.plans import Plan, PlanLike

# Megatron pads the vocabulary to a multiple of this times tp (make_vocab_size_divisible_by).
VOCAB_DIVISOR = 128


@dataclass(frozen=True)
class EstimateSpec:
    """One rank of a training run, described by shapes: recipe, parallel sizes, batch."""

    recipe: str = "llama3_tiny"
    overrides: dict[str, Any] = field(default_factory=dict)  # LlamaConfig fields
    facts: TrainingFacts = field(default_factory=TrainingFacts)  # tp, sp, pp, vpp, cp
    micro_batch_size: int = 1
    micro_batches: int = 1  # per step on each data-parallel rank
    optimizer: bool = True  # AdamW state (fused: no temporaries) held and stepped
    dtype: torch.dtype = torch.bfloat16
    target: str = "cuda"  # whose fused attention kernel to count
    compile: bool = False  # the model's regions compiled, as `remat bench --compile` runs them
    tflops: float = DEFAULT_TFLOPS
    host_gbps: float = DEFAULT_HOST_GBPS  # times offload copies, each way
    # bytes of one cuBLAS handle's workspace; None: from CUBLAS_WORKSPACE_CONFIG, else torch's default
    cublas_workspace: int | None = None
    # what cuBLAS holds on the target through the step (no tensor's, so no trace sees it); set once
    # from the above, so later changes to the environment do not move an estimate
    workspace_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        cfg = self.model_config
        problems = list(parallel_shape_problems(
            self.facts, num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
            ffn_hidden_size=cfg.ffn_hidden_size, seq_length=cfg.seq_length))
        problems += micro_batch_tokens_problems(cfg.seq_length, self.micro_batch_size,
                                                self.facts.context_parallel_size)
        try:  # the recompute rules check the parallel sizes and the pipeline split of the layers
            RecomputeConfig(facts=dataclasses.replace(self.facts, num_layers=cfg.num_layers))
        except ConfigError as err:
            problems += err.problems
        problems += estimate_problems(self.target, self.micro_batch_size, self.micro_batches, self.tflops,
                                      self.host_gbps, self.cublas_workspace)
        try:
            object.__setattr__(self, "workspace_bytes", self._workspace_bytes())  # frozen: set once here
        except ConfigError as err:
            problems += err.problems
        if problems:
            raise ConfigError(problems)

    @property
    def model_config(self) -> LlamaConfig:
        return recipe_config(self.recipe, **self.overrides)

    @property
    def stages(self) -> int:
        return self.facts.pipeline_model_parallel_size

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
    step_time_s: float  # 1F1B: (micro-batches + bubble) x the slowest stage's micro-batch time

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
    layout = find_sites(build(spec.recipe, device="meta", **spec.overrides)).layout
    problems = [p for _, plan in plans if isinstance(plan, Plan)
                for p in _plan_problems(plan, layout, spec.facts)]
    if problems:  # every error before the first trace
        raise ConfigError(problems)
    lowered = [_lowered(plan, layout) for _, plan in plans]
    offloading = [p for p in lowered if p.offloads()]
    thresholds = {p.min_offloaded_tensor_size for p in offloading}
    if problems := list(estimate_threshold_problems(thresholds)):
        raise ConfigError(problems)
    stage_plans = [[_stage_plan(plan, spec, k) for k in range(pp)] for _, plan in plans]
    stage_layout = dataclasses.replace(layout, labels=layout.labels[:layout.num_layers // pp])
    problems = [p for whole in lowered for p in unmeasured_problems(whole, layout, bool(offloading))]
    stages_lowered = [_lowered(stage, stage_layout) for per_stage in stage_plans for stage in per_stage]
    problems += [p for s in stages_lowered for p in offload_prediction_problems(s.layers, s.full_recompute)]
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    kind = [2 if k == pp - 1 else min(k, 1) for k in range(pp)]  # first, middle, last stage
    first_of_kind = {kind[k]: k for k in reversed(range(pp))}
    offload = (thresholds.pop(),) if thresholds else ()
    traced = {c: _trace_stage(spec, k, progress, *offload) for c, k in sorted(first_of_kind.items())}
    out = []
    for (name, _), per_stage, whole in zip(plans, stage_plans, lowered):
        stages = [traced[kind[k]].predict(k, per_stage[k], spec) for k in range(pp)]
        slowest = max(s.micro_batch_time_s for s in stages)
        bubble = (pp - 1) / (spec.facts.virtual_pipeline_model_parallel_size or 1)
        out.append(Estimate(name, tuple(stages), (spec.micro_batches + bubble) * slowest))
        if whole.offloads():  # as a run under the plan would say after its steps
            advise(nothing_offloaded_advice(sum(s.host for s in stages), whole.min_offloaded_tensor_size))
    return out


# ---- one rank's shapes -----------------------------------------------------------------------

def shard_config(config: LlamaConfig, facts: TrainingFacts) -> LlamaConfig:
    """The model one tensor-/context-parallel rank runs, with one pipeline stage's layers."""
    tp, cp = facts.tensor_model_parallel_size, facts.context_parallel_size
    vocab = -(-config.vocab_size // (VOCAB_DIVISOR * tp)) * VOCAB_DIVISOR  # padded, per rank
    return dataclasses.replace(
        config, num_layers=config.num_layers // facts.pipeline_model_parallel_size,
        num_attention_heads=config.num_attention_heads // tp, num_query_groups=config.num_query_groups // tp,
        ffn_hidden_size=config.ffn_hidden_size // tp, vocab_size=vocab if tp > 1 else config.vocab_size,
        seq_length=config.seq_length // cp, kv_channels=config.head_dim)


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


def _sequence_parallel(model: LlamaModel, tp: int) -> None:
    """Hooks where torch's SequenceParallel / Colwise / Rowwise styles communicate."""
    def gather(module: nn.Module, args: tuple) -> tuple:
        return (_SeqGather.apply(args[0], tp), *args[1:])

    def scatter(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        return _SeqScatter.apply(out, tp)

    for layer in model.decoder.transformer_layers():
        for block in (layer.self_attention, layer.mlp):
            block.register_forward_pre_hook(gather)
            block.register_forward_hook(scatter)
    if model.embedding is not None:
        model.embedding.register_forward_hook(scatter)
    else:  # the stage input is sharded; RoPE tables still cover the gathered sequence
        model.rotary_pos_emb.register_forward_pre_hook(lambda m, args: (args[0] * tp,))
    if model.output_layer is not None:  # the vocab-parallel loss head sees every token
        model.decoder.register_forward_hook(lambda m, args, out: _SeqGather.apply(out, tp))


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
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> Tensor:
        if self.target == "cuda":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, attn_mask, True, dropout_p, is_causal, False, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _fused_chunk_loss(logits: Tensor, labels: Tensor, valid: Tensor, row_scale: Tensor,
                      need_grad: bool) -> tuple[Tensor, Tensor | None]:
    """The compiled loss chunk by shape: inductor's kernels (remat's one on CUDA) allocate only
    the chunk's loss and write the logit gradients over the logits."""
    loss = logits.new_zeros((), dtype=torch.promote_types(logits.dtype, torch.float32))
    return loss, logits if need_grad else None


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
class _StageTrace:
    trace: Trace
    weights: int
    optimizer_state: int
    input_bytes: int  # the hidden states a later stage receives and holds until its backward
    output_bytes: int  # the hidden states a stage sends on: freed once sent, as Megatron does
    grads_persist: bool

    def predict(self, stage: int, plan: PlanLike, spec: EstimateSpec) -> StageEstimate:
        p = self.trace.predict(plan)
        flight = in_flight(stage, spec.facts, spec.micro_batches)
        per_micro_batch = p.saved_bytes + self.input_bytes - self.output_bytes
        return StageEstimate(
            stage=stage, layers=self.trace.layout.num_layers, in_flight=flight, weights=self.weights,
            grads=self.weights if self.grads_persist else 0, optimizer_state=self.optimizer_state,
            activations=round(flight * per_micro_batch),
            peak=round(p.peak_bytes + self.input_bytes + (flight - 1) * per_micro_batch) + spec.workspace_bytes,
            peak_window=p.peak_window, micro_batch_time_s=p.step_time_s, host=round(flight * p.host_bytes),
            workspaces=spec.workspace_bytes)


def _trace_stage(spec: EstimateSpec, stage: int, progress: Callable[[str], None] | None,
                 offload_threshold: int | None = None) -> _StageTrace:
    """Trace one stage's shard; with `offload_threshold`, offload too (storages of that many
    elements or more)."""
    facts, cfg = spec.facts, spec.model_config
    shard = shard_config(cfg, facts)
    first, last = stage == 0, stage == spec.stages - 1
    meta = torch.device("meta")
    model = LlamaModel(shard, dtype=spec.dtype, device=meta, pre_process=first, post_process=last)
    model.train()
    if spec.compile:  # inductor cannot run on meta tensors; this backend partitions as it does
        model.compile_regions(backend="aot_eager_decomp_partition")
        model.loss_kernels = dataclasses.replace(model.loss_kernels, chunk=_fused_chunk_loss)
        if spec.target == "cuda":  # CUDA's SwiGLU and QKV Functions allocate on meta, launch nothing
            for layer in model.decoder.transformer_layers():
                layer.mlp.activation = swiglu.activation
                layer.self_attention.split_qkv = rope.split_qkv
    if spec.target == "cuda":  # remat's RMSNorm Function saves what torch's fused kernel saves
        model.set_norm_kernel(rmsnorm.triton_rms_norm)
    sp = facts.sequence_parallel and facts.tensor_model_parallel_size > 1
    if sp:
        _sequence_parallel(model, facts.tensor_model_parallel_size)
    b, s = spec.micro_batch_size, shard.seq_length
    labels = torch.zeros(b, s, dtype=torch.long, device=meta)
    if first:
        inputs = torch.zeros(b, s, dtype=torch.long, device=meta)
    else:
        local = s // facts.tensor_model_parallel_size if sp else s
        inputs = torch.zeros(b, local, shard.hidden_size, dtype=spec.dtype, device=meta, requires_grad=True)
    optimizer: torch.optim.Optimizer | None = None
    if spec.optimizer:  # on CPU the bench's AdamW loops over the tensors, which runs on meta as it is
        optimizer = _AdamWState(model.parameters()) if spec.target == "cuda" else adamw(model.parameters(), False)
        _begin_state(model, optimizer)
    note = progress or (lambda what: None)
    with _TargetKernels(spec.target):
        offload: dict[str, Any] = {} if offload_threshold is None else dict(
            offload=True, min_offloaded_tensor_size=offload_threshold, host_bytes_per_s=spec.host_gbps * 1e9)
        measured = trace(model, (inputs, labels), optimizer=optimizer, micro_batches=spec.micro_batches,
                         timing_repeats=1, flops_per_s=spec.tflops * 1e12, **offload,
                         progress=lambda what: note(f"stage {stage}: {what}"))
    hidden = inputs if not first else torch.empty(b, s // (facts.tensor_model_parallel_size if sp else 1),
                                                  shard.hidden_size, dtype=spec.dtype, device=meta)
    return _StageTrace(measured, storage_bytes(model.parameters()), optimizer_state_bytes(optimizer),
                       0 if first else hidden.untyped_storage().nbytes(),
                       0 if last else hidden.untyped_storage().nbytes(),
                       gradients_persist(optimizer, spec.micro_batches))


def _stage_layers(facts: TrainingFacts, num_layers: int, stage: int) -> list[int]:
    """The model's layers pipeline rank `stage` runs, in order: Megatron's model chunks stage,
    stage + pp, stage + 2 pp, ... (one chunk per rank without virtual stages)."""
    pp, vpp = facts.pipeline_model_parallel_size, facts.virtual_pipeline_model_parallel_size or 1
    per_chunk = dataclasses.replace(facts, num_layers=num_layers).layers_per_virtual_stage
    assert per_chunk is not None  # EstimateSpec checked the split, estimate() the plan's length
    return [i for chunk in range(stage, pp * vpp, pp) for i in range(chunk * per_chunk, (chunk + 1) * per_chunk)]


def _stage_plan(plan: PlanLike, spec: EstimateSpec, stage: int) -> PlanLike:
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
        layers = _stage_layers(facts, len(plan.layers), stage)
        local = {layer: i for i, layer in enumerate(layers)}
        # a range lies within one chunk (pipeline_range_problems), consecutive here too
        ranges = [(local[s], local[s] + e - s) for s, e in plan.full_recompute if s in local]
        return Plan([dict(plan.layers[i]) for i in layers], ranges, plan.min_offloaded_tensor_size)
    return plan


def _plan_problems(plan: Plan, layout: ModelLayout, facts: TrainingFacts) -> list[Problem]:
    """A per-layer plan checked against the whole model and its pipeline chunks."""
    try:
        check_plan(plan.layers, plan.full_recompute, layout)
    except ConfigError as err:
        return err.problems
    return list(pipeline_range_problems(plan.full_recompute, layout.num_layers, facts))


def _lowered(plan: PlanLike, layout: ModelLayout) -> Plan:
    if plan is None:
        return Plan.none(layout.num_layers)
    return Plan.from_config(plan, layout) if isinstance(plan, RecomputeConfig) else plan


def _per_chunk(plan: RecomputeConfig, stage_facts: TrainingFacts, chunks: int) -> RecomputeConfig:
    if chunks > 1:  # a stage's virtual chunks act as pipeline stages of its own layers
        stage_facts = dataclasses.replace(stage_facts, pipeline_model_parallel_size=chunks)
    return dataclasses.replace(plan, facts=stage_facts)
