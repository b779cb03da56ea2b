"""The `remat` command: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from rich.console import Console

from remat import __version__
from remat.bench.golden import DEFAULT_THRESHOLD
from remat.config import (
    DEFAULT_HOST_GBPS,
    DEFAULT_TFLOPS,
    ESTIMATE_TARGETS,
    MIN_OFFLOADED_TENSOR_SIZE,
    BenchSettings,
    ConfigError,
    Problem,
    RecomputeConfig,
    RematWarning,
    device_problems,
    parse_bytes,
    plan_file_flag_problems,
    recompute_flag_problems,
)
from remat.plans import Plan, load_plan_or_config

_console = Console(highlight=False, soft_wrap=True)
_errors = Console(stderr=True, highlight=False, soft_wrap=True)
for _c in (_console, _errors):
    if not _c.is_terminal:
        _c.width = 160  # logs and pipes: keep table columns whole


def _add_recompute_flags(p: argparse.ArgumentParser) -> None:
    """The recompute and parallelism flags of Megatron Bridge's performance scripts."""
    g = p.add_argument_group("recompute (Megatron Bridge names)")
    g.add_argument("--recompute_granularity", choices=["full", "selective"],
                   help="full: whole layers; selective: the modules in --recompute_modules")
    g.add_argument("--recompute_modules", metavar="A,B",
                   help="selective labels, comma separated (core_attn, layernorm, mlp, moe, moe_act, "
                        "shared_experts, mla_up_proj; remat's mlp_act); implies --recompute_granularity selective")
    g.add_argument("-rl", "--recompute_num_layers", type=int, metavar="N",
                   help="full recompute of N layers per (virtual) stage; implies full granularity "
                        "and, unless --recompute_method says otherwise, the block method")
    g.add_argument("--recompute_method", choices=["uniform", "block"])
    g.add_argument("-ol", "--activation_offload_layers", type=int, metavar="N",
                   help="offload what the first N layers save to host memory (cpu_offloading); with "
                        "full recompute, the inputs its groups keep")
    g.add_argument("--min_offloaded_tensor_size", type=int, metavar="N",
                   help="tensors of fewer elements stay on the GPU (default 1048576)")
    g = p.add_argument_group("parallelism and CUDA graphs")
    g.add_argument("-tp", "--tensor_model_parallel_size", type=int, metavar="N")
    g.add_argument("-pp", "--pipeline_model_parallel_size", type=int, metavar="N")
    g.add_argument("-vp", "--virtual_pipeline_model_parallel_size", type=int, metavar="N")
    g.add_argument("-cp", "--context_parallel_size", type=int, metavar="N")
    g.add_argument("--sequence_parallel", action="store_true", default=None)
    g.add_argument("--cuda_graph_impl", choices=["none", "local", "transformer_engine", "full_iteration"])
    g.add_argument("--cuda_graph_scope", metavar="A,B",
                   help="comma separated: full_iteration, attn, mlp, moe, moe_router, moe_preprocess, mamba")
    g.add_argument("--config", metavar="FILE",
                   help="YAML or JSON with Megatron TransformerConfig keys; flags override it")


def megatron_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Map parsed flags to Megatron config keys, as Bridge's perf scripts do."""
    keys: dict[str, Any] = {}
    if args.recompute_num_layers is not None:
        keys.update(recompute_granularity="full", recompute_method="block",
                    recompute_num_layers=args.recompute_num_layers)
    if args.recompute_modules is not None:
        keys.update(recompute_granularity="selective", recompute_modules=args.recompute_modules)
    if args.activation_offload_layers:
        keys.update(cpu_offloading=True, cpu_offloading_num_layers=args.activation_offload_layers)
    if args.min_offloaded_tensor_size is not None:
        keys.update(min_offloaded_tensor_size=args.min_offloaded_tensor_size)
    for name in ("recompute_granularity", "recompute_method", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "context_parallel_size",
                 "sequence_parallel", "cuda_graph_impl", "cuda_graph_scope"):
        value = getattr(args, name)
        if value is not None:
            keys[name] = value
    return keys


def resolve_config(args: argparse.Namespace, model_facts: dict[str, Any]) -> RecomputeConfig | Plan:
    """What a command line means: --config FILE (Megatron keys or a per-layer plan), then the
    model's facts, then the flags."""
    problems = list(recompute_flag_problems(args.recompute_num_layers, args.recompute_modules,
                                            args.recompute_granularity))
    if problems:
        raise ConfigError(problems)
    keys: dict[str, Any] = {}
    if args.config:
        loaded = load_plan_or_config(args.config)
        if isinstance(loaded, Plan):
            problems = list(plan_file_flag_problems(megatron_overrides(args)))
            if problems:
                raise ConfigError(problems)
            return loaded
        keys.update(loaded.to_megatron())
    keys.update(model_facts)
    keys.update(megatron_overrides(args))
    return RecomputeConfig.from_megatron(keys)


