"""The `remat` command: one module per subcommand, each a thin layer over the Python API."""
from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from remat import __version__
from remat.cli import bench, doctor, estimate, plan, recipes, sweep, validate, verify
from remat.cli.common import err
from remat.problems import ConfigError

COMMANDS = (validate, verify, bench, sweep, plan, estimate, doctor, recipes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat", description="Activation recompute for PyTorch transformer training.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        name = command.__name__.rsplit(".", 1)[1]
        p = sub.add_parser(name, help=command.HELP, description=command.__doc__)
        command.add_arguments(p)
        # command_parser: so an unknown flag gets its command's usage
        p.set_defaults(func=command.run, command_parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command_line = shlex.join(["remat", *argv])  # recorded with each result
    try:
        return args.func(args)
    except ConfigError as e:
        err.print(f"[red]invalid config ({len(e.problems)} problem"
                  f"{'s' if len(e.problems) != 1 else ''}):[/]")
        for problem in e.problems:
            err.print(f"  [bold]{problem.field}[/]: {problem.message}")
        return 1
    except ValueError as e:  # bad recipe name or shape override
        err.print(f"[red]error:[/] {e}")
        return 1
