"""parallelize(): one model chunk of a run split by every parallelism of its layout, in Megatron's
and torchtitan's order: the routed experts over ep data-parallel ranks (each rank draws its experts
whole, before tensor parallelism splits their FFN), tensor (and sequence) parallelism, context
parallelism, then FSDP2 over the data- and context-parallel ranks, the experts over the ranks
holding the same ones.

Its twin `parallelize_by_shape` does to one rank's shard on the meta device what a run does to its
tensors: sequence parallelism's collectives and distribute_saved_activations' shards by shape (the
shard's own sizes are its family's `shard`); `sharded_state_bytes` is what FSDP2 leaves the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from remat.config.parallel import ParallelLayout
from remat.core.problems import raise_if_any
from remat.models import ModelFamily
from remat.parallel.context_parallel import shard_context
from remat.parallel.data_parallel import fully_shard_layers, shard_bytes
from remat.parallel.expert_parallel import shard_experts, split_checked
from remat.parallel.state import built_layout_problems, planned
from remat.parallel.tensor_parallel import (
    distribute_saved_inputs_by_shape,
    seed_problems,
    sequence_parallel_by_shape,
    split_tensor,
)


@dataclass(frozen=True)
class Sharding:
    """How FSDP2 keeps a model's training state: parameters gathered in `compute_dtype` and
    gradients reduced in `reduce_dtype` (None: the parameters' own dtype); with
    `reduce_once_a_step`, as Megatron's distributed optimizer (each layer gathered through a step,
    gradients reduced once)."""

    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reduce_once_a_step: bool = False


def parallelize(
    model: nn.Module, family: ModelFamily, layout: ParallelLayout, mesh: DeviceMesh, sharding: Sharding = Sharding()
) -> nn.Module:
    """Split `model` (one pipeline chunk, built by `family` with the experts of its expert-parallel
    rank) over the pp x dp x cp x tp `mesh` of `layout` (`layout.mesh(device)`). Every problem of
    the layout on this model is raised as one ConfigError before anything changes. Call on every
    rank, after seeding torch alike on all of them. Returns `model`."""
    state = planned(model, family, layout)
    problems = [*layout.problems(), *built_layout_problems(model, state)]
    if layout.tp > 1:
        problems += seed_problems(mesh["tp"])
    raise_if_any(problems)
    context = layout.cp > 1
    # torchtitan's flattened dp x cp dimension: the replicas of this rank's model
    replicas = mesh["dp", "cp"]._flatten() if context else mesh["dp"]
    experts = split_checked(state, mesh["dp"], (mesh, replicas) if context else None) if layout.ep > 1 else None
    if layout.tp > 1:
        split_tensor(model, state, mesh["tp"])
    if context:
        shard_context(state, mesh["cp"])
    if layout.replicas == 1:
        return model
    state.parallelism.replicas(replicas.get_group())
    compute, reduce, once = sharding.compute_dtype, sharding.reduce_dtype, sharding.reduce_once_a_step
    if experts is not None:
        return shard_experts(model, experts, compute_dtype=compute, reduce_dtype=reduce, reduce_once_a_step=once)
    return fully_shard_layers(model, replicas, compute_dtype=compute, reduce_dtype=reduce, reduce_once_a_step=once)


def parallelize_by_shape(
    model: nn.Module, family: ModelFamily, layout: ParallelLayout, *, split_inputs: bool = False
) -> nn.Module:
    """On one rank's shard (`family.shard` of the layout, built; on the meta device, or on a device
    that traces it alone): sequence parallelism's collectives where the family says it
    communicates, moving tensors of the collectives' shapes, and with `split_inputs`
    (distribute_saved_activations, meta only) full recompute keeping 1/tp of each range's input.
    Returns `model`."""
    if layout.sequence_split > 1:
        sequence_parallel_by_shape(family.parallelism(model, layout))
    if split_inputs:
        distribute_saved_inputs_by_shape(model, layout.tp)
    return model


def sharded_state_bytes(model: nn.Module, family: ModelFamily, layout: ParallelLayout, dtype: torch.dtype) -> int:
    """Bytes of `model` (one rank's shard) FSDP2 leaves this rank: its routed experts sharded over
    the ranks holding the same experts (dp x cp / ep), everything else over dp x cp."""
    replicas = layout.replicas
    experts = {p for module in family.parallelism(model, layout).routed_experts() for p in module.parameters()}
    rest = [p for p in model.parameters() if p not in experts]
    return shard_bytes(rest, replicas, dtype) + shard_bytes(experts, replicas // layout.ep, dtype)
