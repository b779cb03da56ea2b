"""Trace one training step per action of one rank's shard of the recipe on the meta device (shapes
only: no GPU; seconds to a minute on a CPU), with the tensor, sequence, context and pipeline
parallel sizes given, then predict each config's peak allocated memory per pipeline stage, by
component, and its step time.
"""
from __future__ import annotations

import argparse
import dataclasses

from remat.apply import apply
from remat.bench.run import plan_name
from remat.cli.args import (
    add_model_flags,
    compile_default,
    optimizer_precision,
    add_recompute_flags,
    flag_facts,
    megatron_overrides,
    meta_model,
    model_facts,
    model_overrides,
    resolve_config,
    sweep_entries,
)
from remat.cli.checks import configs_flag_problems, planning_flag_problems
from remat.cli.plan import add_budget_flags, budget_problems, plan_per_stage
from remat.cli.common import (Outputs, Problems, collected_warnings, path_problems, print_warnings, progress_bar, show,
                              write_json)
from remat.cli.tables import estimate_table
from remat.estimating import DEFAULT_TFLOPS, ESTIMATE_TARGETS, EstimateSpec, estimate
from remat.layer_plan import PlanLike
from remat.planner import max_group_problems
from remat.memory.measure import DEFAULT_HOST_GBPS
from remat.recompute import RecomputeConfig, TrainingFacts
from remat.sizes import parse_bytes

HELP = "predict peak memory per GPU and pipeline stage from shapes alone"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_recompute_flags(p)
    p.add_argument("--configs", nargs="+", metavar="ENTRY",
                   help="estimate these (not beside recompute or offload flags): none, mlp+core_attn, "
                        "full_uniform_1, full_block_K, a config or plan file, or `presets` for Megatron's "
                        "usual ones")
    p.add_argument("--target", choices=ESTIMATE_TARGETS, default="cuda",
                   help="whose fused kernels (attention, RMSNorm) to count (default cuda)")
    p.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS, metavar="X",
                   help=f"sustained TFLOP/s per GPU that times a step (default {DEFAULT_TFLOPS:g})")
    p.add_argument("--host_gbps", type=float, default=DEFAULT_HOST_GBPS, metavar="X",
                   help=f"host link bandwidth each way in GB/s that times offload copies (default "
                        f"{DEFAULT_HOST_GBPS:g}, pinned copies on an H200)")
    p.add_argument("--cublas_workspace", metavar="SIZE",
                   help="one cuBLAS handle's workspace on the cuda target, e.g. 8MiB (a bare number is bytes; "
                        "default: from CUBLAS_WORKSPACE_CONFIG, else 32 MiB, torch's on an H200; about 8 MiB "
                        "on GPUs before Hopper); counted once per GEMM thread")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="PATH", help="write the estimates (or the plans) as JSON")
    budget = p.add_argument_group("planning by shape (instead of estimating given configs)")
    add_budget_flags(budget, required=False, threshold=False)


def _global_batch(args: argparse.Namespace, facts: TrainingFacts) -> int | None:
    """-gb, or by default one micro-batch per pipeline stage on each data-parallel rank (1F1B's fill)."""
    if args.global_batch_size is not None:
        return args.global_batch_size
    pp = facts.pipeline_model_parallel_size
    model_parallel = facts.tensor_model_parallel_size * pp * facts.context_parallel_size
    if model_parallel < 1 or pp < 1:  # the rules refuse the sizes
        return None
    gpus = args.num_gpus or model_parallel
    return args.micro_batch_size * max(gpus // model_parallel, 1) * pp


def check(args: argparse.Namespace) -> tuple[EstimateSpec, list[tuple[str, PlanLike]]]:
    """The spec and the configs of an estimate command line, every problem reported together."""
    found = Problems()
    keys = found.run(model_facts, args, field="model_recipe_name")
    flags = found.run(resolve_config, args, keys) if keys is not None else None
    found.raise_if_any()
    assert keys is not None  # or a problem was raised
    facts = flags.facts if isinstance(flags, RecomputeConfig) else flag_facts(args)
    model = meta_model(args)
    plans: list[tuple[str, PlanLike]] = []
    if args.configs:
        found.add(configs_flag_problems(flags if isinstance(flags, RecomputeConfig) else None))
        parallel = {k: v for k, v in dataclasses.asdict(facts).items()
                    if k.endswith("_size") or k == "sequence_parallel"}
        stage_layers = dataclasses.replace(facts, num_layers=keys["num_layers"]).layers_per_virtual_stage
        plans = sweep_entries(found, model, args.configs, {**keys, **parallel}, stage_layers=stage_layers)
    elif found.run(apply, model, flags) is not None:
        plans.append((plan_name(flags), flags))
    found.add(path_problems({"--json": args.json}))
    workspace = (found.run(parse_bytes, args.cublas_workspace, "cublas_workspace", "b", True)
                 if args.cublas_workspace is not None else None)
    spec = found.run(lambda: EstimateSpec(
        recipe=args.model_recipe_name, overrides=model_overrides(args), facts=facts,
        micro_batch_size=args.micro_batch_size, global_batch_size=_global_batch(args, facts),
        num_gpus=args.num_gpus, optimizer=not args.no_optimizer, precision=optimizer_precision(args),
        device=args.target,
        compile=compile_default(args.compile, args.target),
        tflops=args.tflops, host_gbps=args.host_gbps, cublas_workspace=workspace))
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
    found.add(planning_flag_problems(args.configs, megatron_overrides(args)))
    found.add(max_group_problems(args.max_group))
    found.raise_if_any()
    args.configs = ["none"]  # the run's layout and shapes, with no config of its own
    with collected_warnings() as caught:
        spec, _ = check(args)
    print_warnings(caught)
    assert budget is not None  # or a problem was raised
    return plan_per_stage(spec, args, budget, host_budget)
