"""Run real training steps (forward, backward, AdamW) of a recipe under a recompute config on mock
data; report step time, TFLOP/s per GPU, tokens/s, peak memory and its breakdown, loss per step.
"""
from __future__ import annotations

import argparse

import torch

from remat.bench.golden import DEFAULT_THRESHOLD, compare, golden_failed, mismatch_notes, save_golden, uncompared
from remat.bench.run import plan_name, run_bench
from remat.bench.spec import BenchSpec
from remat.cli.args import add_recompute_flags, add_run_flags, check_bench, gpus_of
from remat.cli.common import (Outputs, collected_warnings, err, out, output_problems, print_warnings, progress_bar,
                              show, write_json)
from remat.cli.tables import checks_table, memory_table, results_table
from remat.parallel import is_main, launched_world, start, stop, torchrun
from remat.problems import count
from remat.recompute import RecomputeConfig

HELP = "train a recipe under a recompute config and measure it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_flags(p)
    add_recompute_flags(p)
    p.add_argument("-d", "--dryrun", action="store_true", help="build, validate and print; run nothing")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--golden", metavar="FILE",
                   help="compare with a stored result; exit 1 on a difference beyond --threshold. A golden of "
                        "another recipe or shape is refused before running; another GPU name or recompute "
                        "config is a note, and so is a metric only one side has")
    p.add_argument("--save-golden", "--save_golden", dest="save_golden", metavar="FILE",
                   help="store this result as golden")
    p.add_argument("--threshold", type=float,
                   help=f"with --golden: relative difference that fails the comparison, both ways (default "
                        f"{DEFAULT_THRESHOLD})")


def run(args: argparse.Namespace) -> int:
    """Under torchrun, every rank runs the bench and rank 0 reports; `-ng N` outside torchrun
    starts it with N processes."""
    gpus = gpus_of(args)
    if gpus > 1 and launched_world() == 1 and not args.dryrun:
        check_bench(args, output_problems(args))  # every problem before any process starts
        return torchrun(gpus, args.argv)
    if args.num_gpus is None and launched_world() > 1:  # under torchrun: as many GPUs as it started processes
        args.num_gpus = launched_world()
    start(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not is_main():
        out.quiet = True
    try:
        status = _run(args)
    except BaseException:
        stop(failed=True)
        raise
    stop()
    return status


def _layout_words(spec: BenchSpec) -> str:
    """How the run spreads over GPUs, for the table's title."""
    words = []
    tp = spec.facts.tensor_model_parallel_size
    if tp > 1:
        words.append(f"tensor parallel over {tp} ranks" + (" with sequence parallel" if spec.facts.sequence_parallel
                                                            else ""))
    if spec.stages > 1:
        virtual = spec.pipeline.virtual
        words.append(f"{spec.stages} pipeline stages" + (f" x {virtual} virtual (interleaved 1F1B)" if virtual > 1
                                                        else " (1F1B)"))
    if spec.data_parallel > 1:
        words.append(f"data parallel over {spec.data_parallel} ranks (FSDP2)")
    return "".join(f", {w}" for w in words)


def _run(args: argparse.Namespace) -> int:
    with collected_warnings() as caught:
        spec, plan, resolved, golden = check_bench(args, output_problems(args))
    print_warnings(caught)
    if args.dryrun:
        out.print(f"[bold]{spec.recipe}[/] on {spec.device}: micro-batch {spec.micro_batch_size}, "
                  f"{count(spec.micro_batches, 'micro-batch', 'micro-batches')} a step, {count(spec.max_steps, 'step')} "
                  f"({spec.warmup_steps} warm-up), {spec.compute_dtype}")
        if isinstance(plan, RecomputeConfig):
            out.print(plan.describe())
        out.print(resolved.describe())
        return 0
    with collected_warnings() as during, progress_bar(not args.no_progress and is_main()) as bar:
        result = run_bench(spec, plan, name=plan_name(plan), on_step=bar.on_step())
    if not is_main():  # rank 0 reports and writes; its numbers are every rank's (peaks the highest)
        return 0 if result.status == "ok" else 1
    print_warnings(during, printed=caught)
    show(results_table([result], title=f"remat bench: {spec.recipe}{_layout_words(spec)}"))
    if result.memory is not None:
        show(memory_table(result))
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
