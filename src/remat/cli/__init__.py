"""The `remat` command: one module per subcommand, each a thin layer over the Python API."""

from __future__ import annotations

import argparse
import io
import re
import shlex
import sys
from collections.abc import Sequence

from rich.markup import escape

from remat.cli import bench, doctor, estimate, history, plan, recipes, support, sweep, validate, verify
from remat.cli.args import select_model
from remat.cli.common import INTERRUPTED, err, tables_to_stderr
from remat.core.problems import ConfigError, Problem, count
from remat.core.version import remat_version

COMMANDS = (validate, verify, bench, sweep, plan, estimate, doctor, recipes, support, history)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat", description="Activation recompute for PyTorch transformer training.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"remat {remat_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers: dict[str, argparse.ArgumentParser] = {}
    for command in COMMANDS:
        name = command.__name__.rsplit(".", 1)[1]
        p = parsers[name] = sub.add_parser(name, help=command.HELP, description=command.__doc__, allow_abbrev=False)
        command.add_arguments(p)
        # command_parser: so an unknown flag gets its command's usage; parsers: a follow-up line's flags
        p.set_defaults(func=command.run, command_parser=p, parsers=parsers)
    return parser


# Megatron keys a flag of another name sets
_SET_BY = {"cpu_offloading": "cpu_offloading_num_layers"}


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the action of each flag of a command."""
    return {action.dest: action for action in parser._actions if action.option_strings}


def on_command_line(problem: Problem, parser: argparse.ArgumentParser) -> Problem:
    """A problem in the words of the command line: its field with the flag that sets it
    ("-pp/--pipeline_model_parallel_size"), and "key=value" in its message followed by the flag
    to type ("(-pp 1)")."""
    flags = _flags(parser)
    action = flags.get(_SET_BY.get(problem.field, problem.field))
    field = "/".join(action.option_strings) if action is not None else problem.field

    def typed(match: re.Match[str]) -> str:
        key, value = match.group(1), match.group(2)
        flag = flags.get(key)
        if flag is None or flag.nargs == 0:  # a switch: nothing to type with the value
            return match.group(0)
        return f"{match.group(0)} ({flag.option_strings[0]} {value.strip(chr(39))})"

    return Problem(field, re.sub(r"\b([a-z_]+)=([^\s,;)]+)", typed, problem.message))


def survive_any_encoding() -> None:
    """Output that stdout or stderr cannot encode is written as '?': a '±' in a table on a non-UTF-8
    stream (PYTHONIOENCODING=ascii, a Latin-1 terminal), or a lone surrogate from a config file's
    escaped key on UTF-8, must not stop a command before it writes its files."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    survive_any_encoding()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command_line = shlex.join(["remat", *argv])  # recorded with each result
    args.argv = argv  # what a command that starts torchrun runs again in each process
    try:
        with tables_to_stderr(args):
            select_model(args)
            return args.func(args)
    except ConfigError as e:
        err.print(f"[red]invalid config ({count(len(e.problems), 'problem')}):[/]")
        for problem in e.shown:
            shown = on_command_line(problem, args.command_parser)
            err.print(f"  [bold]{escape(shown.field)}[/]: {escape(shown.message)}")
        for line in e.more:
            err.print(f"  {line}")
        return 1
    except ValueError as e:  # bad recipe name or shape override
        err.print(f"[red]error:[/] {e}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT
        err.print("interrupted")
        return INTERRUPTED
