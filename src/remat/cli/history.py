"""List the runs `remat bench`, `sweep` and `plan --verify` recorded (newest first), or show one."""

from __future__ import annotations

import argparse

from remat.bench.history import default_history_path, entries, entry
from remat.cli.checks import history_file_problems
from remat.cli.common import Problems, out, show
from remat.cli.tables import history_table, memory_table, results_table
from remat.core.problems import Problem

HELP = "list past runs from the run history, or show one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "what",
        nargs="?",
        choices=["list", "show"],
        default="list",
        help="list (default): the latest runs; show ID: one run whole",
    )
    p.add_argument("id", nargs="?", type=int, metavar="ID", help="with show: the run's id, as the list gives it")
    p.add_argument(
        "--history",
        metavar="DB",
        help="the SQLite run history (default $REMAT_HISTORY or ~/.cache/remat/history.sqlite)",
    )
    p.add_argument("-n", "--limit", type=int, default=20, metavar="N", help="how many runs to list (default 20)")


def run(args: argparse.Namespace) -> int:
    path = args.history or default_history_path()
    found = Problems()
    found.add(history_file_problems(path))
    if args.what == "show" and args.id is None:
        found.add([Problem("ID", "show needs the id of a run; `remat history` lists them")])
    if args.what == "list" and args.id is not None:
        found.add([Problem("ID", f"{args.id} is given without show; use `remat history show {args.id}`")])
    if args.limit < 1:
        found.add([Problem("--limit", f"is {args.limit}; list at least 1 run")])
    found.raise_if_any()
    if args.what == "show":
        result = entry(args.id, path)
        if result is None:
            found.add([Problem("ID", f"no run {args.id} in {path}; `remat history` lists the runs there")])
            found.raise_if_any()
        assert result is not None  # or a problem was raised
        out.print(f"run {args.id}: {result.date}, {result.command}")
        show(results_table([result], title=f"{result.recipe} on {result.gpu}, torch {result.torch}"))
        if result.memory is not None:
            show(memory_table(result))
        out.print(f"config: {result.config or 'no recompute'}\nshape: {result.shape}")
        return 0
    runs = entries(args.limit, path)
    if not runs:
        out.print(f"no runs recorded in {path} yet; `remat bench` and `remat sweep` record theirs there")
        return 0
    show(history_table(runs, str(path)), keys=2)
    return 0
