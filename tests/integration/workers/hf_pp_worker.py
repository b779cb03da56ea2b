"""Run by tests/integration/test_hf_pipeline_runs.py under torchrun (gloo, CPU, 2 processes): tiny
Hugging Face Llama and Mixtral causal LMs (float64, 4 layers) cut into pipeline stages by the hf
family, each stage holding the whole model's weights for its layers (copied by name), under torch's
1F1B and interleaved 1F1B (2 virtual stages); one step of 4 micro-batches without recompute
(attention dropout off, to hold against the whole model's step on one process, which rank 0 also
runs, and on) and one per recompute plan with dropout on (to hold against no recompute). Rank 0
saves every result to the file argv[1]. Under 4 processes the same runs 1F1B on a pp 2 x tp 2 mesh,
each stage split by the model's own tensor-parallel plan.

The Llama with tied embeddings (TIED) holds its embedding on both ends of the pipeline: a stage
loads the whole model's weight under either name. Beside the tied model's own step on one process,
rank 0 runs the same model untied (its output layer a copy of the embedding), whose two gradients
summed are the pipeline's arithmetic for the tied weight. The last stage's copy is drawn anew
before the pipeline starts it as the first's. Under 4 processes the tied model also runs 1F1B on
pp 2 x dp 2, each stage sharded by FSDP2."""

from __future__ import annotations

import warnings
from typing import Any

import gloo
import hf_tp_worker  # the plans of the tensor-parallel tests
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import remat
from remat.config.parallel import ParallelLayout
from remat.models.hf.family import FAMILY
from remat.parallel import Pipeline, fully_shard_layers
from remat.parallel.tensor_parallel import parallelize_tensor
from remat.run.build import stage_plan
from remat.sites.calls import forward_loss

LAYERS, SEQ, MICRO_BATCHES = 4, 16, 4
LAYOUTS = {"1f1b": ParallelLayout(pp=2), "interleaved": ParallelLayout(pp=2, vp=2)}
TIED = "llama, tied"
FAMILIES = {**hf_tp_worker.FAMILIES, TIED: "mlp"}
TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def config(family: str, dropout: float, tied: bool | None = None) -> Any:
    """`tied`: the tied family's model with tie_word_embeddings so (None: as the family has it)."""
    if family == TIED:
        return FAMILY.config(
            "hf:llama",
            num_layers=LAYERS,
            seq_length=SEQ,
            attention_dropout=dropout,
            tie_word_embeddings=tied is not False,
        )
    return FAMILY.config(f"hf:{family}", num_layers=LAYERS, seq_length=SEQ, attention_dropout=dropout)


def whole(family: str, dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return FAMILY.build(config(family, dropout), dtype=torch.float64).train()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(
        0, config("llama", 0.0).vocab_size, (MICRO_BATCHES, 1, SEQ), generator=torch.Generator().manual_seed(1)
    )
    return [(i, i) for i in ids]  # HF's causal-LM loss shifts the labels itself


def weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter by every name it has: a tied weight under both."""
    return dict(model.named_parameters(remove_duplicate=False))


def one_process(family: str, untied: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """`untied`: the tied family's model untied, loaded with the tied weights, the gradients of its
    two copies summed (embedding + output layer, as the pipeline's first stage adds them)."""
    model = whole(family, 0.0)
    if untied:
        source, model = weights(model), FAMILY.build(config(family, 0.0, tied=False), dtype=torch.float64).train()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(source[name])
    total = 0.0
    for inputs, labels in batches():
        loss = forward_loss(model, inputs, labels) / MICRO_BATCHES
        loss.backward()
        total += loss.item()
    grads = {name: p.grad for name, p in weights(model).items()}
    if untied:
        tied = grads[TIED_NAMES[0]] + grads[TIED_NAMES[1]]
        grads.update(dict.fromkeys(TIED_NAMES, tied))
    return total, grads


def step(
    family: str, layout: ParallelLayout, plan: Any, dropout: float, sharded: bool = False
) -> tuple[float, dict[str, torch.Tensor]]:
    """`sharded`: the ranks beside each stage's are its FSDP2 data-parallel ranks (each on the same
    batches, so their mean gradient is one rank's), else its tensor-parallel ranks."""
    tp = 1 if sharded else dist.get_world_size() // layout.pp
    mesh = init_device_mesh(
        "cpu", (layout.pp, dist.get_world_size() // layout.pp), mesh_dim_names=("pp", "dp" if sharded else "tp")
    )
    rank, source = mesh["pp"].get_local_rank(), weights(whole(family, dropout))
    stages = []
    for index in layout.stage_indices(rank):
        shard = FAMILY.shard(config(family, dropout), layout, layout.chunk_layers(LAYERS, index))
        stage = FAMILY.build(
            shard, dtype=torch.float64, pre_process=index == 0, post_process=index == layout.chunks - 1
        ).train()
        with torch.no_grad():  # a stage's parameters carry the whole model's names
            for name, p in stage.named_parameters():
                p.copy_(source[name])
            if family == TIED and index == layout.chunks - 1:  # the pipeline sets it to the first stage's
                stage.lm_head.weight.normal_()
        if sharded:
            fully_shard_layers(stage, mesh["dp"])
        if tp > 1:  # every rank seeded alike (whole's seed): each tp rank's own stream from it
            parallelize_tensor(stage, mesh["tp"], sequence_parallel=False)
        if plan is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", remat.RematWarning)
                remat.apply(stage, stage_plan(plan, layout, LAYERS, index))
        stages.append(stage)
    hidden = torch.empty(1, SEQ, stages[0].model.config.hidden_size, dtype=torch.float64, device="meta")
    pipeline = Pipeline(
        stages, layout, pipeline_rank=rank, hidden=hidden, micro_batches=MICRO_BATCHES, group=mesh["pp"].get_group()
    )
    torch.manual_seed(100 + rank)
    loss = pipeline.forward_backward(batches())
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # type: ignore[misc]
        for stage in stages
        for name, p in stage.named_parameters()
    }
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, grads)
    return loss.item(), {k: v for g in gathered for k, v in g.items()}


def results() -> dict[str, Any]:
    found: dict[str, Any] = {}
    layouts = LAYOUTS if dist.get_world_size() == 2 else {"1f1b x tp 2": LAYOUTS["1f1b"]}
    if dist.get_world_size() == 4:
        found[f"{TIED}@1f1b x dp 2@none@0.0"] = step(TIED, LAYOUTS["1f1b"], None, 0.0, sharded=True)
    for family, block in FAMILIES.items():
        for layout_name, layout in layouts.items():
            for name, plan in hf_tp_worker.plans(block).items():
                for dropout in (0.0, 0.1) if plan is None else (0.1,):
                    found[f"{family}@{layout_name}@{name}@{dropout}"] = step(family, layout, plan, dropout)
        if dist.get_rank() == 0:
            found[f"{family}@one process"] = one_process(family, untied=family == TIED)
    if dist.get_rank() == 0:
        found[f"{TIED}@one process, tied"] = one_process(TIED)
    return found


if __name__ == "__main__":
    gloo.run(results)
