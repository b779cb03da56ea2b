"""A local history of benchmark runs in SQLite, so runs can be compared across sessions without a server."""

from __future__ import annotations

import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path

from remat.bench.result import BenchResult

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

_INSERT = """
INSERT INTO runs (date, gpu, torch, recipe, name, status, tflops_per_gpu, peak_allocated_bytes,
                  peak_reserved_bytes, config, command, result)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""


def default_history_path() -> Path:
    override = os.environ.get("REMAT_HISTORY")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "remat" / "history.sqlite"


def _resolve(path: str | os.PathLike[str] | None) -> Path:
    return default_history_path() if path is None else Path(path)


def _connect(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db, timeout=_CONNECT_TIMEOUT_S)
    conn.execute(_SCHEMA)
    return conn


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
    with closing(_connect(db)) as conn, conn:  # inner `conn` commits the insert
        row_id = conn.execute(_INSERT, row).lastrowid
    assert row_id is not None  # always set after an INSERT
    return row_id


def recent(limit: int = 20, path: str | os.PathLike[str] | None = None) -> list[BenchResult]:
    """The latest runs by date, newest first (ties in insertion order, latest first)."""
    return [result for _, result in entries(limit, path)]


def entries(limit: int = 20, path: str | os.PathLike[str] | None = None) -> list[tuple[int, BenchResult]]:
    """(row id, run) of the latest runs by date, newest first (ties in insertion order, latest first)."""
    db = _resolve(path)
    if not db.exists():  # reading should not create a history
        return []
    with closing(_connect(db)) as conn:
        rows = conn.execute("SELECT id, result FROM runs ORDER BY date DESC, id DESC LIMIT ?", (limit,)).fetchall()
    return [(row_id, BenchResult.from_dict(json.loads(text))) for row_id, text in rows]


def entry(row_id: int, path: str | os.PathLike[str] | None = None) -> BenchResult | None:
    """The run stored under `row_id`, or None."""
    db = _resolve(path)
    if not db.exists():
        return None
    with closing(_connect(db)) as conn:
        row = conn.execute("SELECT result FROM runs WHERE id = ?", (row_id,)).fetchone()
    return None if row is None else BenchResult.from_dict(json.loads(row[0]))
