"""Run by tests/integration/test_tensor_parallel_runs.py under torchrun (gloo, CPU). With 2
processes: remat's tiny Llama split by tensor parallelism (with and without sequence parallelism),
one step per plan on the same batch on both ranks; the dropout masks each rank draws; the refusals.
With 4: FSDP2 over 2 data-parallel replicas of tensor parallelism over 2 ranks with sequence
parallelism, one step per plan, each replica its own share of the global batch. Plans go in as
`remat bench` installs them (build.apply_plan), so a config's distribute_saved_activations splits
what full recompute keeps (sequence parallelism off). Rank 0 saves every result to the file named by
argv[1]."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import fsdp_worker  # the tiny model, its batch and the plans of the FSDP2 tests
import gloo
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

import remat
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.models import build, family_of, recipe_config
from remat.parallel import fully_shard_layers
from remat.parallel.data_parallel import layer_modules
from remat.parallel.tensor_parallel import parallelize_tensor
from remat.run.build import apply_plan
from remat.run.optimizer import MainParamsAdamW, OptimizerPrecision, main_grad_bytes
from remat.run.spec import RunSpec
from remat.run.verify import run_step
from remat.sites.apply import offloader_of
from remat.sites.calls import forward_loss

PLANS: dict[str, Any] = {**fsdp_worker.PLANS, "mlp_act": Plan([{"mlp_act": "discard"}] * fsdp_worker.LAYERS, [])}
DP_TP_PLANS = ("none", "selective", "full_uniform_2", "offload")  # under FSDP2 over tensor parallelism
STEP_SEED = 100  # torch's default generators for the step, alike on the tensor-parallel ranks
TP = 2
# what apply_plan reads of a run: no pipeline (the model is the worker's own)
SPEC = RunSpec(
    overrides={"num_layers": fsdp_worker.LAYERS},
    device="cpu",
    precision=Precision("fp64"),
    layout=ParallelLayout(tp=TP),
)
# full recompute (method, k): each with its kept inputs whole, and split over the tp ranks
FULL = {"uniform_1": ("uniform", 1), "uniform_2": ("uniform", 2), "block_1": ("block", 1), "block_2": ("block", 2)}


def full(method: str, k: int, distribute: bool) -> RecomputeConfig:
    return RecomputeConfig(
        recompute_granularity="full",
        recompute_method=method,
        recompute_num_layers=k,
        distribute_saved_activations=distribute,
        facts=TrainingFacts(layout=ParallelLayout(tp=TP)),
    )


def gate_then_up(name: str, grad: torch.Tensor) -> torch.Tensor:
    """Under tensor parallelism linear_fc1's rows are each rank's gate then up rows; one
    process has all gate rows, then all up rows."""
    if not name.endswith("linear_fc1.weight"):
        return grad
    return grad.unflatten(0, (TP, 2, -1)).transpose(0, 1).reshape(grad.shape)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return fsdp_worker.global_batch(1)  # every tensor-parallel rank takes the same sequences


def split(dropout: float, sp: bool) -> torch.nn.Module:
    """The tiny model (built from seed 0, so this rank's own stream is seeded 0 + 2718 + rank)."""
    return parallelize_tensor(fsdp_worker.model(dropout), sequence_parallel=sp)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # type: ignore[misc]
        for name, p in model.named_parameters()
    }


Result = tuple[list[float], dict[str, torch.Tensor]]


def step(
    model: torch.nn.Module, plan: object, inputs: tuple[torch.Tensor, torch.Tensor], seed: int, micro_batches: int = 1
) -> Result:
    """Each rank's loss (the last micro-batch's) and the full gradients."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        apply_plan(SPEC, model, plan)  # type: ignore[arg-type]
    torch.manual_seed(seed)
    for _ in range(micro_batches):
        loss = forward_loss(model, *inputs)
        loss.backward()
    losses = [torch.zeros((), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach())
    return [float(x) for x in losses], full_grads(model)


class DropoutMasks(TorchFunctionMode):
    """Where each F.dropout call dropped a nonzero element, with the nonzero elements."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is F.dropout:
            nonzero = args[0] != 0
            self.masks.append(((out == 0) & nonzero, nonzero))
        return out


def masks(sp: bool) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every rank's dropout masks in one forward, attention and hidden dropout on."""
    model = split(0.1, sp)
    torch.manual_seed(STEP_SEED)
    with DropoutMasks() as recorded:
        forward_loss(model, *batch())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, recorded.masks)
    return every


def refusal(make: Any, sp: bool = True, mesh: Any = None) -> str:
    """What parallelize_tensor says of the model `make` builds, and that it changed nothing."""
    return gloo.refused_unchanged(
        make(), lambda m: parallelize_tensor(m, mesh, sequence_parallel=sp), "parallelize_tensor"
    )


