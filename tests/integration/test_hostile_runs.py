"""Hostile input and noisy machines, as a new user meets them: each command exits with a message
(never a traceback, never a hang), keeps every result it measured, and tells noise from a change.

The quick tests of the same code: tests/unit/cli/test_hostile.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hostile import TINY_RUN, run

from remat.cli import common


@pytest.fixture(autouse=True)
def _private_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_HISTORY", str(tmp_path / "history.sqlite"))
    monkeypatch.chdir(tmp_path)  # rescue files land here


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
