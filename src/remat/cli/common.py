"""What every command shares: the consoles, problems gathered from every stage before anything
runs, warnings printed once, progress bars, and the files a command writes."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sqlite3
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from remat.bench.history import append, default_history_path
from remat.bench.result import BenchResult
from remat.bench.run import OnStep
from remat.cli.checks import (
    dryrun_output_problems,
    history_file_problems,
    history_flag_problems,
    output_path_problems,
    png_path_problems,
)
from remat.cli.tables import fit_width
from remat.core.problems import ConfigError, Problem, RematWarning

INTERRUPTED = 130  # the exit code of a command stopped by Ctrl-C (SIGINT), as shells report it

# Widths output is laid out in, whatever COLUMNS says: at 0 rich prints nothing (errors included),
# at 5 a word a line, at 10**8 each rule and table line is that wide.
MIN_WIDTH, MAX_WIDTH = 40, 1000


def _console(stderr: bool) -> Console:
    console = Console(stderr=stderr, highlight=False, emoji=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width, console.soft_wrap = 160, True  # logs and pipes: lines and table columns whole
    else:
        console.width = min(max(console.width, MIN_WIDTH), MAX_WIDTH)
    return console


out, err = _console(stderr=False), _console(stderr=True)


def show(renderable: RenderableType, keys: int = 1) -> None:
    """Print to stdout; a table too wide for the terminal is split into tables that fit,
    each repeating its first `keys` columns (tables.fit_width)."""
    for part in fit_width(renderable, out.width, keys) if isinstance(renderable, Table) else [renderable]:
        out.print(part)


class Problems:
    """Problems from independent checking stages, reported together rather than first-found."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def run(self, fn: Callable[..., Any], *fn_args: Any, field: str = "", prefix: str = "") -> Any:
        """fn(*fn_args), or None after recording why it failed."""
        try:
            return fn(*fn_args)
        except ConfigError as e:
            self.problems += [Problem(prefix + p.field, p.message) for p in e.problems]
        except ValueError as e:  # an unknown recipe or shape override
            self.problems.append(Problem(prefix + field, str(e)))
        return None

    def add(self, problems: Iterable[Problem]) -> None:
        self.problems += list(problems)

    def raise_if_any(self) -> None:
        if self.problems:
            raise ConfigError(list(dict.fromkeys(self.problems)))