def refusals() -> dict[str, str]:
    def bad_shape() -> torch.nn.Module:
        torch.manual_seed(0)
        return build(
            "llama3_tiny",
            num_layers=1,
            hidden_size=48,
            num_attention_heads=3,
            num_query_groups=1,
            ffn_hidden_size=81,
            seq_length=15,
            qk_layernorm=True,
        )

    def moe() -> torch.nn.Module:
        torch.manual_seed(0)
        family, config = family_of("moe_tiny"), recipe_config("moe_tiny")
        return family.build(family.shard(config, ParallelLayout(ep=2, etp=2), range(config.num_layers)))

    def unseeded() -> torch.nn.Module:
        model = fsdp_worker.model(0.0)
        torch.manual_seed(dist.get_rank())  # each rank its own seed
        return model

    return {
        "shape": refusal(bad_shape),
        "moe": refusal(moe),
        "seed": refusal(unseeded),
        "mesh": refusal(
            lambda: fsdp_worker.model(0.0), mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        ),
    }


def distributed() -> dict[str, Any]:
    """Full recompute with its kept inputs whole and split (sequence parallelism off): the step,
    and what the forward leaves for backward; then a plan without the split takes it off."""
    found: dict[str, Any] = {}
    for name, (method, k) in FULL.items():
        for distribute in (False, True):
            for dropout in (0.0, 0.1):
                found[f"{name}@{distribute}@{dropout}"] = step(
                    split(dropout, False), full(method, k, distribute), batch(), STEP_SEED
                )
            model = split(0.0, False)
            apply_plan(SPEC, model, full(method, k, distribute))
            found[f"saved:{name}@{distribute}"] = run_step(model, *batch(), seed=STEP_SEED).saved.bytes
    apply_plan(SPEC, model, full("uniform", 1, False))
    found["taken off"] = [site.before_replay for _, site in layer_modules(model)]
    for distribute in (False, True):  # the first two ranges' kept inputs (or shards) offloaded
        offloaded = dataclasses.replace(
            full("uniform", 1, distribute),
            cpu_offloading=True,
            cpu_offloading_num_layers=2,
            min_offloaded_tensor_size=0,
        )
        model = split(0.1, False)
        found[f"offloaded@{distribute}"] = step(model, offloaded, batch(), STEP_SEED)
        found[f"offloaded bytes@{distribute}"] = offloader_of(model).stats().offloaded_bytes  # type: ignore[union-attr]
    return found


def tensor_parallel() -> dict[str, Any]:
    def tp_step(dropout: float, sp: bool, plan: object, micro_batches: int = 1) -> Result:
        return step(split(dropout, sp), plan, batch(), STEP_SEED, micro_batches)

    results: dict[str, Any] = {
        f"{name}@sp={sp}@{dropout}": tp_step(dropout, sp, plan)
        for sp in (False, True)
        for dropout in (0.0, 0.1)
        for name, plan in PLANS.items()
    }
    results.update({f"accumulated@sp={sp}": tp_step(0.0, sp, None, micro_batches=2) for sp in (False, True)})
    results.update({f"masks@sp={sp}": masks(sp) for sp in (False, True)})
    results["refusals"] = refusals()
    model = split(0.0, False)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    results["main grads"] = (
        main_grad_bytes(MainParamsAdamW(model.parameters(), OptimizerPrecision("fp32"))),
        4 * local,
    )
    results["distributed"] = distributed()
    return results


def fsdp_over_tensor_parallel() -> dict[str, Any]:
    """FSDP2 over the data-parallel dimension of a dp x tp mesh, tensor and sequence parallelism
    over its other (torchtitan's order: tensor parallelism first)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=("dp", "tp"))
    dp, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = slice(dp * fsdp_worker.PER_RANK, (dp + 1) * fsdp_worker.PER_RANK)
    inputs = tuple(t[rows] for t in fsdp_worker.global_batch(replicas))

    def dp_tp_step(dropout: float, plan: object, sp: bool = True) -> Result:
        model = parallelize_tensor(fsdp_worker.model(dropout), mesh["tp"], sequence_parallel=sp)
        return step(fully_shard_layers(model, mesh["dp"]), plan, inputs, STEP_SEED + dp)  # type: ignore[arg-type]

    found = {f"{name}@{dropout}": dp_tp_step(dropout, PLANS[name]) for dropout in (0.0, 0.1) for name in DP_TP_PLANS}
    # without sequence parallelism, split inputs: layer 0 replays after FSDP2 resharded it (gathered first)
    found.update(
        {
            f"{name}@sp=False": dp_tp_step(0.1, plan, sp=False)
            for name, plan in (("none", None), ("distributed_uniform_2", full("uniform", 2, True)))
        }
    )
    return found


if __name__ == "__main__":
    gloo.run(lambda: tensor_parallel() if dist.get_world_size() == TP else fsdp_over_tensor_parallel())
