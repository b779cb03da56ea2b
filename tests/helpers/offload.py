"""Shared by the unit and integration tests of offload."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import remat
from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.models import build
from remat.run.verify import verify

LAYERS, BATCH, SEQ = 4, 2, 16


FULL1 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _model(dropout: float = 0.2) -> nn.Module:
    torch.manual_seed(0)
    return build(
        "llama3_tiny",
        dtype=torch.float64,
        num_layers=LAYERS,
        attention_backend="eager",
        attention_dropout=dropout,
        hidden_dropout=dropout,
    )


def _batch(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _verify(model: nn.Module, plan):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        return verify(model, plan, *_batch(model))


def _config(**keys) -> RecomputeConfig:
    return RecomputeConfig.from_megatron({"min_offloaded_tensor_size": 0, **keys})


ALL_LAYERS = Plan([{"layer": "offload"}] * LAYERS, min_offloaded_tensor_size=0)


PLANS = {
    "layer_level": _config(cpu_offloading=True, cpu_offloading_num_layers=3),
    "per_site": _config(
        fine_grained_activation_offloading=True, offload_modules=["attn_norm", "core_attn", "mlp_norm"]
    ),
    "full_uniform_1+offload": _config(**FULL1, cpu_offloading=True, cpu_offloading_num_layers=3),
    "full_uniform_2+offload": _config(
        **{**FULL1, "recompute_num_layers": 2}, cpu_offloading=True, cpu_offloading_num_layers=3
    ),
    "full_block_2+per_site": _config(
        **{**FULL1, "recompute_method": "block", "recompute_num_layers": 2},
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn"],
    ),
    "selective+offload": _config(
        recompute_granularity="selective",
        recompute_modules=["layernorm", "mlp"],
        cpu_offloading=True,
        cpu_offloading_num_layers=3,
    ),
    "selective+per_site": _config(
        recompute_granularity="selective",
        recompute_modules=["layernorm", "mlp"],
        fine_grained_activation_offloading=True,
        offload_modules=["core_attn"],
    ),
    "all_layers": ALL_LAYERS,
    "mixed_plan": Plan(
        [
            {"layer": "offload", "layernorm": "discard"},
            {"core_attn": "offload", "mlp": "recompute"},
            {"layer": "offload"},
            {},
        ],
        [(2, 4)],
        min_offloaded_tensor_size=0,
    ),
}