def _cmd_validate(args: argparse.Namespace) -> int:
    from remat.apply import apply
    from remat.models import build

    found = _Problems()
    model = None
    facts: dict[str, Any] = {}
    if args.model_recipe_name:
        overrides = {"num_layers": args.num_layers} if args.num_layers is not None else {}
        model = found.run(lambda: build(args.model_recipe_name, device="meta", **overrides), field="model_recipe_name")
        if model is not None:
            facts["num_layers"] = model.config.num_layers
    elif args.num_layers is not None:
        facts["num_layers"] = args.num_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        config = found.run(resolve_config, args, facts)  # without a model's facts, as with no -mr
        if isinstance(config, Plan):
            found.add(plan_file_flag_problems({}, model is not None))
        found.raise_if_any()
        plan = apply(model, config) if model is not None else None
    _print_warnings(caught)
    if isinstance(config, RecomputeConfig):
        _console.print(config.describe())
    if plan is not None:
        _console.print(f"\n[bold]per-layer plan on {args.model_recipe_name}[/]")
        _console.print(plan.describe())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from remat.apply import apply, offloader_of
    from remat.config import execution_problems, format_bytes, micro_batch_problems, tolerance_problems
    from remat.models import build
    from remat.verify import verify

    overrides = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "seq_length",
                                                "attention_backend", "attention_dropout",
                                                "hidden_dropout") if getattr(args, k) is not None}
    found = _Problems()
    found.add([*device_problems(args.device), *micro_batch_problems(args.micro_batch_size),
               *execution_problems(_flag_facts(args)), *tolerance_problems(args.tolerance)])
    shape = found.run(lambda: build(args.model_recipe_name, device="meta", **overrides), field="model_recipe_name")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        config = None
        if shape is not None:  # the config is checked against the model before anything is allocated
            config = found.run(resolve_config, args, {"num_layers": shape.config.num_layers,
                                                      "attention_dropout": shape.config.attention_dropout,
                                                      "hidden_dropout": shape.config.hidden_dropout})
            if config is not None:
                found.run(apply, shape, config)
        found.raise_if_any()
        assert config is not None  # None only after a problem found above
        torch.use_deterministic_algorithms(args.device == "cpu")
        torch.manual_seed(args.seed)
        model = build(args.model_recipe_name, dtype=getattr(torch, args.dtype), device=args.device, **overrides)
        seq = model.config.seq_length
        ids = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, seq + 1), device=args.device)
        report = verify(model, config, ids[:, :-1], ids[:, 1:], seed=args.seed)
    _print_warnings(caught)
    _console.print(report.plan.describe())
    _console.print(_verify_table(report, args))
    offloader = offloader_of(model)
    if offloader is not None:
        stats = offloader.stats()
        _console.print(f"offloaded to host: {format_bytes(stats.offloaded_bytes)} a step"
                       f" (peak host {format_bytes(stats.peak_host_bytes)})")
    ok = report.bit_identical or report.max_grad_diff <= args.tolerance
    _console.print("[green]gradients match[/]" if ok else "[red]gradients differ[/]")
    return 0 if ok else 1


def _verify_table(report: Any, args: argparse.Namespace) -> Any:
    from rich.table import Table

    from remat.bench.report import format_gib

    table = Table(title=f"{args.model_recipe_name}, micro-batch {args.micro_batch_size}, "
                        f"{args.dtype} on {args.device}")
    for column in ("run", "loss", "saved for backward", "storages"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for name, step in (("no recompute", report.baseline), ("with config", report.candidate)):
        table.add_row(name, f"{step.loss.item():.6f}", format_gib(step.saved.bytes), str(step.saved.storages))
    table.caption = (f"freed {format_gib(report.freed_bytes)}; bit-identical: {report.bit_identical}; "
                     f"max |grad diff| {report.max_grad_diff:.3g}")
    return table


def _add_model_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Model and batch flags of Megatron Bridge's performance scripts."""
    g = p.add_argument_group("model and run (Megatron Bridge names)")
    g.add_argument("-m", "--model_family_name", default="llama", choices=["llama"])
    g.add_argument("-mr", "--model_recipe_name", default="llama3_tiny", metavar="RECIPE",
                   help="see `remat recipes` (default llama3_tiny, which runs on CPU)")
    g.add_argument("-ng", "--num_gpus", type=int, default=1)
    g.add_argument("-sl", "--seq_length", type=int, metavar="N")
    g.add_argument("-mb", "--micro_batch_size", type=int, default=1, metavar="N")
    g.add_argument("-gb", "--global_batch_size", type=int, metavar="N")
    g.add_argument("--num_layers", type=int, metavar="N")
    g.add_argument("--hidden_size", type=int, metavar="N")
    g.add_argument("--no_gradient_accumulation_fusion", action="store_true",
                   help="let autograd add each weight gradient into .grad with its own kernel instead of the "
                        "weight-gradient GEMM (Megatron's --no-gradient-accumulation-fusion)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model's regions between Sites (QKV split+RoPE, SwiGLU, loss softmax); "
                        "on CUDA, SwiGLU+linear_fc2, the QKV split with RoPE, RMSNorm and the loss chunk run "
                        "remat's Triton kernels")
    g.add_argument("--no_optimizer", action="store_true",
                   help="forward+backward only, gradients accumulating, as the torch anchor measures")
    return g


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """Model, batch and run flags of Megatron Bridge's performance scripts."""
    g = _add_model_flags(p)
    g.add_argument("--task", default="pretrain", help="pretrain or sft (labels of the first quarter masked)")
    g.add_argument("-g", "--gpu", help="GPU label, checked against the device (h100, h200, b200, ...)")
    g.add_argument("-c", "--compute_dtype", default="bf16", help="bf16 (fp8 variants not supported yet)")
    g.add_argument("-ms", "--max_steps", type=int, default=BenchSettings.max_steps, metavar="N")
    g.add_argument("--warmup_steps", type=int, default=BenchSettings.warmup_steps, metavar="N")
    g.add_argument("--device", help="cuda or cpu (default: cuda when there is a GPU)")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    g.add_argument("--history", metavar="DB", help="SQLite run history (default $REMAT_HISTORY or "
                                                   "~/.cache/remat/history.sqlite)")
    g.add_argument("--no_history", action="store_true", help="do not record the run")


class _Problems:
    """Problems from independent checking stages, reported together rather than first-found."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def run(self, fn: Any, *fn_args: Any, field: str = "", prefix: str = "") -> Any:
        """fn(*fn_args), or None after recording why it failed."""
        try:
            return fn(*fn_args)
        except ConfigError as e:
            self.problems += [Problem(prefix + p.field, p.message) for p in e.problems]
        except ValueError as e:  # an unknown recipe or shape override
            self.problems.append(Problem(prefix + field, str(e)))
        return None

    def add(self, problems: Any) -> None:
        self.problems += list(problems)

    def raise_if_any(self) -> None:
        if self.problems:
            raise ConfigError(list(dict.fromkeys(self.problems)))


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "seq_length")
                 if getattr(args, k) is not None}
    if args.no_gradient_accumulation_fusion:
        overrides["gradient_accumulation_fusion"] = False
    return overrides


def _spec(args: argparse.Namespace) -> Any:
    from remat.bench import BenchSpec

    device = args.device or ("cuda" if _cuda_available() else "cpu")
    return BenchSpec(recipe=args.model_recipe_name, overrides=_overrides(args),
                     micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                     max_steps=args.max_steps, warmup_steps=args.warmup_steps, task=args.task,
                     compute_dtype=args.compute_dtype, device=device, compile=args.compile,
                     gpu=args.gpu, num_gpus=args.num_gpus, optimizer=not args.no_optimizer,
                     command=args.command_line, dryrun=getattr(args, "dryrun", False))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_facts(args: argparse.Namespace) -> dict[str, Any]:
    """The Megatron keys a recipe's model fixes for the recompute rules."""
    from remat.models import recipe_config

    cfg = recipe_config(args.model_recipe_name, **_overrides(args))
    return {"num_layers": cfg.num_layers, "attention_dropout": cfg.attention_dropout,
            "hidden_dropout": cfg.hidden_dropout}


def _meta_model(args: argparse.Namespace) -> Any:
    from remat.models import build

    return build(args.model_recipe_name, device="meta", **_overrides(args))


def _flag_facts(args: argparse.Namespace) -> Any:
    from remat.config import TrainingFacts

    scope = args.cuda_graph_scope.split(",") if args.cuda_graph_scope else []
    return TrainingFacts(
        tensor_model_parallel_size=args.tensor_model_parallel_size or 1,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size or 1,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size or 1, sequence_parallel=bool(args.sequence_parallel),
        cuda_graph_impl=args.cuda_graph_impl or "none", cuda_graph_scope=scope)


def _print_warnings(caught: Sequence[warnings.WarningMessage], printed: Sequence[warnings.WarningMessage] = ()) -> None:
    """Each warning once, leaving out those `printed` already."""
    already = {str(w.message) for w in printed}
    for message in dict.fromkeys(str(w.message) for w in caught if str(w.message) not in already):
        _errors.print(f"[yellow]warning:[/] {message}")


def _record(results: Sequence[Any], args: argparse.Namespace) -> None:
    from remat.bench.history import append

    if not args.no_history:
        for result in results:
            append(result, args.history)


# (flag, attribute) of the files bench and sweep write once they have run, besides the history
_OUTPUTS = (("--json", "json"), ("--save-golden", "save_golden"), ("--plot", "plot"))
_DEFAULT_PLOT = "pareto.png"


def _output_problems(args: argparse.Namespace, default_plot: str | None = None) -> list[Problem]:
    """The files a bench or sweep writes once it has run, checked before it runs; beside -d, which
    writes none, the output flags given are refused."""
    from remat.bench.history import default_history_path
    from remat.config import dryrun_output_problems, history_file_problems, history_flag_problems, png_path_problems

    given = {flag: getattr(args, name, None) for flag, name in _OUTPUTS}
    given = {flag: path for flag, path in given.items() if path is not None}
    if args.dryrun:
        return list(dryrun_output_problems([*given, *(["--history"] if args.history else [])]))
    if conflict := list(history_flag_problems(args.history, args.no_history)):
        return conflict
    history = None if args.no_history else args.history or default_history_path()
    return [*_path_problems({"--plot": default_plot, **given, "--history": history}),
            *(history_file_problems(history) if history else ()), *png_path_problems("--plot", given.get("--plot"))]


def _path_problems(written: dict[str, str | Path | None]) -> list[Problem]:
    """Each file a command will write (flag -> path, None: not written), checked before it runs."""
    from remat.config import output_path_problems

    return [p for flag, path in written.items() if path is not None for p in output_path_problems(flag, path)]


def _write_json(data: Any, path: str) -> None:
    """--json output; like every file the commands write, its missing folders are created."""
    import json

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))


