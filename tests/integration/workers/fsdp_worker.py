"""Run by tests/integration/test_parallel_runs.py under torchrun (gloo, CPU): remat's tiny Llama
sharded with FSDP2, one step per plan on this rank's share of a global batch; rank 0 saves the
losses of every rank and the full gradients to the file named by argv[1]."""

from __future__ import annotations

import warnings

import gloo
import torch
import torch.distributed as dist

import remat
from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.models import build
from remat.parallel import accumulate, fully_shard_layers
from remat.run.verify import run_step
from remat.sites.calls import forward_loss

LAYERS, PER_RANK, SEQ = 4, 2, 16


def model(dropout: float, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(
        "llama3_tiny",
        dtype=dtype,
        num_layers=LAYERS,
        attention_backend="eager",
        attention_dropout=dropout,
        hidden_dropout=dropout,
        seq_length=SEQ,
    )


def global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (world * PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def full(method: str, k: int) -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="full", recompute_method=method, recompute_num_layers=k)


PLANS: dict[str, RecomputeConfig | Plan | None] = {
    "none": None,
    "selective": RecomputeConfig(
        recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", "mlp"]
    ),
    "full_uniform_1": full("uniform", 1),
    "full_uniform_2": full("uniform", 2),  # replays layers 0 and 2 after FSDP2 resharded them
    "full_block_3": full("block", 3),
    "offload": Plan([{"layer": "offload"}, {"core_attn": "offload"}, {}, {}], [(2, 4)], min_offloaded_tensor_size=0),
}


def step(dropout: float, plan: object, mixed: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """mixed: float32 shards, bfloat16 compute, float32 gradient reduction."""
    m = fully_shard_layers(
        model(dropout, torch.float32 if mixed else torch.float64), compute_dtype=torch.bfloat16 if mixed else None
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(m, plan)  # type: ignore[arg-type]
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = (t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in global_batch(world))
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    loss = forward_loss(m, inputs, labels)
    loss.backward()
    losses = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(losses, loss.detach().double())
    grads = {name: p.grad.full_tensor() for name, p in m.named_parameters()}  # type: ignore[union-attr]
    return [float(x) for x in losses], grads


def accumulated(reduce_once: bool, plan: object = None) -> dict[str, torch.Tensor]:
    """The full gradients of two micro-batches (this rank's half of the global batch each),
    reduced every micro-batch (FSDP2's default) or once, in the last one's backward."""
    m = fully_shard_layers(model(0.0), reduce_once_a_step=reduce_once)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(m, plan)  # type: ignore[arg-type]
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = (t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in global_batch(world))
    for i in range(2):
        accumulate(m, last=i == 1)
        (forward_loss(m, inputs[i : i + 1], labels[i : i + 1]) / 2).backward()
    return {name: p.grad.full_tensor() for name, p in m.named_parameters()}  # type: ignore[union-attr]


def saved_for_backward() -> tuple[tuple[int, int], tuple[int, int]]:
    """What this rank's forward leaves for backward, by one process and under FSDP2."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = (t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in global_batch(world))
    plain = run_step(model(0.0), inputs, labels, seed=0).saved
    sharded = run_step(fully_shard_layers(model(0.0)), inputs, labels, seed=0).saved
    return (plain.bytes, plain.storages), (sharded.bytes, sharded.storages)


def mixed_dtypes() -> dict[str, object]:
    """Transformers' DeepSeek-V3 in bf16 keeps its MoE router's weight in fp32: FSDP2 over a layer
    holding both, each plan's loss and every gradient (whole) on rank 0's batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = (t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in global_batch(world))
    found: dict[str, object] = {}
    for name in ("none", "full_uniform_2"):
        torch.manual_seed(0)
        net = fully_shard_layers(build("hf:deepseek_v3", dtype=torch.bfloat16, num_layers=2, seq_length=SEQ))
        dtypes = sorted({str(p.dtype) for p in net.parameters()})
        if name != "none":
            remat.apply(net, full("uniform", 2))
        loss = forward_loss(net, inputs, labels)
        loss.backward()
        found[name] = (dtypes, loss.item(), {n: p.grad.full_tensor() for n, p in net.named_parameters()})
    return found


def results() -> dict[str, object]:
    found: dict[str, object] = {
        f"{name}@{dropout}": step(dropout, plan) for dropout in (0.0, 0.1) for name, plan in PLANS.items()
    }
    found.update({f"{name}@bf16": step(0.1, PLANS[name], mixed=True) for name in ("none", "full_uniform_2")})
    found["saved"] = saved_for_backward()
    found["mixed dtypes"] = mixed_dtypes()
    found["reduced"] = {
        "every": accumulated(False),
        "once": accumulated(True),
        "once_full_uniform_2": accumulated(True, PLANS["full_uniform_2"]),
    }
    return found


if __name__ == "__main__":
    gloo.run(results)
