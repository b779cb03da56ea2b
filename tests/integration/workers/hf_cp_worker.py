"""Run by tests/integration/test_hf_context_parallel_runs.py under torchrun (gloo, CPU). With 2
processes: tiny Hugging Face causal LMs built by `build_model` with -cp 2 (torch's ring attention
over the two ranks, FSDP2 over the flattened dp x cp mesh), one float64 step of 2 micro-batches on
the step's mock data: hf:llama under every plan, and SFT (rank 0's head chunk all prompt) through
the chunked loss head, hf:mixtral without recompute; and a bench run. With 4 (a slow test): -cp 2
beside -tp 2 (sequence parallelism off and on) and beside -pp 2 (the stages loaded with one
process's weights). Rank 0 saves the mean loss and the full gradients of each, and the bench run, to
argv[1]."""

from __future__ import annotations

import warnings
from typing import Any
from unittest import mock

import gloo
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

import remat
from remat import parallel
from remat.bench.run import run_bench
from remat.bench.spec import BenchSpec
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.run.build import apply_plan, build_model
from remat.run.spec import RunSpec
from remat.run.step import MockData, forward_backward

CP, SEQ, SFT_SEQ, MICRO_BATCHES = 2, 16, 72, 2
PLANS: dict[str, RecomputeConfig | None] = {
    "none": None,
    "selective": RecomputeConfig(
        recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "mlp"]
    ),
    "full": RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
}
# the loss averaged over the ranks and the full gradients, named as in the whole model
Step = tuple[float, dict[str, torch.Tensor]]


def spec(
    recipe: str = "hf:llama",
    task: str = "pretrain",
    context_parallel: int = CP,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    pipeline: int = 1,
    seq_length: int = SEQ,
    compile: bool = False,
) -> RunSpec:
    """2 layers in float64 (torch's ring merges its blocks in float32: see the test); `compile`:
    with the chunked loss head, as a compiled run has it (see step)."""
    layout = ParallelLayout(
        cp=context_parallel,
        tp=tensor_parallel,
        sp=sequence_parallel,
        pp=pipeline,
        num_gpus=context_parallel * tensor_parallel * pipeline,
    )
    return RunSpec(
        recipe=recipe,
        overrides=dict(seq_length=seq_length),
        precision=Precision("fp64"),
        device="cpu",
        task=task,
        optimizer=False,
        global_batch_size=MICRO_BATCHES,
        compile=compile,
        layout=layout,
    )


def step(run: RunSpec, plan: RecomputeConfig | None = None) -> Step:
    with mock.patch("remat.models.hf.family.compile_sites", lambda model: None):  # costs more than it tests
        model = build_model(run)
    if isinstance(model, parallel.Pipeline):  # each stage drew from a seed of its own: one process's instead
        torch.manual_seed(run.seed)
        whole = dict(run.family.build(run.model_config, dtype=run.state_dtype).named_parameters())
        for chunk in model.chunks:
            load(chunk, whole)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        apply_plan(run, model, plan)
    loss = parallel.mean_over_ranks(forward_backward(model, MockData(run), run.micro_batches))
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # type: ignore[misc]
        for chunk in parallel.model_chunks(model)
        for name, p in chunk.named_parameters()
    }
    if isinstance(model, parallel.Pipeline):  # each pipeline rank holds its stages'
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, grads)
        grads = {name: grad for found in every for name, grad in found.items()}
    return loss.item(), grads


@torch.no_grad()
def load(chunk: torch.nn.Module, whole: dict[str, torch.Tensor]) -> None:
    """A stage's weights from the whole model's, by name (a stage keeps them); under FSDP2, its shard."""
    for name, p in chunk.named_parameters():
        source = whole[name]
        if isinstance(p, DTensor):
            source = distribute_tensor(source, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(source)


def bench() -> tuple[str, list[float]]:
    """What `remat bench -mr hf:llama -cp 2 -ng 2 --device cpu` runs, full recompute."""
    result = run_bench(
        BenchSpec(
            recipe="hf:llama",
            overrides=dict(seq_length=SEQ),
            precision=Precision("fp32"),
            device="cpu",
            max_steps=2,
            warmup_steps=1,
            global_batch_size=MICRO_BATCHES,
            layout=ParallelLayout(cp=CP, num_gpus=CP),
        ),
        RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    )
    return result.status, result.losses or []


def results() -> dict[str, object]:
    if dist.get_world_size() == 2 * CP:
        return four_results()
    found: dict[str, object] = {f"llama:{name}": step(spec(), plan) for name, plan in PLANS.items()}
    # each rank's 36 labels in a micro-batch: more than half the hidden size (64), the chunked head's
    found["llama:sft"] = step(spec(task="sft", seq_length=SFT_SEQ, compile=True))
    found["mixtral:none"] = step(spec("hf:mixtral"))
    found["bench"] = bench()
    return found


def four_results() -> dict[str, object]:
    found: dict[str, object] = {
        f"llama:{name}@sp={sp}": step(spec(tensor_parallel=2, sequence_parallel=sp), plan)
        for sp in (False, True)
        for name, plan in PLANS.items()
        if name != "full"
    }
    found["mixtral@tp"] = step(spec("hf:mixtral", tensor_parallel=2))
    found["llama@pp"] = step(spec(pipeline=2))
    found["llama@pp:selective"] = step(spec(pipeline=2), PLANS["selective"])
    return found


if __name__ == "__main__":
    gloo.run(results)
