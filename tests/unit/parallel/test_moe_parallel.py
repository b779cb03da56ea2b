"""MoE models under pipeline, tensor, context and expert parallelism without a launch: stage
shards keep the whole model's layer numbers, ranks of other layer kinds trace apart, and the
layouts are accepted.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_moe_parallel_runs.py."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.estimate import stages as estimating
from remat.models import family_of
from remat.run import build as builds
from remat.run.spec import RunSpec
from remat.run.spec import run_problems as spec_run_problems

sys.path.insert(0, str(Path(__file__).parents[2] / "integration" / "workers"))  # the workers' helpers


import moe_worker  # noqa: E402


def test_stage_shards_build_the_whole_models_layers_by_their_global_numbers() -> None:
    """Kinds (dense first layer) and expert weights (seeded by the global layer) of each virtual
    stage equal the whole model's, built from the same seed."""
    spec = moe_worker.spec("deepseek_tiny", "interleaved")
    torch.manual_seed(0)
    whole = spec.family.build(spec.model_config, dtype=torch.float64)
    for stage in range(spec.layout.chunks):
        config = builds.chunk_config(spec, stage)
        assert config.layers == (stage,) and config.num_layers == 1  # type: ignore[attr-defined]
        torch.manual_seed(0)
        chunk = spec.family.build(config, dtype=torch.float64, pre_process=stage == 0, post_process=stage == 3)
        (layer,), expected = chunk.decoder.layers, whole.decoder.layers[stage]  # type: ignore[union-attr]
        assert type(layer.mlp) is type(expected.mlp)
        if stage > 0:
            assert layer.mlp.experts.layer == stage
            assert torch.equal(layer.mlp.experts.weight1, expected.mlp.experts.weight1)


def test_a_rank_traces_apart_from_another_whose_layers_are_of_other_kinds(monkeypatch) -> None:
    """Middle pipeline ranks share a trace where their layers are alike: with 3 dense first layers
    of 8 over 4 ranks, rank 1 holds a dense and an MoE layer, rank 2 two MoE layers."""
    monkeypatch.setattr(estimating, "trace_stage", lambda spec, stage, *args: stage)
    facts = TrainingFacts(layout=ParallelLayout(pp=4))
    moe = estimating.EstimateSpec(
        recipe="deepseek_tiny",
        overrides=dict(num_layers=8, moe_layer_freq="[0]*3+[1]*5"),
        global_batch_size=4,
        layout=facts.layout,
        capture=facts.capture,
    )
    assert estimating.trace_stages(moe) == [0, 1, 2, 3]  # type: ignore[arg-type]
    llama = estimating.EstimateSpec(
        recipe="llama3_tiny",
        overrides=dict(num_layers=8),
        global_batch_size=4,
        layout=facts.layout,
        capture=facts.capture,
    )
    assert estimating.trace_stages(llama) == [0, 1, 1, 3]  # type: ignore[arg-type]


def test_moe_runs_under_pipeline_tensor_and_context_parallelism() -> None:
    family = family_of("moe_tiny")
    config = family.config("moe_tiny", num_layers=4)
    assert not list(family.layout_problems(config, ParallelLayout(pp=2, tp=2, cp=2)))
    assert [p.field for p in family.layout_problems(config, ParallelLayout(cp=3))] == ["context_parallel_size"]
    shard = family.shard(config, ParallelLayout(pp=2, tp=2), (2, 3))
    assert shard.num_layers == 2 and shard.layers == (2, 3)  # type: ignore[attr-defined]
    assert [shard.is_moe_layer(i) for i in (2, 3)] == [True, True]  # type: ignore[attr-defined]
    assert shard.expert_ffn * 2 == config.expert_ffn  # type: ignore[attr-defined]


def test_expert_parallelism_runs_beside_pipeline_stages_and_tensor_parallelism() -> None:
    def run_problems(pp: int, tp: int) -> list[str]:
        spec = RunSpec(
            recipe="moe_tiny",
            overrides=dict(num_layers=4),
            global_batch_size=4,
            device="cpu",
            layout=ParallelLayout(pp=pp, tp=tp, ep=2, num_gpus=4 * tp),
        )
        return [p.message for p in spec_run_problems(spec)]

    assert run_problems(pp=2, tp=1) == run_problems(pp=1, tp=2) == run_problems(pp=2, tp=2) == []
