"""remat estimate against real steps and through the command line: the meta device's estimate
equals the trace of the same step on CPU byte for byte (every plan, both attention backends, with
AdamW's step, with offload), full recompute configs act per virtual stage as Megatron's, a plan
under virtual stages equals the same actions on each rank without them, slow host copies add step
time, and `remat estimate` writes its stages as JSON (presets, the cuBLAS workspace).

The quick tests of the same code: tests/unit/estimate/test_estimate.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.estimate import FULL, MB, SHAPE, SMALL, VPP, _figures, _quiet, _spec

import remat
from remat.cli import main
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.estimate.stages import estimate
from remat.run.optimizer import adamw

PLANS = [
    ("none", None),
    ("mlp", RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"])),
    ("layernorm", RecomputeConfig(recompute_granularity="selective", recompute_modules=["layernorm"])),
    (
        "full_uniform_2",
        RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    ),
    ("mixed", Plan([{"mlp": "recompute"}, {"layernorm": "discard", "core_attn": "recompute"}, {}, {}], [(2, 4)])),
]


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_estimate_agrees_exactly_with_the_trace_of_a_cpu_model(backend) -> None:
    """The same step on meta tensors (shapes only) and on real CPU tensors: equal bytes for every plan."""
    overrides = {**SHAPE, "attention_backend": backend, "hidden_dropout": 0.1}
    estimates = _quiet(estimate, _spec(overrides=overrides), PLANS)  # 4 layers: the mixed plan
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float32, **overrides)
    ids = torch.randint(0, model.config.vocab_size, (MB, SHAPE["seq_length"] + 1))
    # contiguous labels, as the bench's data gives (a strided view would be copied by the loss)
    traced = _quiet(remat.trace, model, (ids[:, :-1], ids[:, 1:].contiguous()), timing_repeats=1)
    for (name, plan), est in zip(PLANS, estimates):
        predicted = _quiet(traced.predict, plan)
        (stage,) = est.stages
        assert (stage.activations, stage.peak, stage.peak_window) == (
            predicted.saved_bytes,
            predicted.peak_bytes,
            predicted.peak_window,
        ), name


def test_with_the_optimizer_the_estimate_agrees_exactly_with_the_cpu_trace() -> None:
    """On CPU the bench's AdamW loops over the tensors and allocates temporaries for each; the
    estimate runs the same optimizer on meta, so even a peak in the optimizer step agrees."""
    plans = [("none", None), ("full", FULL)]
    estimates = _quiet(estimate, _spec(overrides=SMALL, optimizer=True), plans)
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float32, **SMALL)
    ids = torch.randint(0, model.config.vocab_size, (MB, SMALL["seq_length"] + 1))
    traced = _quiet(
        remat.trace,
        model,
        (ids[:, :-1], ids[:, 1:].contiguous()),
        optimizer=adamw(model.parameters(), fused=False),
        timing_repeats=1,
    )
    windows = []
    for (name, plan), est in zip(plans, estimates):
        predicted = _quiet(traced.predict, plan)
        (stage,) = est.stages
        assert (stage.activations, stage.peak, stage.peak_window) == (
            predicted.saved_bytes,
            predicted.peak_bytes,
            predicted.peak_window,
        ), name
        windows.append(stage.peak_window)
    assert "optimizer" in windows  # the case the fused-AdamW estimate got wrong


@pytest.mark.parametrize(
    "method, ranges",
    [
        # 12 layers in 4 chunks of 3: block recomputes the first 2 layers of each chunk, uniform groups
        # 2 layers from each chunk's start (a stage's 6 layers lowered at once would differ for both)
        ("block", [(0, 1), (1, 2), (3, 4), (4, 5), (6, 7), (7, 8), (9, 10), (10, 11)]),
        pytest.param(
            "uniform", [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8), (8, 9), (9, 11), (11, 12)], marks=pytest.mark.slow
        ),  # the same lowering per chunk as block's, 9 s
    ],
)
def test_full_recompute_configs_act_per_virtual_stage_as_megatron(method, ranges) -> None:
    overrides = {**SMALL, "num_layers": 12}
    config = RecomputeConfig(
        recompute_granularity="full",
        recompute_method=method,
        recompute_num_layers=2,
        facts=dataclasses.replace(VPP, num_layers=12),
    )
    lowered, plan = _quiet(
        estimate,
        _spec(overrides=overrides, layout=VPP.layout, global_batch_size=2 * MB),
        [("config", config), ("plan", Plan([{}] * 12, ranges))],
    )
    assert _figures(lowered) == _figures(plan)


def test_cli_estimates_configs_per_stage_as_json(tmp_path, capsys) -> None:
    out = tmp_path / "estimate.json"
    code = main(
        [
            "estimate",
            "--num_layers",
            "2",
            "-sl",
            "32",
            "-mb",
            "2",
            "-pp",
            "2",
            "-ng",
            "2",
            "-gb",
            "8",
            "--configs",
            "none",
            "full_uniform_1",
            "--target",
            "cpu",
            "--no_progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    assert "estimated peak memory per GPU" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [d["name"] for d in data] == ["none", "full_uniform_1"]
    assert [len(d["stages"]) for d in data] == [2, 2]
    assert data[1]["peak_bytes"] < data[0]["peak_bytes"]
    assert data[0]["stages"][0]["in_flight"] == 2  # 4 micro-batches of 2 on one data-parallel rank


def test_cli_presets_block_half_a_virtual_stage(tmp_path) -> None:
    out = tmp_path / "estimate.json"
    assert (
        main(
            [
                "estimate",
                "--num_layers",
                "4",
                "-sl",
                "32",
                "-pp",
                "2",
                "-vp",
                "2",
                "-ng",
                "2",
                "--configs",
                "presets",
                "--target",
                "cpu",
                "--no_progress",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())[-1]["name"] == "full_block_1"  # 1 layer of each 2-layer chunk


OFFLOAD_PLANS = [
    (
        "layer offload",
        Plan(
            [{"layer": "offload", "mlp": "recompute"}, {"core_attn": "offload"}, {}, {}], min_offloaded_tensor_size=64
        ),
    ),
    (
        "inputs offloaded",
        Plan(
            [{"layer": "offload"}, {}, {"layer": "offload"}, {}], [(0, 2), (2, 3), (3, 4)], min_offloaded_tensor_size=64
        ),
    ),
]


@pytest.mark.slow
def test_offload_estimates_agree_exactly_with_the_trace_of_a_cpu_model() -> None:
    overrides = {**SHAPE, "attention_backend": "eager"}
    estimates = _quiet(estimate, _spec(overrides=overrides), PLANS[:1] + OFFLOAD_PLANS)
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float32, **overrides)
    ids = torch.randint(0, model.config.vocab_size, (MB, SHAPE["seq_length"] + 1))
    traced = _quiet(
        remat.trace,
        model,
        (ids[:, :-1], ids[:, 1:].contiguous()),
        timing_repeats=1,
        offload=True,
        min_offloaded_tensor_size=64,
    )
    for (name, plan), est in zip(PLANS[:1] + OFFLOAD_PLANS, estimates):
        predicted = traced.predict(plan)
        (stage,) = est.stages
        assert (stage.activations, stage.peak, stage.host) == (
            predicted.saved_bytes,
            predicted.peak_bytes,
            predicted.host_bytes,
        ), name
        assert (stage.host > 0) == (plan is not None)


def test_cli_estimate_takes_the_cublas_workspace(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    out = tmp_path / "e.json"
    for size, held in (("4MiB", 8 * 2**20), ("0", 0)):
        assert (
            main(
                [
                    "estimate",
                    "--num_layers",
                    "2",
                    "-sl",
                    "32",
                    "--cublas_workspace",
                    size,
                    "--no_progress",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        assert json.loads(out.read_text())[0]["stages"][0]["workspaces"] == held
    capsys.readouterr()
    assert main(["estimate", "--cublas_workspace", "some", "--no_progress"]) == 1
    assert "cublas_workspace: cannot read 'some'" in capsys.readouterr().err


@pytest.mark.slow  # 13 s; the per-layer plan on each rank's interleaved layers above runs by default
def test_a_plan_under_virtual_stages_equals_the_plan_on_each_ranks_layers_without_them() -> None:
    """With one micro-batch each rank holds one in flight either way, so a plan under -vp 2
    predicts what the same actions on the same ranks predict without virtual stages: rank 0 runs
    layers 0, 1, 4, 5 of 8, rank 1 layers 2, 3, 6, 7."""
    layers = [
        {},
        {},
        {"mlp": "recompute"},
        {"layernorm": "discard"},
        {"core_attn": "recompute"},
        {},
        {},
        {"mlp": "recompute"},
    ]
    interleaved = Plan(layers, [(0, 2), (6, 7)])
    by_rank = Plan([layers[i] for i in (0, 1, 4, 5, 2, 3, 6, 7)], [(0, 2), (6, 7)])
    overrides = {**SMALL, "num_layers": 8}
    (virtual,) = _quiet(
        estimate, _spec(overrides=overrides, layout=VPP.layout, global_batch_size=1 * MB), [("plan", interleaved)]
    )
    (plain,) = _quiet(
        estimate, _spec(overrides=overrides, layout=ParallelLayout(pp=2), global_batch_size=1 * MB), [("plan", by_rank)]
    )
    assert [s.in_flight for s in virtual.stages] == [s.in_flight for s in plain.stages] == [1, 1]
    assert _figures(virtual) == _figures(plain)


@pytest.mark.slow
def test_offload_copies_slower_than_compute_add_step_time() -> None:
    plan = [("offload", Plan([{"layer": "offload"}, {}], min_offloaded_tensor_size=64))]
    fast, slow = (_quiet(estimate, _spec(host_gbps=gbps), [("none", None), *plan]) for gbps in (1e6, 1e-3))
    assert fast[1].step_time_s == pytest.approx(fast[0].step_time_s)  # hidden behind the next layer
    host = slow[1].stages[0].host
    assert slow[1].step_time_s >= slow[0].step_time_s + 2 * host / 1e6 * 0.99  # out and back, barely hidden
    with pytest.raises(ConfigError, match="host_gbps"):
        _spec(host_gbps=0)
    with pytest.raises(ConfigError, match="one estimate traces one"):
        estimate(_spec(), [plan[0], ("other", Plan([{"layer": "offload"}, {}]))])
