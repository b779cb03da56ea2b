"""Run by tests/integration/test_pipeline_runs.py under torchrun (gloo, CPU, 2 processes): remat's
tiny Llama split into pipeline stages run by torch's 1F1B schedule (and interleaved 1F1B with 2
virtual stages), each stage's weights those of one whole model; one step of 4 micro-batches per
plan. Rank 0 saves the mean loss and every stage's gradients, named as in the whole model, to the
file argv[1]."""

from __future__ import annotations

import warnings

import fsdp_worker  # the tiny model, its batch and the plans of the FSDP2 tests
import gloo
import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.config.parallel import ParallelLayout
from remat.models import family_of, recipe_config
from remat.parallel import Pipeline, layer_modules
from remat.run.build import stage_plan

MICRO_BATCHES = 4
HIDDEN = recipe_config("llama3_tiny").hidden_size
LAYOUTS = {"1f1b": ParallelLayout(pp=2), "interleaved": ParallelLayout(pp=2, vp=2)}
# stages of two layers under 1F1B, of one under interleaving: full recompute within a stage
PLANS = {
    "1f1b": {name: plan for name, plan in fsdp_worker.PLANS.items() if name != "full_block_3"},
    "interleaved": {
        name: plan for name, plan in fsdp_worker.PLANS.items() if name in ("none", "selective", "full_uniform_1")
    },
}


def stage_names(stage: nn.Module, whole: nn.Module, layers: range) -> dict[str, str]:
    """Each stage parameter's name in the whole model: its layers are the whole model's `layers`,
    paired in order (by their `layer` Sites), and the rest (embedding, final norm, loss head) keep
    their names."""
    whole_names = {id(m): n for n, m in whole.named_modules()}
    stage_names = {id(m): n for n, m in stage.named_modules()}
    whole_layers = [module for module, _ in layer_modules(whole)]
    names = {}
    for (module, _), index in zip(layer_modules(stage), layers):
        for relative, _ in module.named_parameters():
            names[f"{stage_names[id(module)]}.{relative}"] = f"{whole_names[id(whole_layers[index])]}.{relative}"
    return {name: names.get(name, name) for name, _ in stage.named_parameters()}


def chunks(dropout: float, layout: ParallelLayout, rank: int) -> tuple[list[nn.Module], list[dict[str, str]]]:
    whole = fsdp_worker.model(dropout)
    family = family_of("llama3_tiny")
    config = recipe_config(
        "llama3_tiny",
        num_layers=fsdp_worker.LAYERS // layout.chunks,
        attention_backend="eager",
        attention_dropout=dropout,
        hidden_dropout=dropout,
        seq_length=fsdp_worker.SEQ,
    )
    built, names = [], []
    whole_params = dict(whole.named_parameters())
    for index in layout.stage_indices(rank):
        stage = family.build(
            config, dtype=torch.float64, pre_process=index == 0, post_process=index == layout.chunks - 1
        )
        named = stage_names(stage, whole, layout.chunk_layers(fsdp_worker.LAYERS, index))
        with torch.no_grad():
            for name, p in stage.named_parameters():
                p.copy_(whole_params[named[name]])
        built.append(stage)
        names.append(named)
    return built, names


def step(dropout: float, layout_name: str, plan: object) -> tuple[float, dict[str, torch.Tensor]]:
    layout, rank = LAYOUTS[layout_name], dist.get_rank()
    stages, names = chunks(dropout, layout, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        for stage, index in zip(stages, layout.stage_indices(rank)):
            remat.apply(stage, stage_plan(plan, layout, fsdp_worker.LAYERS, index))  # type: ignore[arg-type]
    hidden = torch.empty(1, fsdp_worker.SEQ, HIDDEN, dtype=torch.float64, device="meta")
    pipeline = Pipeline(stages, layout, pipeline_rank=rank, hidden=hidden, micro_batches=MICRO_BATCHES)
    inputs, labels = fsdp_worker.global_batch(MICRO_BATCHES // fsdp_worker.PER_RANK)
    torch.manual_seed(100 + rank)
    loss = pipeline.forward_backward([(inputs[i : i + 1], labels[i : i + 1]) for i in range(MICRO_BATCHES)])
    grads = {named[name]: p.grad for stage, named in zip(stages, names) for name, p in stage.named_parameters()}
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, grads)
    return loss.item(), {k: v for g in gathered for k, v in g.items()}


if __name__ == "__main__":
    gloo.run(
        lambda: {
            f"{layout}:{name}@{dropout}": step(dropout, layout, plan)
            for layout, plans in PLANS.items()
            for name, plan in plans.items()
            for dropout in (0.0, 0.1)
        }
    )
