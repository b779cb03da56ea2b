"""The flags the commands share, each derived from the setting it sets (`cli/flags.py`), and what
a command line means: the run's spec, its layout, the recompute config or plan, the model's facts
for the rules. A config file (--config) gives Megatron's keys; flags override it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.bench.golden import golden_match_problems, load_golden, run_differences
from remat.bench.presets import megatron_presets, parse_entry, run_key
from remat.bench.result import BenchResult
from remat.bench.run import plan_name, run_shape
from remat.bench.spec import BenchSpec
from remat.cli.checks import (
    golden_flag_problems,
    offload_device_advice,
    plan_file_flag_problems,
    recompute_flag_problems,
)
from remat.cli.common import Problems
from remat.cli.flags import add_settings, given
from remat.config.capture import Capture
from remat.config.fields import from_public
from remat.config.megatron import RecomputeFields, TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan, PlanLike, load_plan_or_config, plan_pipeline_problems
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError, Problem, advise
from remat.estimate.stages import cpu_run_problems
from remat.models import FAMILIES, build, module_recipe, recipe_config
from remat.run.optimizer import OptimizerPrecision
from remat.run.spec import ModelOverrides, RunSpec
from remat.sites.apply import apply, find_sites

# ModelOverrides a run's recipe takes from the command line (verify adds attention and dropout)
RUN_OVERRIDES = (
    "num_layers",
    "hidden_size",
    "seq_length",
    "num_moe_experts",
    "moe_layer_freq",
    "gradient_accumulation_fusion",
)


def add_model_source_flags(g: argparse._ActionsContainer) -> None:
    """Which model: a recipe, a Hugging Face config, or any model from a factory."""
    g.add_argument("-m", "--model_family_name", default="llama", choices=list(FAMILIES))
    add_settings(g, RunSpec, only=["recipe"], defaults={"model_recipe_name": "llama3_tiny"})
    g.add_argument(
        "--hf_config",
        metavar="FAMILY_OR_JSON",
        help="with -m hf: a transformers family (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, gpt2,"
        " mixtral, qwen2_moe, qwen3_moe, deepseek_v3; small shapes to override) or a config.json;"
        " built from the config, never downloaded",
    )
    g.add_argument(
        "--model",
        metavar="PACKAGE.MODULE:FUNCTION",
        help="any model: a function (no arguments) returning it, or (model, site map); token ids"
        " below its first embedding's vocabulary, -sl tokens; imported from the current folder too."
        " It takes labels= and returns its loss, or it returns logits and --loss_fn gives the loss",
    )
    g.add_argument(
        "--loss_fn",
        metavar="PACKAGE.MODULE:FUNCTION",
        help="with --model, for a model that returns logits: a function (output, labels) -> loss;"
        " remat:cross_entropy for next-token cross-entropy",
    )


def add_model_flags(p: argparse.ArgumentParser, *, skip: Iterable[str] = ()) -> argparse._ArgumentGroup:
    """The model, its shape and the step: Megatron Bridge's names."""
    g = p.add_argument_group("model and run (Megatron Bridge names)")
    add_model_source_flags(g)
    add_settings(g, ModelOverrides, only=RUN_OVERRIDES)
    add_settings(g, RunSpec, skip=["recipe", *skip])
    add_settings(g, Precision)
    add_settings(g, OptimizerPrecision)
    return g


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """A run that trains steps: the model flags, the bench's steps and GPU, progress and history."""
    g = add_model_flags(p)
    add_settings(g, BenchSpec, only=["max_steps", "warmup_steps", "gpu"])
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--history", metavar="DB", help="SQLite run history (default $REMAT_HISTORY or ~/.cache/remat/history.sqlite)"
    )
    g.add_argument("--no_history", action="store_true", help="do not record the run")


def add_layout_flags(p: argparse.ArgumentParser, title: str = "parallelism and CUDA graphs") -> None:
    """The parallel layout (Megatron's sizes) and CUDA graphs."""
    g = p.add_argument_group(title)
    add_settings(g, ParallelLayout)
    add_settings(g, Capture)


def add_recompute_flags(p: argparse.ArgumentParser) -> None:
    """The recompute and offload flags of Megatron Bridge's performance scripts, and a config file."""
    g = p.add_argument_group("recompute (Megatron Bridge names)")
    add_settings(g, RecomputeFields)
    g.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON with Megatron TransformerConfig keys, or a plan file; flags override it",
    )


