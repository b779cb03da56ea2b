"""List the model recipes remat builds, with their shapes and parameter counts."""

from __future__ import annotations

import argparse

from remat.cli.common import show
from remat.cli.tables import recipes_table
from remat.models import family_of, recipe_config, recipes

HELP = "list the model recipes and their shapes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No flags: every recipe is listed."""


def run(args: argparse.Namespace) -> int:
    show(recipes_table([(name, family_of(name).name, recipe_config(name)) for name in recipes()]))
    return 0
