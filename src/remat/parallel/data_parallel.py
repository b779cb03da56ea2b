"""FSDP2 (`fully_shard`) on a model with Sites: each transformer layer, the module holding a
`layer` Site, is one unit whose parameters are gathered for its forward and backward; the root
holds the rest (embedding, final norm, loss head).

Recompute under FSDP2: a layer's own replay runs in its backward, when FSDP2 has gathered its
parameters. A full-recompute group of several layers replays its earlier layers from the last
layer's backward, after FSDP2 resharded them, so each layer Site gathers its layer before such a
replay (`Site.before_replay`); the layer's own backward then reshards it as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from remat.core.labels import LAYER
from remat.core.problems import ConfigError, Problem
from remat.parallel.state import planned, state_of
from remat.sites.site import Site


def layer_modules(model: nn.Module) -> list[tuple[nn.Module, Site]]:
    """(layer module, its `layer` Site) for each transformer layer, first to last."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, Site) and module.label == LAYER:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            found.append((model.get_submodule(parent), module))
    return found


def mixed_precision(compute_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in `compute_dtype` and gradients reduced in
    `reduce_dtype` (default float32); none given, everything in the parameters' own dtype."""
    if compute_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype or torch.float32)


def fully_shard_layers(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    reduce_once_a_step: bool = False,
) -> nn.Module:
    """Shard `model` over `mesh` (default: every rank of the default process group) with FSDP2,
    one unit per transformer layer and the root. `compute_dtype` (e.g. bfloat16 over float32
    parameters): the dtype parameters are gathered in for compute, with gradients reduced in
    `reduce_dtype` (default float32), as Megatron keeps fp32 main weights and gradients.
    `reduce_once_a_step`: Megatron's distributed optimizer on FSDP2 (only the main parameters,
    their gradients between steps and the moments sharded): each layer stays gathered from its
    first forward of a step to the step's last backward, and gradients accumulate whole and are
    reduce-scattered once, in the last micro-batch's backward (tell it which: `accumulate`).
    Returns `model`, sharded in place."""
    layers = layer_modules(model)
    problems = []
    if not layers:
        problems.append(
            Problem(
                "model",
                f"{type(model).__name__} marks no 'layer' Sites, so FSDP2 has no per-layer"
                " units; place Site('layer') around each transformer layer's forward"
                " (remat.models.adapt does for known families)",
            )
        )
    if not dist.is_initialized():
        problems.append(
            Problem(
                "torch.distributed",
                "no process group: launch with torchrun and call torch.distributed.init_process_group() first",
            )
        )
    if problems:
        raise ConfigError(problems)
    if mesh is None:
        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = mixed_precision(compute_dtype, reduce_dtype)
    reshard = reshard_after_forward and not reduce_once_a_step
    in_layers = {id(m) for module, _ in layers for m in module.modules()}
    for module, site in layers:
        units = [*_other_dtype_units(module.modules(), module), module]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        site.before_replay = _unshard(units)
    outside = [m for m in model.modules() if id(m) not in in_layers]
    for unit in _other_dtype_units(outside, model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    planned(model).reduce_once = reduce_once_a_step
    return model


def _other_dtype_units(modules: Iterable[nn.Module], unit: nn.Module) -> list[nn.Module]:
    """The modules among `modules` (those of `unit`) whose own parameters are all of another
    dtype than most of `unit`'s, innermost first: FSDP2 flattens one dtype per unit, and
    transformers keeps some weights in float32 in a bfloat16 model (DeepSeek-V3's router)."""
    modules = list(modules)
    sizes: dict[torch.dtype, int] = {}
    for module in modules:
        for p in module.parameters(recurse=False):
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    most = max(sizes, key=sizes.__getitem__)
    return [
        m
        for m in reversed(modules)
        if m is not unit and (own := list(m.parameters(recurse=False))) and all(p.dtype != most for p in own)
    ]


def _unshard(units: list[nn.Module]) -> Callable[[], None]:
    """Gather a layer's units (the layer's own last) before a replay from a later layer's backward."""

    def gather() -> None:
        for unit in units:
            unit.unshard()  # type: ignore[operator]

    return gather


def accumulate(model: nn.Module, last: bool) -> None:
    """Before each micro-batch of a step on a model sharded with `reduce_once_a_step`: whether it
    is the step's last, whose backward reduces the gradients and reshards the layers. (torch's
    pipeline schedules do this for their stages themselves.) Other models: nothing."""
    state = state_of(model)
    if state is not None and state.reduce_once:
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        model.set_reshard_after_backward(last)  # type: ignore[operator]


def shard_bytes(params: Iterable[torch.Tensor], shards: int, dtype: torch.dtype) -> int:
    """Bytes one rank holds of `params` sharded by FSDP2 over `shards` ranks in `dtype`: each
    parameter split along dim 0 into equal chunks, the last padded (FSDP2's rule)."""
    size = dtype.itemsize
    return sum(-(-p.shape[0] // shards) * (p.numel() // p.shape[0]) * size if p.dim() else size for p in params)


def gathered_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of parameters FSDP2 holds gathered in `dtype` at a step's peak: the root's (it
    does not reshard them between forward and backward) and one layer's, the one computing."""
    layers = [module for module, _ in layer_modules(model)]
    in_layers = {p for layer in layers for p in layer.parameters()}
    size = dtype.itemsize
    root = sum(p.numel() for p in model.parameters() if p not in in_layers)
    largest = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
    return (root + largest) * size
