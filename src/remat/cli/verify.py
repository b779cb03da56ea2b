"""Run one training step of a recipe without recompute and with the given config; compare loss and
every gradient, and count the bytes each leaves saved for backward.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from remat.cli.args import (
    add_layout_flags,
    add_model_source_flags,
    add_recompute_flags,
    config_file,
    facts_of,
    file_keys,
    model_overrides,
    resolve_config,
    run_parts,
)
from remat.cli.checks import tolerance_problems
from remat.cli.common import Problems, collected_warnings, out, print_warnings, show
from remat.cli.flags import add_settings
from remat.cli.tables import verify_table
from remat.config.precision import Precision
from remat.core.problems import Problem
from remat.core.sizes import format_bytes
from remat.estimate.stages import cpu_run_problems
from remat.models import build, parameter_count, recipe_config
from remat.run.fp8 import to_fp8
from remat.run.spec import (
    ModelOverrides,
    RunSpec,
    device_problems,
    micro_batch_problems,
    micro_batch_tokens_problems,
    single_process_problems,
    unrun_problems,
)
from remat.run.verify import verify
from remat.sites.apply import apply, offloader_of

HELP = "run one step without and with a config; compare gradients"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and step")
    add_model_source_flags(g)
    add_settings(g, ModelOverrides, skip=["gradient_accumulation_fusion"])
    add_settings(
        g,
        RunSpec,
        only=["micro_batch_size", "device", "seed"],
        defaults={"micro_batch_size": 2, "device": "cpu", "seed": 0},
    )
    add_settings(g, Precision, defaults={"compute_dtype": "fp64"})
    g.add_argument(
        "--tolerance", type=float, default=0.0, help="largest |gradient difference| accepted (default 0: bit-identical)"
    )
    add_layout_flags(p)
    add_recompute_flags(p)


def _cpu_run_problems(args: argparse.Namespace, overrides: dict[str, Any], precision: Precision) -> list[Problem]:
    """On CPU: the larger step (without recompute) and the two sets of gradients kept to compare."""
    spec = RunSpec(
        recipe=args.model_recipe_name,
        overrides=overrides,
        micro_batch_size=args.micro_batch_size,
        precision=precision,
        device=args.device,
        optimizer=False,
    )
    weights = parameter_count(args.model_recipe_name, **overrides)
    return list(cpu_run_problems(spec, [("no recompute", None)], 2 * weights * spec.dtype.itemsize))


def run(args: argparse.Namespace) -> int:
    overrides = model_overrides(args)
    found = Problems()
    loaded = found.run(config_file, args, field="config")
    keys = file_keys(loaded)
    parts = found.run(run_parts, args, keys) or {}
    found.add(
        [
            *device_problems(args.device),
            *micro_batch_problems(args.micro_batch_size),
            *tolerance_problems(args.tolerance),
        ]
    )
    if parts:
        found.add(
            [
                *single_process_problems(parts["layout"]),
                *unrun_problems(parts["capture"]),
                *parts["precision"].problems(),
            ]
        )
    shape = found.run(lambda: recipe_config(args.model_recipe_name, **overrides), field="model_recipe_name")
    with collected_warnings() as caught:
        config = None
        if shape is not None:  # the config is checked against the model before anything is allocated
            found.add(micro_batch_tokens_problems(shape.seq_length, args.micro_batch_size, 1))
            config = found.run(resolve_config, args, loaded, facts_of(args, keys))
            if config is not None:
                found.run(apply, build(args.model_recipe_name, device="meta", **overrides), config)
        found.raise_if_any()
        assert shape is not None and config is not None  # None only after a problem found above
        precision = parts["precision"]
        found.add(_cpu_run_problems(args, overrides, precision))
        found.raise_if_any()
        torch.use_deterministic_algorithms(args.device == "cpu")
        torch.manual_seed(args.seed)
        model = build(args.model_recipe_name, dtype=precision.dtype, device=args.device, **overrides)
        to_fp8(model, precision)
        ids = torch.randint(0, shape.vocab_size, (args.micro_batch_size, shape.seq_length + 1), device=args.device)
        report = verify(model, config, ids[:, :-1], ids[:, 1:].contiguous(), seed=args.seed)  # losses may view labels
    print_warnings(caught)
    out.print(report.plan.describe())
    show(verify_table(report, args.model_recipe_name, args.micro_batch_size, precision.label, args.device))
    offloader = offloader_of(model)
    if offloader is not None:
        stats = offloader.stats()
        out.print(
            f"offloaded to host: {format_bytes(stats.offloaded_bytes)} a step"
            f" (peak host {format_bytes(stats.peak_host_bytes)})"
        )
    ok = report.bit_identical or report.max_grad_diff <= args.tolerance
    out.print("[green]gradients match[/]" if ok else "[red]gradients differ[/]")
    return 0 if ok else 1
