"""Shared by the unit and integration tests of cli."""

from __future__ import annotations

from remat.cli import main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
