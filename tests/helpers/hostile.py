"""Shared by the unit and integration tests of hostile."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from remat.cli import main

TINY_RUN = ["-mr", "llama3_tiny", "--num_layers", "2", "-sl", "16", "-ms", "3", "--warmup_steps", "1", "--no_progress"]


@pytest.fixture
def private_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """History in tmp_path, and tmp_path the working directory, where rescue files land (a module
    asks for it: usefixtures)."""
    monkeypatch.setenv("REMAT_HISTORY", str(tmp_path / "history.sqlite"))
    monkeypatch.chdir(tmp_path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds) of `remat argv`; argparse's refusals exit 2."""
    start = time.perf_counter()
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split()), time.perf_counter() - start
