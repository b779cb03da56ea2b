"""Bench many configs on one model in one process, on one GPU (`remat bench -ng N` runs a config on
N). Entries: none, a label list (mlp+core_attn), full_uniform_K, full_block_K, a YAML/JSON config or
plan file, or `presets` for Megatron's usual ones (the default).
"""

from __future__ import annotations

import argparse

from remat.bench.plot import pareto_plot
from remat.bench.result import CPU_TIMING_CAVEAT, BenchResult
from remat.bench.run import sweep
from remat.bench.spec import BenchSpec
from remat.cli.args import (
    add_layout_flags,
    add_run_flags,
    advise_offload,
    bench_spec,
    facts_of,
    gpus_of,
    meta_model,
    sweep_entries,
)
from remat.cli.checks import one_process_problems
from remat.cli.common import (
    INTERRUPTED,
    Outputs,
    Problems,
    collected_warnings,
    err,
    out,
    output_problems,
    print_warnings,
    progress_bar,
    show,
    write_json,
)
from remat.cli.flags import add_settings
from remat.cli.tables import results_table
from remat.config.plan import PlanLike
from remat.core.problems import count
from remat.estimate.stages import cpu_run_problems
from remat.parallel import launched_world
from remat.run.spec import unrun_problems

HELP = "bench many recompute configs in one process; table and Pareto plot"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_flags(p)
    add_settings(p, BenchSpec, only=["dryrun"], defaults={"dryrun": False})
    add_layout_flags(p)
    p.add_argument("--configs", nargs="+", metavar="ENTRY")
    p.add_argument("--plot", metavar="PNG", help="write the Pareto plot (memory against throughput) here")
    p.add_argument(
        "--json", metavar="PATH", help="write all results as a JSON list; - for stdout (the tables then go to stderr)"
    )


def check(args: argparse.Namespace) -> tuple[BenchSpec, list[tuple[str, PlanLike]]]:
    """Every problem of a sweep, each entry checked against the model, before anything runs."""
    found = Problems()
    spec = found.run(bench_spec, args, field="model_recipe_name")
    facts = found.run(facts_of, args, field="model_recipe_name")
    plans: list[tuple[str, PlanLike]] = []
    if facts is not None:
        plans = sweep_entries(
            found,
            meta_model(args),
            args.configs,
            facts.to_megatron(),
            lambda config: unrun_problems(config.facts.capture),
        )
    found.add(output_problems(args))
    found.add(one_process_problems("sweep", gpus_of(args), launched_world()))
    found.raise_if_any()
    assert spec is not None  # or a problem was raised
    if not spec.dryrun:
        found.add(cpu_run_problems(spec, plans))
        found.raise_if_any()
    advise_offload(spec, plans)
    return spec, plans


def run(args: argparse.Namespace) -> int:
    with collected_warnings() as checked:
        spec, plans = check(args)
    print_warnings(checked)  # before the runs, which may take hours
    if args.dryrun:
        for name, _ in plans:
            out.print(name)
        return 0
    results: list[BenchResult] = []
    with collected_warnings() as caught, progress_bar(not args.no_progress) as bar:
        try:
            sweep(spec, plans, on_step=bar.on_step(), into=results)
        except KeyboardInterrupt:  # the configs run so far are results: kept, then exit 130
            if not results:
                raise
            err.print(f"interrupted after {count(len(results), 'config')} of {len(plans)}; recording those")
    print_warnings(caught, printed=checked)
    code = _outputs(args, spec, results)
    return INTERRUPTED if len(results) < len(plans) else code


def _outputs(args: argparse.Namespace, spec: BenchSpec, results: list[BenchResult]) -> int:
    """The table, --json, the history and --plot of the configs run."""
    show(results_table(results, title=f"remat sweep: {spec.recipe}"))
    if any(r.device == "cpu" for r in results):  # a faster config on CPU may be noise, not the config
        out.print(CPU_TIMING_CAVEAT)
    data = [r.to_dict() for r in results]
    outputs = Outputs("sweep", data)
    if args.json:
        outputs.write("--json", args.json, lambda: write_json(data, args.json))
    outputs.history(results, args)
    if args.plot:
        failed = len(outputs.failed)
        title = f"{spec.recipe} on {results[0].gpu}: memory vs throughput"
        outputs.write("--plot", args.plot, lambda: pareto_plot(results, args.plot, title=title))
        if len(outputs.failed) == failed:
            out.print(f"Pareto plot: {args.plot}")
    return outputs.close()
