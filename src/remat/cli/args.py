"""The flags the commands share (Megatron Bridge's names) and what a command line means: the
recompute config or plan, the run's spec, the model's facts for the rules."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from remat.apply import apply, find_sites
from remat.bench.golden import golden_match_problems, load_golden, run_differences
from remat.bench.presets import megatron_presets, parse_entry, run_key
from remat.bench.result import BenchResult
from remat.bench.run import plan_name, run_shape
from remat.bench.spec import DEFAULT_MAX_STEPS, DEFAULT_WARMUP_STEPS, BenchSpec
from remat.cli.checks import (
    golden_flag_problems,
    offload_device_advice,
    plan_file_flag_problems,
    recompute_flag_problems,
)
from remat.cli.common import Problems
from remat.estimating import cpu_run_problems
from remat.labels import labels_without_model, recompute_labels
from remat.layer_plan import Plan, PlanLike, load_plan_or_config, plan_pipeline_problems
from remat.models import FAMILIES, build, recipe_config
from remat.optimizer import DTYPES, OptimizerPrecision
from remat.problems import ConfigError, Problem, advise, raise_if_any
from remat.recompute import RecomputeConfig, TrainingFacts
from remat.rules import CUDA_GRAPH_IMPLS, CUDA_GRAPH_SCOPES, GRANULARITIES, METHODS, MIN_OFFLOADED_TENSOR_SIZE
from remat.step import unrun_problems


def add_recompute_flags(p: argparse.ArgumentParser) -> None:
    """The recompute and parallelism flags of Megatron Bridge's performance scripts."""
    g = p.add_argument_group("recompute (Megatron Bridge names)")
    g.add_argument("--recompute_granularity", choices=list(GRANULARITIES),
                   help="full: whole layers; selective: the modules in --recompute_modules")
    megatron = [label for label in recompute_labels() if label != "mlp_act"]
    g.add_argument("--recompute_modules", metavar="A,B",
                   help=f"selective labels, comma separated ({', '.join(megatron)}; remat's mlp_act; Megatron's "
                        f"{', '.join(labels_without_model())} are refused: no remat model has their layers yet); "
                        "implies --recompute_granularity selective")
    g.add_argument("-rl", "--recompute_num_layers", type=int, metavar="N",
                   help="full recompute of N layers per (virtual) stage; implies full granularity "
                        "and, unless --recompute_method says otherwise, the block method")
    g.add_argument("--recompute_method", choices=list(METHODS))
    g.add_argument("--distribute_saved_activations", action="store_true", default=None,
                   help="full recompute keeps 1/tp of each range's input on each tensor-parallel rank, "
                        "all-gathered before its replay (not with --sequence_parallel)")
    g.add_argument("-ol", "--activation_offload_layers", type=int, metavar="N",
                   help="offload what the first N layers save to host memory (cpu_offloading); with "
                        "full recompute, the inputs its groups keep")
    g.add_argument("--min_offloaded_tensor_size", type=int, metavar="N",
                   help=f"tensors of fewer elements stay on the GPU (default {MIN_OFFLOADED_TENSOR_SIZE})")
    g = p.add_argument_group("parallelism and CUDA graphs")
    add_parallel_flags(g)
    g.add_argument("--cuda_graph_impl", choices=list(CUDA_GRAPH_IMPLS))
    g.add_argument("--cuda_graph_scope", metavar="A,B", help=f"comma separated: {', '.join(CUDA_GRAPH_SCOPES)}")
    g.add_argument("--config", metavar="FILE",
                   help="YAML or JSON with Megatron TransformerConfig keys; flags override it")


def add_parallel_flags(g: argparse._ActionsContainer) -> None:
    """Megatron's model-parallel sizes: tensor (with sequence), pipeline (with virtual stages), context."""
    g.add_argument("-tp", "--tensor_model_parallel_size", type=int, metavar="N")
    g.add_argument("-pp", "--pipeline_model_parallel_size", type=int, metavar="N")
    g.add_argument("-vp", "--virtual_pipeline_model_parallel_size", type=int, metavar="N")
    g.add_argument("-cp", "--context_parallel_size", type=int, metavar="N")
    g.add_argument("--sequence_parallel", action="store_true", default=None)


