"""Trace one training step per action on the recipe (what each site saves and what recomputing it
costs), then solve for the fastest per-layer plan whose predicted peak allocated memory fits the
budget. Writes a Megatron config when one expresses the plan, else a plan file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from remat.bench.run import run_bench
from remat.bench.spec import BenchSpec
from remat.cli.args import add_layout_flags, add_run_flags, bench_spec
from remat.cli.checks import (
    offload_device_advice,
    offload_threshold_problems,
    per_stage_verify_problems,
    plan_output_problems,
    plan_run_flag_problems,
)
from remat.cli.common import (
    Outputs,
    Problems,
    collected_warnings,
    follow_up,
    out,
    path_problems,
    print_warnings,
    progress_bar,
    show,
    write_json,
)
from remat.cli.flags import add_settings, whole_number
from remat.cli.tables import (
    estimate_table,
    plan_table,
    stage_plans_table,
    storage_table,
    trace_table,
    verify_plan_table,
)
from remat.config.fields import MIN_OFFLOADED_TENSOR_SIZE
from remat.config.megatron import RecomputeFields
from remat.config.plan import Plan
from remat.core.problems import advise, raise_if_any
from remat.core.sizes import BARE_IS_BYTES, parse_bytes
from remat.estimate.spec import EstimateSpec
from remat.estimate.stage_plans import plan_stages
from remat.estimate.stages import cpu_run_problems
from remat.planner import (
    PlanResult,
    host_budget_problems,
    max_group_problems,
    plan_from_trace,
    plan_search_problems,
    weight_bytes,
)
from remat.run.build import build_model
from remat.run.step import trace_spec

HELP = "choose the fastest recompute plan that fits a memory budget"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_flags(p)
    add_layout_flags(p, "parallelism (a plan per pipeline rank, each rank's shard traced here) and CUDA graphs")
    add_budget_flags(p, required=True)
    p.add_argument("--verify", action="store_true", help="bench the chosen plan and print predicted against measured")
    p.add_argument(
        "--json",
        metavar="PATH",
        help="write the plan, prediction (and measurement) as JSON; - for stdout (the tables then go to stderr)",
    )


def add_budget_flags(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, required: bool, threshold: bool = True
) -> None:
    """What the planner is asked: the budget, what it may do, and where the plan goes
    (`threshold`: add --min_offloaded_tensor_size, unless the command's recompute flags have it)."""
    p.add_argument(
        "--memory-budget",
        "--memory_budget",
        dest="memory_budget",
        required=required,
        metavar="SIZE",
        help=f"peak allocated memory to fit on each GPU, like 60GiB, 80GB or 512MiB ({BARE_IS_BYTES}); "
        "with pipeline stages, each rank gets its own plan",
    )
    p.add_argument(
        "-o",
        "--output",
        default="remat_plan.yaml",
        metavar="FILE",
        help="where to write the plan (.yaml or .json; default remat_plan.yaml)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="consider offloading activations to host memory too (pinned; the trace takes about twice as long)",
    )
    p.add_argument(
        "--host-memory-budget",
        "--host_memory_budget",
        dest="host_memory_budget",
        metavar="SIZE",
        help=f"with --offload: the most host memory offload may hold (per GPU), like 200GiB ({BARE_IS_BYTES})",
    )
    if threshold:
        add_settings(p, RecomputeFields, only=["min_offloaded_tensor_size"])
    p.add_argument(
        "--max_group",
        type=whole_number,
        default=16,
        metavar="N",
        help="longest run of layers recomputed as one unit that the planner considers",
    )


def budget_problems(args: argparse.Namespace, found: Problems) -> tuple[int | None, int | None]:
    """The budgets of a planning command line, and the problems of its planning flags."""
    budget = found.run(parse_bytes, args.memory_budget, "memory_budget", "b")
    host_budget = (
        found.run(parse_bytes, args.host_memory_budget, "host_memory_budget", "b")
        if args.host_memory_budget is not None
        else None
    )
    found.add(host_budget_problems(args.offload, host_budget))
    found.add(plan_output_problems("--output", args.output))
    found.add(offload_threshold_problems(args.offload, args.min_offloaded_tensor_size))
    return budget, host_budget


def plan_per_stage(
    spec: EstimateSpec, args: argparse.Namespace, budget: int, host_budget: int | None, device: str = "meta"
) -> int:
    """Plan each pipeline rank of `spec` under the budget, show the plans beside the fastest
    uniform Megatron config, and write the plan file (and --json)."""
    with progress_bar(not args.no_progress) as bar:
        result = plan_stages(
            spec,
            budget,
            offload=args.offload,
            host_budget=host_budget,
            max_group=args.max_group,
            min_offloaded_tensor_size=_threshold(args),
            device=device,
            progress=bar.note("trace" if device != "meta" else "trace on meta"),
        )
    compared = [result.estimate] + ([result.uniform[1]] if result.uniform else [])
    show(estimate_table(spec, compared, measured=device != "meta"), keys=2)
    show(stage_plans_table(result))
    outputs = Outputs("plan", result.to_dict())
    outputs.write("--output", args.output, lambda: _save(result.plan, args.output))
    if not outputs.failed:
        out.print(f"written to {args.output}; run it with `{follow_up(args, 'bench', '--config', str(args.output))}`")
    if args.json:
        outputs.write("--json", args.json, lambda: write_json(result.to_dict(), args.json))
    return outputs.close()


def _save(plan: Plan, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)


def _write_plan(result: PlanResult, keys: dict[str, Any] | None, path: str) -> None:
    """The Megatron keys when they express the plan, else the per-layer plan file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if keys is None:
        result.plan.save(path)
    else:
        Path(path).write_text(
            json.dumps(keys, indent=1) if path.endswith(".json") else yaml.safe_dump(keys, sort_keys=False)
        )


def _check(args: argparse.Namespace) -> tuple[BenchSpec, int, int | None]:
    """The spec and budgets of a plan command line, every problem reported together."""
    found = Problems()
    spec = found.run(bench_spec, args, field="model_recipe_name")
    budget, host_budget = budget_problems(args, found)
    found.add(path_problems({"--output": args.output, "--json": args.json}))
    run_flags = {"--max_steps": args.max_steps, "--warmup_steps": args.warmup_steps, "--history": args.history}
    found.add(plan_run_flag_problems(args.verify, [flag for flag, value in run_flags.items() if value is not None]))
    if spec is not None:
        found.add(per_stage_verify_problems(args.verify, spec.layout.model_parallel))
    found.raise_if_any()
    assert spec is not None and budget is not None  # or a problem was raised
    found.add(cpu_run_problems(spec, [("the no-recompute step the trace starts from", None)]))
    if spec.layout.model_parallel > 1:
        found.add(max_group_problems(args.max_group))
    found.raise_if_any()
    return spec, budget, host_budget


def _threshold(args: argparse.Namespace) -> int:
    return MIN_OFFLOADED_TENSOR_SIZE if args.min_offloaded_tensor_size is None else args.min_offloaded_tensor_size


def _record(result: PlanResult, budget: int) -> dict[str, Any]:
    """What --json writes of a plan: the plan, its Megatron keys, each choice and the prediction."""
    explained = [
        dict(layers=layers, action=what, freed_bytes=freed, added_s=seconds)
        for layers, what, freed, seconds in result.explain()
    ]
    return {
        "budget_bytes": budget,
        "plan": result.plan.to_dict(),
        "megatron": result.megatron_keys(),
        "explain": explained,
        "predicted": dataclasses.asdict(result.prediction),
    }


def run(args: argparse.Namespace) -> int:
    spec, budget, host_budget = _check(args)
    if spec.layout.model_parallel > 1:  # one rank's shard per kind of stage, traced here in turn
        return plan_per_stage(EstimateSpec.of_run(spec), args, budget, host_budget, device=spec.device)
    model = build_model(spec)  # the weights are checked against the budget before minutes of tracing
    raise_if_any(plan_search_problems(budget, weight_bytes(model, spec.device.split(":")[0]), args.max_group))
    with collected_warnings() as caught:
        advise(offload_device_advice(spec.device, ["--offload"] if args.offload else []))
    print_warnings(caught)
    with progress_bar(not args.no_progress) as bar:
        model, measured = trace_spec(
            spec, model, offload=args.offload, min_offloaded_tensor_size=_threshold(args), progress=bar.note("trace")
        )
    measured = dataclasses.replace(measured, max_group=args.max_group)
    show(storage_table(measured))
    show(trace_table(measured))
    result = plan_from_trace(measured, budget, host_budget)
    show(plan_table(result))
    record, keys = _record(result, budget), result.megatron_keys()
    outputs = Outputs("plan", record)
    outputs.write("--output", args.output, lambda: _write_plan(result, keys, args.output))
    if not outputs.failed:
        if keys is not None:
            out.print(f"a Megatron config expresses this plan: {keys or 'no recompute'}")
        out.print(f"written to {args.output}; run it with `{follow_up(args, 'bench', '--config', str(args.output))}`")
    if args.verify:
        with progress_bar(not args.no_progress) as bar:
            bench = run_bench(spec, result.config or result.plan, model=model, name="plan", on_step=bar.on_step())
        show(verify_plan_table(result, bench, spec, measured.step_noise_s))
        record["measured"] = bench.to_dict()
        outputs.history([bench], args)
    if args.json:
        outputs.write("--json", args.json, lambda: write_json(record, args.json))
    return outputs.close()
