"""A plan per pipeline rank against each rank's trace on the device and through the commands: the
by-shape estimate of each rank equal to its CPU trace, byte for byte, for the ranks' plans and
Megatron's configs; `remat estimate --memory-budget` writing a plan per rank that bench refuses
under another layout; `remat plan` tracing each rank on the device.

The quick tests of the same code: tests/unit/estimate/test_stage_plans.py."""

from __future__ import annotations

import json

from helpers.stage_plans import MiB, _peaks, _spec

from remat.cli import main
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.plan import PipelineStages, Plan
from remat.config.recompute import RecomputeConfig
from remat.estimate.stage_plans import plan_stages
from remat.estimate.stages import predict_stages, rank_plan, trace_stages


def test_the_estimate_of_each_rank_is_its_trace_on_the_device() -> None:
    """Shapes alone (meta) against each rank's shard traced on the CPU: for the ranks' plans and
    Megatron's configs, the same bytes per component, exactly (the times differ: counted FLOPs
    against measured)."""
    spec = _spec(pp=2, vpp=2)
    by_shape, on_cpu = trace_stages(spec), trace_stages(spec, device="cpu")
    planned = plan_stages(spec, max(_peaks(spec, by_shape, [None, None])) - 128 * 1024)
    full = RecomputeConfig(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        facts=TrainingFacts(num_layers=4, layout=ParallelLayout(pp=2, vp=2)),
    )
    for plans in ([None, None], [s.plan for s in planned.stages], [rank_plan(full, spec, k) for k in range(2)]):
        for shaped, traced in zip(
            predict_stages("x", spec, by_shape, plans).stages, predict_stages("x", spec, on_cpu, plans).stages
        ):
            assert (shaped.weights, shaped.grads, shaped.optimizer_state, shaped.activations, shaped.peak) == (
                traced.weights,
                traced.grads,
                traced.optimizer_state,
                traced.activations,
                traced.peak,
            )
    assert planned.plan.pipeline == PipelineStages(
        ParallelLayout(pp=2, vp=2), tuple(s.peak for s in planned.estimate.stages)
    )
    assert [s.layers for s in planned.stages] == [(0, 2), (1, 3)]  # rank r runs chunks r and r + pp


def test_estimate_plans_each_rank_by_shape_and_writes_the_plan(tmp_path, capsys) -> None:
    out, record = tmp_path / "plan.yaml", tmp_path / "plan.json"
    args = [
        "estimate",
        "-mr",
        "llama3_tiny",
        "--seq_length",
        "256",
        "-pp",
        "2",
        "-gb",
        "4",
        "--target",
        "cpu",
        "--no-compile",
        "--memory-budget",
        "3.9MiB",
        "-o",
        str(out),
        "--json",
        str(record),
        "--no_progress",
    ]
    assert main(args) == 0
    plan, data = Plan.load(out), json.loads(record.read_text())
    assert plan.pipeline is not None and plan.pipeline.layout.pp == 2
    assert [s["peak"] for s in data["estimate"]["stages"]] == list(plan.pipeline.predicted_peak_bytes)
    assert max(plan.pipeline.predicted_peak_bytes) <= 3.9 * MiB
    shown = capsys.readouterr().out
    assert "a plan per pipeline rank under 3.90 MiB" in shown and "fastest Megatron config" in shown
    # run with another layout, the plan is refused before anything runs
    assert (
        main(["bench", "-mr", "llama3_tiny", "--seq_length", "256", "-pp", "4", "-gb", "4", "--config", str(out), "-d"])
        == 1
    )
    assert "solved stage by stage for 2 pipeline stages" in capsys.readouterr().err


def test_plan_with_pipeline_stages_traces_each_rank_on_the_device(tmp_path, capsys) -> None:
    out = tmp_path / "plan.yaml"
    args = [
        "plan",
        "-mr",
        "llama3_tiny",
        "--seq_length",
        "64",
        "--num_layers",
        "2",
        "-pp",
        "2",
        "-gb",
        "2",
        "--device",
        "cpu",
        "--memory-budget",
        "1GiB",
        "-o",
        str(out),
        "--no_progress",
    ]
    assert main(args) == 0
    assert Plan.load(out).pipeline == PipelineStages(ParallelLayout(pp=2), Plan.load(out).pipeline.predicted_peak_bytes)
    assert "timed on the device" in capsys.readouterr().out
    assert main([*args, "--verify"]) == 1
    assert "--verify:" in capsys.readouterr().err
