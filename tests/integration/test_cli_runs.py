"""The `remat` command running a step end to end: `remat verify` trains a tiny step under a selective
plan with dropout and reports it bit-identical.

The quick tests of the same code: tests/unit/cli/test_cli.py."""

from __future__ import annotations

from helpers.cli import _run


def test_verify_runs_a_tiny_step_and_reports_bit_identical(capsys) -> None:
    code, out, _ = _run(
        capsys,
        "verify",
        "--num_layers",
        "2",
        "-sl",
        "16",
        "--hidden_dropout",
        "0.1",
        "--recompute_modules",
        "layernorm,mlp",
    )
    assert code == 0
    assert "bit-identical: True" in out and "gradients match" in out
