"""Run by tests/test_context_parallel.py under torchrun (gloo, CPU, 2 processes): remat's tiny Llama
built by `build_model` with -cp 2 (torch's ring attention over the two ranks, FSDP2 over the
flattened dp x cp mesh), one step of 2 micro-batches on the step's mock data: every plan with
hidden dropout, and no recompute without dropout (pretrain, and SFT whose masked prompt leaves the
ranks unequal shares of labelled tokens). Rank 0 saves the mean loss and the full gradients of
each, each rank's share of a sequence, a bench run and the refusals to the file argv[1]."""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import remat
from remat import parallel
from remat.bench.run import run_bench
from remat.bench.spec import BenchSpec
from remat.layer_plan import Plan
from remat.problems import ConfigError
from remat.recompute import RecomputeConfig, TrainingFacts
from remat.step import MockData, RunSpec, apply_plan, build_model, forward_backward

import gloo
import fsdp_worker  # the plans of the FSDP2 tests

CP, SEQ, MICRO_BATCHES = 2, 16, 2
PLANS: dict[str, RecomputeConfig | Plan | None] = {
    **fsdp_worker.PLANS,
    "core_attn": RecomputeConfig(recompute_granularity="selective", recompute_modules=["core_attn"]),
}


def spec(dropout: float = 0.0, task: str = "pretrain", context_parallel: int = CP, **more: Any) -> RunSpec:
    """fp32 (torch's ring merges its blocks in fp32), 4 layers, attention through SDPA."""
    return RunSpec(recipe="llama3_tiny", overrides=dict(num_layers=fsdp_worker.LAYERS, seq_length=SEQ,
                                                        hidden_dropout=dropout), compute_dtype="fp32", device="cpu",
                   task=task, optimizer=False, global_batch_size=MICRO_BATCHES, num_gpus=context_parallel,
                   facts=TrainingFacts(context_parallel_size=context_parallel), **more)


def step(run: RunSpec, plan: object) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of `run` under `plan`: the loss averaged over the ranks, and the full gradients."""
    model = build_model(run)  # weights from the seed, before FSDP2 shards them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        apply_plan(run, model, plan)  # type: ignore[arg-type]
    loss = parallel.mean_over_ranks(forward_backward(model, MockData(run), run.micro_batches))
    grads = {name: getattr(p.grad, "full_tensor", lambda: p.grad)() for name, p in model.named_parameters()}
    return loss.item(), grads


def shares() -> list[list[int]]:
    """Each rank's positions of a sequence: torch's head-tail chunks (0 and 3 of 4, 1 and 2)."""
    run = spec()
    model = build_model(run)
    positions = torch.arange(SEQ)[None]
    with parallel.sharded(model, positions, positions.clone()):
        mine = positions[0].tolist()
    found: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(found, mine)
    return found


def refusal(fn: Any) -> list[str]:
    try:
        fn()
    except (ConfigError, ValueError) as err:
        return [str(err)]
    return []


def refusals() -> dict[str, list[str]]:
    cp_mesh = init_device_mesh("cpu", (CP,))
    two_d = init_device_mesh("cpu", (1, CP), mesh_dim_names=("dp", "cp"))
    eager = remat.models.build("llama3_tiny", attention_backend="eager", attention_dropout=0.1, seq_length=SEQ)
    short = build_model(spec())
    ids = torch.zeros(1, SEQ // 2, dtype=torch.long)
    return {"mesh": refusal(lambda: parallel.context_parallel_model(fsdp_worker.model(0.0), two_d)),
            "model": refusal(lambda: parallel.context_parallel_model(eager, cp_mesh)),
            "short": refusal(lambda: parallel.sharded(short, ids, ids.clone()).__enter__())}


def bench() -> tuple[str, list[float]]:
    """remat bench's run on this torchrun's two ranks (what `remat bench -cp 2` runs)."""
    result = run_bench(BenchSpec(recipe="llama3_tiny", overrides=dict(num_layers=2), compute_dtype="fp32",
                                 device="cpu", max_steps=2, warmup_steps=1, num_gpus=CP,
                                 facts=TrainingFacts(context_parallel_size=CP)),
                       RecomputeConfig(recompute_granularity="full", recompute_method="uniform",
                                       recompute_num_layers=1))
    return result.status, result.losses or []


def results() -> dict[str, object]:
    found: dict[str, object] = {f"{name}@0.1": step(spec(0.1), plan) for name, plan in PLANS.items()}
    found |= {f"{task}:none": step(spec(task=task), None) for task in ("pretrain", "sft")}
    found["shares"] = shares()
    found["refusals"] = refusals()
    found["bench"] = bench()
    return found


if __name__ == "__main__":
    gloo.run(results)
