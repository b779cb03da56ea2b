"""A local history of benchmark runs in SQLite, so runs can be compared across sessions without a server.

A file that is no run history (a folder, a damaged database, another program's tables) raises
HistoryError naming the file and what to do; a run whose record cannot be read is skipped with a
RematWarning naming its id, so one bad row never hides the others."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sqlite3
import types
import typing
import warnings
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from remat.bench.result import BenchResult
from remat.core.problems import RematWarning

# Concurrent writers (several `remat bench` processes) wait this long for SQLite's lock instead of failing.
_CONNECT_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    date TEXT NOT NULL,
    gpu TEXT NOT NULL,
    torch TEXT NOT NULL,
    recipe TEXT NOT NULL,
    name TEXT NOT NULL,
    status TEXT NOT NULL,
    tflops_per_gpu REAL,
    peak_allocated_bytes INTEGER,
    peak_reserved_bytes INTEGER,
    config TEXT NOT NULL,
    command TEXT NOT NULL,
    result TEXT NOT NULL
)
"""
_COLUMNS: tuple[str, ...] = (
    *("id", "date", "gpu", "torch", "recipe", "name", "status", "tflops_per_gpu", "peak_allocated_bytes"),
    *("peak_reserved_bytes", "config", "command", "result"),
)

_INSERT = """
INSERT INTO runs (date, gpu, torch, recipe, name, status, tflops_per_gpu, peak_allocated_bytes,
                  peak_reserved_bytes, config, command, result)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""

# SQLite's row ids are 64-bit: a larger id names no run (and would overflow the query)
_ROW_IDS = range(-(2**63), 2**63)

_ELSEWHERE = "point REMAT_HISTORY (or --history) elsewhere; `--no_history` runs a bench without it"


class HistoryError(sqlite3.DatabaseError):
    """A history file remat cannot use, or a run it cannot read; the message names the file and what to do."""


def default_history_path() -> Path:
    override = os.environ.get("REMAT_HISTORY")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "remat" / "history.sqlite"


def _resolve(path: str | os.PathLike[str] | None) -> Path:
    return default_history_path() if path is None else Path(path)


def _layout_problem(conn: sqlite3.Connection, write: bool) -> str | None:
    """Why this database is not a run history, or None; an empty one becomes one when written."""
    listed = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    tables = {name for (name,) in listed}  # SQLite's own (sqlite_sequence) say nothing of the owner
    if "runs" not in tables:
        if tables:  # another program's database: never add a table to it
            return f"it has no runs table, only {', '.join(sorted(tables))}"
        if write:
            conn.execute(_SCHEMA)
        return None
    columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    missing = [name for name in _COLUMNS if name not in columns]
    if not missing:
        return None
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    return f"its runs table has no column {', '.join(missing[:3])}{more}"


@contextmanager
def _database(db: Path, *, write: bool) -> Iterator[sqlite3.Connection]:
    """The history at `db`, opened read-only unless `write`; every SQLite error inside, the
    caller's queries included, becomes a HistoryError naming the file."""
    if db.is_dir():
        raise HistoryError(
            f"{db} is a directory, not a run history; point REMAT_HISTORY (or --history) at a file in it, e.g."
            f" {db / 'history.sqlite'}; `--no_history` runs a bench without one"
        )
    uri = f"{db.absolute().as_uri()}?mode={'rwc' if write else 'ro'}"  # reading never changes the file
    try:
        with closing(sqlite3.connect(uri, uri=True, timeout=_CONNECT_TIMEOUT_S)) as conn:
            if problem := _layout_problem(conn, write):
                raise HistoryError(f"{db} is an SQLite database but not a run history ({problem}); {_ELSEWHERE}")
            yield conn
    except HistoryError:
        raise
    except sqlite3.OperationalError as e:  # locked, unreadable, a full disk: the file may be fine
        raise HistoryError(f"cannot use the run history {db} ({e}); {_ELSEWHERE}") from e
    except sqlite3.DatabaseError as e:  # not a database, or a damaged one
        raise HistoryError(f"{db} is not a run history remat can read ({e}); move it aside or {_ELSEWHERE}") from e


def check(path: str | os.PathLike[str] | None = None) -> None:
    """HistoryError unless the history at `path` is missing, or a run history SQLite reads whole:
    for a command to check before it runs, not after (the check reads every page)."""
    db = _resolve(path)
    if not db.exists():
        return
    with _database(db, write=False) as conn:
        verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
    if verdict != "ok":
        raise HistoryError(f"{db} is a damaged run history ({verdict}); move it aside or {_ELSEWHERE}")