def _advise_offload(spec: Any, plans: Sequence[tuple[str, Any]]) -> None:
    """Warn where a run offloads on a device where offload saves nothing."""
    from remat.config import advise, offload_device_advice

    if spec is not None:
        offloading = [name for name, plan in plans if plan is not None and plan.offloads()]
        advise(offload_device_advice(spec.device, offloading))


def _check_bench(args: argparse.Namespace, more: Iterable[Problem] = ()) -> tuple[Any, Any, Any, Any]:
    """Every problem of a bench command line, from every stage (and `more`), before anything runs."""
    from remat.apply import apply
    from remat.bench.golden import load_golden, run_differences
    from remat.bench.run import plan_name, run_shape
    from remat.config import bench_config_problems, execution_problems, golden_flag_problems, golden_match_problems
    from remat.models import recipe_config

    found = _Problems()
    spec = found.run(_spec, args, field="model_recipe_name")
    facts = found.run(_model_facts, args, field="model_recipe_name")
    found.add(execution_problems(_flag_facts(args)))
    found.add(golden_flag_problems(args.threshold, args.golden is not None))
    resolved = None
    # without the model's facts (a bad shape) the rules that need none still run
    plan = found.run(resolve_config, args, facts or {})
    if isinstance(plan, RecomputeConfig):
        found.add(bench_config_problems(plan))
    if facts is not None and (plan is not None or not found.problems):
        resolved = found.run(apply, _meta_model(args), plan)
    golden = found.run(load_golden, args.golden, field="golden") if args.golden else None
    if golden is not None and spec is not None:
        shape = run_shape(spec, recipe_config(spec.recipe, **spec.overrides))
        found.add(golden_match_problems(run_differences(golden, spec.recipe, shape)))
    found.add(more)
    found.raise_if_any()
    _advise_offload(spec, [(plan_name(plan), plan)])
    return spec, plan, resolved, golden


