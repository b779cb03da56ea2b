"""One rank's shard of the MoE and MLA layers under tensor parallelism, by shape, and the expert
tensor-parallel size it refuses.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_tensor_parallel_models_runs.py."""

from __future__ import annotations

import dataclasses

import pytest

from remat import models
from remat.cli.tables import _expert_parallel
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError
from remat.estimate.stages import EstimateSpec
from remat.run.spec import RunSpec


def test_one_ranks_shard_holds_its_heads_and_its_share_of_every_experts_ffn() -> None:
    family = models.family_of("deepseek_tiny")
    config = family.config("deepseek_tiny")
    shard = family.shard(config, ParallelLayout(tp=2, sp=True), range(config.num_layers))
    assert (shard.num_attention_heads, shard.expert_ffn, shard.moe_shared_expert_intermediate_size) == (2, 16, 16)
    # the down projections' ranks stay whole (replicated), as do the experts and the router
    assert (shard.q_lora_rank, shard.kv_lora_rank, shard.num_moe_experts) == (48, 32, 8)
    assert [str(p) for p in family.layout_problems(family.config("moe_tiny"), ParallelLayout(tp=3))] == [
        f"tensor_model_parallel_size: {name}={size} does not split over 3 tensor-parallel ranks; use a"
        " tensor-parallel size that divides it"
        for name, size in (
            ("num_attention_heads", 4),
            ("num_query_groups", 2),
            ("ffn_hidden_size", 160),
            ("moe_shared_expert_intermediate_size", 64),
        )
    ]


def test_experts_split_over_tp_as_megatron_s_default_and_an_explicit_etp_1_is_refused() -> None:
    tp2 = TrainingFacts(layout=ParallelLayout(tp=2))
    with pytest.raises(
        ConfigError,
        match="expert_tensor_parallel_size: is 1, experts whole on every tensor-parallel"
        " rank, which does not run yet; beside -tp remat splits each expert",
    ):
        RunSpec("moe_tiny", device="cpu", layout=dataclasses.replace(tp2.layout, etp=1), capture=tp2.capture)
    assert (
        _expert_parallel(EstimateSpec("moe_tiny", device="cpu", layout=tp2.layout, capture=tp2.capture))
        == "ep 1, etp 2, "
    )
    assert _expert_parallel(EstimateSpec("moe_tiny", device="cpu")) == "ep 1, etp 1, "
