"""--results: checks for common recompute mistakes on `remat bench --json` / `remat sweep --json`
output (exit 1 on a finding): mlp recompute on a large FFN, layernorm alone, mlp with core_attn,
full recompute under per-layer CUDA graphs, CPU offload with pipeline parallelism, and the kind of
each OOM (under torchrun, with the numbers of the rank that ran out). --snapshot / --oom_message:
classify an OOM as fragmentation or capacity and say what to change; given a torchrun log, each
rank's OOM with its own numbers. --timeline: plot one step's memory (CPU or GPU). Otherwise (CUDA
only): run the bench with the run flags in one process and diagnose an OOM it hits (`remat bench
-ng N` diagnoses an OOM on any of N ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import torch

from remat import doctor
from remat.bench.findings import check_results, load_results
from remat.bench.plot import timeline_plot
from remat.bench.run import plan_name, run_bench
from remat.cli.args import add_layout_flags, add_recompute_flags, add_run_flags, check_bench, gpus_of
from remat.cli.checks import doctor_flag_problems, doctor_run_problems, one_process_problems, png_path_problems
from remat.cli.common import Problems, out, path_problems, progress_bar, show
from remat.cli.tables import doctor_report, findings_table, format_gib
from remat.core.problems import Problem
from remat.core.sizes import BARE_IS_BYTES, parse_bytes
from remat.memory.timeline import timeline
from remat.parallel import launched_world
from remat.run.build import build_model
from remat.run.step import MockData, make_optimizer

HELP = "diagnose an OOM (fragmentation or capacity) or a bench/sweep's results"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--results", metavar="FILE.json", help="bench or sweep results as --json writes them")
    g.add_argument(
        "--snapshot",
        metavar="SNAP",
        help="torch.cuda.memory._dump_snapshot pickle (load only your own) or the same as .json",
    )
    g.add_argument("--oom_message", metavar="TEXT", help="the 'CUDA out of memory. Tried to allocate ...' line")
    p.add_argument(
        "--timeline",
        metavar="PNG",
        help="run one step of the recipe (CPU or GPU) and plot its memory after every op, phases and layers marked",
    )
    p.add_argument("--request", metavar="SIZE", help=f"the failed request, like 2GiB ({BARE_IS_BYTES})")
    p.add_argument("--limit", metavar="SIZE", help=f"the device memory the snapshot had, like 80GiB ({BARE_IS_BYTES})")
    add_run_flags(p)
    add_layout_flags(p)
    add_recompute_flags(p)
    p.set_defaults(golden=None, threshold=None)


def run(args: argparse.Namespace) -> int:
    flags = doctor_flag_problems(
        results=bool(args.results),
        state=bool(args.snapshot or args.oom_message),
        oom_message=bool(args.oom_message),
        timeline=bool(args.timeline),
        request=args.request is not None,
        limit=args.limit is not None,
    )
    if args.results:
        return _results(args, flags)
    if args.snapshot or args.oom_message:
        return _state(args, flags)
    if args.timeline:
        return _timeline(args, flags)
    return _run(args, flags)


def _results(args: argparse.Namespace, flag_problems: list[Problem]) -> int:
    found = Problems()
    found.add(flag_problems)
    results = found.run(load_results, args.results, field="results")
    found.raise_if_any()
    findings = check_results(results)
    show(findings_table(findings, args.results))
    return 1 if findings else 0


def _run(args: argparse.Namespace, flag_problems: list[Problem]) -> int:
    """The one mode that needs a GPU: it runs the bench and diagnoses an OOM it hits."""
    spec, plan, _, _ = check_bench(
        args,
        [
            *flag_problems,
            *doctor_run_problems(torch.cuda.is_available()),
            *one_process_problems("doctor", gpus_of(args), launched_world()),
        ],
    )
    run_flags = shlex.join(a for a in shlex.split(args.command_line)[2:] if a != "--no_progress")
    model = build_model(spec)
    doc = doctor.Doctor(
        spec.device, on_oom=None, micro_batch_size=spec.micro_batch_size, run_flags=run_flags, model=model
    )
    with progress_bar(not args.no_progress) as bar, doc:
        result = run_bench(spec, plan, model=model, name=plan_name(plan), on_step=bar.on_step(), on_oom=doc.observe)
    if doc.report is None:
        out.print(f"no OOM: {result.name} ran, peak allocated {format_gib(result.peak_allocated_bytes)}")
        return 0
    out.print(doctor_report(doc.report))
    return 1


def _timeline(args: argparse.Namespace, flag_problems: list[Problem]) -> int:
    """One training step of the recipe under the config, memory after every op, as a PNG."""
    spec, plan, _, _ = check_bench(
        args,
        [
            *flag_problems,
            *path_problems({"--timeline": args.timeline}),
            *png_path_problems("--timeline", args.timeline),
        ],
    )
    model = build_model(spec)
    model.train()
    recorded = timeline(
        model,
        MockData(spec).batch(),
        optimizer=make_optimizer(model, spec),
        plan=plan,
        micro_batches=spec.micro_batches,
        per_op=not spec.compile,
    )
    tokens = f"{spec.micro_batch_size} x {spec.model_config.seq_length} tokens"
    path = timeline_plot(recorded, args.timeline, title=f"{spec.recipe} on {spec.device}: one step, {tokens}")
    window, peak = max(recorded.peaks.items(), key=lambda item: item[1])
    fp8 = recorded.fp8_at_peak()
    of_it = f", of it {format_gib(fp8)} in FP8 (kept inputs and casts)" if fp8 else ""
    out.print(f"memory timeline of one step: {path} (peak allocated {format_gib(peak)} in {window}{of_it})")
    return 0


def _state(args: argparse.Namespace, flag_problems: list[Problem]) -> int:
    """A snapshot, or an OOM message: a torchrun log's diagnosed rank by rank, each with its own numbers."""
    found = Problems()
    found.add(flag_problems)
    request = found.run(parse_bytes, args.request, "request", "b") if args.request is not None else None
    states: dict[int | None, doctor.AllocatorState | None] = {}
    if args.oom_message:
        for rank, message in doctor.oom_messages(args.oom_message).items():
            state = found.run(
                doctor.AllocatorState.from_oom_message,
                message,
                field="oom_message" if rank is None else f"oom_message of rank {rank}",
            )
            states[rank] = state if state is None or request is None else dataclasses.replace(state, request=request)
    else:
        limit = found.run(parse_bytes, args.limit, "limit", "b") if args.limit is not None else None
        snapshot = found.run(doctor.load_snapshot, args.snapshot, field="snapshot")
        found.raise_if_any()
        assert limit is not None  # doctor_flag_problems refuses a snapshot without --limit
        snapped = doctor.AllocatorState.from_snapshot(snapshot, {}, limit, request)
        found.add(doctor.snapshot_limit_problems(snapped.reserved, limit))
        states[None] = snapped
    found.raise_if_any()
    for rank, state in states.items():
        assert state is not None  # or a problem was raised
        out.print(doctor_report(doctor.report_of(state, rank=rank, micro_batch_size=args.micro_batch_size)))
    return 0
