"""Run by tests/integration/test_tensor_parallel_models_runs.py under torchrun (gloo, CPU, 2
processes): the tiny models whose layers split under tensor parallelism beyond the dense Llama's
(Qwen3's q/k norms, DeepSeek-V3's multi-latent attention, MoE layers), each split over 2 ranks with
and without sequence parallelism, one step per plan on the same batch on both ranks. Rank 0 saves
every result to the file named by argv[1]: each rank's loss, the full gradients (the experts' slices
gathered), and the parameters held whole on every rank whose gradients differ between ranks."""

from __future__ import annotations

from typing import Any

import gloo
import torch
import torch.distributed as dist
import tp_worker
from torch.distributed.tensor import DTensor

from remat import models
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.recompute import RecomputeConfig
from remat.models import build
from remat.parallel.tensor_parallel import parallelize_tensor

LAYERS, SEQ = 2, 16
# name -> (recipe, overrides, the Sites a selective plan recomputes)
MODELS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "qk_layernorm": ("llama3_tiny", dict(qk_layernorm=True), ["core_attn", "layernorm", "mlp"]),
    # DeepSeek-V3's multi-latent attention on dense layers: queries through a low rank, and not
    "mla": ("deepseek_tiny", dict(moe_layer_freq=f"[0]*{LAYERS}"), ["core_attn", "mla_up_proj", "mlp"]),
    "mla_q_proj": (
        "deepseek_tiny",
        dict(moe_layer_freq=f"[0]*{LAYERS}", q_lora_rank=None),
        ["core_attn", "mla_up_proj", "mlp"],
    ),
    # MoE layers (4 experts, top-2, shared experts; the first layer dense) with Qwen3's q/k norms,
    # and with MLA and DeepSeek-V3's router (sigmoid, groups, expert bias, per-sequence aux loss)
    "moe": (
        "moe_tiny",
        dict(moe_layer_freq=f"[0]*1+[1]*{LAYERS - 1}"),
        ["core_attn", "moe", "moe_act", "shared_experts"],
    ),
    "deepseek": (
        "deepseek_tiny",
        dict(moe_layer_freq=f"[0]*1+[1]*{LAYERS - 1}"),
        ["core_attn", "mla_up_proj", "moe_act", "shared_experts"],
    ),
}
DROPOUT = 0.1


def model(name: str, dropout: float) -> torch.nn.Module:
    """One process's model (float64, seed 0)."""
    recipe, overrides, _ = MODELS[name]
    torch.manual_seed(0)
    return build(
        recipe,
        dtype=torch.float64,
        num_layers=LAYERS,
        seq_length=SEQ,
        attention_backend="eager",
        attention_dropout=dropout,
        hidden_dropout=dropout,
        **overrides,
    )


def plans(name: str) -> dict[str, RecomputeConfig | None]:
    recipe, overrides, modules = MODELS[name]
    config = models.recipe_config(recipe, num_layers=LAYERS, **overrides)
    facts = TrainingFacts(
        **{key: value for key, value in config.megatron_facts().items() if key in TrainingFacts.__dataclass_fields__},
        layout=ParallelLayout(tp=tp_worker.TP),
    )
    return {
        "none": None,
        "selective": RecomputeConfig(recompute_granularity="selective", recompute_modules=modules, facts=facts),
        "full": RecomputeConfig(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, facts=facts
        ),
    }


def gathered(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A weight's gradient from this rank's slice of it (a plain parameter, an MoE layer's
    experts): the ranks' slices, joined along the dimension they split."""
    dim = next(d for d, (part, whole) in enumerate(zip(grad.shape, shape)) if part != whole)
    every = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(every, grad.contiguous())
    return torch.cat(every, dim)


def one_process_order(name: str, grad: torch.Tensor) -> torch.Tensor:
    """A split gradient gathered whole, in one process's row order: linear_fc1's rows (each
    expert's, of experts.weight1) are each rank's gate then up rows under tensor parallelism."""
    dim = 0 if name.endswith("linear_fc1.weight") else 1 if name.endswith("experts.weight1") else None
    if dim is None:
        return grad
    return grad.unflatten(dim, (tp_worker.TP, 2, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2)


def step(split: torch.nn.Module, plan: object, shapes: dict[str, torch.Size]) -> tp_worker.Result:
    """tp_worker's step, with the gradients of the weights sliced from `shapes` gathered whole."""
    losses, grads = tp_worker.step(split, plan, tp_worker.batch(), tp_worker.STEP_SEED)
    return losses, {
        param: grad if grad.shape == shapes[param] else gathered(grad, shapes[param]) for param, grad in grads.items()
    }


def replicated_but_unlike(model: torch.nn.Module, sliced: set[str]) -> list[str]:
    """The parameters every rank holds whole as plain tensors whose gradients differ between ranks."""
    unlike = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) or p.grad is None or name in sliced:
            continue
        every = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(every, p.grad)
        if not all(torch.equal(g, p.grad) for g in every):
            unlike.append(name)
    return unlike


def results() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in MODELS:
        for sp in (False, True):
            runs = [("none", 0.0)] + [(plan, DROPOUT) for plan in plans(name)]
            for plan, dropout in runs:
                whole = model(name, dropout)
                shapes = {param: p.shape for param, p in whole.named_parameters()}
                split = parallelize_tensor(whole, sequence_parallel=sp)
                found[f"{name}@sp={sp}@{plan}@{dropout}"] = step(split, plans(name)[plan], shapes)
                sliced = {param for param, p in split.named_parameters() if p.shape != shapes[param]}
                found[f"unlike:{name}@sp={sp}@{plan}@{dropout}"] = replicated_but_unlike(split, sliced)
    return found


if __name__ == "__main__":
    gloo.run(results)
