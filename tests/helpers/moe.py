"""Shared by the unit and integration tests of moe."""

from __future__ import annotations

import warnings

import torch

import remat
from remat.config.recompute import RecomputeConfig
from remat.models import build

BATCH, SEQ = 2, 16


TOKENS = BATCH * SEQ


F64 = 8  # bytes per float64 element


RECIPES = ("moe_tiny", "deepseek_tiny")


def _model(recipe: str, dropout: float = 0.1, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(
        recipe,
        dtype=torch.float64,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        attention_backend="eager",
        seq_length=SEQ,
        **overrides,
    )


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _config(model, **keys) -> RecomputeConfig:
    """Megatron keys with the model's own facts (moe_grouped_gemm, multi_latent_attention, layers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)  # e.g. a label absent from the dense layer 0
        return RecomputeConfig.from_megatron({**model.config.megatron_facts(), **keys})


def _selective(model, *modules: str) -> RecomputeConfig:
    return _config(model, recompute_granularity="selective", recompute_modules=list(modules))


def _full(model, method: str, k: int) -> RecomputeConfig:
    return _config(model, recompute_granularity="full", recompute_method=method, recompute_num_layers=k)


def _random_expert_bias(model, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    for router in model.routers():
        router.expert_bias.copy_(0.5 * torch.randn(router.expert_bias.shape, generator=g))


def _moe_layers(model) -> int:
    return sum(model.config.is_moe_layer(i) for i in range(model.config.num_layers))


LABELS = {
    "moe_tiny": ("core_attn", "layernorm", "mlp", "mlp_act", "moe", "moe_act", "shared_experts"),
    "deepseek_tiny": ("core_attn", "layernorm", "mlp", "mlp_act", "mla_up_proj", "moe", "moe_act", "shared_experts"),
}
