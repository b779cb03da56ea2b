"""List the runs `remat bench`, `sweep` and `plan --verify` recorded (newest first), or show one."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from remat.bench.history import HistoryError, check, default_history_path, entries, entry
from remat.cli.common import Problems, collected_warnings, err, out, print_warnings, show
from remat.cli.flags import whole_number
from remat.cli.tables import history_table, memory_table, results_table
from remat.core.problems import ConfigError, Problem

HELP = "list past runs from the run history, or show one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "what",
        nargs="?",
        choices=["list", "show"],
        default="list",
        help="list (default): the latest runs; show ID: one run whole",
    )
    p.add_argument(
        "id", nargs="?", type=whole_number, metavar="ID", help="with show: the run's id, as the list gives it"
    )
    p.add_argument(
        "--history",
        metavar="DB",
        help="the SQLite run history (default $REMAT_HISTORY or ~/.cache/remat/history.sqlite)",
    )
    p.add_argument(
        "-n", "--limit", type=whole_number, default=20, metavar="N", help="how many runs to list (default 20)"
    )


def run(args: argparse.Namespace) -> int:
    path = Path(args.history) if args.history else default_history_path()
    found = Problems()
    if args.what == "show" and args.id is None:
        found.add([Problem("ID", "show needs the id of a run; `remat history` lists them")])
    if args.what == "list" and args.id is not None:
        found.add([Problem("ID", f"{args.id} is given without show; use `remat history show {args.id}`")])
    if args.limit < 1:
        found.add([Problem("--limit", f"is {args.limit}; list at least 1 run")])
    found.raise_if_any()
    # a file that is no run history is one line naming it, not an "invalid config" of flags
    try:
        check(path)
        return _show(args.id, path) if args.what == "show" else _list(args.limit, path)
    except HistoryError as e:
        err.print(f"[red]error:[/] {escape(str(e))}")
        return 1


def _show(row_id: int, path: Path) -> int:
    result = entry(row_id, path)
    if result is None:
        raise ConfigError([Problem("ID", f"no run {row_id} in {path}; `remat history` lists the runs there")])
    out.print(f"run {row_id}: {escape(result.date)}, {escape(result.command)}")
    show(results_table([result], title=f"{result.recipe} on {result.gpu}, torch {result.torch}"))
    if result.memory is not None:
        show(memory_table(result))
    out.print(f"config: {escape(str(result.config or 'no recompute'))}\nshape: {escape(str(result.shape))}")
    return 0


def _list(limit: int, path: Path) -> int:
    with collected_warnings() as caught:  # runs skipped for a record that cannot be read
        runs = entries(limit, path)
    print_warnings(caught)
    if not runs:
        out.print(f"no runs recorded in {path} yet; `remat bench` and `remat sweep` record theirs there")
        return 0
    show(history_table(runs, str(path)), keys=2)
    return 0
