"""remat.plan against runs: the plans chosen under several budgets fit when run (the measured peak
is the predicted one), offload reaches below every recompute plan and fits when run, and `remat
plan` writes a plan file that bench takes and verifies (measured within 1e-3 of predicted), with
offload too (slow).

The quick tests of the same code: tests/unit/planner/test_planning.py."""

from __future__ import annotations

import json

import pytest
from helpers.planning import MiB

import remat
from remat.bench.history import recent
from remat.cli import main
from remat.config.plan import Plan, load_plan_or_config
from remat.planner import NoPlanFits, megatron_keys, plan_from_trace


def test_plans_fit_their_budget_when_run(budget_trace, measured_peak) -> None:
    model, batch, trace = budget_trace
    highest = trace.predict(None).peak_bytes
    lowest = trace.predict(Plan(Plan.none(4).layers, [(0, 4)])).peak_bytes
    for fraction in (1.0, 0.9, 0.8, 0.7):
        budget = int(lowest + fraction * (highest - lowest))
        result = plan_from_trace(trace, budget)
        assert result.prediction.peak_bytes <= budget
        assert measured_peak(model, batch, result.config or result.plan) == result.prediction.peak_bytes
    roomy = plan_from_trace(trace, "1GiB")
    assert roomy.plan == Plan.none(4) and roomy.config == remat.RecomputeConfig()
    assert list(roomy.explain()) == []


@pytest.fixture(scope="module")
def offload_traced(budget_trace):
    model, batch, _ = budget_trace
    return model, batch, remat.trace(model, batch, timing_repeats=1, offload=True, min_offloaded_tensor_size=256)


def test_offload_reaches_below_every_recompute_plan_and_fits_when_run(
    budget_trace, offload_traced, measured_peak
) -> None:
    _, _, plain = budget_trace
    model, batch, trace = offload_traced
    with pytest.raises(NoPlanFits) as recompute_only:
        plan_from_trace(plain, 1024)
    with pytest.raises(NoPlanFits) as with_offload:
        plan_from_trace(trace, 1024)
    lowest_recompute, lowest = recompute_only.value.lowest.peak_bytes, with_offload.value.lowest.peak_bytes
    assert lowest < lowest_recompute
    budget = (lowest + lowest_recompute) // 2
    result = plan_from_trace(trace, budget)
    assert result.plan.offloads() and result.prediction.host_bytes > 0
    assert result.prediction.peak_bytes <= budget
    assert result.plan.min_offloaded_tensor_size == 256
    assert measured_peak(model, batch, result.config or result.plan) == result.prediction.peak_bytes
    assert any("offload" in what for _, what, _, _ in result.explain())
    # host memory capped at nothing: the same budget cannot be met
    with pytest.raises(NoPlanFits):
        plan_from_trace(trace, budget, host_budget=1)


def test_cli_plan_writes_a_file_bench_takes_and_verifies_it(tmp_path, capsys) -> None:
    out, record, history = tmp_path / "plan.yaml", tmp_path / "plan.json", tmp_path / "history.sqlite"
    argv = [
        "plan",
        "-mr",
        "llama3_tiny",
        "--num_layers",
        "3",
        "-sl",
        "32",
        "--no_progress",
        "--history",
        str(history),
        "--memory-budget",
        "2.2MiB",
        "-o",
        str(out),
        "--verify",
        "--json",
        str(record),
        "-ms",
        "2",
        "--warmup_steps",
        "1",
    ]
    assert main(argv) == 0
    assert [r.name for r in recent(path=history)] == ["plan"]  # the verifying run is recorded
    text = capsys.readouterr().out
    assert "fastest plan under 2.20 MiB" in text and "predicted vs measured" in text
    assert "what each site saves for backward" in text and "layer 0 mlp" in text
    data = json.loads(record.read_text())
    assert data["predicted"]["peak_bytes"] <= 2.2 * MiB
    # bench also allocates each step's tokens and a loss total: a few hundred bytes more
    assert data["measured"]["peak_allocated_bytes"] == pytest.approx(data["predicted"]["peak_bytes"], rel=1e-3)
    loaded = load_plan_or_config(out)
    model_sites = remat.find_sites(remat.models.build("llama3_tiny", num_layers=3, seq_length=32)).model_sites
    assert (loaded if isinstance(loaded, Plan) else Plan.from_config(loaded, model_sites)) == Plan.from_dict(
        data["plan"]
    )
    assert data["megatron"] == (None if isinstance(loaded, Plan) else megatron_keys(loaded))
    assert bool(data["explain"]) == (Plan.from_dict(data["plan"]) != Plan.none(3))
    assert (
        main(
            [
                "bench",
                "-mr",
                "llama3_tiny",
                "--num_layers",
                "3",
                "-sl",
                "32",
                "--config",
                str(out),
                "--no_progress",
                "--no_history",
                "-ms",
                "1",
                "--warmup_steps",
                "0",
            ]
        )
        == 0
    )


def test_cli_plan_under_a_budget_no_recompute_fits_says_so(tmp_path, capsys) -> None:
    out = tmp_path / "plan.yaml"
    assert (
        main(
            [
                "plan",
                "-mr",
                "llama3_tiny",
                "--num_layers",
                "2",
                "-sl",
                "16",
                "--no_progress",
                "--no_history",
                "--memory-budget",
                "1GiB",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "keep (no recompute)" in text and "a Megatron config expresses this plan: no recompute" in text
    assert load_plan_or_config(out) == remat.RecomputeConfig()


@pytest.mark.slow
def test_cli_plan_with_offload_writes_an_offload_plan_bench_runs(tmp_path, capsys) -> None:
    out, record = tmp_path / "plan.yaml", tmp_path / "plan.json"
    # with -sl 128 no recompute plan goes below 1.85 MiB; offload reaches 1.77
    argv = [
        "plan",
        "-mr",
        "llama3_tiny",
        "--num_layers",
        "3",
        "-sl",
        "128",
        "--no_progress",
        "--no_history",
        "--offload",
        "--min_offloaded_tensor_size",
        "256",
        "--host-memory-budget",
        "1GiB",
        "--memory-budget",
        "1.8MiB",
        "-o",
        str(out),
        "--json",
        str(record),
    ]
    assert main(argv) == 0
    out_text, err = capsys.readouterr()
    assert "offloaded to host" in out_text
    assert "offload on CPU (--offload) copies CPU memory to CPU memory" in " ".join(err.split())
    data = json.loads(record.read_text())
    assert data["predicted"]["peak_bytes"] <= 1.8 * MiB and data["predicted"]["host_bytes"] > 0
    loaded = load_plan_or_config(out)
    lowered = (
        loaded
        if isinstance(loaded, Plan)
        else Plan.from_config(
            loaded, remat.find_sites(remat.models.build("llama3_tiny", num_layers=3, seq_length=128)).model_sites
        )
    )
    assert lowered.offloads() and lowered.min_offloaded_tensor_size == 256
    assert (
        main(
            [
                "bench",
                "-mr",
                "llama3_tiny",
                "--num_layers",
                "3",
                "-sl",
                "128",
                "--config",
                str(out),
                "--no_progress",
                "--no_history",
                "-ms",
                "1",
                "--warmup_steps",
                "0",
            ]
        )
        == 0
    )