def add_model_source_flags(g: argparse._ActionsContainer) -> None:
    """Which model: a recipe, a Hugging Face config, or any model from a factory."""
    g.add_argument("-m", "--model_family_name", default="llama", choices=list(FAMILIES))
    g.add_argument("-mr", "--model_recipe_name", default="llama3_tiny", metavar="RECIPE",
                   help="see `remat recipes` (default llama3_tiny, which runs on CPU)")
    g.add_argument("--hf_config", metavar="FAMILY_OR_JSON",
                   help="with -m hf: a transformers family (llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, gpt2,"
                        " mixtral, qwen2_moe, qwen3_moe, deepseek_v3; small shapes to override) or a config.json;"
                        " built from the config, never downloaded")
    g.add_argument("--model", metavar="PACKAGE.MODULE:FUNCTION",
                   help="any model: a function (no arguments) returning it, or (model, site map); token ids"
                        " below its first embedding's vocabulary, -sl tokens")


def add_expert_flags(g: argparse._ActionsContainer) -> None:
    """Megatron's expert-parallel sizes, overrides of an MoE recipe's config."""
    g.add_argument("-ep", "--expert_model_parallel_size", type=int, metavar="N",
                   help="MoE recipes: split each MoE layer's routed experts over N data-parallel ranks (bench: "
                        "tokens sent to their experts' ranks by all-to-all, -ng a multiple of N; estimate: one "
                        "rank's share)")
    g.add_argument("-etp", "--expert_tensor_parallel_size", type=int, metavar="N",
                   help="MoE recipes: split each expert's FFN over N ranks (estimate: one rank's share; beside -tp"
                        " the experts split over the tensor-parallel ranks, Megatron's default)")


def add_model_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Model and batch flags of Megatron Bridge's performance scripts."""
    g = p.add_argument_group("model and run (Megatron Bridge names)")
    add_model_source_flags(g)
    g.add_argument("-ng", "--num_gpus", type=int, metavar="N",
                   help="GPUs in all: tp x pp x cp x data parallel (default: one copy of the model, tp x pp x cp)")
    g.add_argument("-sl", "--seq_length", type=int, metavar="N")
    g.add_argument("-mb", "--micro_batch_size", type=int, default=1, metavar="N")
    g.add_argument("-gb", "--global_batch_size", type=int, metavar="N")
    g.add_argument("--num_layers", type=int, metavar="N")
    g.add_argument("--hidden_size", type=int, metavar="N")
    g.add_argument("--num_moe_experts", type=int, metavar="N", help="MoE recipes: routed experts (a slice that fits)")
    g.add_argument("--moe_layer_freq", metavar="F",
                   help="MoE recipes: every F-th layer is MoE, or one 0/1 per layer as '[0]*1+[1]*3'")
    add_expert_flags(g)
    g.add_argument("--no_gradient_accumulation_fusion", action="store_true",
                   help="let autograd add each weight gradient into .grad with its own kernel instead of the "
                        "weight-gradient GEMM (Megatron's --no-gradient-accumulation-fusion)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model's regions between Sites (QKV split+RoPE, SwiGLU, loss softmax); "
                        "on CUDA, SwiGLU+linear_fc2, the QKV split with RoPE, RMSNorm and the loss chunk run "
                        "remat's Triton kernels; a Hugging Face model gets the chunked loss head. Default: on"
                        " for CUDA (the fast path), off for CPU")
    g.add_argument("--no_optimizer", action="store_true",
                   help="forward+backward only, gradients accumulating, as the torch anchor measures")
    g.add_argument("--main_params_dtype", choices=sorted(DTYPES), metavar="DTYPE",
                   help="Megatron's mixed-precision optimizer: AdamW on main parameters of this dtype beside "
                        "the model's (fp32 in Megatron's bf16 runs); default: AdamW on the model's parameters")
    g.add_argument("--main_grads_dtype", choices=sorted(DTYPES), metavar="DTYPE",
                   help="with --main_params_dtype: the main gradients each backward adds into (default: the main "
                        "parameters' dtype)")
    g.add_argument("--use_distributed_optimizer", action="store_true",
                   help="with --main_params_dtype: each data-parallel rank keeps 1/dp of the main parameters "
                        "and moments (6 + 12/dp bytes a parameter; bench: FSDP2 keeping each layer gathered through a"
                        " step and reducing gradients once, at its last micro-batch)")
    g.add_argument("--use_torch_fsdp2", action="store_true",
                   help="data parallel by torch's FSDP2, as Megatron's --use-torch-fsdp2: parameters (in the main"
                        " dtype), gradients and moments sharded over data parallel, each layer gathered in the"
                        " compute dtype; what remat bench runs with data parallelism unless told"
                        " --use_distributed_optimizer (estimate; bench: implied)")
    return g