def _cmd_bench(args: argparse.Namespace) -> int:
    from remat.bench import plan_name, run_bench
    from remat.bench.golden import compare, golden_failed, mismatch_notes, save_golden, uncompared
    from remat.bench.report import checks_table, memory_table, results_table
    from remat.bench.run import progress_bar

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        spec, plan, resolved, golden = _check_bench(args, _output_problems(args))
    _print_warnings(caught)
    if args.dryrun:
        _console.print(f"[bold]{spec.recipe}[/] on {spec.device}: micro-batch {spec.micro_batch_size}, "
                       f"{spec.micro_batches} micro-batches a step, {spec.max_steps} steps "
                       f"({spec.warmup_steps} warm-up), {spec.compute_dtype}")
        if isinstance(plan, RecomputeConfig):
            _console.print(plan.describe())
        _console.print(resolved.describe())
        return 0
    with warnings.catch_warnings(record=True) as during, progress_bar(not args.no_progress) as bar:
        warnings.simplefilter("always", RematWarning)
        result = run_bench(spec, plan, name=plan_name(plan), progress=bar)
    _print_warnings(during, printed=caught)
    _console.print(results_table([result], title=f"remat bench: {spec.recipe}"))
    if result.memory is not None:
        _console.print(memory_table(result))
    if args.json:
        _write_json(result.to_dict(), args.json)
    _record([result], args)
    if args.save_golden:
        save_golden(result, args.save_golden)
    if golden is None:
        return 0 if result.status == "ok" else 1
    for note in [*mismatch_notes(result, golden), *uncompared(result, golden)]:
        _errors.print(f"[yellow]note:[/] {note}")
    checks = compare(result, golden, DEFAULT_THRESHOLD if args.threshold is None else args.threshold)
    _console.print(checks_table(checks))
    return 1 if golden_failed(checks) else 0


def _check_sweep(args: argparse.Namespace) -> tuple[Any, list[tuple[str, Any]]]:
    """Every problem of a sweep, each entry checked against the model, before anything runs."""
    from remat.config import bench_config_problems

    found = _Problems()
    spec = found.run(_spec, args, field="model_recipe_name")
    facts = found.run(_model_facts, args, field="model_recipe_name")
    plans: list[tuple[str, Any]] = []
    if facts is not None:
        plans = _entries(found, _meta_model(args), args.configs, facts, bench_config_problems)
    found.add(_output_problems(args, _DEFAULT_PLOT))
    found.raise_if_any()
    _advise_offload(spec, plans)
    return spec, plans


def _entries(found: _Problems, model: Any, entries: Sequence[str] | None, keys: dict[str, Any],
             execution: Any = None, stage_layers: int | None = None) -> list[tuple[str, Any]]:
    """Sweep entries (None, or the entry "presets" among them: Megatron's presets, full block over
    half of the `stage_layers` of a (virtual) pipeline stage) parsed and checked against the model;
    `execution` lists what a config asks that the runner would not run as asked."""
    from remat.apply import apply, find_sites
    from remat.bench.presets import megatron_presets, parse_entry, run_key

    layout = find_sites(model).layout
    presets = megatron_presets(frozenset().union(*layout.labels), stage_layers or layout.num_layers)
    expanded = [name for entry in entries or ["presets"] for name in (presets if entry == "presets" else [entry])]
    plans, runs = [], set()
    for entry in dict.fromkeys(expanded):  # an entry given twice runs once
        parsed = found.run(parse_entry, entry, keys, field=entry)  # its problems name the entry
        if parsed is None or (run := run_key(parsed[1])) in runs:  # core_attn+mlp after mlp+core_attn
            continue
        if run is not None:
            runs.add(run)
        if execution is not None and isinstance(parsed[1], RecomputeConfig):
            found.add(Problem(f"{entry}: {p.field}", p.message) for p in execution(parsed[1]))
        if found.run(apply, model, parsed[1], prefix=f"{entry}: ") is not None:
            plans.append(parsed)
    return plans


