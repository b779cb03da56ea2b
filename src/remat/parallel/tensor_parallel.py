"""Tensor parallelism, with or without sequence parallelism, by torch's DTensor styles
(`parallelize_module` with ColwiseParallel, RowwiseParallel, SequenceParallel,
PrepareModuleOutput), the module of each style named by the model's family.

Inside attention and the MLP each rank holds its own heads and its share of the FFN as plain
tensors, so every Site there (core_attn, mlp_act, mlp, layer) recomputes, discards or offloads
local tensors; the projections' own saves are DTensors, which stay on the device under offload.

Dropout follows Megatron: torch's default generators must be seeded alike on every
tensor-parallel rank, so dropout on tensors all ranks hold draws the same masks everywhere;
dropout on what only this rank holds (attention over its own heads; under sequence parallelism
also the hidden dropout over its own tokens) draws from this rank's own stream, seeded
seed + 2718 + tensor-parallel rank as Megatron's model-parallel RNG. The stream is registered
with the engine, so every recompute replays its masks exactly.

Megatron's distribute_saved_activations (`distribute_saved_inputs`): without sequence
parallelism every rank holds the residual stream whole, so a full-recompute range keeps only this
rank's 1/tp of its input and all-gathers it over the tensor-parallel group before the replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from remat.core.problems import Problem, raise_if_any
from remat.engine import KeptInputs, Restore, register_stream
from remat.models import ModelParallelism
from remat.models.family import on_tokens_argument, on_tokens_output
from remat.parallel.data_parallel import layer_modules
from remat.parallel.state import (
    ParallelState,
    built_layout_problems,
    mesh_problems,
    planned,
    state_of,
    unknown_model_problems,
)
from remat.sites.site import Site

# Megatron's offset of the model-parallel RNG seed from the data seed (model_parallel_cuda_manual_seed).
RANK_SEED_OFFSET = 2718


def _default_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_default_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RankStream:
    """This rank's own random stream on `device`: `fork()` swaps it into the device's default
    generator around what it encloses (forks do not nest), as Megatron's RNG tracker does."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._state = torch.Generator(device).manual_seed(seed).get_state()

    def get_state(self) -> torch.Tensor:
        return self._state

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        default = _default_state(self.device)
        _set_default_state(self.device, self._state)
        try:
            yield
        finally:
            self._state = _default_state(self.device)
            _set_default_state(self.device, default)


def seed_problems(mesh: DeviceMesh) -> Iterator[Problem]:
    seeds: list[int | None] = [None] * mesh.size()
    dist.all_gather_object(seeds, torch.initial_seed(), group=mesh.get_group())
    if len(set(seeds)) > 1:
        yield Problem(
            "seed",
            f"torch's default generators were seeded {seeds} on the tensor-parallel ranks, so"
            " dropout on the tensors they all hold would differ; call torch.manual_seed() with"
            " one seed on every tensor-parallel rank first",
        )


def parallelize_tensor(model: nn.Module, mesh: DeviceMesh | None = None, *, sequence_parallel: bool) -> nn.Module:
    """Split `model` over the ranks of `mesh` (one dimension; default: every rank of the default
    process group) by tensor parallelism, with `sequence_parallel` the tokens between attention
    and MLP split over them too. The embedding and the loss head stay whole on every rank.
    Call it on every rank, after seeding torch alike on all of them, and before FSDP2.
    Raises one ConfigError with every problem before changing anything. Returns `model`."""
    raise_if_any([*mesh_problems(mesh, "tensor-parallel", "tp"), *unknown_model_problems(model)])
    device = next(model.parameters()).device
    mesh = mesh or init_device_mesh(device.type, (dist.get_world_size(),))
    state = planned(model, tp=mesh.size(), sp=sequence_parallel)
    raise_if_any([*built_layout_problems(model, state), *seed_problems(mesh)])
    return split_tensor(model, state, mesh)


def split_tensor(model: nn.Module, state: ParallelState, mesh: DeviceMesh) -> nn.Module:
    """`parallelize_tensor` on a model whose layout's problems are checked."""
    device = next(model.parameters()).device
    stream = RankStream(device, torch.initial_seed() + RANK_SEED_OFFSET + mesh.get_local_rank())
    register_stream("tensor_parallel", stream)
    parallelize_module(model, mesh, state.parallelism.tensor_parallel(stream.fork))
    state.tensor_mesh = mesh
    return model