def optimizer_precision(args: argparse.Namespace) -> OptimizerPrecision:
    return OptimizerPrecision(args.main_params_dtype, args.main_grads_dtype, args.use_distributed_optimizer,
                              args.use_torch_fsdp2)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """Model, batch and run flags of Megatron Bridge's performance scripts."""
    g = add_model_flags(p)
    g.add_argument("--task", default="pretrain", help="pretrain or sft (labels of the first quarter masked)")
    g.add_argument("-g", "--gpu", help="GPU label, checked against the device (h100, h200, b200, ...)")
    g.add_argument("-c", "--compute_dtype", default="bf16", help="bf16 (fp8 variants not supported yet)")
    g.add_argument("-ms", "--max_steps", type=int, default=DEFAULT_MAX_STEPS, metavar="N")
    g.add_argument("--warmup_steps", type=int, default=DEFAULT_WARMUP_STEPS, metavar="N")
    g.add_argument("--device", help="cuda or cpu (default: cuda when there is a GPU)")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    g.add_argument("--history", metavar="DB", help="SQLite run history (default $REMAT_HISTORY or "
                                                   "~/.cache/remat/history.sqlite)")
    g.add_argument("--no_history", action="store_true", help="do not record the run")


def select_model(args: argparse.Namespace) -> None:
    """-m hf --hf_config X is the recipe hf:X (--hf_config needs -m hf); --model P is module:P."""
    family = getattr(args, "model_family_name", None)
    hf, factory = getattr(args, "hf_config", None), getattr(args, "model", None)
    if hf is not None and family != "hf":
        raise ConfigError([Problem("hf_config", "names a Hugging Face config; add -m hf")])
    if factory is not None and family == "hf":
        raise ConfigError([Problem("model", "is a model of its own; drop -m hf")])
    if family == "hf":
        args.model_recipe_name = f"hf:{hf or 'llama'}"
    elif factory is not None:
        args.model_recipe_name = f"module:{factory}"


# the keys that say how a run is laid out over GPUs (and captured), not what it recomputes
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "context_parallel_size", "sequence_parallel", "cuda_graph_impl", "cuda_graph_scope")


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
    for name in ("recompute_granularity", "recompute_method", "distribute_saved_activations", *LAYOUT_KEYS):
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
            actions = {k: v for k, v in megatron_overrides(args).items() if k not in LAYOUT_KEYS}
            problems = list(plan_file_flag_problems(actions))
            if problems:
                raise ConfigError(problems)
            return loaded
        keys.update(loaded.to_megatron())
    keys.update(model_facts)
    keys.update(megatron_overrides(args))
    return RecomputeConfig.from_megatron(keys)


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's fields the flags replace."""
    overrides = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "seq_length", "num_moe_experts",
                                               "expert_model_parallel_size", "expert_tensor_parallel_size")
                 if getattr(args, k, None) is not None}
    if getattr(args, "moe_layer_freq", None) is not None:
        freq = args.moe_layer_freq
        overrides["moe_layer_freq"] = int(freq) if freq.isdigit() else freq
    if getattr(args, "no_gradient_accumulation_fusion", False):
        overrides["gradient_accumulation_fusion"] = False
    return overrides


def compile_default(flag: bool | None, device: str) -> bool:
    """--compile / --no-compile as given, else the fast path where there is one (CUDA)."""
    return device.startswith("cuda") if flag is None else flag