def select_model(args: argparse.Namespace) -> None:
    """-m hf --hf_config X is the recipe hf:X (--hf_config needs -m hf); --model P is module:P,
    and with --loss_fn L module:P+L."""
    family = getattr(args, "model_family_name", None)
    hf, factory = getattr(args, "hf_config", None), getattr(args, "model", None)
    loss_fn = getattr(args, "loss_fn", None)
    if loss_fn is not None and factory is None:
        raise ConfigError([Problem("loss_fn", "is the loss of a --model that returns logits; add --model")])
    if hf is not None and family != "hf":
        raise ConfigError([Problem("hf_config", "names a Hugging Face config; add -m hf")])
    if factory is not None and family == "hf":
        raise ConfigError([Problem("model", "is a model of its own; drop -m hf")])
    if family == "hf":
        args.model_recipe_name = f"hf:{hf or 'llama'}"
    elif factory is not None:
        args.model_recipe_name = module_recipe(factory, loss_fn)


def config_file(args: argparse.Namespace) -> RecomputeConfig | Plan | None:
    """--config FILE: Megatron keys or a per-layer plan."""
    path = getattr(args, "config", None)
    return load_plan_or_config(path) if path else None


def file_keys(loaded: RecomputeConfig | Plan | None) -> dict[str, Any]:
    return loaded.to_megatron() if isinstance(loaded, RecomputeConfig) else {}


def _setting(cls: Any, args: argparse.Namespace, keys: Mapping[str, Any]) -> Any:
    """A settings value of `cls`: a config file's keys, then the flags."""
    return cls(**{**from_public(cls, keys), **given(cls, args)})


def layout_of(args: argparse.Namespace, keys: Mapping[str, Any] = {}) -> ParallelLayout:
    """The run's parallel layout: a config file's sizes, then the flags'."""
    return _setting(ParallelLayout, args, keys)


def run_parts(args: argparse.Namespace, keys: Mapping[str, Any] = {}) -> dict[str, Any]:
    """The layout, CUDA graphs and precision a command line (and its config file's `keys`) gives."""
    return dict(
        layout=layout_of(args, keys), capture=_setting(Capture, args, keys), precision=_setting(Precision, args, keys)
    )


def gpus_of(args: argparse.Namespace) -> int:
    """The GPUs a command line's run takes (-ng, else one copy of the model); 1 where its flags or
    config file cannot say (their problems are reported when checked)."""
    try:
        return layout_of(args, file_keys(config_file(args))).gpus
    except ConfigError:
        return 1


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's fields the flags replace."""
    return given(ModelOverrides, args)


def compile_default(flag: bool | None, device: str) -> bool:
    """--compile / --no-compile as given, else the fast path where there is one (CUDA)."""
    return device.startswith("cuda") if flag is None else flag


def spec_settings(args: argparse.Namespace, keys: Mapping[str, Any] = {}) -> dict[str, Any]:
    """A RunSpec's fields from a command line (and its config file's `keys`)."""
    values = {**given(RunSpec, args), **run_parts(args, keys)}
    values["overrides"] = model_overrides(args)
    values["optimizer_precision"] = OptimizerPrecision(**given(OptimizerPrecision, args))
    return values


def bench_spec(args: argparse.Namespace, keys: Mapping[str, Any] = {}) -> BenchSpec:
    """The run a bench, sweep, plan or doctor command line asks for; ConfigError with every problem."""
    values = {**spec_settings(args, keys), **given(BenchSpec, args)}
    device = values.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    values.update(
        device=device,
        compile=compile_default(values.get("compile"), device),
        command=args.command_line,
        dryrun=bool(getattr(args, "dryrun", False)),
    )
    return BenchSpec(**values)


def facts_of(args: argparse.Namespace, keys: Mapping[str, Any] = {}) -> TrainingFacts:
    """What the recompute rules read of the run a command line asks for: its recipe's layers,
    dropout and switches, and its layout, CUDA graphs and precision (the config file's, then the
    flags')."""
    config = recipe_config(args.model_recipe_name, **model_overrides(args))
    return TrainingFacts(**run_parts(args, keys), **from_public(TrainingFacts, config.megatron_facts()))


def fallback_facts(found: Problems, args: argparse.Namespace, keys: Mapping[str, Any]) -> TrainingFacts:
    """The facts of a command line whose model cannot be built: its layout, CUDA graphs and
    precision alone, so that the rules that need no model still run."""
    return TrainingFacts(**(found.run(run_parts, args, keys) or {}))


