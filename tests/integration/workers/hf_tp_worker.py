"""Run by tests/integration/test_hf_tensor_parallel_runs.py under torchrun (gloo, CPU, 2 processes):
tiny Hugging Face Llama and Mixtral causal LMs (float64, built from configs, adapted), split by
their own tensor-parallel plans, one step per plan on the same batch on both ranks, attention
dropout off and on; and the same model on one process. Rank 0 saves every result to the file named
by argv[1]."""

from __future__ import annotations

import warnings
from typing import Any

import gloo
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

import remat
from remat.config.recompute import RecomputeConfig
from remat.engine import rng
from remat.models.hf.configs import hf_config
from remat.parallel.tensor_parallel import parallelize_tensor

LAYERS, BATCH, SEQ = 2, 2, 16
STEP_SEED = 100
# the MLP or MoE block: the Llama's MLP splits by its plan, Mixtral's experts stay whole
FAMILIES = {"llama": "mlp", "mixtral": "moe"}
SEQUENCE_PARALLEL = ("llama",)  # Mixtral's experts, whole on every rank, refuse it


def plans(block: str) -> dict[str, RecomputeConfig | None]:
    return {
        "none": None,
        "selective": RecomputeConfig(
            recompute_granularity="selective", recompute_modules=["core_attn", "layernorm", block]
        ),
        "full": RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    }


def model(family: str, dropout: float) -> torch.nn.Module:
    config = hf_config(family, num_layers=LAYERS, attention_dropout=dropout)
    torch.manual_seed(0)
    kwargs = {"experts_implementation": "eager"} if family == "mixtral" else {}
    built = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, **kwargs)
    return remat.adapt(built.train())


def step(net: torch.nn.Module, plan: RecomputeConfig | None) -> tuple[float, dict[str, torch.Tensor]]:
    if plan is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            remat.apply(net, plan)
    ids = torch.randint(0, net.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(STEP_SEED)
    loss = net(ids, labels=ids).loss
    loss.backward()
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # type: ignore[misc]
        for name, p in net.named_parameters()
    }
    return float(loss), grads


def draws_from_rank_stream(family: str, dropout: float) -> bool:
    """Whether a forward advanced this rank's own stream (attention dropout over its heads)."""
    net = parallelize_tensor(model(family, dropout), sequence_parallel=False)
    stream = rng._streams["tensor_parallel"]
    before = stream.get_state().clone()
    net(torch.zeros(BATCH, SEQ, dtype=torch.long))
    return not torch.equal(before, stream.get_state())


def tokens_a_norm_sees(family: str) -> list[int]:
    """The shape of a layer norm's input under sequence parallelism (this rank's tokens)."""
    net = parallelize_tensor(model(family, 0.0), sequence_parallel=True)
    seen: list[int] = []
    net.model.layers[1].post_attention_layernorm.register_forward_pre_hook(
        lambda _, args: seen.extend(args[0].to_local().shape)
    )
    net(torch.zeros(BATCH, SEQ, dtype=torch.long))
    return seen


def results() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for family, block in FAMILIES.items():
        for sp in (False, True) if family in SEQUENCE_PARALLEL else (False,):
            for dropout in (0.0, 0.1):
                for name, plan in plans(block).items():
                    found[f"{family}@sp={sp}@{name}@{dropout}"] = step(
                        parallelize_tensor(model(family, dropout), sequence_parallel=sp), plan
                    )
        found[f"{family}@one process"] = step(model(family, 0.0), None)
        split = parallelize_tensor(model(family, 0.0), sequence_parallel=False)
        found[f"{family}@rank stream"] = [draws_from_rank_stream(family, dropout) for dropout in (0.0, 0.1)]
        found[f"{family}@local q_proj"] = tuple(split.model.layers[0].self_attn.q_proj.weight.to_local().shape)
        if family in SEQUENCE_PARALLEL:
            found[f"{family}@tokens a norm sees"] = tokens_a_norm_sees(family)
    losses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(
        losses, {k: v[0] for k, v in found.items() if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], float)}
    )
    found["every rank's losses"] = losses
    return found


if __name__ == "__main__":
    gloo.run(results)