def _cmd_sweep(args: argparse.Namespace) -> int:
    from remat.bench import sweep
    from remat.bench.plot import pareto_plot
    from remat.bench.report import results_table

    with warnings.catch_warnings(record=True) as checked:
        warnings.simplefilter("always", RematWarning)
        spec, plans = _check_sweep(args)
    _print_warnings(checked)  # before the runs, which may take hours
    if args.dryrun:
        for name, _ in plans:
            _console.print(name)
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        results = sweep(spec, plans, progress=not args.no_progress)
    _print_warnings(caught, printed=checked)
    _console.print(results_table(results, title=f"remat sweep: {spec.recipe}"))
    if args.json:
        _write_json([r.to_dict() for r in results], args.json)
    _record(results, args)
    path = pareto_plot(results, args.plot or _DEFAULT_PLOT,
                       title=f"{spec.recipe} on {results[0].gpu}: memory vs throughput")
    _console.print(f"Pareto plot: {path}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from remat.bench.run import build_model, progress_bar, run_bench, trace_spec
    from remat.config import (MIN_OFFLOADED_TENSOR_SIZE, advise, offload_device_advice, offload_threshold_problems,
                              plan_output_problems, plan_run_flag_problems, plan_search_problems,
                              planning_problems)
    from remat.planning import plan_from_trace, weight_bytes

    found = _Problems()
    spec = found.run(_spec, args, field="model_recipe_name")
    budget = found.run(parse_bytes, args.memory_budget)
    host_budget = (found.run(parse_bytes, args.host_memory_budget, "host_memory_budget")
                   if args.host_memory_budget is not None else None)
    found.add(planning_problems(args.offload, host_budget, spec.device if spec is not None else None))
    found.add(_path_problems({"--output": args.output, "--json": args.json}))
    found.add(plan_output_problems("--output", args.output))
    found.add(offload_threshold_problems(args.offload, args.min_offloaded_tensor_size))
    found.add(plan_run_flag_problems(args.verify, [flag for flag, given in (
        ("--max_steps", args.max_steps != BenchSettings.max_steps),
        ("--warmup_steps", args.warmup_steps != BenchSettings.warmup_steps),
        ("--history", args.history is not None)) if given]))
    found.raise_if_any()
    model = build_model(spec)  # the weights are checked against the budget before minutes of tracing
    found.add(plan_search_problems(budget, weight_bytes(model, spec.device.split(":")[0]), args.max_group))
    found.raise_if_any()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        advise(offload_device_advice(spec.device, ["--offload"] if args.offload else []))
    _print_warnings(caught)
    with progress_bar(not args.no_progress) as bar:
        task = bar.add_task("trace", total=None, loss="") if bar is not None else None
        model, measured = trace_spec(
            spec, model, offload=args.offload,
            min_offloaded_tensor_size=(MIN_OFFLOADED_TENSOR_SIZE if args.min_offloaded_tensor_size is None
                                       else args.min_offloaded_tensor_size),
            progress=lambda what: bar.update(task, loss=what) if bar is not None and task is not None else None)
    measured = dataclasses.replace(measured, max_group=args.max_group)
    _console.print(_storage_table(measured))
    _console.print(_trace_table(measured))
    result = plan_from_trace(measured, budget, host_budget)
    _console.print(_plan_table(result))
    keys = result.megatron_keys()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    if keys is not None:
        _write_mapping(keys, args.output)
        _console.print(f"a Megatron config expresses this plan: {keys or 'no recompute'}")
    else:
        result.plan.save(args.output)
    _console.print(f"written to {args.output}; run it with `remat bench --config {args.output}`")
    record: dict[str, Any] = {"budget_bytes": budget, "plan": result.plan.to_dict(), "megatron": keys,
                              "explain": [dict(layers=layers, action=what, freed_bytes=freed, added_s=seconds)
                                          for layers, what, freed, seconds in result.explain()],
                              "predicted": dataclasses.asdict(result.prediction)}
    if args.verify:
        with progress_bar(not args.no_progress) as bar:
            bench = run_bench(spec, result.config or result.plan, model=model, name="plan", progress=bar)
        _console.print(_verify_plan_table(result, bench, spec))
        record["measured"] = bench.to_dict()
        _record([bench], args)
    if args.json:
        _write_json(record, args.json)
    return 0


def _check_estimate(args: argparse.Namespace) -> tuple[Any, list[tuple[str, Any]]]:
    """The spec and the configs of an estimate command line, every problem reported together."""
    from remat.apply import apply
    from remat.bench import plan_name
    from remat.config import batch_split_problems, configs_flag_problems
    from remat.estimating import EstimateSpec

    found = _Problems()
    keys = found.run(_model_facts, args, field="model_recipe_name")
    flags = found.run(resolve_config, args, keys) if keys is not None else None
    found.raise_if_any()
    facts = flags.facts if isinstance(flags, RecomputeConfig) else _flag_facts(args)
    model = _meta_model(args)
    plans: list[tuple[str, Any]] = []
    if args.configs:
        found.add(configs_flag_problems(flags if isinstance(flags, RecomputeConfig) else None))
        parallel = {k: v for k, v in dataclasses.asdict(facts).items()
                    if k.endswith("_size") or k == "sequence_parallel"}
        stage_layers = dataclasses.replace(facts, num_layers=keys["num_layers"]).layers_per_virtual_stage
        plans = _entries(found, model, args.configs, {**keys, **parallel}, stage_layers=stage_layers)
    elif found.run(apply, model, flags) is not None:
        plans.append((plan_name(flags), flags))
    found.add(batch_split_problems(facts, args.num_gpus, args.micro_batch_size, args.global_batch_size))
    found.add(_path_problems({"--json": args.json}))
    workspace = (found.run(parse_bytes, args.cublas_workspace, "cublas_workspace", "b", True)
                 if args.cublas_workspace is not None else None)
    found.raise_if_any()
    data_parallel = args.num_gpus // (facts.tensor_model_parallel_size * facts.pipeline_model_parallel_size
                                      * facts.context_parallel_size)
    micro_batches = (args.global_batch_size // (args.micro_batch_size * data_parallel)
                     if args.global_batch_size else facts.pipeline_model_parallel_size)
    spec = found.run(lambda: EstimateSpec(
        args.model_recipe_name, _overrides(args), facts, args.micro_batch_size, micro_batches,
        optimizer=not args.no_optimizer, target=args.target, compile=args.compile, tflops=args.tflops,
        host_gbps=args.host_gbps, cublas_workspace=workspace))
    found.raise_if_any()
    return spec, plans


def _cmd_estimate(args: argparse.Namespace) -> int:
    from remat.bench.run import progress_bar
    from remat.estimating import estimate

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        spec, plans = _check_estimate(args)
        with progress_bar(not args.no_progress) as bar:
            task = bar.add_task("trace on meta", total=None, loss="") if bar is not None else None
            results = estimate(spec, plans, progress=(
                lambda what: bar.update(task, loss=what) if bar is not None and task is not None else None))
    _print_warnings(caught)
    _console.print(_estimate_table(spec, results))
    if args.json:
        _write_json([r.to_dict() for r in results], args.json)
    return 0


def _milliseconds(seconds: float) -> str:
    """A step time in ms: three significant digits (whole ms from 100), never in exponent form."""
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms" if ms >= 0.001 else "< 0.001 ms"


