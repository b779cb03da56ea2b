"""A plan per pipeline rank: each rank's trace, its micro-batches in flight, the plan file that
carries the ranks' plans, and the uniform Megatron config they are compared with."""
from __future__ import annotations

import json
import warnings

import pytest

import remat
from remat.cli import main
from remat.estimate.spec import EstimateSpec
from remat.estimate.stages import predict_stages, rank_plan, trace_stages
from remat.config.plan import PipelineStages, Plan, plan_file_problems, plan_pipeline_problems
from remat.planner import recompute_candidates
from remat.core.problems import ConfigError
from remat.config.recompute import RecomputeConfig
from remat.config.megatron import TrainingFacts
from remat.estimate import stage_plans
from remat.estimate.stage_plans import plan_stages
from remat.config.parallel import ParallelLayout

MiB = 2**20


def _spec(pp: int = 2, layers: int = 4, vpp: int | None = None, micro_batches: int = 4,
          seq: int = 256) -> EstimateSpec:
    return EstimateSpec(recipe="llama3_tiny", overrides={"num_layers": layers, "seq_length": seq},
                        layout=ParallelLayout(pp=pp, vp=vpp),
                        micro_batch_size=1, global_batch_size=micro_batches, device="cpu", compile=False)


@pytest.fixture(scope="module")
def traced_pp4_once():
    spec = _spec(pp=4, layers=8)
    return spec, trace_stages(spec)


@pytest.fixture
def traced_pp4(traced_pp4_once, monkeypatch):
    """Four ranks traced by shape once for the module; plan_stages reuses the traces."""
    monkeypatch.setattr(stage_plans, "trace_stages", lambda *args, **kwargs: traced_pp4_once[1])
    return traced_pp4_once


def _peaks(spec: EstimateSpec, traced, plans) -> list[int]:
    return [s.peak for s in predict_stages("x", spec, traced, plans).stages]


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


def test_the_estimate_of_each_rank_is_its_trace_on_the_device() -> None:
    """Shapes alone (meta) against each rank's shard traced on the CPU: for the ranks' plans and
    Megatron's configs, the same bytes per component, exactly (the times differ: counted FLOPs
    against measured)."""
    spec = _spec(pp=2, vpp=2)
    by_shape, on_cpu = trace_stages(spec), trace_stages(spec, device="cpu")
    planned = plan_stages(spec, max(_peaks(spec, by_shape, [None, None])) - 128 * 1024)
    full = RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                           facts=TrainingFacts(num_layers=4, layout=ParallelLayout(pp=2, vp=2)))
    for plans in ([None, None], [s.plan for s in planned.stages], [rank_plan(full, spec, k) for k in range(2)]):
        for shaped, traced in zip(predict_stages("x", spec, by_shape, plans).stages,
                                  predict_stages("x", spec, on_cpu, plans).stages):
            assert (shaped.weights, shaped.grads, shaped.optimizer_state, shaped.activations, shaped.peak) == (
                traced.weights, traced.grads, traced.optimizer_state, traced.activations, traced.peak)
    assert planned.plan.pipeline == PipelineStages(ParallelLayout(pp=2, vp=2),
                                                   tuple(s.peak for s in planned.estimate.stages))
    assert [s.layers for s in planned.stages] == [(0, 2), (1, 3)]  # rank r runs chunks r and r + pp


def test_the_ranks_plans_join_into_one_plan_that_runs_each_ranks_own(traced_pp4) -> None:
    spec, traced = traced_pp4
    result = plan_stages(spec, _peaks(spec, traced, [None] * 4)[0] - 512 * 1024, max_group=2)
    for k, stage in enumerate(result.stages):
        assert rank_plan(result.plan, spec, k) == stage.plan
    assert not list(plan_pipeline_problems(result.plan, ParallelLayout(pp=4)))


# ---- the plan file ---------------------------------------------------------------------------

def _stamped() -> Plan:
    plan = Plan([{"mlp": "recompute"}, {}, {}, {}], [(2, 3)])
    plan.pipeline = PipelineStages(ParallelLayout(pp=2), (100, 90))
    return plan