@contextlib.contextmanager
def collected_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every RematWarning raised inside, kept to print once (remat's advice is never filtered away)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        yield caught


def print_warnings(caught: Sequence[warnings.WarningMessage], printed: Sequence[warnings.WarningMessage] = ()) -> None:
    """Each warning once, leaving out those `printed` already."""
    already = {str(w.message) for w in printed}
    for message in dict.fromkeys(str(w.message) for w in caught if str(w.message) not in already):
        err.print(f"[yellow]warning:[/] {message}")


class Bar:
    """A rich progress bar for runs (steps of each) and traces (what is being measured)."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def on_step(self) -> OnStep:
        def update(name: str, done: int, total: int, status: str) -> None:
            if self.progress is None:
                return
            if name not in self.tasks or done == 0:
                self.tasks[name] = self.progress.add_task(name, total=total, loss="")
            shown = "[red]OOM[/]" if status == "OOM" else status
            self.progress.update(self.tasks[name], completed=done, loss=shown)

        return update

    def note(self, description: str) -> Callable[[str], None]:
        """A callback showing what a trace measures now, under `description`."""
        task = self.progress.add_task(description, total=None, loss="") if self.progress is not None else None

        def show(what: str) -> None:
            if self.progress is not None and task is not None:
                self.progress.update(task, loss=what)

        return show


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Bar]:
    if not enabled:
        yield Bar(None)
        return
    with Progress(
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
        console=err,
    ) as progress:
        yield Bar(progress)


# --json's path for standard output: the JSON alone goes there, the tables to stderr (tables_to_stderr)
STDOUT = "-"


@contextlib.contextmanager
def tables_to_stderr(args: argparse.Namespace) -> Iterator[None]:
    """With `--json -`, what a command prints to stdout goes to stderr inside, so that stdout holds
    the JSON alone and reads with json.load."""
    before = out.stderr
    out.stderr = before or getattr(args, "json", None) == STDOUT
    try:
        yield
    finally:
        out.stderr = before


def write_json(data: Any, path: str | Path) -> None:
    """JSON output, to stdout for `-`; like every file the commands write, its missing folders are created."""
    if str(path) == STDOUT:
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
        sys.stdout.flush()
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1))


class Outputs:
    """The files a command writes once it has measured something. Each write is tried; if any
    fails (a full disk, a device that refuses), the measurement is kept in a rescue file, the
    command says where, and it exits non-zero: a failed write never loses a result."""

    def __init__(self, command: str, data: Any) -> None:
        self.command, self.data = command, data
        self.failed: list[str] = []

    def write(self, flag: str, path: str | Path | None, writer: Callable[[], object]) -> None:
        try:
            writer()
        except (OSError, sqlite3.Error) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self.failed.append(f"{flag} {path}" if path is not None else flag)
            err.print(f"[red]error:[/] could not write {self.failed[-1]} ({reason})")

    def history(self, results: Sequence[BenchResult], args: argparse.Namespace) -> None:
        if not args.no_history:
            path = args.history or default_history_path()
            self.write("--history", path, lambda: [append(result, path) for result in results])

    def close(self) -> int:
        """0, or 1 after keeping the data in a rescue file (and saying where) when a write failed."""
        if not self.failed:
            return 0
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        for folder in (Path.cwd(), Path(tempfile.gettempdir())):
            rescue = folder / f"remat-{self.command}-{stamp}.json"
            try:
                write_json(self.data, rescue)
            except OSError:
                continue
            err.print(f"the result is kept in {rescue}")
            return 1
        err.print("[red]error:[/] the result could not be kept anywhere; it is printed above")
        return 1


def path_problems(written: dict[str, str | Path | None]) -> list[Problem]:
    """Each file a command will write (flag -> path, None: not written), checked before it runs."""
    return [
        p
        for flag, path in written.items()
        if path is not None and not (flag == "--json" and str(path) == STDOUT)
        for p in output_path_problems(flag, path)
    ]


# (flag, attribute) of the files bench and sweep write once they have run, besides the history
_OUTPUTS = (("--json", "json"), ("--save-golden", "save_golden"), ("--plot", "plot"))


def output_problems(args: argparse.Namespace, default_plot: str | None = None) -> list[Problem]:
    """The files a bench or sweep writes once it has run, checked before it runs; beside -d, which
    writes none, the output flags given are refused."""
    given = {flag: getattr(args, name, None) for flag, name in _OUTPUTS}
    given = {flag: path for flag, path in given.items() if path is not None}
    if args.dryrun:
        return list(dryrun_output_problems([*given, *(["--history"] if args.history else [])]))
    if conflict := list(history_flag_problems(args.history, args.no_history)):
        return conflict
    history = None if args.no_history else args.history or default_history_path()
    return [
        *path_problems({"--plot": default_plot, **given, "--history": history}),
        *(history_file_problems(history) if history else ()),
        *png_path_problems("--plot", given.get("--plot")),
    ]


# Flags a follow-up run does not repeat: the file it runs is its config, and the plan replaces
# whatever recompute or offload the planning run was given.
_NOT_REPEATED = ("config", "configs", "recompute_", "cpu_offloading", "fine_grained", "offload", "distribute_saved")


def follow_up(args: argparse.Namespace, command: str, *extra: str) -> str:
    """`remat COMMAND` with the flags of this run's command line that COMMAND takes (the model,
    its shape, the layout), then `extra`: the line a user types to run what this one wrote."""
    flags = {s: a for a in args.parsers[command]._actions for s in a.option_strings}
    kept, argv, i = [], list(getattr(args, "argv", [])), 0
    while i < len(argv):
        action = flags.get(argv[i].split("=", 1)[0])
        n = 0 if action is None or "=" in argv[i] or action.nargs == 0 else 1
        if action is not None and action.nargs in ("+", "*"):
            n = next((j for j, t in enumerate(argv[i + 1 :]) if t.startswith("-")), len(argv) - i - 1)
        if action is not None and not action.dest.startswith(_NOT_REPEATED):
            kept += argv[i : i + 1 + n]
        i += 1 + n
    return shlex.join(["remat", command, *kept, *extra])