def _estimate_table(spec: Any, results: Sequence[Any]) -> Any:
    from rich.table import Table

    from remat.bench.report import format_gib

    f = spec.facts
    sp = f.sequence_parallel and f.tensor_model_parallel_size > 1
    title = (f"{spec.recipe}: tp {f.tensor_model_parallel_size}{' (sp)' if sp else ''}, "
             f"pp {f.pipeline_model_parallel_size}, vpp {f.virtual_pipeline_model_parallel_size or 1}, "
             f"cp {f.context_parallel_size}, micro-batch {spec.micro_batch_size} x {spec.micro_batches}")
    table = Table(title=f"estimated peak memory per GPU, {title}")
    host = any(s.host for result in results for s in result.stages)
    columns = ("config", "stage", "layers", "in flight", "weights", "grads", "optimizer", "activations",
               "workspaces", "other", "peak", "peak in", *(["host"] if host else []), "step")
    for column in columns:
        table.add_column(column, justify="left" if column in ("config", "peak in") else "right")
    for result in results:
        for s in result.stages:
            first = s.stage == 0
            table.add_row(result.name if first else "", str(s.stage), str(s.layers), f"{s.in_flight:g}",
                          *(format_gib(b) for b in (s.weights, s.grads, s.optimizer_state, s.activations,
                                                    s.workspaces, s.other, s.peak)),
                          s.peak_window, *([format_gib(s.host)] if host else []),
                          _milliseconds(result.step_time_s) if first else "")
    copies = (f"; host: offloaded, copies at {spec.host_gbps:g} GB/s each way, hidden behind the next layer's "
              f"forward and backward where they fit" if host else "")
    table.caption = (f"activations: saved for backward by the micro-batches in flight (1F1B); workspaces: "
                     f"cuBLAS's, one per GEMM thread (forward, autograd's backward); other: the "
                     f"peak window's working memory; step: counted FLOPs at {spec.tflops:g} TFLOP/s, "
                     f"{spec.target} kernels{', compiled regions' if spec.compile else ''}{copies}")
    return table


def _write_mapping(keys: dict[str, Any], path: str) -> None:
    import json

    import yaml

    with open(path, "w") as f:
        f.write(json.dumps(keys, indent=1) if path.endswith(".json") else yaml.safe_dump(keys, sort_keys=False))


def _trace_table(measured: Any) -> Any:
    from rich.table import Table

    from remat.bench.report import format_gib
    from remat.memory.trace import describe

    table = Table(title="what each action saves and costs, per layer")
    for column in ("action", "frees", "adds"):
        table.add_column(column, justify="left" if column == "action" else "right")
    for what, freed, ms in describe(measured):
        table.add_row(what, format_gib(freed), f"{ms:.2f} ms")
    table.caption = f"no-recompute step: {measured.base_step_time_s * 1e3:.1f} ms"
    return table


def _storage_table(measured: Any) -> Any:
    from rich.table import Table

    from remat.bench.report import format_gib
    from remat.memory.attribution import owner_name
    from remat.memory.trace import describe_sites

    table = Table(title="what each site saves for backward (no recompute)")
    for column in ("site", "saves", "its inputs", "saved by other sites too", "recomputed alone frees"):
        table.add_column(column, justify="left" if column == "site" else "right")
    for site, s, frees in describe_sites(measured):
        others = ", ".join(sorted(owner_name(owner) for owner in s.shared_with))
        table.add_row(site, format_gib(s.saved_bytes), format_gib(s.input_bytes),
                      f"{format_gib(s.shared_bytes)} ({others})" if others else "-",
                      "-" if frees is None else format_gib(frees))
    table.caption = ("recomputing a site keeps its inputs and what other sites save: it frees what it saves "
                     "less those, unless something else holds them (a discard-only site, such as mlp_act:"
                     " what discarding it frees)")
    return table


def _plan_table(result: Any) -> Any:
    from rich.table import Table

    from remat.bench.report import format_gib

    table = Table(title=f"fastest plan under {format_gib(result.budget_bytes)}")
    for column in ("layers", "action", "frees / layer", "adds / layer"):
        table.add_column(column, justify="right" if column.startswith(("frees", "adds")) else "left")
    rows = list(result.explain())
    for layers, what, freed, seconds in rows:
        table.add_row(layers, what, format_gib(freed), f"{seconds * 1e3:.2f} ms")
    if not rows:
        table.add_row("all", "keep (no recompute)", format_gib(0), "0.00 ms")
    p = result.prediction
    host = f", {format_gib(p.host_bytes)} offloaded to host" if p.host_bytes else ""
    table.caption = (f"predicted peak {format_gib(p.peak_bytes)} (in {p.peak_window}){host}, "
                     f"step {p.step_time_s * 1e3:.1f} ms; every layer not listed keeps everything")
    return table


def _verify_plan_table(result: Any, bench: Any, spec: Any) -> Any:
    from rich.table import Table

    from remat.bench.report import format_gib

    table = Table(title="predicted vs measured")
    for column in ("", "predicted", "measured", "error"):
        table.add_column(column, justify="right" if column else "left")
    if bench.status != "ok":
        table.add_row("peak allocated", format_gib(result.prediction.peak_bytes), "OOM", "")
        return table
    rows: list[tuple[str, Any, Any, Callable[[float], str]]]  # name, predicted, measured, format
    rows = [("peak allocated", result.prediction.peak_bytes, bench.peak_allocated_bytes, format_gib)]
    if result.prediction.host_bytes and bench.peak_host_bytes:
        rows.append(("host (offloaded)", result.prediction.host_bytes, bench.peak_host_bytes, format_gib))
    if spec.micro_batches == 1:
        rows.append(("step time", result.prediction.step_time_s, bench.step_time_s,
                     lambda s: f"{s * 1e3:.1f} ms"))
    for name, predicted, measured, fmt in rows:
        table.add_row(name, fmt(predicted), fmt(measured), f"{(predicted - measured) / measured:+.1%}")
    return table


def _cmd_doctor(args: argparse.Namespace) -> int:
    from remat import doctor
    from remat.config import doctor_flag_problems, doctor_run_problems
    from remat.bench import plan_name, run_bench
    from remat.bench.report import format_gib
    from remat.bench.run import build_model, progress_bar

    flags = doctor_flag_problems(results=bool(args.results), state=bool(args.snapshot or args.oom_message),
                                 oom_message=bool(args.oom_message), timeline=bool(args.timeline),
                                 request=args.request is not None, limit=args.limit is not None)
    if args.results:
        found = _Problems()
        found.add(flags)
        results = found.run(doctor.load_results, args.results, field="results")
        found.raise_if_any()
        findings = doctor.check_results(results)
        _console.print(_findings_table(findings, args.results))
        return 1 if findings else 0
    if args.snapshot or args.oom_message:
        return _doctor_state(args, flags)
    if args.timeline:
        return _doctor_timeline(args, flags)
    # the one mode that needs a GPU: it runs the bench
    spec, plan, _, _ = _check_bench(args, [*flags, *doctor_run_problems(_cuda_available())])
    run_flags = shlex.join(a for a in shlex.split(args.command_line)[2:] if a != "--no_progress")
    model = build_model(spec)
    doc = doctor.Doctor(spec.device, on_oom=None, micro_batch_size=spec.micro_batch_size, run_flags=run_flags,
                        model=model)
    with progress_bar(not args.no_progress) as bar, doc:
        result = run_bench(spec, plan, model=model, name=plan_name(plan), progress=bar, on_oom=doc.observe)
    if doc.report is None:
        _console.print(f"no OOM: {result.name} ran, peak allocated {format_gib(result.peak_allocated_bytes)}")
        return 0
    _print_report(doc.report)
    return 1


