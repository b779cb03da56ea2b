"""remat recipes: the model recipes, with their shapes."""
from __future__ import annotations

import argparse
from typing import Any

from remat.cli.common import out
from remat.models import recipes


def add_parser(sub: Any) -> None:
    p = sub.add_parser("recipes", help="list the model recipes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in recipes():
        out.print(name)
    return 0
