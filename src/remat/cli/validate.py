"""Check a recompute config (flags and/or --config FILE) against every rule, and against a recipe's
model when -mr is given.
"""
from __future__ import annotations

import argparse
from typing import Any

from remat.apply import apply
from remat.cli.args import add_expert_flags, add_recompute_flags, resolve_config
from remat.cli.checks import plan_file_flag_problems
from remat.cli.common import Problems, collected_warnings, out, print_warnings
from remat.problems import Problem
from remat.step import EXPERT_SIZES, parallel_sizes
from remat.models import build, family_of, recipe_config
from remat.recompute import RecomputeConfig

HELP = "check a recompute config and print it resolved"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-mr", "--model_recipe_name", metavar="RECIPE",
                   help="check the config against this recipe's model (see `remat recipes`)")
    p.add_argument("--num_layers", type=int, metavar="N")
    add_expert_flags(p)
    add_recompute_flags(p)


def run(args: argparse.Namespace) -> int:
    found = Problems()
    model, shape = None, None
    facts: dict[str, Any] = {}
    if args.model_recipe_name:
        overrides = {key: value for key in ("num_layers", *EXPERT_SIZES)
                     if (value := getattr(args, key)) is not None}
        shape = found.run(lambda: recipe_config(args.model_recipe_name, **overrides), field="model_recipe_name")
        if shape is not None:
            model = build(args.model_recipe_name, device="meta", **overrides)
            facts.update(shape.megatron_facts())  # its layers, dropout, MoE and MLA switches
    else:
        if args.num_layers is not None:
            facts["num_layers"] = args.num_layers
        if any(getattr(args, key) is not None for key in EXPERT_SIZES):
            found.add([Problem("model_recipe_name", "-ep and -etp split a recipe's experts; name it with -mr")])
    with collected_warnings() as caught:
        config = found.run(resolve_config, args, facts)
        if config is not None and not isinstance(config, RecomputeConfig):
            found.add(plan_file_flag_problems({}, model is not None))
        elif config is not None and shape is not None:  # the same shape checks as remat estimate
            found.add(family_of(args.model_recipe_name).shard_problems(shape, parallel_sizes(config.facts)))
        found.raise_if_any()
        plan = apply(model, config) if model is not None else None
    print_warnings(caught)
    if isinstance(config, RecomputeConfig):
        out.print(config.describe())
    if plan is not None:
        out.print(f"\n[bold]per-layer plan on {args.model_recipe_name}[/]")
        out.print(plan.describe())
    return 0