def _doctor_timeline(args: argparse.Namespace, flag_problems: list[Problem]) -> int:
    """One training step of the recipe under the config, memory after every op, as a PNG."""
    from remat.bench.plot import timeline_plot
    from remat.bench.report import format_gib
    from remat.bench.run import MockData, build_model, make_optimizer
    from remat.config import png_path_problems
    from remat.memory.trace import timeline

    spec, plan, _, _ = _check_bench(args, [*flag_problems, *_path_problems({"--timeline": args.timeline}),
                                           *png_path_problems("--timeline", args.timeline)])
    model = build_model(spec)
    model.train()
    batch = MockData(spec, model.config.vocab_size, model.config.seq_length).batch()
    recorded = timeline(model, batch, optimizer=make_optimizer(model, spec), plan=plan,
                        micro_batches=spec.micro_batches, per_op=not spec.compile)
    path = timeline_plot(recorded, args.timeline, title=f"{spec.recipe} on {spec.device}: one step, "
                                                         f"{spec.micro_batch_size} x {model.config.seq_length} tokens")
    window, peak = max(recorded.peaks.items(), key=lambda item: item[1])
    _console.print(f"memory timeline of one step: {path} (peak allocated {format_gib(peak)} in {window})")
    return 0


def _doctor_state(args: argparse.Namespace, flag_problems: list[Problem]) -> int:
    from remat import doctor
    from remat.config import snapshot_limit_problems

    found = _Problems()
    found.add(flag_problems)
    request = found.run(parse_bytes, args.request, "request", "b") if args.request is not None else None
    if args.oom_message:
        state = found.run(doctor.AllocatorState.from_oom_message, args.oom_message, field="oom_message")
        if state is not None and request is not None:
            state = dataclasses.replace(state, request=request)
    else:
        limit = found.run(parse_bytes, args.limit, "limit", "b") if args.limit is not None else None
        snapshot = found.run(doctor.load_snapshot, args.snapshot, field="snapshot")
        found.raise_if_any()
        assert limit is not None  # doctor_flag_problems refuses a snapshot without --limit
        state = doctor.AllocatorState.from_snapshot(snapshot, {}, limit, request)
        found.add(snapshot_limit_problems(state.reserved, limit))
    found.raise_if_any()
    diagnosis = doctor.classify(state)
    _print_report(doctor.Report(diagnosis, doctor.recommend(diagnosis, micro_batch_size=args.micro_batch_size)))
    return 0


