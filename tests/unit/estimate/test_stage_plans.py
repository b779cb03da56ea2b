"""A plan per pipeline rank in one process, by shape (four ranks traced once): each rank's fastest
plan that fits with its micro-batches in flight, the uniform Megatron config compared, a rank no
plan fits, the ranks' plans joined into one, the plan file's pipeline section and its rules, the
layout a plan runs on, and estimate's refusals.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_stage_plans_runs.py."""

from __future__ import annotations

import warnings

import pytest
from helpers.stage_plans import MiB, _peaks, _spec

import remat
from remat.cli import main
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.plan import PipelineStages, Plan, plan_file_problems, plan_pipeline_problems
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.estimate import stage_plans
from remat.estimate.stage_plans import plan_stages
from remat.estimate.stages import predict_stages, rank_plan, trace_stages
from remat.planner import recompute_candidates


@pytest.fixture(scope="module")
def traced_pp4_once():
    spec = _spec(pp=4, layers=8)
    return spec, trace_stages(spec)


@pytest.fixture
def traced_pp4(traced_pp4_once, monkeypatch):
    """Four ranks traced by shape once for the module; plan_stages reuses the traces."""
    monkeypatch.setattr(stage_plans, "trace_stages", lambda *args, **kwargs: traced_pp4_once[1])
    return traced_pp4_once


def test_each_rank_gets_the_fastest_plan_that_fits_with_its_micro_batches_in_flight(traced_pp4) -> None:
    spec, traced = traced_pp4
    none = _peaks(spec, traced, [None] * 4)
    budget = sorted(none)[-2] - 1  # the two ranks with the highest peaks must act, the others need not
    result = plan_stages(spec, budget)
    peaks = [s.peak for s in result.estimate.stages]
    assert all(p <= budget for p in peaks)
    for k, (stage, before) in enumerate(zip(result.stages, none)):
        acts = stage.plan != Plan.none(len(stage.layers))
        assert acts == (before > budget), k  # a rank that fits as it is keeps everything
        # the solver's own sum over the rank's windows is the estimate's peak
        problem = traced[k].problem(k, spec)
        chosen = [traced[k].trace.choice(i, i + 1, a) for i, a in enumerate(stage.plan.layers)]
        assert problem.peak(chosen) == pytest.approx(peaks[k], abs=1)
    assert [s.in_flight for s in result.estimate.stages] == [4, 3, 2, 1]


def test_a_rank_with_more_in_flight_frees_more_of_each_micro_batch(traced_pp4) -> None:
    spec, traced = traced_pp4
    # the same saved bytes per micro-batch weigh more where more micro-batches are in flight
    budget = _peaks(spec, traced, [None] * 4)[1] - 256 * 1024  # rank 1 must shed a quarter MiB
    result = plan_stages(spec, budget)
    saved = [traced[k].trace.predict(s.plan).saved_bytes for k, s in enumerate(result.stages)]
    assert saved[0] <= saved[1] <= saved[2]


def test_the_uniform_config_compared_is_the_fastest_that_fits_every_rank(traced_pp4) -> None:
    spec, traced = traced_pp4
    budget = _peaks(spec, traced, [None] * 4)[0] - 512 * 1024
    result = plan_stages(spec, budget)
    assert result.uniform is not None
    config, uniform = result.uniform
    labels = frozenset().union(*traced[0].trace.model_sites.labels)
    fitting = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        for keys in recompute_candidates(labels, 2):
            candidate = RecomputeConfig(**keys, facts=TrainingFacts(num_layers=8, layout=ParallelLayout(pp=4)))
            estimated = predict_stages("c", spec, traced, [rank_plan(candidate, spec, k) for k in range(4)])
            if estimated.peak <= budget:
                fitting.append(estimated.step_time_s)
    assert uniform.peak <= budget and uniform.step_time_s == min(fitting)
    assert result.estimate.step_time_s <= uniform.step_time_s  # one plan per rank is never slower


