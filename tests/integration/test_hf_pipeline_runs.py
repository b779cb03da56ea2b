"""Pipeline parallelism for Hugging Face causal LMs on CPU under torchrun with gloo
(tests/integration/workers/hf_pp_worker.py), the estimate of each stage, and `remat bench` on
stages (slow).

A tiny HF Llama and Mixtral (float64, 4 layers) under 1F1B over 2 stages and interleaved 1F1B over
2 x 2 virtual stages give the loss and every gradient of the whole model's step on one process bit
for bit: each stage runs the base model's own forward on its layers (position ids, causal mask and
rotary tables computed again, alike), so every micro-batch runs the same ops in the same order.
HF's loss head reduces in float32 on both. With attention dropout each rank draws its own masks,
so every recompute plan is held against the pipeline without recompute, also bit for bit.
Beside tensor parallelism (pp 2 x tp 2, four processes, slow) the loss and gradients agree with
one process to 1e-12 (the row-parallel projections sum each rank's partial products, which
reorders one process's additions), and every plan is bit-identical to none.

A Llama with tied embeddings holds the weight on both ends (the first stage's embedding, the last
stage's output layer), their gradients summed after the step: every gradient is one process's bit
for bit, the tied one the sum of the embedding's and the output layer's gradients of the untied
model, which one process with the tied weight adds up in autograd's order instead: to 1e-15 of it.
Under FSDP2 (pp 2 x dp 2, slow) each end's shard is summed with the other's, bit for bit too.

The quick tests of the same code: tests/unit/models/test_hf_pipeline.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.hf_pipeline import TIED_TOLERANCE

pytest.importorskip("transformers")


from conftest import run_under_torchrun, worker_env  # noqa: E402

from remat.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import hf_pp_worker  # noqa: E402

TP_TOLERANCE = 1e-12  # float64, additions reordered by the row-parallel sums


FAMILIES = list(hf_pp_worker.FAMILIES)


TIED = hf_pp_worker.TIED


@pytest.fixture(scope="module")
def piped(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hf_pp") / "results.pt"
    run_under_torchrun(Path(hf_pp_worker.__file__), out, 2)
    return torch.load(out)


@pytest.fixture(scope="module")
def piped_four(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hf_pp_four") / "results.pt"
    run_under_torchrun(Path(hf_pp_worker.__file__), out, 4)
    return torch.load(out)


def _equal(found: tuple[float, dict], expected: tuple[float, dict]) -> None:
    (loss, grads), (expected_loss, expected_grads) = found, expected
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    assert loss == pytest.approx(expected_loss, rel=1e-15)  # the schedule sums the scaled losses in its order
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name


@pytest.mark.parametrize("layout", list(hf_pp_worker.LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pipeline_step_of_an_hf_model_is_its_step_on_one_process_bit_for_bit(piped, family, layout) -> None:
    _equal(piped[f"{family}@{layout}@none@0.0"], piped[f"{family}@one process"])


@pytest.mark.parametrize("layout", list(hf_pp_worker.LAYOUTS))
def test_a_tied_embedding_on_two_stages_has_the_one_process_gradient(piped, layout) -> None:
    loss, grads = piped[f"{TIED}@{layout}@none@0.0"]
    one_loss, one_grads = piped[f"{TIED}@one process, tied"]
    assert loss == pytest.approx(one_loss, rel=1e-15) and grads.keys() == one_grads.keys()
    for name, grad in grads.items():
        if name in hf_pp_worker.TIED_NAMES:
            torch.testing.assert_close(grad, one_grads[name], rtol=0, atol=TIED_TOLERANCE, msg=name)
        else:
            assert torch.equal(grad, one_grads[name]), name


@pytest.mark.parametrize("plan", ["selective", "full"])
@pytest.mark.parametrize("layout", list(hf_pp_worker.LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_plan_on_hf_stages_with_dropout_is_bit_identical_to_none(piped, family, layout, plan) -> None:
    found, plain = piped[f"{family}@{layout}@{plan}@0.1"], piped[f"{family}@{layout}@none@0.1"]
    assert found[0] == plain[0]
    _equal(found, plain)
    assert plain[0] != piped[f"{family}@{layout}@none@0.0"][0]  # dropout drew: not two plain runs


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_stages_split_by_tensor_parallelism_match_one_process(piped_four, family) -> None:
    loss, grads = piped_four[f"{family}@1f1b x tp 2@none@0.0"]
    one_loss, one_grads = piped_four[f"{family}@one process"]
    assert loss == pytest.approx(one_loss, abs=TP_TOLERANCE)
    assert grads.keys() == one_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, one_grads[name], rtol=0, atol=TP_TOLERANCE, msg=name)
    for plan in ("selective", "full"):
        found, plain = piped_four[f"{family}@1f1b x tp 2@{plan}@0.1"], piped_four[f"{family}@1f1b x tp 2@none@0.1"]
        assert found[0] == plain[0]
        _equal(found, plain)


@pytest.mark.slow
def test_a_tied_embedding_on_stages_sharded_by_fsdp2_matches_one_process(piped_four) -> None:
    """pp 2 x dp 2: each end's gradient is an FSDP2 shard, summed with the other end's shard."""
    _equal(piped_four[f"{TIED}@1f1b x dp 2@none@0.0"], piped_four[f"{TIED}@one process"])


def test_estimate_gives_each_hf_stage_its_numbers(tmp_path) -> None:
    out = tmp_path / "estimate.json"
    assert (
        main(
            [
                "estimate",
                "-mr",
                "hf:llama",
                "-pp",
                "2",
                "-ng",
                "2",
                "-gb",
                "4",
                "--configs",
                "none",
                "--target",
                "cpu",
                "--no_progress",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (found,) = json.loads(out.read_text())
    assert [(s["stage"], s["layers"], s["in_flight"]) for s in found["stages"]] == [(0, 1, 2), (1, 1, 1)]


@pytest.mark.slow
def test_bench_runs_hf_stages_under_torchrun(tmp_path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "remat",
            "bench",
            "-mr",
            "hf:llama",
            "--device",
            "cpu",
            "-ms",
            "2",
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
            "-ng",
            "2",
            "--json",
            str(out),
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "remat bench: hf:llama, 2 pipeline stages (1f1b)" in run.stdout
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["shape"]["pipeline_parallel"] == 2