def _print_report(report: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    from remat import doctor
    from remat.bench.report import format_gib

    d = report.diagnosis
    table = Table(title=f"remat doctor: {d.kind}")
    table.add_column("")
    table.add_column("bytes", justify="right")
    for name, value in d.evidence().items():
        table.add_row(name, format_gib(value))
    table.caption = escape(d.explanation)
    _console.print(table)
    for i, r in enumerate(report.recommendations, 1):
        _console.print(f"{i}. {escape(r.what)}:\n   [bold]{escape(r.setting)}[/]\n   {escape(r.why)}")
    rows = doctor.attribution_rows(report)
    if rows:
        held = Table(title="who held the allocated memory")
        held.add_column("")
        held.add_column("bytes", justify="right")
        for what, nbytes in rows:
            held.add_row(what, format_gib(nbytes))
        _console.print(held)


def _findings_table(findings: Sequence[Any], path: str) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"remat doctor: {len(findings)} finding{'s' if len(findings) != 1 else ''} in {path}")
    for column in ("check", "symptom", "cause", "confirmed by", "fix"):
        table.add_column(column)
    for f in findings:
        table.add_row(*(escape(text) for text in (f.check, f.symptom, f.cause, f.confirmed_by, f.fix)))
    table.caption = "checks: the activation-recompute skill's failure-diagnosis table"
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat", description="Activation recompute for PyTorch transformer training.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("validate", help="check a recompute config and print it resolved",
                       description="Check a recompute config (flags and/or --config FILE) against "
                                   "every rule, and against a recipe's model when -mr is given.")
    p.add_argument("-mr", "--model_recipe_name", metavar="RECIPE",
                   help="check the config against this recipe's model (see `remat recipes`)")
    p.add_argument("--num_layers", type=int, metavar="N")
    _add_recompute_flags(p)
    p.set_defaults(func=_cmd_validate)
    p = sub.add_parser("verify", help="run one step without and with a config; compare gradients",
                       description="Run one training step of a recipe without recompute and with "
                                   "the given config; compare loss and every gradient, and count "
                                   "the bytes each leaves saved for backward.")
    p.add_argument("-mr", "--model_recipe_name", metavar="RECIPE", default="llama3_tiny",
                   help="the recipe (default llama3_tiny; `remat recipes` lists them)")
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
    _add_recompute_flags(p)
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("bench", help="train a recipe under a recompute config and measure it",
                       description="Run real training steps (forward, backward, AdamW) of a recipe "
                                   "under a recompute config on mock data; report step time, TFLOP/s "
                                   "per GPU, tokens/s, peak memory and its breakdown, loss per step.")
    _add_run_flags(p)
    _add_recompute_flags(p)
    p.add_argument("-d", "--dryrun", action="store_true", help="build, validate and print; run nothing")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--golden", metavar="FILE",
                   help="compare with a stored result; exit 1 on a difference beyond --threshold. A golden of "
                        "another recipe or shape is refused before running; another GPU name or recompute "
                        "config is a note, and so is a metric only one side has")
    p.add_argument("--save-golden", dest="save_golden", metavar="FILE", help="store this result as golden")
    p.add_argument("--threshold", type=float,
                   help=f"with --golden: relative difference that fails the comparison, both ways (default "
                        f"{DEFAULT_THRESHOLD})")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("sweep", help="bench many recompute configs in one process; table and Pareto plot",
                       description="Bench many configs on one model in one process. Entries: none, "
                                   "a label list (mlp+core_attn), full_uniform_K, full_block_K, a "
                                   "YAML/JSON config or plan file, or `presets` for Megatron's usual ones "
                                   "(the default).")
    _add_run_flags(p)
    p.add_argument("--configs", nargs="+", metavar="ENTRY")
    p.add_argument("--plot", metavar="PNG", help=f"where to write the Pareto plot (default {_DEFAULT_PLOT})")
    p.add_argument("--json", metavar="PATH", help="write all results as a JSON list")
    p.add_argument("-d", "--dryrun", action="store_true", help="list the entries; run nothing")
    p.set_defaults(func=_cmd_sweep)
    p = sub.add_parser("plan", help="choose the fastest recompute plan that fits a memory budget",
                       description="Trace one training step per action on the recipe (what each site "
                                   "saves and what recomputing it costs), then solve for the fastest "
                                   "per-layer plan whose predicted peak allocated memory fits the budget. "
                                   "Writes a Megatron config when one expresses the plan, else a plan file.")
    _add_run_flags(p)
    p.add_argument("--memory-budget", "--memory_budget", dest="memory_budget", required=True, metavar="SIZE",
                   help="peak allocated memory to fit, like 60GiB, 80GB or 512MiB (a bare number is GiB)")
    p.add_argument("-o", "--output", default="remat_plan.yaml", metavar="FILE",
                   help="where to write the plan (.yaml or .json; default remat_plan.yaml)")
    p.add_argument("--offload", action="store_true",
                   help="consider offloading activations to host memory too (pinned; the trace takes about "
                        "twice as long)")
    p.add_argument("--host-memory-budget", "--host_memory_budget", dest="host_memory_budget", metavar="SIZE",
                   help="with --offload: the most host memory offload may hold, like 200GiB")
    p.add_argument("--min_offloaded_tensor_size", type=int, metavar="N",
                   help=f"with --offload: tensors of fewer elements stay on the GPU (default "
                        f"{MIN_OFFLOADED_TENSOR_SIZE})")
    p.add_argument("--max_group", type=int, default=16, metavar="N",
                   help="longest run of layers recomputed as one unit that the planner considers")
    p.add_argument("--verify", action="store_true",
                   help="bench the chosen plan and print predicted against measured")
    p.add_argument("--json", metavar="PATH", help="write the plan, prediction (and measurement) as JSON")
    p.set_defaults(func=_cmd_plan)
    p = sub.add_parser("estimate", help="predict peak memory per GPU and pipeline stage from shapes alone",
                       description="Trace one training step per action of one rank's shard of the recipe "
                                   "on the meta device (shapes only: no GPU; seconds to a minute on a CPU), with the "
                                   "tensor, sequence, context and pipeline parallel sizes given, then "
                                   "predict each config's peak allocated memory per pipeline stage, by "
                                   "component, and its step time.")
    _add_model_flags(p)
    _add_recompute_flags(p)
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
    p.add_argument("--json", metavar="PATH", help="write the estimates as JSON")
    p.set_defaults(func=_cmd_estimate)
    p = sub.add_parser("doctor", help="diagnose an OOM (fragmentation or capacity) or a bench/sweep's results",
                       description="--results: the activation-recompute skill's failure checks on `remat bench "
                                   "--json` / `remat sweep --json` output (exit 1 on a finding). --snapshot / "
                                   "--oom_message: classify an OOM as fragmentation or capacity and say what to "
                                   "change. Otherwise (CUDA only): run the bench with the run flags and diagnose "
                                   "an OOM it hits.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--results", metavar="FILE.json", help="bench or sweep results as --json writes them")
    g.add_argument("--snapshot", metavar="SNAP",
                   help="torch.cuda.memory._dump_snapshot pickle (load only your own) or the same as .json")
    g.add_argument("--oom_message", metavar="TEXT", help="the 'CUDA out of memory. Tried to allocate ...' line")
    p.add_argument("--timeline", metavar="PNG", help="run one step of the recipe (CPU or GPU) and plot its "
                                                      "memory after every op, phases and layers marked")
    p.add_argument("--request", metavar="SIZE", help="the failed request: bytes, or like 2GiB")
    p.add_argument("--limit", metavar="SIZE", help="the device memory the snapshot had: bytes, or like 80GiB")
    _add_run_flags(p)
    _add_recompute_flags(p)
    p.set_defaults(func=_cmd_doctor, golden=None, threshold=None)
    p = sub.add_parser("recipes", help="list the model recipes")
    p.set_defaults(func=_cmd_recipes)
    for command in sub.choices.values():  # so an unknown flag gets its command's usage
        command.set_defaults(command_parser=command)
    return parser


def _cmd_recipes(args: argparse.Namespace) -> int:
    from remat.models import recipes

    for name in recipes():
        _console.print(name)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command_line = shlex.join(["remat", *argv])  # recorded with each result
    try:
        return args.func(args)
    except ConfigError as e:
        _errors.print(f"[red]invalid config ({len(e.problems)} problem"
                      f"{'s' if len(e.problems) != 1 else ''}):[/]")
        for problem in e.problems:
            _errors.print(f"  [bold]{problem.field}[/]: {problem.message}")
        return 1
    except ValueError as e:  # bad recipe name or shape override
        _errors.print(f"[red]error:[/] {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