def bench_spec(args: argparse.Namespace) -> BenchSpec:
    """The run a bench or sweep command line asks for; ConfigError with every problem."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    spec = BenchSpec(recipe=args.model_recipe_name, overrides=model_overrides(args),
                     micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                     max_steps=args.max_steps, warmup_steps=args.warmup_steps, task=args.task,
                     compute_dtype=args.compute_dtype, device=device, compile=compile_default(args.compile, device),
                     gpu=args.gpu, num_gpus=args.num_gpus, optimizer=not args.no_optimizer,
                     precision=optimizer_precision(args), facts=flag_facts(args),
                     command=args.command_line, dryrun=getattr(args, "dryrun", False))
    return spec


def model_facts(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Megatron keys a recipe's model fixes for the recompute rules."""
    config = recipe_config(args.model_recipe_name, **(model_overrides(args) if overrides is None else overrides))
    return config.megatron_facts()


def meta_model(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> nn.Module:
    return build(args.model_recipe_name, device="meta", **(model_overrides(args) if overrides is None else overrides))


def gpus_of(args: argparse.Namespace) -> int:
    """The GPUs a run's flags take: -ng, else one copy of the model (tp x pp x cp)."""
    return args.num_gpus or flag_facts(args).model_parallel_size


def flag_facts(args: argparse.Namespace) -> TrainingFacts:
    """The parallel sizes and CUDA graphs the flags give (without a config file's); a command
    without those flags runs one copy of the model without CUDA graphs."""
    def flag(name: str) -> Any:
        return getattr(args, name, None)
    scope = flag("cuda_graph_scope")
    return TrainingFacts(
        tensor_model_parallel_size=flag("tensor_model_parallel_size") or 1,
        pipeline_model_parallel_size=flag("pipeline_model_parallel_size") or 1,
        virtual_pipeline_model_parallel_size=flag("virtual_pipeline_model_parallel_size"),
        context_parallel_size=flag("context_parallel_size") or 1, sequence_parallel=bool(flag("sequence_parallel")),
        cuda_graph_impl=flag("cuda_graph_impl") or "none", cuda_graph_scope=scope.split(",") if scope else [])


def advise_offload(spec: BenchSpec | None, plans: Sequence[tuple[str, PlanLike]]) -> None:
    """Warn where a run offloads on a device where offload saves nothing."""
    if spec is not None:
        offloading = [name for name, plan in plans if plan is not None and plan.offloads()]
        advise(offload_device_advice(spec.device, offloading))


def check_bench(args: argparse.Namespace, more: Iterable[Problem] = ()
                ) -> tuple[BenchSpec, PlanLike, Plan, BenchResult | None]:
    """Every problem of a bench command line, from every stage (and `more`), before anything runs:
    the spec, the config (or plan file) as given, as applied to the model, and the golden."""
    found = Problems()
    spec = found.run(bench_spec, args, field="model_recipe_name")
    facts = found.run(model_facts, args, field="model_recipe_name")
    found.add(unrun_problems(flag_facts(args)))
    found.add(golden_flag_problems(args.threshold, args.golden is not None))
    resolved = None
    # without the model's facts (a bad shape) the rules that need none still run
    plan = found.run(resolve_config, args, facts or {})
    if isinstance(plan, RecomputeConfig):
        found.add(unrun_problems(plan.facts))
    if isinstance(plan, Plan):  # a per-layer plan's ranges and solved-for layout against the run's stages
        found.add(plan_pipeline_problems(plan, flag_facts(args)))
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


def sweep_entries(found: Problems, model: nn.Module, entries: Sequence[str] | None, keys: dict[str, Any],
                  execution: Callable[[RecomputeConfig], Iterator[Problem]] | None = None,
                  stage_layers: int | None = None) -> list[tuple[str, PlanLike]]:
    """Sweep entries (None, or the entry "presets" among them: Megatron's presets, full block over
    half of the `stage_layers` of a (virtual) pipeline stage) parsed and checked against the model;
    `execution` lists what a config asks that the runner would not run as asked."""
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
