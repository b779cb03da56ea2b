"""Run by tests/integration/test_expert_parallel_runs.py under torchrun (gloo, CPU, 2 processes):
remat's tiny MoE with its 4 experts split over 2 expert-parallel ranks (2 each), which are
data-parallel ranks under FSDP2; one step per plan on this rank's share of a global batch, dropout
on. Rank 0 saves every rank's loss, the full gradients (the experts' gathered from their
expert-parallel group, in expert order), how many token exchanges each step ran, and the refusals to
the file named by argv[1]. With 4 processes (2 ranks holding the same experts) it runs the same."""

from __future__ import annotations

import warnings
from typing import Any

import gloo
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import remat
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.models import build, family_of
from remat.models.moe.dispatch import AllToAll
from remat.parallel.expert_parallel import expert_mesh, parallelize_experts
from remat.run.build import build_model
from remat.run.spec import RunSpec
from remat.sites.calls import forward_loss

EP, RECIPE, LAYERS, PER_RANK, SEQ = 2, "moe_tiny", 4, 2, 16
MAX_RANKS = 4
DROPOUT = 0.1
SEED, STEP_SEED = 0, 100  # the weights'; the step's, + the rank: each rank its own dropout masks


# moe_tiny with one dense layer then 3 MoE layers (4 experts, top-2, shared experts)
SHAPE: dict[str, Any] = dict(
    num_layers=LAYERS,
    moe_layer_freq="[0]*1+[1]*3",
    seq_length=SEQ,
    attention_backend="eager",
    attention_dropout=DROPOUT,
    hidden_dropout=DROPOUT,
)


def model(ep: int = 1, etp: int | None = None) -> torch.nn.Module:
    """The model in float64 in one process (built with the experts of one of `ep` ranks)."""
    torch.manual_seed(SEED)
    family = family_of(RECIPE)
    config = family.config(RECIPE, **SHAPE)
    return family.build(
        family.shard(config, ParallelLayout(ep=ep, etp=etp), range(config.num_layers)), dtype=torch.float64
    )


def spec(ranks: int) -> RunSpec:
    return RunSpec(
        RECIPE,
        SHAPE,
        layout=ParallelLayout(ep=EP, num_gpus=ranks),
        precision=Precision("fp64"),
        device="cpu",
        seed=SEED,
    )


def split_model() -> torch.nn.Module:
    """The model as remat bench -ep 2 builds it: its experts split over the expert-parallel group
    of this rank, FSDP2 over the data-parallel ranks."""
    return build_model(spec(dist.get_world_size()))


def share(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank `rank`'s sequences of the global batch."""
    ids = torch.randint(0, 512, (MAX_RANKS * PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(1))
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return ids[rows, :-1], ids[rows, 1:]


def config(**keys: Any) -> RecomputeConfig:
    """Megatron keys with the model's own facts (moe_grouped_gemm for moe_act, its layers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)  # a label absent from the dense layer 0
        return RecomputeConfig.from_megatron({**model().config.megatron_facts(), **keys})


def selective(*modules: str) -> RecomputeConfig:
    return config(recompute_granularity="selective", recompute_modules=list(modules))


def full(method: str, k: int) -> RecomputeConfig:
    return config(recompute_granularity="full", recompute_method=method, recompute_num_layers=k)


PLANS: dict[str, RecomputeConfig | Plan | None] = {
    "none": None,
    "moe": selective("moe"),  # replays the dispatch and combine all-to-alls
    "moe_act": selective("moe_act"),
    "shared_experts": selective("shared_experts"),
    "every_moe_site": selective("core_attn", "layernorm", "moe", "moe_act", "shared_experts"),
    "full_uniform_1": full("uniform", 1),
    "full_uniform_2": full("uniform", 2),  # replays layers 0 and 2 from 1 and 3, after FSDP2 resharded them
    "full_block_3": full("block", 3),
    "offload": Plan([{"layer": "offload"}, {"expert_fc1": "offload"}, {}, {}], [(2, 4)], min_offloaded_tensor_size=0),
}


def gathered_grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient whole; an expert weight's from every expert-parallel rank, in expert order."""
    dp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    group = expert_mesh(dp, EP)["ep"].get_group()
    grads = {}
    for name, p in m.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert grad is not None, name
        if ".experts.weight" in name:
            parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = torch.cat(parts)
        grads[name] = grad
    return grads


class CountedExchanges:
    """How many times the MoE layers exchanged token slots (forward and replays)."""

    def __init__(self) -> None:
        self.calls = 0
        self.exchange = AllToAll.__call__

    def __enter__(self) -> CountedExchanges:
        def counted(dispatch: AllToAll, *args: Any) -> torch.Tensor:
            self.calls += 1
            return self.exchange(dispatch, *args)

        AllToAll.__call__ = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        AllToAll.__call__ = self.exchange  # type: ignore[method-assign]


def step(plan: object) -> tuple[list[float], dict[str, torch.Tensor], int]:
    m = split_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(m, plan)  # type: ignore[arg-type]
    rank = dist.get_rank()
    torch.manual_seed(STEP_SEED + rank)
    with CountedExchanges() as exchanges:
        loss = forward_loss(m, *share(rank))
        loss.backward()
    losses = [torch.zeros((), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach())
    return [float(x) for x in losses], gathered_grads(m), exchanges.calls


def refusal(make: Any, ep: int = EP, mesh: Any = None) -> str:
    """What parallelize_experts says of the model `make` builds, and that it changed nothing."""
    return gloo.refused_unchanged(make(), lambda m: parallelize_experts(m, mesh, ep), "parallelize_experts")


def refusals() -> dict[str, str]:
    def dense() -> torch.nn.Module:
        torch.manual_seed(0)
        return build("llama3_tiny", num_layers=1)

    two_d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    return {
        "built_for_another_size": refusal(lambda: model(1, etp=2)),
        "not_dividing": refusal(lambda: model(1), ep=4),
        "dense": refusal(dense),
        "mesh": refusal(lambda: model(EP), mesh=two_d),
        "unnamed": refusal(lambda: model(EP), mesh=init_device_mesh("cpu", (dist.get_world_size(),))),
    }


def held_bytes() -> list[int]:
    """Each rank's bytes of FSDP2's shards of the split model's parameters."""
    local = sum(p.to_local().untyped_storage().nbytes() for p in split_model().parameters())
    every: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return every


def results() -> dict[str, Any]:
    found: dict[str, Any] = {name: step(plan) for name, plan in PLANS.items()}
    found["held_bytes"] = held_bytes()
    found["refusals"] = refusals()
    return found


if __name__ == "__main__":
    gloo.run(results)
