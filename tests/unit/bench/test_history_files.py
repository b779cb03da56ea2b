"""A run history that is not one, as a user meets it through `remat history` and `remat bench`:
one line naming the file and what to do, exit 1; a run whose record cannot be read is skipped
with a warning naming it, and the others are listed."""

from __future__ import annotations

import json
import random
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
from helpers.bench import TINY, cli
from helpers.hostile import run

from remat.bench import history
from remat.bench.result import BenchResult
from remat.cli import common

ADVICE = ("REMAT_HISTORY", "--no_history")


@pytest.fixture(autouse=True)
def _unwrapped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Messages as one line each whatever $COLUMNS says, and rescue files in tmp_path."""
    monkeypatch.setattr(common.err, "soft_wrap", True)
    monkeypatch.chdir(tmp_path)


def run_record(name: str = "none") -> BenchResult:
    return BenchResult(
        name=name,
        recipe="llama3_tiny",
        status="ok",
        config={},
        shape={},
        device="cpu",
        gpu="cpu",
        torch="2.5",
        date="2025-01-01T00:00:00",
        command="remat bench",
    )


def recorded(path: Path, runs: int = 3) -> Path:
    for i in range(runs):
        history.append(run_record(f"run{i}"), path)
    return path


def truncated(path: Path, size: int | None = None) -> None:
    """A history cut short (at `size` bytes; None: half of it), as a full disk or a killed copy leaves one."""
    data = recorded(path, runs=60).read_bytes()
    path.write_bytes(data[: len(data) // 2 if size is None else size])


def tables(path: Path, *statements: str) -> None:
    with closing(sqlite3.connect(path)) as conn, conn:
        for statement in statements:
            conn.execute(statement)


# (what is at the path, a phrase of its message)
NOT_HISTORIES: dict[str, tuple[Callable[[Path], object], str]] = {
    "directory": (lambda p: p.mkdir(), "is a directory, not a run history"),
    "truncated": (truncated, "is not a run history remat can read (database disk image is malformed)"),
    "header only": (lambda p: truncated(p, 100), "is not a run history remat can read"),  # SQLite's header whole
    "random bytes": (lambda p: p.write_bytes(random.Random(0).randbytes(4096)), "(file is not a database)"),
    "other columns": (
        lambda p: tables(p, "CREATE TABLE runs (a, b)", "INSERT INTO runs VALUES (1, 2)"),
        "not a run history (its runs table has no column id, date, gpu and 10 more)",
    ),
    "no runs table": (
        lambda p: tables(p, "CREATE TABLE songs (title)"),
        "not a run history (it has no runs table, only songs)",
    ),
}


@pytest.mark.parametrize("command", [["history"], ["history", "show", "1"]])
@pytest.mark.parametrize("kind", list(NOT_HISTORIES))
def test_a_file_that_is_no_run_history_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str, command: list[str]
) -> None:
    path = tmp_path / "history.sqlite"
    make, phrase = NOT_HISTORIES[kind]
    make(path)
    before = path.read_bytes() if path.is_file() else None
    monkeypatch.setenv("REMAT_HISTORY", str(path))
    code, out, err = cli(capsys, *command)
    assert code == 1 and out == ""
    assert err.startswith(f"error: {path} ") and err.count("\n") == 1, err
    assert phrase in err and all(advice in err for advice in ADVICE), err
    assert before is None or path.read_bytes() == before  # reading changes nothing


@pytest.mark.parametrize("argv", [["show", "99999999999999999999999"], ["-n", "99999999999999999999999"]])
def test_numbers_past_sqlites_integers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str]
) -> None:
    """Refused by argparse, as every whole-number flag past 64 bits is, naming the argument."""
    path = recorded(tmp_path / "history.sqlite")
    monkeypatch.setenv("REMAT_HISTORY", str(path))
    code, _, err, _ = run(capsys, "history", *argv)
    assert code == 2 and "99999999999999999999999 is out of range; give a whole number from" in err, err
    assert "Traceback" not in err


_GOOD = json.dumps(run_record().to_dict())
# (what the result column of run 2 holds, why it is skipped)
BAD_RECORDS = {
    "not JSON": ("{not json", "its record is not JSON (Expecting property name"),
    "NULL": (None, "its record is empty (NULL)"),
    "a null date": (_GOOD.replace('"date": "2025-01-01T00:00:00"', '"date": null'), "(date is None, not str)"),
    "a field missing": (_GOOD.replace('"recipe": "llama3_tiny", ', ""), "is malformed (it has no recipe)"),
    "a list": ("[1, 2]", "is malformed (it is list, not a mapping"),
    "a text number": (_GOOD.replace('"tflops_per_gpu": null', '"tflops_per_gpu": "fast"'), "tflops_per_gpu is 'fast'"),
}


# a run history's columns besides its id
COLUMNS = ("date", "gpu", "torch", "recipe", "name", "status", "tflops_per_gpu", "peak_allocated_bytes")
COLUMNS += ("peak_reserved_bytes", "config", "command", "result")


def with_bad_record(path: Path, text: str | None) -> Path:
    """Three runs, the second's record `text`, in a history whose columns take NULL (one made by hand)."""
    tables(path, f"CREATE TABLE runs (id INTEGER PRIMARY KEY, {', '.join(COLUMNS)})")
    with closing(sqlite3.connect(recorded(path))) as conn, conn:
        conn.execute("UPDATE runs SET result = ? WHERE id = 2", (text,))
    return path


@pytest.mark.parametrize("kind", list(BAD_RECORDS))
def test_a_run_that_cannot_be_read_is_skipped_by_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    text, why = BAD_RECORDS[kind]
    path = with_bad_record(tmp_path / "history.sqlite", text)
    monkeypatch.setenv("REMAT_HISTORY", str(path))
    code, out, err = cli(capsys, "history", "-n", "100")
    assert code == 0 and "run0" in out and "run2" in out and "run1" not in out
    assert err.startswith(f"warning: skipped run 2 of {path}: ") and err.count("\n") == 1, err
    assert why in err and "DELETE FROM runs WHERE id = 2" in err
    code, out, err = cli(capsys, "history", "show", "2")
    assert code == 1 and err.startswith(f"error: run 2 of {path} cannot be read: ") and why in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("kind", ["truncated", "no runs table"])
def test_a_bench_says_which_history_failed_and_how_to_run_without_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    """The default history ($REMAT_HISTORY) is damaged: the bench is refused before it runs, the
    message says what to do with the file; --no_history runs without it."""
    path = tmp_path / "history.sqlite"
    make, phrase = NOT_HISTORIES[kind]
    make(path)
    monkeypatch.setenv("REMAT_HISTORY", str(path))
    code, _, err = cli(capsys, "bench", *TINY)
    assert code == 1 and f"--history: {path} " in " ".join(err.split())
    assert phrase in " ".join(err.split()) and all(advice in " ".join(err.split()) for advice in ADVICE), err
    assert "loss" not in err  # nothing ran
    code, _, err = cli(capsys, "bench", *TINY, "--no_history")
    assert code == 0, err
