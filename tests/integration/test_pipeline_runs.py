"""Pipeline parallelism (remat.parallel.Pipeline, torch's 1F1B and interleaved 1F1B) on CPU: two
processes under torchrun with gloo.

Each stage holds the whole model's weights for its layers, so the pipeline's step is the whole
model's step on the same micro-batches: the loss and every gradient equal one process's
accumulation over the 4 micro-batches bit for bit (float64, no dropout): every micro-batch runs
the same ops in the same order, only split across processes, and gradients accumulate in
micro-batch order on both. With dropout each rank draws its own masks, so recompute is held
against the pipeline without recompute, also bit for bit.

The quick tests of the same code: tests/unit/parallel/test_pipeline.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_under_torchrun

from remat.sites.calls import forward_loss

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import fsdp_worker  # noqa: E402
import pp_worker  # noqa: E402

CASES = [(layout, name) for layout, plans in pp_worker.PLANS.items() for name in plans]


@pytest.fixture(scope="module")
def piped(tmp_path_factory) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    out = tmp_path_factory.mktemp("pp") / "results.pt"
    run_under_torchrun(Path(pp_worker.__file__), out)
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process() -> tuple[float, dict[str, torch.Tensor]]:
    model = fsdp_worker.model(0.0)
    inputs, labels = fsdp_worker.global_batch(pp_worker.MICRO_BATCHES // fsdp_worker.PER_RANK)
    total = 0.0
    for i in range(pp_worker.MICRO_BATCHES):
        loss = forward_loss(model, inputs[i : i + 1], labels[i : i + 1]) / pp_worker.MICRO_BATCHES
        loss.backward()
        total += loss.item()
    return total, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout,plan", CASES)
def test_a_pipeline_step_is_the_whole_models_step_bit_for_bit(piped, one_process, layout, plan) -> None:
    loss, grads = piped[f"{layout}:{plan}@0.0"]
    whole_loss, whole_grads = one_process
    assert grads.keys() == whole_grads.keys()
    assert loss == pytest.approx(whole_loss, rel=1e-15)  # the schedule sums the scaled losses in its order
    for name, grad in grads.items():
        assert torch.equal(grad, whole_grads[name]), name


@pytest.mark.parametrize("layout,plan", [c for c in CASES if c[1] != "none"])
def test_recompute_in_a_pipeline_with_dropout_is_bit_identical_to_none(piped, layout, plan) -> None:
    loss, grads = piped[f"{layout}:{plan}@0.1"]
    plain_loss, plain_grads = piped[f"{layout}:none@0.1"]
    assert loss == plain_loss
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_dropout_changes_the_step(piped) -> None:  # the comparison above is not of two plain runs
    assert piped["1f1b:none@0.1"][0] != piped["1f1b:none@0.0"][0]


def test_bench_pp_2_starts_torchrun_and_runs_the_stages(tmp_path) -> None:
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "remat",
            "bench",
            "-mr",
            "llama3_tiny",
            "--device",
            "cpu",
            "-ms",
            "3",
            "--warmup_steps",
            "1",
            "--no_history",
            "--no_progress",
            "-pp",
            "2",
            "-gb",
            "2",
            "-rl",
            "1",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "remat bench: llama3_tiny, 2 pipeline stages (1f1b)" in run.stdout
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and len(result["losses"]) == 3
    assert result["shape"]["pipeline_parallel"] == 2 and "data_parallel" not in result["shape"]
