"""adapt() on a torchtitan-style model end to end: every selective subset and full recompute plan
gives the unmodified model's loss and gradients bit for bit and frees bytes, and `remat bench` and
`remat estimate` run such a model from a factory (--model helpers.adapt:titan_model).

The quick tests of the same code: tests/unit/sites/test_adapt.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.adapt import LAYERS, SELECTIVE, SEQ, SITE_MAP, _batch, _model

import remat
from remat.config.recompute import RecomputeConfig
from remat.run.verify import run_step, verify


def _configs() -> list[RecomputeConfig]:
    subsets = [c for r in range(1, 4) for c in itertools.combinations(SELECTIVE, r)]
    return [RecomputeConfig(recompute_granularity="selective", recompute_modules=list(s)) for s in subsets] + [
        RecomputeConfig(recompute_granularity="full", recompute_method=m, recompute_num_layers=k)
        for m in ("uniform", "block")
        for k in (1, LAYERS)
    ]


@pytest.mark.parametrize(
    "config",
    _configs(),
    ids=lambda c: (
        c.recompute_granularity
        + ":"
        + (
            ",".join(c.recompute_modules)
            if c.recompute_granularity == "selective"
            else f"{c.recompute_method}{c.recompute_num_layers}"
        )
    ),
)
def test_every_plan_on_an_adapted_model_is_bit_identical_to_the_unmodified_model(config) -> None:
    model = _model()
    model.train()
    plain = run_step(model, *_batch(), seed=3)
    remat.adapt(model, SITE_MAP)
    report = verify(model, config, *_batch(), seed=3)
    assert report.bit_identical, report.max_grad_diff
    assert torch.equal(report.baseline.loss, plain.loss)
    assert all(torch.equal(plain.grads[n], g) for n, g in report.candidate.grads.items())
    assert report.freed_bytes > 0


def test_any_model_runs_through_the_command_line_from_a_factory(capsys) -> None:
    from remat.cli import main

    code = main(
        [
            "bench",
            "--model",
            "helpers.adapt:titan_model",
            "-sl",
            str(SEQ),
            "-ms",
            "2",
            "--warmup_steps",
            "1",
            "--recompute_modules",
            "mlp,layernorm",
            "--no_history",
            "--no_progress",
            "--device",
            "cpu",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "ok" in out
    code = main(["estimate", "--model", "helpers.adapt:titan_model", "-sl", str(SEQ), "--target", "cpu", "-rl", "1"])
    assert code == 0, capsys.readouterr().err


def test_a_factory_model_trains_in_fp8_through_the_command_line(capsys) -> None:
    from remat.cli import main

    model = _model()
    remat.adapt(model, SITE_MAP)
    # every linear of each layer (attention's four, the MLP's three); the embedding and head stay
    assert remat.to_fp8(model, remat.Precision("fp8_cs")) == 7 * LAYERS
    flags = [
        "--model",
        "helpers.adapt:titan_model",
        "-sl",
        "16",
        "-c",
        "fp8_cs",
        "--recompute_modules",
        "mlp,layernorm",
    ]
    assert main(["verify", *flags]) == 0
    out = capsys.readouterr().out
    assert "fp8_cs on cpu" in out and "bit-identical: True" in out
    assert main(["bench", *flags, "-ms", "2", "--warmup_steps", "1", "--no_history", "--no_progress"]) == 0