def append(result: BenchResult, path: str | os.PathLike[str] | None = None) -> int:
    """Store one run; returns its row id."""
    db = _resolve(path)
    db.parent.mkdir(parents=True, exist_ok=True)
    row = (
        result.date,
        result.gpu,
        result.torch,
        result.recipe,
        result.name,
        result.status,
        result.tflops_per_gpu,
        result.peak_allocated_bytes,
        result.peak_reserved_bytes,
        json.dumps(result.config, sort_keys=True),
        result.command,
        json.dumps(result.to_dict()),
    )
    with _database(db, write=True) as conn, conn:  # inner `conn` commits the insert
        row_id = conn.execute(_INSERT, row).lastrowid
    assert row_id is not None  # always set after an INSERT
    return row_id


def recent(limit: int = 20, path: str | os.PathLike[str] | None = None) -> list[BenchResult]:
    """The latest runs by date, newest first (ties in insertion order, latest first)."""
    return [result for _, result in entries(limit, path)]


def entries(limit: int = 20, path: str | os.PathLike[str] | None = None) -> list[tuple[int, BenchResult]]:
    """(row id, run) of the latest runs by date, newest first (ties in insertion order, latest
    first); a run whose record cannot be read is skipped with a RematWarning saying which and why."""
    db = _resolve(path)
    if not db.exists():  # reading should not create a history
        return []
    found: list[tuple[int, BenchResult]] = []
    with _database(db, write=False) as conn:
        # no LIMIT: skipped runs do not count, and -n may be past SQLite's integers
        for row_id, text in conn.execute("SELECT id, result FROM runs ORDER BY date DESC, id DESC"):
            if len(found) >= limit:
                break
            try:
                found.append((row_id, _parse(text)))
            except ValueError as e:
                warnings.warn(
                    f"skipped run {row_id} of {db}: its record {e}; {_removal(db, row_id)}", RematWarning, stacklevel=2
                )
    return found


def entry(row_id: int, path: str | os.PathLike[str] | None = None) -> BenchResult | None:
    """The run stored under `row_id`, or None; HistoryError when its record cannot be read."""
    db = _resolve(path)
    if not db.exists() or row_id not in _ROW_IDS:
        return None
    with _database(db, write=False) as conn:
        row = conn.execute("SELECT result FROM runs WHERE id = ?", (row_id,)).fetchone()
    if row is None:
        return None
    try:
        return _parse(row[0])
    except ValueError as e:
        raise HistoryError(f"run {row_id} of {db} cannot be read: its record {e}; {_removal(db, row_id)}") from None


def _removal(db: Path, row_id: int) -> str:
    return f"delete it with: sqlite3 {shlex.quote(str(db))} 'DELETE FROM runs WHERE id = {row_id}'"


def _parse(text: object) -> BenchResult:
    """The run a `result` column holds; ValueError ("is not JSON (...)") saying what is wrong."""
    if text is None:
        raise ValueError("is empty (NULL)")
    try:
        data = json.loads(text)  # type: ignore[arg-type]  # what SQLite holds is checked here
    except (TypeError, ValueError) as e:
        raise ValueError(f"is not JSON ({e})") from None
    try:
        result = BenchResult.from_dict(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"is malformed ({e})") from None
    if (wrong := _mistyped(result)) is not None:
        raise ValueError(f"is malformed ({wrong})")
    return result


def _mistyped(record: Any, prefix: str = "") -> str | None:
    """The first field of a dataclass record (nested ones too) whose value its type does not
    allow, as "date is None, not str"; the tables format these values and would fail on them."""
    hints = typing.get_type_hints(type(record))
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if not _fits(value, hints[f.name]):
            hint = hints[f.name]
            return f"{prefix}{f.name} is {value!r}, not {getattr(hint, '__name__', str(hint))}".replace("typing.", "")
        if dataclasses.is_dataclass(value) and (wrong := _mistyped(value, f"{prefix}{f.name}.")):
            return wrong
    return None


def _fits(value: Any, hint: Any) -> bool:
    """Whether JSON-read `value` is of type `hint` (an int for a float too, never a bool for a number)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:  # a status newer than this remat is still shown
        return any(isinstance(value, type(arg)) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(item, args[1]) for item in value.values())
    if hint in (int, float):
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)
