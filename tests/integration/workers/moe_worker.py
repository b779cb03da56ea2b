"""Run by tests/integration/test_moe_parallel_runs.py under torchrun (gloo, CPU, 2 processes), one
launch for all:

- pipeline: an MoE recipe (moe_tiny; deepseek_tiny with MLA and expert bias) split into 2
  stages by `remat.run.build.build_model` (1F1B, and interleaved 1F1B with 2 virtual stages), each
  stage holding the whole model's weights and expert bias for its layers (copied in by the
  layers' global numbers); one step of 4 micro-batches per plan, then the balancing step.
- data parallel: deepseek_tiny on 2 data-parallel ranks (FSDP2, built by build_model), each
  on micro-batches of its own, two balancing steps.

Rank 0 saves everything to the file argv[1], gradients and biases named as in the whole model."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import gloo
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import remat
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.models import family_of
from remat.parallel import Pipeline, mean_over_ranks, model_chunks
from remat.run import build
from remat.run import step as steps
from remat.run.spec import RunSpec
from remat.sites.calls import after_optimizer_step

MICRO_BATCHES, SEQ = 4, 16
OVERRIDES: dict[str, Any] = dict(num_layers=4, seq_length=SEQ, attention_backend="eager")
LAYOUTS = {"1f1b": (2, None), "interleaved": (2, 2)}
SELECTIVE = {"moe_tiny": ["core_attn", "moe_act", "moe"], "deepseek_tiny": ["core_attn", "mla_up_proj", "moe"]}
# (recipe, layout) -> plan names; full recompute within a stage (2 layers, or 1 interleaved)
CASES: dict[tuple[str, str], tuple[str, ...]] = {
    ("moe_tiny", "1f1b"): ("none", "selective", "full_uniform_2"),
    ("moe_tiny", "interleaved"): ("none", "selective", "full_uniform_1"),
    ("deepseek_tiny", "1f1b"): ("none", "selective", "full_uniform_1"),
    ("deepseek_tiny", "interleaved"): ("none", "full_uniform_1"),
}


def spec(recipe: str, layout: str | None = None, num_gpus: int | None = None, ep: int = 1) -> RunSpec:
    pp, vp = LAYOUTS[layout] if layout else (1, None)
    return RunSpec(
        recipe=recipe,
        overrides=OVERRIDES,
        global_batch_size=MICRO_BATCHES,
        precision=Precision("fp64"),
        device="cpu",
        optimizer=False,
        layout=ParallelLayout(pp=pp, vp=vp, ep=ep, num_gpus=num_gpus),
    )


def plan(recipe: str, name: str) -> RecomputeConfig | None:
    facts = family_of(recipe).config(recipe, **OVERRIDES).megatron_facts()
    if name == "none":
        return None
    if name == "selective":
        return RecomputeConfig.from_megatron(
            {**facts, "recompute_granularity": "selective", "recompute_modules": SELECTIVE[recipe]}
        )
    return RecomputeConfig.from_megatron(
        {**facts, "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": int(name[-1])}
    )


def whole(recipe: str) -> nn.Module:
    """The one-process model of the recipe, as build_model draws it, with a random expert bias
    (routing then depends on it too)."""
    s = spec(recipe)
    torch.manual_seed(s.seed)  # build_model's seed of the one-process model
    model = s.family.build(s.model_config, dtype=s.dtype, device=s.device)
    g = torch.Generator().manual_seed(7)
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            buffer.copy_(0.5 * torch.randn(buffer.shape, generator=g, dtype=buffer.dtype))
    return model


def batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, 512, (count, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return [(ids[i : i + 1, :-1], ids[i : i + 1, 1:]) for i in range(count)]


class Data:
    """A step's micro-batches, given (what MockData's `batch` hands out)."""

    def __init__(self, given: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.spec, self.given = spec("moe_tiny"), iter(given)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self.given)


def global_names(chunk: nn.Module) -> Iterator[tuple[str, str]]:
    """(name in the chunk, name in the whole model) of each parameter and buffer: layer j of the
    chunk is the whole model's layer config.layers[j]."""
    layers = chunk.config.layers  # type: ignore[union-attr]
    for name in [n for n, _ in chunk.named_parameters()] + [n for n, _ in chunk.named_buffers()]:
        yield name, re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layers[int(m[1])]}.", name)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _experts_of(chunk: nn.Module, name: str) -> nn.Module | None:
    """The MoE layer whose routed experts' weight `name` is, or None for any other tensor."""
    return chunk.get_submodule(name.rsplit(".", 2)[0]) if ".experts.weight" in name else None


