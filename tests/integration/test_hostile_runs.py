"""Commands run end to end on an 80-column terminal: the tables of estimate (llama3_70b over 32
GPUs, slow), bench, sweep and recipes fit in it, no cell cut short.

The quick tests of the same code: tests/unit/cli/test_hostile.py."""

from __future__ import annotations

import pytest
from helpers.hostile import TINY_RUN, run

from remat.cli import common

pytestmark = pytest.mark.usefixtures("private_run_dir")


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(
            [
                "estimate",
                "-mr",
                "llama3_70b",
                "-tp",
                "8",
                "-pp",
                "4",
                "-ng",
                "32",
                "--sequence_parallel",
                "--no_progress",
                "--configs",
                "none",
                "mlp",
                "full_block_10",
            ],
            marks=pytest.mark.slow,
        ),
        ["bench", *TINY_RUN, "--no_history"],
        ["sweep", *TINY_RUN, "--no_history", "--configs", "none", "core_attn+layernorm", "--plot", "p.png"],
        ["recipes"],
    ],
)
def test_tables_fit_80_columns(capsys, monkeypatch, argv) -> None:
    for console in (common.out, common.err):
        monkeypatch.setattr(console, "width", 80)
        monkeypatch.setattr(console, "soft_wrap", False)
    code, out, _, _ = run(capsys, *argv)
    assert code == 0
    assert max(map(len, out.splitlines())) <= 80 and "…" not in out
