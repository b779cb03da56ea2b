"""Expert parallelism as torchtitan and Megatron run it, on torch.distributed: the routed experts of
each MoE layer split over `ep` data-parallel ranks, token slots sent to the ranks holding their
experts and the outputs back by torch's autograd-aware all-to-all (the family's MoE layers do the
exchange; the family seam says which modules hold the experts).

Layout (Megatron's): expert-parallel ranks are data-parallel ranks. The data-parallel mesh is
unflattened into (edp, ep), ep inner, so an expert-parallel group is `ep` adjacent ranks, and the
ranks holding the same experts (edp = dp / ep) are one apart by ep. FSDP2 shards each layer's
experts over edp and the rest of the model over all dp ranks, each averaging its gradients. An
expert's gradient sums the tokens of its whole expert-parallel group (the all-to-all's backward
brings them), so the family scales it by 1 / ep, and the mean over edp is the mean over dp, as
for every other gradient (torchtitan gets there by FSDP2's gradient divide factor, which torch
2.13 applies twice on a one-rank mesh in float64).

Recompute: the exchange runs inside the MoE layer, so inside the `moe` Site, as Megatron's `moe`
recompute checkpoints the whole layer with its dispatch and combine. A replay of `moe` or of a
full-recompute group runs the all-to-alls again. Every rank runs the same layers under the same
plan, and autograd reaches the same nodes in the same order on each (the graphs differ only in how
many rows each op holds), so the ranks of a group replay the same exchanges in the same order.
`moe_act` and `shared_experts` replay no communication.

Beside pipeline parallelism (Megatron's layout): each stage splits its experts over the dp ranks
of its own pipeline rank (`mesh["dp"]` of the pp x dp mesh), so the ranks of an expert-parallel
group hold the same stages. torch's 1F1B and interleaved schedules order a rank's forwards and
backwards by its pipeline rank and the micro-batch count alone, so the ranks of a group run the
same micro-batches of the same stages in the same order, each exchange (and replay) matched one
for one; the pipeline's sends and receives stay within one data-parallel replica.

Beside tensor parallelism (Megatron's default expert tensor-parallel size, etp = tp): an
expert-parallel group's ranks share their tensor-parallel rank, and every tensor-parallel rank
routes all of its replica's tokens (gathered first under sequence parallelism), so each exchanges
the same slots within its own group, runs its share of each expert's FFN on them, and the MoE
layer sums the tp ranks' partial outputs after the exchange back. The experts are split first,
each rank drawing its experts whole as one process does, and their FFN then split over tp
(`split_experts`, `parallelize_tensor`, `shard_experts`).

Beside context parallelism: an expert-parallel group's ranks share their cp rank and exchange
its tokens; each cp rank's expert gradients are of its own tokens, so FSDP2 shards the experts
over the ranks holding the same ones across both (edp x cp) and averages there, as it averages
the rest over dp x cp.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from remat.config.parallel import ParallelLayout
from remat.core.problems import Problem, raise_if_any
from remat.parallel.data_parallel import fully_shard_layers, mixed_precision
from remat.parallel.state import ParallelState, built_layout_problems, mesh_problems, planned, unknown_model_problems

EXPERT_MESH_DIMS = ("edp", "ep")


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The data-parallel `mesh` as edp x ep: `["ep"]` this rank's expert-parallel group, `["edp"]`
    the ranks holding the same experts."""
    return mesh._unflatten(0, (mesh.size() // ep, ep), EXPERT_MESH_DIMS)


def _mesh_problems(mesh: DeviceMesh | None, ep: int) -> Iterator[Problem]:
    yield from mesh_problems(mesh, "data-parallel", "dp")
    if mesh is not None and mesh.ndim == 1 and mesh.mesh_dim_names is None:  # torch unflattens named dimensions only
        yield Problem("mesh", "has no dimension names; make it with init_device_mesh(..., mesh_dim_names=('dp',))")
    if dist.is_initialized():
        size = dist.get_world_size() if mesh is None else mesh.size()
        yield from ParallelLayout(ep=ep, num_gpus=size).expert_problems()


@dataclass(frozen=True)
class ExpertSplit:
    """Experts split by `split_experts`: the mesh of this rank's replicas (whose mean gradient
    FSDP2 takes), the ranks holding the same experts, and the modules holding this rank's experts."""

    data_parallel: DeviceMesh
    holding: DeviceMesh
    experts: list[nn.Module]


def split_experts(model: nn.Module, mesh: DeviceMesh | None, ep: int) -> ExpertSplit:
    """Split the routed experts of `model` (built with expert_model_parallel_size = `ep`) over
    groups of `ep` ranks of the data-parallel `mesh` (default: every rank of the default process
    group): each rank draws its experts whole, as one process draws them. Under tensor parallelism
    call it before `parallelize_tensor` (which then splits each expert's FFN over the
    tensor-parallel ranks) and `shard_experts` after; `parallelize_experts` does both without.
    Call on every rank, after seeding torch alike on all of them (`parallelize` splits them
    under context parallelism too). Raises one ConfigError with every problem before changing anything."""
    problems = [*_mesh_problems(mesh, ep), *unknown_model_problems(model)]
    if any(isinstance(p, DTensor) for p in model.parameters()):
        problems.append(
            Problem(
                "model",
                "is already split by tensor parallelism or sharded by FSDP2; split its"
                " experts first (split_experts before parallelize_tensor, shard_experts"
                " after)",
            )
        )
    raise_if_any(problems)
    state = planned(model, ep=ep)
    raise_if_any(built_layout_problems(model, state))
    device = next(model.parameters()).device
    return split_checked(state, mesh or init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",)))


def split_checked(
    state: ParallelState, mesh: DeviceMesh, context: tuple[DeviceMesh, DeviceMesh] | None = None
) -> ExpertSplit:
    """`split_experts` on a model whose layout's problems are checked. `context`: under context
    parallelism, the pp x dp x cp x tp mesh (`ParallelLayout.mesh`) whose "dp" `mesh` is, and its
    flattened dp x cp replicas: each cp rank's expert gradients are of its own tokens, so the ranks
    holding the same experts are edp x cp of it."""
    ep = state.layout.ep
    if context is None:
        split = expert_mesh(mesh, ep)
        return ExpertSplit(mesh, split["edp"], state.parallelism.split_experts(split["ep"].get_group()))
    root, replicas = context
    names = root.mesh_dim_names or ()
    split = root._unflatten(names.index("dp"), (mesh.size() // ep, ep), EXPERT_MESH_DIMS)
    return ExpertSplit(
        replicas, split["edp", "cp"]._flatten(), state.parallelism.split_experts(split["ep"].get_group())
    )


def shard_experts(
    model: nn.Module,
    split: ExpertSplit,
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reduce_once_a_step: bool = False,
) -> nn.Module:
    """Shard `model`, whose experts `split` split, by FSDP2 over its data-parallel mesh
    as `fully_shard_layers` does (in its mixed precision and schedule), its experts over the ranks
    holding the same ones. Returns `model`."""
    policy = mixed_precision(compute_dtype, reduce_dtype)
    for experts in split.experts:
        fully_shard(experts, mesh=split.holding, mp_policy=policy, reshard_after_forward=not reduce_once_a_step)
    return fully_shard_layers(
        model,
        split.data_parallel,
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        reduce_once_a_step=reduce_once_a_step,
    )


def parallelize_experts(
    model: nn.Module,
    mesh: DeviceMesh | None,
    ep: int,
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reduce_once_a_step: bool = False,
) -> nn.Module:
    """`split_experts` then `shard_experts`, for a model without tensor parallelism: its routed
    experts split over groups of `ep` ranks of the data-parallel `mesh` (a pipeline stage passes
    its pipeline rank's), the model sharded by FSDP2 over `mesh`, the experts over the ranks
    holding the same ones. Returns `model`."""
    return shard_experts(
        model,
        split_experts(model, mesh, ep),
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        reduce_once_a_step=reduce_once_a_step,
    )