@torch.no_grad()
def load(chunk: nn.Module, source: Mapping[str, torch.Tensor]) -> None:
    """The whole model's tensors into a stage: under expert parallelism a rank's experts only,
    under FSDP2 its shard."""
    own = state(chunk)
    for local, global_ in global_names(chunk):
        whole, target = source[global_], own[local]
        if (moe := _experts_of(chunk, local)) is not None:
            first = moe.experts.first_expert
            whole = whole[first : first + target.shape[0]]
        if isinstance(target, DTensor):
            whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        target.copy_(whole)


def whole_grad(chunk: nn.Module, name: str, grad: torch.Tensor) -> torch.Tensor:
    """A gradient whole: gathered from FSDP2's shards, an expert weight's from its expert-parallel
    group in expert order."""
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    moe = _experts_of(chunk, name)
    if moe is None or moe.dispatch is None:
        return grad
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(moe.dispatch.group))]
    dist.all_gather(parts, grad.contiguous(), group=moe.dispatch.group)
    return torch.cat(parts)


def pipelined(s: RunSpec, name: str, source: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """One step of the spec's pipeline, weights from `source`, on the data-parallel replica's share
    of the global batch of MICRO_BATCHES; the mean loss over the replicas."""
    model = build.build_model(s)
    assert isinstance(model, Pipeline)
    for chunk in model.chunks:
        load(chunk, source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)  # moe on the dense first layer
        build.apply_plan(s, model, plan(s.recipe, name))
    replica = s.layout.coordinates(dist.get_rank()).dp
    mine = batches(MICRO_BATCHES)[replica * s.micro_batches : (replica + 1) * s.micro_batches]
    loss = steps.forward_backward(model, Data(mine), s.micro_batches)  # type: ignore[arg-type]
    after_optimizer_step(model)
    found: dict[str, dict[Any, Any]] = {"kinds": {}, "grads": {}, "bias": {}, "experts": {}}
    for chunk in model_chunks(model):
        own = state(chunk)
        for local, global_ in global_names(chunk):
            if local.endswith("expert_bias"):
                found["bias"][global_] = own[local].clone()
            elif (grad := own[local].grad) is not None:
                found["grads"][global_] = whole_grad(chunk, local, grad)
        for index, layer in zip(chunk.config.layers, chunk.decoder.layers):  # type: ignore[union-attr]
            found["kinds"][index] = type(layer.mlp).__name__
            if getattr(layer.mlp, "dispatch", None) is not None:  # which experts, split over which ranks
                found["experts"][index, dist.get_rank()] = (
                    layer.mlp.experts.first_expert,
                    dist.get_process_group_ranks(layer.mlp.dispatch.group),
                )
    gathered: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, found)
    merged = {key: {k: v for g in gathered for k, v in g[key].items()} for key in found}
    return {"loss": mean_over_ranks(loss).item(), **merged}


def data_parallel() -> dict[str, Any]:
    """Two balancing steps of deepseek_tiny on 2 data-parallel ranks: rank r's micro-batches are
    the global batch's r-th half. Returns every rank's biases after each step."""
    s = spec("deepseek_tiny", num_gpus=2)
    model = build.build_model(s)
    source = whole("deepseek_tiny")
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(dict(source.named_buffers())[name])
    rank, per_rank = dist.get_rank(), s.micro_batches
    given = batches(2 * per_rank * 2, seed=3)  # two steps of the global batch
    biases = []
    for k in range(2):
        mine = given[(2 * k + rank) * per_rank : (2 * k + rank + 1) * per_rank]
        steps.forward_backward(model, Data(mine), per_rank)
        after_optimizer_step(model)
        biases.append({n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    gathered: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, biases)
    return {"per_rank": per_rank, "biases": gathered}


def results() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for recipe in ("moe_tiny", "deepseek_tiny"):
        source = {name: t.detach().clone() for name, t in state(whole(recipe)).items()}
        for (r, layout), names in CASES.items():
            if r == recipe:
                found.update(
                    {f"{recipe}:{layout}:{name}": pipelined(spec(recipe, layout), name, source) for name in names}
                )
    found["data_parallel"] = data_parallel()
    return found


if __name__ == "__main__":
    gloo.run(results)
