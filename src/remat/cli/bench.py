"""Run real training steps (forward, backward, AdamW) of a recipe under a recompute config on mock
data; report step time, TFLOP/s per GPU, tokens/s, peak memory and its breakdown, loss per step.
An out-of-memory error is diagnosed with the numbers of the rank that ran out.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from rich.markup import escape

from remat.bench.golden import DEFAULT_THRESHOLD, compare, golden_failed, mismatch_notes, save_golden, uncompared
from remat.bench.result import BenchResult
from remat.bench.run import plan_name, run_bench
from remat.bench.spec import BenchSpec
from remat.cli.args import add_layout_flags, add_recompute_flags, add_run_flags, check_bench, gpus_of
from remat.cli.common import (
    Outputs,
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
from remat.cli.tables import checks_table, doctor_report, memory_table, results_table
from remat.config.recompute import RecomputeConfig
from remat.core.problems import count
from remat.doctor import report_of
from remat.parallel import is_main, launched_world, rank, start, stop, torchrun
from remat.parallel.launch import leave, left_by_ranks, rank_words

HELP = "train a recipe under a recompute config and measure it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_flags(p)
    add_settings(p, BenchSpec, only=["dryrun"])
    add_layout_flags(p)
    add_recompute_flags(p)
    p.add_argument(
        "--json", metavar="PATH", help="write the result as JSON; - for stdout (the tables then go to stderr)"
    )
    p.add_argument(
        "--golden",
        metavar="FILE",
        help="compare with a stored result; exit 1 on a difference beyond --threshold. A golden of "
        "another recipe or shape is refused before running; one of another parallel layout checks "
        "the loss alone; another GPU name or recompute config is a note, and so is a metric only "
        "one side has",
    )
    p.add_argument(
        "--save-golden", "--save_golden", dest="save_golden", metavar="FILE", help="store this result as golden"
    )
    p.add_argument(
        "--threshold",
        type=float,
        help=f"with --golden: relative difference that fails the comparison, both ways (default {DEFAULT_THRESHOLD})",
    )


class RankFailed(Exception):
    """This rank ran out of memory under torchrun: the other ranks wait in a collective it will not join."""


def run(args: argparse.Namespace) -> int:
    """Under torchrun, every rank runs the bench and rank 0 reports, or the rank that ran out of
    memory; `-ng N` outside torchrun starts it with N processes."""
    gpus = gpus_of(args)
    if gpus > 1 and launched_world() == 1 and not args.dryrun:
        return _launch(args, gpus)
    if args.num_gpus is None and launched_world() > 1:  # under torchrun: as many GPUs as it started processes
        args.num_gpus = launched_world()
    start(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not is_main():
        out.quiet = True
    here = rank()
    try:
        status = _run(args)
    except RankFailed:
        stop(failed=True)  # it exits at once, and torchrun stops the ranks that wait for it
        return 1
    except BaseException as error:
        stop(failed=True)
        if not (isinstance(error, Exception) and left_by_ranks()):
            raise
        # a collective that lost the rank which failed first: one line, not a traceback to mistake for the failure
        err.print(
            f"rank {here} stopped after another rank failed: {type(error).__name__}: "
            f"{escape((str(error).splitlines() or [''])[0])}"
        )
        return 1
    stop()
    return status


def _launch(args: argparse.Namespace, gpus: int) -> int:
    """Start torchrun with `gpus` processes. Rank 0 reports a run that ends; a rank that runs out of
    memory leaves its result here, since rank 0 may be stopped while it waits for that rank."""
    spec, _, _, golden = check_bench(args, output_problems(args))  # every problem before any process starts
    launched = torchrun(gpus, args.argv)
    failed = [BenchResult.from_dict(record) for record in launched.records.values()]  # in rank order
    if not failed:
        return launched.status
    out.print(
        "torchrun stopped the other ranks: what they printed about a closed connection or a timeout follows from this"
    )
    return max(_report(args, spec, failed, golden), 1)


def _layout_words(spec: BenchSpec) -> str:
    """How the run spreads over GPUs, for the table's title."""
    words, layout = [], spec.layout
    if layout.tp > 1:
        words.append(f"tensor parallel over {layout.tp} ranks" + (" with sequence parallel" if layout.sp else ""))
    if layout.pp > 1:
        words.append(
            f"{layout.pp} pipeline stages"
            + (f" x {layout.virtual} virtual" if layout.virtual > 1 else "")
            + f" ({layout.pipeline_schedule})"
        )
    if layout.cp > 1:
        words.append(f"context parallel over {layout.cp} ranks (ring attention)")
    if layout.ep > 1:
        words.append(f"experts over {layout.ep} ranks")
    if layout.dp > 1:
        words.append(f"data parallel over {layout.dp} ranks (FSDP2)")
    return "".join(f", {w}" for w in words)


