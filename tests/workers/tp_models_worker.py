"""Run by tests/test_tensor_parallel_models.py under torchrun (gloo, CPU, 2 processes): the tiny
models whose layers split under tensor parallelism beyond the dense Llama's (Qwen3's q/k norms,
DeepSeek-V3's multi-latent attention),
each split over 2 ranks with and without sequence parallelism, one step per plan on the same
batch on both ranks. Rank 0 saves every result to the file named by argv[1]: each rank's loss, the
full gradients, and the parameters held whole on every rank whose gradients differ between ranks."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from remat import models
from remat.models import build
from remat.parallel.tensor_parallel import parallelize_tensor
from remat.recompute import RecomputeConfig, TrainingFacts

import gloo
import tp_worker

LAYERS, SEQ = 2, 16
# name -> (recipe, overrides, the Sites a selective plan recomputes)
MODELS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "qk_layernorm": ("llama3_tiny", dict(qk_layernorm=True), ["core_attn", "layernorm", "mlp"]),
    # DeepSeek-V3's multi-latent attention on dense layers: queries through a low rank, and not
    "mla": ("deepseek_tiny", dict(moe_layer_freq=f"[0]*{LAYERS}"), ["core_attn", "mla_up_proj", "mlp"]),
    "mla_q_proj": ("deepseek_tiny", dict(moe_layer_freq=f"[0]*{LAYERS}", q_lora_rank=None),
                   ["core_attn", "mla_up_proj", "mlp"]),
}
DROPOUT = 0.1


def model(name: str, dropout: float) -> torch.nn.Module:
    """One process's model (float64, seed 0)."""
    recipe, overrides, _ = MODELS[name]
    torch.manual_seed(0)
    return build(recipe, dtype=torch.float64, num_layers=LAYERS, seq_length=SEQ, attention_backend="eager",
                 attention_dropout=dropout, hidden_dropout=dropout, **overrides)


def plans(name: str) -> dict[str, RecomputeConfig | None]:
    recipe, overrides, modules = MODELS[name]
    config = models.recipe_config(recipe, num_layers=LAYERS, **overrides)
    facts = TrainingFacts(**{key: value for key, value in config.megatron_facts().items()
                             if key in TrainingFacts.__dataclass_fields__}, tensor_model_parallel_size=tp_worker.TP)
    return {"none": None,
            "selective": RecomputeConfig(recompute_granularity="selective", recompute_modules=modules, facts=facts),
            "full": RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                                    facts=facts)}


def replicated_but_unlike(model: torch.nn.Module) -> list[str]:
    """The parameters every rank holds whole as plain tensors whose gradients differ between ranks."""
    unlike = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) or p.grad is None:
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
                split = parallelize_tensor(model(name, dropout), sequence_parallel=sp)
                found[f"{name}@sp={sp}@{plan}@{dropout}"] = tp_worker.step(
                    split, plans(name)[plan], tp_worker.batch(), tp_worker.STEP_SEED)
                found[f"unlike:{name}@sp={sp}@{plan}@{dropout}"] = replicated_but_unlike(split)
    return found


if __name__ == "__main__":
    gloo.run(results)
