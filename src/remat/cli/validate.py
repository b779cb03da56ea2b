"""Check a recompute config (flags and/or --config FILE) against every rule, and against a recipe's
model when -mr is given.
"""

from __future__ import annotations

import argparse
import dataclasses

from remat.cli.args import (
    add_layout_flags,
    add_recompute_flags,
    config_file,
    facts_of,
    fallback_facts,
    file_keys,
    meta_model,
    model_overrides,
    resolve_config,
)
from remat.cli.checks import plan_file_flag_problems
from remat.cli.common import Problems, collected_warnings, out, print_warnings
from remat.cli.flags import add_settings
from remat.config.recompute import RecomputeConfig
from remat.core.problems import Problem
from remat.models import family_of, recipe_config
from remat.run.spec import ModelOverrides, RunSpec
from remat.sites.apply import apply

# the expert-parallel sizes, which split a recipe's experts
EXPERT_FLAGS = ("expert_model_parallel_size", "expert_tensor_parallel_size")

HELP = "check a recompute config and print it resolved"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (optional)")
    add_settings(g, RunSpec, only=["recipe"])
    add_settings(g, ModelOverrides, only=["num_layers"])
    add_layout_flags(p)
    add_recompute_flags(p)


def run(args: argparse.Namespace) -> int:
    found = Problems()
    loaded = found.run(config_file, args, field="config")
    keys = file_keys(loaded)
    model, facts = None, None
    if args.model_recipe_name:
        facts = found.run(facts_of, args, keys, field="model_recipe_name")
        if facts is not None:
            model = meta_model(args)
    elif any(getattr(args, key) is not None for key in EXPERT_FLAGS):
        found.add([Problem("model_recipe_name", "-ep and -etp split a recipe's experts; name it with -mr")])
    if facts is None:
        facts = dataclasses.replace(fallback_facts(found, args, keys), num_layers=args.num_layers)
    with collected_warnings() as caught:
        config = found.run(resolve_config, args, loaded, facts)
        if config is not None and not isinstance(config, RecomputeConfig):
            found.add(plan_file_flag_problems({}, model is not None))
        elif config is not None and model is not None:  # the same shape checks as remat estimate
            found.add(
                family_of(args.model_recipe_name).layout_problems(
                    recipe_config(args.model_recipe_name, **model_overrides(args)), config.facts.layout
                )
            )
        found.raise_if_any()
        plan = apply(model, config) if model is not None else None
    print_warnings(caught)
    if isinstance(config, RecomputeConfig):
        out.print(config.describe())
    if plan is not None:
        out.print(f"\n[bold]per-layer plan on {args.model_recipe_name}[/]")
        out.print(plan.describe())
    return 0
