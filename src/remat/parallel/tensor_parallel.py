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
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from remat import models
from remat.engine import register_stream
from remat.models import ParallelSizes
from remat.problems import ConfigError, Problem

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


def _seed_problems(mesh: DeviceMesh) -> Iterator[Problem]:
    seeds: list[int | None] = [None] * mesh.size()
    dist.all_gather_object(seeds, torch.initial_seed(), group=mesh.get_group())
    if len(set(seeds)) > 1:
        yield Problem("seed", f"torch's default generators were seeded {seeds} on the tensor-parallel ranks, so"
                              " dropout on the tensors they all hold would differ; call torch.manual_seed() with"
                              " one seed on every tensor-parallel rank first")


def parallelize_tensor(model: nn.Module, mesh: DeviceMesh | None = None, *, sequence_parallel: bool) -> nn.Module:
    """Split `model` over the ranks of `mesh` (one dimension; default: every rank of the default
    process group) by tensor parallelism, with `sequence_parallel` the tokens between attention
    and MLP split over them too. The embedding and the loss head stay whole on every rank.
    Call it on every rank, after seeding torch alike on all of them, and before FSDP2.
    Raises one ConfigError with every problem before changing anything. Returns `model`."""
    family = models.family_of_model(model)
    problems = []
    if not dist.is_initialized():
        problems.append(Problem("torch.distributed", "no process group: launch with torchrun and call"
                                                     " torch.distributed.init_process_group() first"))
    elif mesh is not None and mesh.ndim != 1:
        problems.append(Problem("mesh", f"has {mesh.ndim} dimensions {mesh.mesh_dim_names or ''}; pass its"
                                        " tensor-parallel one, e.g. mesh['tp']"))
    if family is None:
        problems.append(Problem("model", f"{type(model).__name__} belongs to no model family remat knows;"
                                         " build it with remat.models.build"))
    if family is None or problems:
        raise ConfigError(problems)
    device = next(model.parameters()).device
    mesh = mesh or init_device_mesh(device.type, (dist.get_world_size(),))
    sizes = ParallelSizes(tensor=mesh.size(), sequence_parallel=sequence_parallel)
    problems = [*family.tensor_parallel_problems(model, sizes), *_seed_problems(mesh)]
    if problems:
        raise ConfigError(problems)
    stream = RankStream(device, torch.initial_seed() + RANK_SEED_OFFSET + mesh.get_local_rank())
    register_stream("tensor_parallel", stream)
    parallelize_module(model, mesh, family.tensor_parallel(model, sizes, stream.fork))
    return model