@dataclass(frozen=True)
class SavedInputShards:
    """A stand-in for what a full-recompute range keeps of its input (`engine.KeptInputs`), as
    Megatron's split_tensor_into_1d_equal_chunks and gather_split_1d_tensor: this rank's 1/size of
    the flattened tensor (the last shards padded), gathered by `group` before the replay; with no
    group, by shape (meta tensors: an estimate of one rank)."""

    size: int
    rank: int = 0
    group: dist.ProcessGroup | None = None

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, Restore] | None:
        # Only activations (leaves that need no gradient or a pipeline stage's received input stay
        # alive anyway); DTensors and non-contiguous tensors are kept whole.
        if type(t) is not torch.Tensor or t.is_leaf or not t.is_contiguous():
            return None
        numel, shape = t.numel(), t.shape
        chunk = -(-numel // self.size)
        piece = t.detach().reshape(-1)[self.rank * chunk : (self.rank + 1) * chunk]
        shard = torch.cat([piece, piece.new_zeros(chunk - piece.numel())])  # a copy: the input is freed
        return shard, lambda kept: self._gather(kept)[:numel].view(shape)

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return shard.repeat(self.size)
        return funcol.wait_tensor(funcol.all_gather_single(shard, 0, self.group))


def distribute_saved_inputs(model: nn.Module, on: bool = True) -> nn.Module:
    """Megatron's distribute_saved_activations on a model `parallelize_tensor` split without
    sequence parallelism: each full-recompute range of its layers keeps this rank's 1/tp of its
    input, and its replay all-gathers the input over the tensor-parallel group first. Whatever
    plan `apply` installs later keeps it; `on=False` takes it off. Call it after FSDP2 (whose
    gather before a replay it runs first). Returns `model`."""
    sites = [site for _, site in layer_modules(model)]
    stand_in: SavedInputShards | None = None
    if on:
        state = state_of(model)
        raise_if_any(_distribute_problems(state, bool(sites)))
        assert state is not None and state.tensor_mesh is not None  # or a problem was raised
        mesh = state.tensor_mesh
        stand_in = SavedInputShards(mesh.size(), mesh.get_local_rank(), mesh.get_group())
    _keep_inputs(sites, stand_in)
    return model


def distribute_saved_inputs_by_shape(model: nn.Module, tensor_parallel: int) -> nn.Module:
    """`distribute_saved_inputs` on the meta device, for a model already shaped as one rank's
    shard of `tensor_parallel` ranks: the ranges keep shards by shape, gathered by shape."""
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("splitting saved inputs by shape needs a model on the meta device")
    _keep_inputs([site for _, site in layer_modules(model)], SavedInputShards(tensor_parallel))
    return model


class _SeqGather(torch.autograd.Function):
    """All-gather along the sequence (dim 1) by shape; backward reduce-scatters."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:  # type: ignore[override]
        ctx.n = n
        return x.repeat(1, n, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.unflatten(1, (ctx.n, -1)).sum(1), None


class _SeqScatter(torch.autograd.Function):
    """Reduce-scatter (or split) along the sequence by shape; backward all-gathers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:  # type: ignore[override]
        ctx.n = n
        return x.unflatten(1, (n, -1))[:, 0].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.repeat(1, ctx.n, 1), None


def sequence_parallel_by_shape(parallelism: ModelParallelism) -> None:
    """Sequence parallelism on one rank's shard by shape (meta tensors): hooks where torch's
    SequenceParallel / Colwise / Rowwise styles communicate, each moving the tensors such a
    collective would."""
    tp = parallelism.layout.tp
    points = parallelism.sequence_points()

    def gather(x: torch.Tensor) -> torch.Tensor:
        return _SeqGather.apply(x, tp)

    def scatter(x: torch.Tensor) -> torch.Tensor:
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


def _keep_inputs(sites: list[Site], stand_in: SavedInputShards | None) -> None:
    """Each layer Site's before_replay keeps its inputs through `stand_in` (None: as usual),
    around the before_replay it had (FSDP2's gather)."""
    for site in sites:
        before = site.before_replay.before if isinstance(site.before_replay, KeptInputs) else site.before_replay
        site.before_replay = KeptInputs(stand_in, before) if stand_in is not None else before


def _distribute_problems(state: ParallelState | None, has_layers: bool) -> Iterator[Problem]:
    field = "distribute_saved_activations"
    if state is None or state.tensor_mesh is None:
        yield Problem(
            field,
            "splits saved inputs over the tensor-parallel ranks of a model split by"
            " parallelize_tensor, and this one is not; split it first, or turn this off",
        )
    elif state.layout.sp:
        yield Problem(
            field,
            "sequence parallelism already splits the saved inputs across ranks; set distribute_saved_activations=False",
        )
    elif state.tensor_mesh.size() == 1:
        yield Problem(
            field, "the model is split over one tensor-parallel rank: nothing to split saved inputs over; turn it off"
        )
    if not has_layers:
        yield Problem(
            field,
            "splits what full recompute keeps, and this model marks no 'layer' Sites to"
            " recompute whole; add layer Sites (remat.adapt does for known families)",
        )