def _run(args: argparse.Namespace) -> int:
    with collected_warnings() as caught:
        spec, plan, resolved, golden = check_bench(args, output_problems(args))
    print_warnings(caught)
    if args.dryrun:
        out.print(
            f"[bold]{spec.recipe}[/] on {spec.device}: micro-batch {spec.micro_batch_size}, "
            f"{count(spec.micro_batches, 'micro-batch', 'micro-batches')} a step, {count(spec.max_steps, 'step')} "
            f"({spec.warmup_steps} warm-up), {spec.precision.compute_dtype}"
        )
        if isinstance(plan, RecomputeConfig):
            out.print(plan.describe())
        out.print(resolved.describe())
        return 0
    with collected_warnings() as during, progress_bar(not args.no_progress and is_main()) as bar:
        result = run_bench(spec, plan, name=plan_name(plan), on_step=bar.on_step())
    if result.oom is not None and result.oom.rank is not None:
        _leave(spec, result)
        raise RankFailed
    if not is_main():  # rank 0 reports and writes; its numbers are every rank's (peaks the highest)
        return 0
    print_warnings(during, printed=caught)
    return _report(args, spec, [result], golden)


def _leave(spec: BenchSpec, result: BenchResult) -> None:
    """A rank that ran out of memory leaves its result to the remat process that started torchrun;
    under a torchrun started by hand it says it itself, since no other rank can."""
    assert result.oom is not None
    if leave(f"rank{result.oom.rank:05d}", result.to_dict()):  # named in rank order
        return
    out.quiet = False
    _show(spec, [result])
    err.print(
        "[yellow]note:[/] a rank of a torchrun started by hand writes no --json, history or golden (several"
        " may run out at once); `remat bench -ng N` starts torchrun itself and writes them"
    )


def _show(spec: BenchSpec, results: Sequence[BenchResult]) -> None:
    """The run's result (the first), then each rank that ran out of memory, diagnosed with its own numbers."""
    result = results[0]
    show(results_table([result], title=f"remat bench: {spec.recipe}{_layout_words(spec)}"))
    if result.memory is not None:
        show(memory_table(result))
    for oom in (r.oom for r in results if r.oom is not None):
        if oom.rank is not None:
            out.print(f"[bold red]{rank_words(oom.rank, oom.coordinates)} ran out of memory:[/] {escape(oom.message)}")
        if oom.allocator is not None:
            show(
                doctor_report(
                    report_of(
                        oom.allocator,
                        oom.message,
                        rank=oom.rank,
                        coordinates=oom.coordinates,
                        micro_batch_size=spec.micro_batch_size,
                    )
                )
            )


def _report(
    args: argparse.Namespace, spec: BenchSpec, results: Sequence[BenchResult], golden: BenchResult | None
) -> int:
    """Show the run's result (the first of `results`, the rest other ranks that ran out of memory
    with it), write it, compare it with the golden; the exit status."""
    _show(spec, results)
    result = results[0]
    outputs = Outputs("bench", result.to_dict())
    if args.json:
        outputs.write("--json", args.json, lambda: write_json(result.to_dict(), args.json))
    outputs.history([result], args)
    if args.save_golden:
        outputs.write("--save-golden", args.save_golden, lambda: save_golden(result, args.save_golden))
    written = outputs.close()
    if golden is None:
        return max(written, 0 if result.status == "ok" else 1)
    for note in [*mismatch_notes(result, golden), *uncompared(result, golden)]:
        err.print(f"[yellow]note:[/] {note}")
    checks = compare(result, golden, DEFAULT_THRESHOLD if args.threshold is None else args.threshold)
    show(checks_table(checks))
    return max(written, 1 if golden_failed(checks) else 0)
