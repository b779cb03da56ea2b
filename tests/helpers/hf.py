"""Shared by the unit and integration tests of hf."""

from __future__ import annotations

import pytest
import torch

from remat.config.megatron import TrainingFacts  # noqa: E402
from remat.config.recompute import RecomputeConfig  # noqa: E402
from remat.models.hf.configs import hf_config  # noqa: E402

transformers = pytest.importorskip("transformers")


BATCH, SEQ, LAYERS = 2, 16, 3


DROPOUT = 0.1


def build(family: str, attention: str | None = None, dropout: float = DROPOUT, **overrides) -> torch.nn.Module:
    config = hf_config(family, num_layers=LAYERS, **overrides)
    for name in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        if hasattr(config, name):
            setattr(config, name, dropout)
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attention} if attention else {}
    if any(getattr(config, n, None) for n in ("num_local_experts", "num_experts", "n_routed_experts")):
        kwargs["experts_implementation"] = "eager"  # grouped_mm takes no float64
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, **kwargs)
    return model.train()


def batch(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=g)
    return ids, ids


def selective(*labels: str) -> RecomputeConfig:
    # moe_act: Megatron asks for grouped GEMM experts; transformers' experts stand in for them
    return RecomputeConfig(
        recompute_granularity="selective",
        recompute_modules=list(labels),
        facts=TrainingFacts(moe_grouped_gemm="moe_act" in labels, multi_latent_attention="mla_up_proj" in labels),
    )


def full(method: str, k: int) -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="full", recompute_method=method, recompute_num_layers=k)


LABELS = {
    **{
        f: ("core_attn", "layernorm", "mlp")
        for f in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2")
    },
    "mixtral": ("core_attn", "layernorm", "moe", "moe_act"),
    "qwen2_moe": ("core_attn", "layernorm", "moe", "moe_act", "shared_experts"),
    "qwen3_moe": ("core_attn", "layernorm", "mlp", "moe", "moe_act"),
    "deepseek_v3": ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts"),
}
