"""The model of a run: built from its recipe and seed on its device, with its kernels; under
torchrun split by `remat.parallel.parallelize` on the layout's mesh, a pipeline's chunks under its
schedule; and a plan installed on it as Megatron applies one to each (virtual) pipeline stage."""

from __future__ import annotations

import torch
from torch import nn

from remat import parallel
from remat.config.model_sites import check_config
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan, PlanLike
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError, Problem
from remat.models import ModelConfig
from remat.parallel import Pipeline, Sharding, model_chunks, parallelize
from remat.parallel.seeding import seeded_parameters, whole_model_names
from remat.parallel.tensor_parallel import distribute_saved_inputs
from remat.run.fp8 import to_fp8
from remat.run.optimizer import DTYPES
from remat.run.spec import RunSpec
from remat.sites.apply import apply, find_sites


def build_model(spec: RunSpec) -> nn.Module:
    """The spec's model on its device, from the spec's seed, with its kernels. Under torchrun, on
    the layout's pp x dp x cp x tp mesh: this rank's pipeline stages (a `Pipeline`) when pp > 1,
    each split by every other parallelism of the layout (`parallelize`)."""
    layout = spec.layout
    if parallel.world_size() == 1:
        if layout.model_parallel > 1:
            raise ConfigError(
                [
                    Problem(
                        "num_gpus",
                        f"tp x pp x cp = {layout.model_parallel} needs as many"
                        " processes; launch with torchrun, or let remat bench start it",
                    )
                ]
            )
        return _build_chunk(spec, 0)
    mesh = layout.mesh(spec.device)
    pipeline_rank = mesh["pp"].get_local_rank()
    chunks = []
    for index in layout.stage_indices(pipeline_rank):
        chunk = _build_chunk(spec, index)
        chunks.append(parallelize(chunk, spec.family, layout, mesh, sharding(spec)))
    if layout.pp == 1:
        return chunks[0]
    # the hidden states a stage sends its next: this rank's tokens, to the same cp and tp rank of it
    config = spec.model_config
    hidden = torch.empty(
        spec.micro_batch_size,
        config.seq_length // (layout.sequence_split * layout.cp),
        config.hidden_size,
        dtype=spec.dtype,
        device="meta",
    )
    return Pipeline(
        chunks,
        layout,
        pipeline_rank=pipeline_rank,
        hidden=hidden,
        micro_batches=spec.micro_batches,
        group=mesh["pp"].get_group(),
    )


def chunk_config(spec: RunSpec, chunk: int) -> ModelConfig:
    """Model chunk `chunk`'s share of the spec's model as built (the whole model without
    pipelining): its layers, numbered as in the whole model (a layer's kind and seeds follow that
    number), and its expert-parallel rank's experts; tensor and context parallelism split the rest
    after it is built."""
    config, layout = spec.model_config, spec.layout
    if layout.chunks == 1 and layout.ep == 1:
        return config
    return spec.family.shard(
        config, ParallelLayout(pp=layout.pp, vp=layout.vp, ep=layout.ep), layout.chunk_layers(config.num_layers, chunk)
    )


def _build_chunk(spec: RunSpec, chunk: int) -> nn.Module:
    """Model chunk `chunk`, seeded by its index (alike on its tensor-parallel ranks): the first with
    the embedding, the last with the loss head."""
    torch.manual_seed(spec.seed + chunk)
    family, last = spec.family, spec.layout.chunks - 1
    model = family.build(
        chunk_config(spec, chunk),
        dtype=spec.state_dtype,
        device=spec.device,
        pre_process=chunk == 0,
        post_process=chunk == last,
    )
    layers = spec.layout.chunk_layers(spec.model_config.num_layers, chunk)
    # before the regions compile; compiled, each cast fuses with its amax
    to_fp8(model, spec.precision, layers, spec.model_config.num_layers, "inductor" if spec.compile else None)
    if spec.compile:
        family.use_kernels(model, "cuda" if spec.device.startswith("cuda") else "cpu", compiled=True)
    return model


def sharding(spec: RunSpec) -> Sharding:
    """How FSDP2 keeps the spec's training state: with main parameters, the shards in their dtype
    are gathered in the compute dtype and gradients reduced in the main gradients' dtype
    (Megatron's fp32 main weights and gradients); without, everything in the compute dtype; under
    Megatron's distributed optimizer, layers whole through a step and gradients reduced once."""
    precision = spec.optimizer_precision
    once = precision.use_distributed_optimizer
    if precision.main_params_dtype is None:
        return Sharding(reduce_once_a_step=once)
    return Sharding(spec.dtype, DTYPES[precision.main_grads_dtype or precision.main_params_dtype], once)


def reset_parameters(spec: RunSpec, model: nn.Module) -> None:
    """The weights every run of a spec starts from, whatever its layout: each parameter drawn whole
    from its own seed (the spec's and its whole-model name), each rank keeping its share of it."""
    stages = model.stage_indices if isinstance(model, Pipeline) else [0]
    num_layers = spec.model_config.num_layers
    for stage, chunk in zip(stages, model_chunks(model)):
        # torch's seed alike on every stage: weights drawn from generators of their own derive theirs from it
        torch.manual_seed(spec.seed)
        names = whole_model_names(chunk, spec.layout.chunk_layers(num_layers, stage))
        with seeded_parameters(chunk, names, spec.seed):
            spec.family.reset_parameters(chunk)
        torch.manual_seed(spec.seed + stage)  # each stage's own stream for dropout, as before
    if isinstance(model, Pipeline):
        model.tie_weights()  # a tied embedding's copy on the last stage starts as the first's


def apply_plan(spec: RunSpec, model: nn.Module, plan: PlanLike) -> None:
    """Install `plan` (the whole model's) on `model`; on a pipeline, on each of its stages. A
    config's distribute_saved_activations splits what its full-recompute ranges keep over the
    tensor-parallel ranks (and a plan without it takes that off). A config is checked on the
    whole model once and lowered onto each stage's sites: a stage need not have every site it
    names (an MoE model's dense first stage has no `moe`), as on Megatron's stages."""
    if not isinstance(model, Pipeline):
        apply(model, plan)
        distribute_saved_inputs(model, distributes_saved_inputs(plan))
        return
    if isinstance(plan, RecomputeConfig):
        check_config(plan, find_sites(spec.family.build(spec.model_config, device="meta")).model_sites)
    for stage, chunk in zip(model.stage_indices, model.chunks):
        chunk_plan = stage_plan(plan, spec.layout, spec.model_config.num_layers, stage)
        lowered = (
            Plan.from_config(chunk_plan, find_sites(chunk).model_sites)
            if isinstance(chunk_plan, RecomputeConfig)
            else chunk_plan
        )
        apply(chunk, lowered)
        distribute_saved_inputs(chunk, distributes_saved_inputs(chunk_plan))


def distributes_saved_inputs(plan: PlanLike) -> bool:
    """Whether `plan` splits full recompute's kept inputs over the tensor-parallel ranks."""
    return isinstance(plan, RecomputeConfig) and plan.distribute_saved_activations


def stage_plan(plan: PlanLike, layout: ParallelLayout, num_layers: int, stage: int) -> PlanLike:
    """What pipeline stage `stage` runs of a whole model's plan: a config as Megatron applies it
    to each (virtual) stage's layers, a per-layer plan cut to the stage's layers."""
    if isinstance(plan, Plan):
        return plan.cut(layout.chunk_layers(num_layers, stage))
    if isinstance(plan, RecomputeConfig):
        return plan.on_layers(num_layers // layout.chunks)
    return plan
