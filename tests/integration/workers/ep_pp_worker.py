"""Run by tests/integration/test_moe_parallel_runs.py under torchrun (gloo, CPU, 4 processes), one
launch for all:

- beside pipeline stages: the MoE recipes of moe_worker over pp 2 x dp 2 with their experts split
  over ep 2 (each pipeline stage's experts over the 2 data-parallel ranks of that stage), built by
  `remat.run.build.build_model` under 1F1B and interleaved 1F1B, each rank holding the whole model's
  weights for its layers and experts; one step per plan of moe_worker's, on each replica's half
  of the same 4 micro-batches, then the balancing step.
- beside tensor parallelism: the same recipes over dp 2 x tp 2, experts split over the 2
  data-parallel ranks (ep 2) and each expert's FFN over the 2 tensor-parallel ranks (Megatron's
  default etp = tp), with and without sequence parallelism, built by `build_model` from its seed;
  one step per plan, without dropout and with it.

Rank 0 saves everything to the file argv[1], gradients whole."""

from __future__ import annotations

import warnings
from typing import Any

import gloo
import torch
import torch.distributed as dist
from moe_worker import CASES, MICRO_BATCHES, OVERRIDES, Data, batches, pipelined, plan, spec, state, whole
from torch.distributed.tensor import DTensor
from tp_models_worker import one_process_order

import remat
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.parallel import mean_over_ranks
from remat.run import build
from remat.run import step as steps
from remat.run.spec import RunSpec

EP, TP, GPUS = 2, 2, 4
DROPOUT = 0.1
TP_PLANS = ("none", "selective", "full_uniform_2")


def tensor_parallel_spec(recipe: str, sequence_parallel: bool, dropout: float) -> RunSpec:
    overrides = {**OVERRIDES, "attention_dropout": dropout, "hidden_dropout": dropout}
    return RunSpec(
        recipe=recipe,
        overrides=overrides,
        global_batch_size=GPUS // TP,
        precision=Precision("fp64"),
        device="cpu",
        optimizer=False,
        layout=ParallelLayout(tp=TP, sp=sequence_parallel, ep=EP, num_gpus=GPUS),
    )


def _gather(grad: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, grad.contiguous(), group=group)
    return torch.cat(parts, dim)


def whole_grads(model: torch.nn.Module, shapes: dict[str, torch.Size], tp: dist.ProcessGroup) -> dict[str, Any]:
    """Every gradient whole, in one process's order: FSDP2's shards and DTensor's splits gathered,
    an expert weight's from its expert-parallel group, a tensor-parallel slice from its group."""
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if ".experts.weight" in name:
            grad = _gather(grad, 0, model.get_submodule(name.rsplit(".", 2)[0]).dispatch.group)
        if grad.shape != shapes[name]:
            grad = _gather(grad, next(d for d, (a, b) in enumerate(zip(grad.shape, shapes[name])) if a != b), tp)
        grads[name] = one_process_order(name, grad)
    return grads


def tensor_parallel(recipe: str, sequence_parallel: bool, dropout: float, name: str) -> dict[str, Any]:
    """One step of the dp 2 x tp 2 model on its replica's micro-batch of the same 2."""
    s = tensor_parallel_spec(recipe, sequence_parallel, dropout)
    shapes = {n: p.shape for n, p in whole(recipe).named_parameters()}
    model = build.build_model(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)  # moe on the dense first layer
        build.apply_plan(s, model, plan(recipe, name))
    replica = s.layout.coordinates(dist.get_rank()).dp
    loss = steps.forward_backward(model, Data(batches(2)[replica : replica + 1]), 1)  # type: ignore[arg-type]
    return {
        "loss": mean_over_ranks(loss).item(),
        "grads": whole_grads(model, shapes, s.layout.mesh("cpu")["tp"].get_group()),
    }


def results() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for (recipe, layout), names in CASES.items():
        source = {name: t.detach().clone() for name, t in state(whole(recipe)).items()}
        found.update(
            {f"{recipe}:{layout}:{name}": pipelined(spec(recipe, layout, GPUS, EP), name, source) for name in names}
        )
    for recipe in ("moe_tiny", "deepseek_tiny"):
        for sp in (False, True):  # the plans with dropout under sequence parallelism (its rank streams too)
            runs = [("none", 0.0)] + ([(name, DROPOUT) for name in TP_PLANS] if sp else [])
            found.update(
                {
                    f"tp:{recipe}:sp={sp}:{name}@{dropout}": tensor_parallel(recipe, sp, dropout, name)
                    for name, dropout in runs
                }
            )
    return found


if __name__ == "__main__":
    assert MICRO_BATCHES == 4  # 2 a replica: 1F1B over 2 stages needs 2
    gloo.run(results)