def test_a_plan_file_carries_the_layout_and_each_ranks_peak(tmp_path) -> None:
    path = tmp_path / "plan.yaml"
    _stamped().save(path)
    loaded = Plan.load(path)
    assert loaded == _stamped() and loaded.pipeline == _stamped().pipeline
    assert loaded.to_dict()["pipeline"]["stages"] == [{"layers": [0, 1], "predicted_peak_bytes": 100},
                                                        {"layers": [2, 3], "predicted_peak_bytes": 90}]


@pytest.mark.parametrize("section, field", [
    ("not a mapping", "pipeline"),
    ({"pipeline_model_parallel_size": 3, "virtual_pipeline_model_parallel_size": None,
      "stages": [{"layers": [0], "predicted_peak_bytes": 1}] * 2}, "pipeline"),  # 2 stages listed for 3
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None,
      "stages": [{"layers": [0, 1], "predicted_peak_bytes": "big"}, {"layers": [2, 3], "predicted_peak_bytes": 1}]},
     "pipeline"),
    ({"pipeline_model_parallel_size": 3, "virtual_pipeline_model_parallel_size": None,
      "stages": [{"predicted_peak_bytes": 1}] * 3}, "pipeline"),  # 4 layers do not split in 3
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": None,
      "stages": [{"layers": [0, 1], "predicted_peak_bytes": 1}, {"layers": [3], "predicted_peak_bytes": 1}]},
     "pipeline.stages[1].layers"),
])
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


# ---- the command line ------------------------------------------------------------------------

def test_estimate_plans_each_rank_by_shape_and_writes_the_plan(tmp_path, capsys) -> None:
    out, record = tmp_path / "plan.yaml", tmp_path / "plan.json"
    args = ["estimate", "-mr", "llama3_tiny", "--seq_length", "256", "-pp", "2", "-gb", "4", "--target", "cpu",
            "--no-compile", "--memory-budget", "3.9MiB", "-o", str(out), "--json", str(record), "--no_progress"]
    assert main(args) == 0
    plan, data = Plan.load(out), json.loads(record.read_text())
    assert plan.pipeline is not None and plan.pipeline.layout.pp == 2
    assert [s["peak"] for s in data["estimate"]["stages"]] == list(plan.pipeline.predicted_peak_bytes)
    assert max(plan.pipeline.predicted_peak_bytes) <= 3.9 * MiB
    shown = capsys.readouterr().out
    assert "a plan per pipeline rank under 3.90 MiB" in shown and "fastest Megatron config" in shown
    # run with another layout, the plan is refused before anything runs
    assert main(["bench", "-mr", "llama3_tiny", "--seq_length", "256", "-pp", "4", "-gb", "4", "--config", str(out), "-d"]) == 1
    assert "solved stage by stage for 2 pipeline stages" in capsys.readouterr().err


@pytest.mark.parametrize("flags, field", [(["--configs", "none"], "--configs"),
                                          (["--recompute_modules", "mlp"], "--recompute_modules")])
def test_estimate_plans_only_without_configs_of_its_own(flags, field, capsys) -> None:
    args = ["estimate", "-mr", "llama3_tiny", "--memory-budget", "1GiB", *flags]
    assert main(args) == 1
    assert f"{field}:" in capsys.readouterr().err


def test_plan_with_pipeline_stages_traces_each_rank_on_the_device(tmp_path, capsys) -> None:
    out = tmp_path / "plan.yaml"
    args = ["plan", "-mr", "llama3_tiny", "--seq_length", "64", "--num_layers", "2", "-pp", "2", "-gb", "2",
            "--device", "cpu", "--memory-budget", "1GiB", "-o", str(out), "--no_progress"]
    assert main(args) == 0
    assert Plan.load(out).pipeline == PipelineStages(ParallelLayout(pp=2), Plan.load(out).pipeline.predicted_peak_bytes)
    assert "timed on the device" in capsys.readouterr().out
    assert main([*args, "--verify"]) == 1
    assert "--verify:" in capsys.readouterr().err