def test_a_rank_no_plan_fits_is_named_with_by_how_much() -> None:
    with pytest.raises(ConfigError) as info:
        plan_stages(_spec(), 1 * MiB)
    assert [p.field for p in info.value.problems] == ["pipeline rank 0", "pipeline rank 1"]
    assert "no plan fits 1.00 MiB" in info.value.problems[0].message


def test_the_ranks_plans_join_into_one_plan_that_runs_each_ranks_own(traced_pp4) -> None:
    spec, traced = traced_pp4
    result = plan_stages(spec, _peaks(spec, traced, [None] * 4)[0] - 512 * 1024, max_group=2)
    for k, stage in enumerate(result.stages):
        assert rank_plan(result.plan, spec, k) == stage.plan
    assert not list(plan_pipeline_problems(result.plan, ParallelLayout(pp=4)))


def _stamped() -> Plan:
    plan = Plan([{"mlp": "recompute"}, {}, {}, {}], [(2, 3)])
    plan.pipeline = PipelineStages(ParallelLayout(pp=2), (100, 90))
    return plan


def test_a_plan_file_carries_the_layout_and_each_ranks_peak(tmp_path) -> None:
    path = tmp_path / "plan.yaml"
    _stamped().save(path)
    loaded = Plan.load(path)
    assert loaded == _stamped() and loaded.pipeline == _stamped().pipeline
    assert loaded.to_dict()["pipeline"]["stages"] == [
        {"layers": [0, 1], "predicted_peak_bytes": 100},
        {"layers": [2, 3], "predicted_peak_bytes": 90},
    ]


@pytest.mark.parametrize(
    "section, field",
    [
        ("not a mapping", "pipeline"),
        (
            {
                "pipeline_model_parallel_size": 3,
                "virtual_pipeline_model_parallel_size": None,
                "stages": [{"layers": [0], "predicted_peak_bytes": 1}] * 2,
            },
            "pipeline",
        ),  # 2 stages listed for 3
        (
            {
                "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": None,
                "stages": [
                    {"layers": [0, 1], "predicted_peak_bytes": "big"},
                    {"layers": [2, 3], "predicted_peak_bytes": 1},
                ],
            },
            "pipeline",
        ),
        (
            {
                "pipeline_model_parallel_size": 3,
                "virtual_pipeline_model_parallel_size": None,
                "stages": [{"predicted_peak_bytes": 1}] * 3,
            },
            "pipeline",
        ),  # 4 layers do not split in 3
        (
            {
                "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": None,
                "stages": [{"layers": [0, 1], "predicted_peak_bytes": 1}, {"layers": [3], "predicted_peak_bytes": 1}],
            },
            "pipeline.stages[1].layers",
        ),
    ],
)
def test_a_plan_files_pipeline_section_rules_fail(section, field) -> None:
    data = {**_stamped().to_dict(), "pipeline": section}
    assert [p.field for p in plan_file_problems(data)] == [field]


def test_a_plan_files_pipeline_section_rule_passes() -> None:
    assert plan_file_problems(_stamped().to_dict()) == []


@pytest.mark.parametrize("pp, vpp, refused", [(2, None, False), (4, None, True), (2, 2, True)])
def test_a_plan_solved_per_stage_runs_only_on_its_layout(pp, vpp, refused) -> None:
    problems = list(plan_pipeline_problems(_stamped(), ParallelLayout(pp=pp, vp=vpp)))
    assert [p.field for p in problems] == (["pipeline"] if refused else [])
    if refused:
        assert "run it with -pp 2" in problems[0].message


@pytest.mark.parametrize(
    "flags, field", [(["--configs", "none"], "--configs"), (["--recompute_modules", "mlp"], "--recompute_modules")]
)
def test_estimate_plans_only_without_configs_of_its_own(flags, field, capsys) -> None:
    args = ["estimate", "-mr", "llama3_tiny", "--memory-budget", "1GiB", *flags]
    assert main(args) == 1
    assert f"{field}:" in capsys.readouterr().err