def recompute_keys(args: argparse.Namespace) -> dict[str, Any]:
    """The recompute settings the flags give, as Megatron Bridge's perf scripts read them: -rl
    implies full recompute by the block method, --recompute_modules selective, -ol CPU offloading."""
    keys = {f: v for f, v in given(RecomputeFields, args).items()}
    if "recompute_num_layers" in keys:
        keys = {"recompute_granularity": "full", "recompute_method": "block", **keys}
    if "recompute_modules" in keys:
        keys.setdefault("recompute_granularity", "selective")
    if keys.get("cpu_offloading_num_layers"):
        keys["cpu_offloading"] = True
    return keys


def resolve_config(
    args: argparse.Namespace, loaded: RecomputeConfig | Plan | None, facts: TrainingFacts
) -> RecomputeConfig | Plan:
    """What a command line means to recompute: its config file's settings, then the flags', on
    the run's `facts`; or the plan file it names."""
    problems = list(
        recompute_flag_problems(args.recompute_num_layers, args.recompute_modules, args.recompute_granularity)
    )
    if problems:
        raise ConfigError(problems)
    flags = recompute_keys(args)
    if isinstance(loaded, Plan):
        problems = list(plan_file_flag_problems(flags))
        if problems:
            raise ConfigError(problems)
        return loaded
    settings = {k: v for k, v in file_keys(loaded).items() if k in RecomputeFields.__dataclass_fields__}
    return RecomputeConfig.from_megatron({**settings, **facts.to_megatron(), **flags})


def meta_model(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> nn.Module:
    return build(args.model_recipe_name, device="meta", **(model_overrides(args) if overrides is None else overrides))


def advise_offload(spec: BenchSpec | None, plans: Sequence[tuple[str, PlanLike]]) -> None:
    """Warn where a run offloads on a device where offload saves nothing."""
    if spec is not None:
        offloading = [name for name, plan in plans if plan is not None and plan.offloads()]
        advise(offload_device_advice(spec.device, offloading))


def check_bench(
    args: argparse.Namespace, more: Iterable[Problem] = ()
) -> tuple[BenchSpec, PlanLike, Plan, BenchResult | None]:
    """Every problem of a bench command line, from every stage (and `more`), before anything runs:
    the spec, the config (or plan file) as given, as applied to the model, and the golden."""
    found = Problems()
    loaded = found.run(config_file, args, field="config")
    keys = file_keys(loaded)
    spec = found.run(bench_spec, args, keys, field="model_recipe_name")
    facts = found.run(facts_of, args, keys, field="model_recipe_name")
    found.add(golden_flag_problems(args.threshold, args.golden is not None))
    resolved = None
    # without the model's facts (a bad shape) the rules that need none still run
    plan = found.run(resolve_config, args, loaded, facts or fallback_facts(found, args, keys))
    if isinstance(plan, Plan) and spec is not None:  # its ranges and solved-for layout against the run's stages
        found.add(plan_pipeline_problems(plan, spec.layout))
    if facts is not None and (plan is not None or not found.problems):
        resolved = found.run(apply, meta_model(args), plan)
    golden = found.run(load_golden, args.golden, field="golden") if args.golden else None
    if golden is not None and spec is not None:
        found.add(golden_match_problems(run_differences(golden, spec.recipe, run_shape(spec))))
    found.add(more)
    found.raise_if_any()
    assert spec is not None and resolved is not None  # or a problem was raised
    if not spec.dryrun:
        found.add(cpu_run_problems(spec, [(plan_name(plan), plan)]))
        found.raise_if_any()
    advise_offload(spec, [(plan_name(plan), plan)])
    return spec, plan, resolved, golden


def sweep_entries(
    found: Problems,
    model: nn.Module,
    entries: Sequence[str] | None,
    keys: dict[str, Any],
    execution: Callable[[RecomputeConfig], Iterator[Problem]] | None = None,
    stage_layers: int | None = None,
) -> list[tuple[str, PlanLike]]:
    """Sweep entries (None, or the entry "presets" among them: Megatron's presets, full block over
    half of the `stage_layers` of a (virtual) pipeline stage) parsed and checked against the model;
    `execution` lists what a config asks that the runner would not run as asked."""
    model_sites = find_sites(model).model_sites
    presets = megatron_presets(frozenset().union(*model_sites.labels), stage_layers or model_sites.num_layers)
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
