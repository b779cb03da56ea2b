"""Trace one training step per action of one rank's shard of the recipe on the meta device (shapes
only: no GPU; seconds to a minute on a CPU), with the tensor, sequence, context and pipeline
parallel sizes given, then predict each config's peak allocated memory per pipeline stage, by
component, and its step time.
"""

from __future__ import annotations

import argparse

from remat.bench.run import plan_name
from remat.cli.args import (
    add_layout_flags,
    add_model_flags,
    add_recompute_flags,
    compile_default,
    config_file,
    facts_of,
    file_keys,
    meta_model,
    resolve_config,
    spec_settings,
    sweep_entries,
)
from remat.cli.checks import configs_flag_problems, planning_flag_problems
from remat.cli.common import (
    Outputs,
    Problems,
    collected_warnings,
    path_problems,
    print_warnings,
    progress_bar,
    show,
    write_json,
)
from remat.cli.flags import add_settings, given
from remat.cli.plan import add_budget_flags, budget_problems, plan_per_stage
from remat.cli.tables import estimate_table
from remat.config.megatron import RecomputeFields
from remat.config.parallel import ParallelLayout
from remat.config.plan import PlanLike
from remat.config.recompute import RecomputeConfig
from remat.estimate.spec import EstimateSpec
from remat.estimate.stages import estimate
from remat.planner import max_group_problems
from remat.sites.apply import apply

HELP = "predict peak memory per GPU and pipeline stage from shapes alone"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = add_model_flags(p, skip=["device", "task", "seed"])
    add_settings(g, EstimateSpec, only=["device", "tflops", "host_gbps", "cublas_workspace"])
    add_layout_flags(p)
    add_recompute_flags(p)
    p.add_argument(
        "--configs",
        nargs="+",
        metavar="ENTRY",
        help="estimate these (not beside recompute or offload flags): none, mlp+core_attn, "
        "full_uniform_1, full_block_K, a config or plan file, or `presets` for Megatron's "
        "usual ones",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--json",
        metavar="PATH",
        help="write the estimates (or the plans) as JSON; - for stdout (the tables then go to stderr)",
    )
    budget = p.add_argument_group("planning by shape (instead of estimating given configs)")
    add_budget_flags(budget, required=False, threshold=False)


def _global_batch(values: dict, layout: ParallelLayout) -> int | None:
    """-gb, or by default one micro-batch per pipeline stage on each data-parallel rank (1F1B's fill)."""
    if values.get("global_batch_size") is not None:
        return values["global_batch_size"]
    if layout.model_parallel < 1 or layout.pp < 1:  # the layout's own problems
        return None
    return values.get("micro_batch_size", 1) * layout.dp * layout.pp


def _spec(args: argparse.Namespace, keys: dict) -> EstimateSpec:
    values = {**spec_settings(args, keys), **given(EstimateSpec, args)}
    values.update(
        global_batch_size=_global_batch(values, values["layout"]),
        compile=compile_default(values.get("compile"), values.get("device", "cuda")),
    )
    return EstimateSpec(**values)


def check(args: argparse.Namespace) -> tuple[EstimateSpec, list[tuple[str, PlanLike]]]:
    """The spec and the configs of an estimate command line, every problem reported together."""
    found = Problems()
    loaded = found.run(config_file, args, field="config")
    keys = file_keys(loaded)
    facts = found.run(facts_of, args, keys, field="model_recipe_name")
    flags = found.run(resolve_config, args, loaded, facts) if facts is not None else None
    found.raise_if_any()
    assert facts is not None  # or a problem was raised
    model = meta_model(args)
    plans: list[tuple[str, PlanLike]] = []
    if args.configs:
        found.add(configs_flag_problems(flags if isinstance(flags, RecomputeConfig) else None))
        plans = sweep_entries(found, model, args.configs, facts.to_megatron(), stage_layers=facts.layers_per_chunk)
    elif found.run(apply, model, flags) is not None:
        plans.append((plan_name(flags), flags))
    found.add(path_problems({"--json": args.json}))
    spec = found.run(_spec, args, keys)
    found.raise_if_any()
    assert spec is not None  # or a problem was raised
    return spec, plans


def run(args: argparse.Namespace) -> int:
    if args.memory_budget is not None:
        return _plan(args)
    with collected_warnings() as caught:
        spec, plans = check(args)
        with progress_bar(not args.no_progress) as bar:
            results = estimate(spec, plans, progress=bar.note("trace on meta"))
    print_warnings(caught)
    show(estimate_table(spec, results), keys=2)
    data = [r.to_dict() for r in results]
    outputs = Outputs("estimate", data)
    if args.json:
        outputs.write("--json", args.json, lambda: write_json(data, args.json))
    return outputs.close()


def _plan(args: argparse.Namespace) -> int:
    """--memory-budget: a plan per pipeline rank, solved on the shapes' trace."""
    found = Problems()
    budget, host_budget = budget_problems(args, found)
    found.add(planning_flag_problems(args.configs, given(RecomputeFields, args)))
    found.add(max_group_problems(args.max_group))
    found.raise_if_any()
    args.configs = ["none"]  # the run's layout and shapes, with no config of its own
    with collected_warnings() as caught:
        spec, _ = check(args)
    print_warnings(caught)
    assert budget is not None  # or a problem was raised
    return plan_per_stage(spec, args, budget, host_budget)
