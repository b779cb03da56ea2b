"""FSDP2 (`fully_shard`) on a model with Sites: each transformer layer, the module holding a
`layer` Site, is one unit whose parameters are gathered for its forward and backward; the root
holds the rest (embedding, final norm, loss head).

Recompute under FSDP2: a layer's own replay runs in its backward, when FSDP2 has gathered its
parameters. A full-recompute group of several layers replays its earlier layers from the last
layer's backward, after FSDP2 resharded them, so each layer Site gathers its layer before such a
replay (`Site.before_replay`); the layer's own backward then reshards it as usual.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from remat.labels import LAYER
from remat.problems import ConfigError, Problem
from remat.sites import Site


def layer_modules(model: nn.Module) -> list[tuple[nn.Module, Site]]:
    """(layer module, its `layer` Site) for each transformer layer, first to last."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, Site) and module.label == LAYER:
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            found.append((model.get_submodule(parent), module))
    return found


def fully_shard_layers(model: nn.Module, mesh: DeviceMesh | None = None, *,
                       compute_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` over `mesh` (default: every rank of the default process group) with FSDP2,
    one unit per transformer layer and the root. `compute_dtype` (e.g. bfloat16 over float32
    parameters): the dtype parameters are gathered in for compute, with gradients reduced in
    float32, as Megatron keeps fp32 main weights and gradients. Returns `model`, sharded in place."""
    layers = layer_modules(model)
    problems = []
    if not layers:
        problems.append(Problem("model", f"{type(model).__name__} marks no 'layer' Sites, so FSDP2 has no per-layer"
                                         " units; place Site('layer') around each transformer layer's forward"
                                         " (remat.adapt does for known families)"))
    if not dist.is_initialized():
        problems.append(Problem("torch.distributed", "no process group: launch with torchrun and call"
                                                     " torch.distributed.init_process_group() first"))
    if problems:
        raise ConfigError(problems)
    if mesh is None:
        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy() if compute_dtype is None else MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for module, site in layers:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        site.before_replay = module.unshard  # type: ignore[assignment,operator]
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
