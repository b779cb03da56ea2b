"""What parallelizing leaves on a model for the steps after it, kept on the model itself: its
family's parallelism for the layout (what the model does under it), the tensor-parallel mesh it was split over, the context-parallel
group and tables sharded with each batch, and whether FSDP2 reduces its gradients once a step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from remat.config.parallel import ParallelLayout
from remat.core.problems import Problem
from remat.models import ModelFamily, ModelParallelism, family_of_model

# The attribute of a model that holds its ParallelState.
STATE = "_remat_parallel"


@dataclass(frozen=True)
class ContextShards:
    """A model's context-parallel group and the tensors it shards with each batch (RoPE tables,
    each with its sequence dimension)."""

    mesh: DeviceMesh
    buffers: list[tuple[Tensor, int]]


@dataclass
class ParallelState:
    family: ModelFamily | None  # None: a model of no family remat knows (FSDP2 runs on any with layer Sites)
    parallelism: ModelParallelism
    tensor_mesh: DeviceMesh | None = None  # set by tensor parallelism
    context: ContextShards | None = None  # set by context parallelism
    reduce_once: bool = False  # FSDP2 as Megatron's distributed optimizer

    @property
    def layout(self) -> ParallelLayout:
        return self.parallelism.layout


def state_of(model: nn.Module) -> ParallelState | None:
    """The parallel state of `model`, if a parallelism acted on it."""
    return model.__dict__.get(STATE)


def planned(
    model: nn.Module, family: ModelFamily | None = None, layout: ParallelLayout | None = None, **sizes: Any
) -> ParallelState:
    """The state of `model` with its family's parallelism for `layout`, or for its layout so far
    with `sizes` replaced (made anew when that changes it); a model of no family remat knows gets
    the base parallelism, which runs nothing but data parallelism."""
    state = state_of(model)
    family = family or (state.family if state is not None else family_of_model(model))
    layout = layout or dataclasses.replace(state.layout if state is not None else ParallelLayout(), **sizes)
    if state is None or layout != state.layout:
        parallelism = (
            family.parallelism(model, layout)
            if family is not None
            else ModelParallelism(model, layout, type(model).__name__)
        )
        state = ParallelState(
            family, parallelism, *(() if state is None else (state.tensor_mesh, state.context, state.reduce_once))
        )
        model.__dict__[STATE] = state
    return state


def unknown_model_problems(model: nn.Module) -> Iterator[Problem]:
    """A model whose family remat does not know (nor a parallelism found before)."""
    if state_of(model) is None and family_of_model(model) is None:
        yield Problem(
            "model", f"{type(model).__name__} belongs to no model family remat knows; build it with remat.models.build"
        )


def mesh_problems(mesh: DeviceMesh | None, kind: str, name: str) -> Iterator[Problem]:
    """A parallelism's process group and its one-dimensional mesh (`kind` ranks, `mesh[name]` of a larger one)."""
    if not dist.is_initialized():
        yield Problem(
            "torch.distributed",
            "no process group: launch with torchrun and call torch.distributed.init_process_group() first",
        )
    elif mesh is not None and mesh.ndim != 1:
        yield Problem(
            "mesh", f"has {mesh.ndim} dimensions {mesh.mesh_dim_names or ''}; pass its {kind} one, e.g. mesh['{name}']"
        )


def built_layout_problems(model: nn.Module, state: ParallelState) -> Iterator[Problem]:
    """Why `model` cannot run under its state's layout: its config's and the built model's."""
    if state.family is not None:
        yield from state.family.layout_problems(getattr(model, "config", None), state.layout)
    yield from state.parallelism.problems()
