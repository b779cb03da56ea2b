"""Run one training step of a recipe without recompute and with the given config; compare loss and
every gradient, and count the bytes each leaves saved for backward.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from remat.apply import apply, offloader_of
from remat.cli.args import add_model_source_flags, add_recompute_flags, flag_facts, model_facts, resolve_config
from remat.cli.checks import tolerance_problems
from remat.cli.common import Problems, collected_warnings, out, print_warnings, show
from remat.cli.tables import verify_table
from remat.estimating import cpu_run_problems
from remat.models import build, parameter_count, recipe_config
from remat.problems import Problem
from remat.sizes import format_bytes
from remat.step import (
    RunSpec,
    device_problems,
    micro_batch_problems,
    micro_batch_tokens_problems,
    single_process_problems,
)
from remat.verify import verify

HELP = "run one step without and with a config; compare gradients"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_source_flags(p)
    p.add_argument("--num_layers", type=int, metavar="N")
    p.add_argument("--hidden_size", type=int, metavar="N")
    p.add_argument("-sl", "--seq_length", type=int, metavar="N")
    p.add_argument("-mb", "--micro_batch_size", type=int, default=2, metavar="N",
                   help="sequences in the step (default 2)")
    p.add_argument("--attention_backend", choices=["sdpa", "eager"])
    p.add_argument("--attention_dropout", type=float, metavar="P")
    p.add_argument("--hidden_dropout", type=float, metavar="P")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16"], default="float64")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="largest |gradient difference| accepted (default 0: bit-identical)")
    add_recompute_flags(p)


_COMPUTE_DTYPES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16"}


def _cpu_run_problems(args: argparse.Namespace, overrides: dict[str, Any]) -> list[Problem]:
    """On CPU: the larger step (without recompute) and the two sets of gradients kept to compare."""
    spec = RunSpec(recipe=args.model_recipe_name, overrides=overrides, micro_batch_size=args.micro_batch_size,
                   compute_dtype=_COMPUTE_DTYPES[args.dtype], device=args.device, optimizer=False)
    weights = parameter_count(args.model_recipe_name, **overrides)
    return list(cpu_run_problems(spec, [("no recompute", None)], 2 * weights * spec.dtype.itemsize))


def run(args: argparse.Namespace) -> int:
    overrides = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "seq_length",
                                                "attention_backend", "attention_dropout",
                                                "hidden_dropout") if getattr(args, k) is not None}
    found = Problems()
    found.add([*device_problems(args.device), *micro_batch_problems(args.micro_batch_size),
               *single_process_problems(flag_facts(args)), *tolerance_problems(args.tolerance)])
    shape = found.run(lambda: recipe_config(args.model_recipe_name, **overrides), field="model_recipe_name")
    with collected_warnings() as caught:
        config = None
        if shape is not None:  # the config is checked against the model before anything is allocated
            found.add(micro_batch_tokens_problems(shape.seq_length, args.micro_batch_size, 1))
            config = found.run(resolve_config, args, model_facts(args, overrides))
            if config is not None:
                found.run(apply, build(args.model_recipe_name, device="meta", **overrides), config)
        found.raise_if_any()
        assert shape is not None and config is not None  # None only after a problem found above
        found.add(_cpu_run_problems(args, overrides))
        found.raise_if_any()
        torch.use_deterministic_algorithms(args.device == "cpu")
        torch.manual_seed(args.seed)
        model = build(args.model_recipe_name, dtype=getattr(torch, args.dtype), device=args.device, **overrides)
        ids = torch.randint(0, shape.vocab_size, (args.micro_batch_size, shape.seq_length + 1), device=args.device)
        report = verify(model, config, ids[:, :-1], ids[:, 1:], seed=args.seed)
    print_warnings(caught)
    out.print(report.plan.describe())
    show(verify_table(report, args.model_recipe_name, args.micro_batch_size, args.dtype, args.device))
    offloader = offloader_of(model)
    if offloader is not None:
        stats = offloader.stats()
        out.print(f"offloaded to host: {format_bytes(stats.offloaded_bytes)} a step"
                  f" (peak host {format_bytes(stats.peak_host_bytes)})")
    ok = report.bit_identical or report.max_grad_diff <= args.tolerance
    out.print("[green]gradients match[/]" if ok else "[red]gradients differ[/]")
    return 0 if ok else 1
