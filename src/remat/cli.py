"""The `remat` command: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Sequence

from rich.console import Console

from remat.config import ConfigError, Problem, RecomputeConfig, RematWarning
from remat.plans import Plan, load_plan_or_config

_console = Console(highlight=False, soft_wrap=True)
_errors = Console(stderr=True, highlight=False, soft_wrap=True)


def _add_recompute_flags(p: argparse.ArgumentParser) -> None:
    """The recompute and parallelism flags of Megatron Bridge's performance scripts."""
    g = p.add_argument_group("recompute (Megatron Bridge names)")
    g.add_argument("--recompute_granularity", choices=["full", "selective"],
                   help="full: whole layers; selective: the modules in --recompute_modules")
    g.add_argument("--recompute_modules", metavar="A,B",
                   help="selective labels, comma separated (core_attn, layernorm, mlp, moe, moe_act, "
                        "shared_experts, mla_up_proj); implies --recompute_granularity selective")
    g.add_argument("-rl", "--recompute_num_layers", type=int, metavar="N",
                   help="full recompute of N layers per (virtual) stage; implies full granularity "
                        "and, unless --recompute_method says otherwise, the block method")
    g.add_argument("--recompute_method", choices=["uniform", "block"])
    g.add_argument("-ol", "--activation_offload_layers", type=int, metavar="N",
                   help="offload the activations of N layers to host memory (cpu_offloading)")
    g = p.add_argument_group("parallelism and CUDA graphs")
    g.add_argument("-tp", "--tensor_model_parallel_size", type=int, metavar="N")
    g.add_argument("-pp", "--pipeline_model_parallel_size", type=int, metavar="N")
    g.add_argument("-vp", "--virtual_pipeline_model_parallel_size", type=int, metavar="N")
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
    for name in ("recompute_granularity", "recompute_method", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "sequence_parallel", "cuda_graph_impl", "cuda_graph_scope"):
        value = getattr(args, name)
        if value is not None:
            keys[name] = value
    return keys


def resolve_config(args: argparse.Namespace, model_facts: dict[str, Any]) -> RecomputeConfig | Plan:
    """What a command line means: --config FILE (Megatron keys or a per-layer plan), then the
    model's facts, then the flags."""
    if args.recompute_num_layers is not None and args.recompute_modules is not None:
        raise ConfigError([Problem(
            "-rl/--recompute_modules", "pass one of them: -rl N recomputes whole layers, "
            "--recompute_modules recomputes the listed modules in every layer")])
    keys: dict[str, Any] = {}
    if args.config:
        loaded = load_plan_or_config(args.config)
        if isinstance(loaded, Plan):
            if megatron_overrides(args):
                raise ConfigError([Problem("--config", "a per-layer plan file sets every action "
                                           "itself; drop the recompute and parallel flags")])
            return loaded
        keys.update(loaded.to_megatron())
    keys.update(model_facts)
    keys.update(megatron_overrides(args))
    return RecomputeConfig.from_megatron(keys)


def _cmd_validate(args: argparse.Namespace) -> int:
    from remat.apply import apply
    from remat.models import build

    model = None
    facts: dict[str, Any] = {}
    if args.model_recipe_name:
        overrides = {"num_layers": args.num_layers} if args.num_layers else {}
        model = build(args.model_recipe_name, device="meta", **overrides)
        facts["num_layers"] = model.config.num_layers
    elif args.num_layers:
        facts["num_layers"] = args.num_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        config = resolve_config(args, facts)
        if isinstance(config, Plan) and model is None:
            raise ConfigError([Problem("--config", "a per-layer plan is checked against a model: "
                                       "pass -mr RECIPE")])
        plan = apply(model, config) if model is not None else None
    for w in caught:
        _errors.print(f"[yellow]warning:[/] {w.message}")
    if isinstance(config, RecomputeConfig):
        _console.print(config.describe())
    if plan is not None:
        _console.print(f"\n[bold]per-layer plan on {args.model_recipe_name}[/]")
        _console.print(plan.describe())
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from remat.models import build
    from remat.verify import verify

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but this machine has no CUDA GPU; use --device cpu")
    torch.use_deterministic_algorithms(args.device == "cpu")
    torch.manual_seed(args.seed)
    overrides = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "seq_length",
                                                "attention_backend", "attention_dropout",
                                                "hidden_dropout") if getattr(args, k) is not None}
    model = build(args.model_recipe_name, dtype=getattr(torch, args.dtype), device=args.device,
                  **overrides)
    seq = model.config.seq_length
    ids = torch.randint(0, model.config.vocab_size, (args.micro_batch_size, seq + 1),
                        device=args.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematWarning)
        config = resolve_config(args, {"num_layers": model.config.num_layers,
                                       "attention_dropout": model.config.attention_dropout,
                                       "hidden_dropout": model.config.hidden_dropout})
        report = verify(model, config, ids[:, :-1], ids[:, 1:], seed=args.seed)
    for w in caught:
        _errors.print(f"[yellow]warning:[/] {w.message}")
    _console.print(report.plan.describe())
    _console.print(_verify_table(report, args))
    ok = report.bit_identical or report.max_grad_diff <= args.tolerance
    _console.print("[green]gradients match[/]" if ok else "[red]gradients differ[/]")
    return 0 if ok else 1


def _verify_table(report: Any, args: argparse.Namespace) -> Any:
    from rich.table import Table

    table = Table(title=f"{args.model_recipe_name}, micro-batch {args.micro_batch_size}, "
                        f"{args.dtype} on {args.device}")
    for column in ("run", "loss", "saved for backward", "storages"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for name, step in (("no recompute", report.baseline), ("with config", report.candidate)):
        table.add_row(name, f"{step.loss.item():.6f}", _bytes(step.saved.bytes), str(step.saved.storages))
    table.caption = (f"freed {_bytes(report.freed_bytes)}; bit-identical: {report.bit_identical}; "
                     f"max |grad diff| {report.max_grad_diff:.3g}")
    return table


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat", description="Activation recompute for PyTorch transformer training.")
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
    p.add_argument("-mr", "--model_recipe_name", metavar="RECIPE", default="llama3_tiny")
    p.add_argument("--num_layers", type=int, metavar="N")
    p.add_argument("--hidden_size", type=int, metavar="N")
    p.add_argument("-sl", "--seq_length", type=int, metavar="N")
    p.add_argument("-mb", "--micro_batch_size", type=int, default=2, metavar="N")
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
    p = sub.add_parser("recipes", help="list the model recipes")
    p.set_defaults(func=_cmd_recipes)
    return parser


def _cmd_recipes(args: argparse.Namespace) -> int:
    from remat.models import recipes

    for name in recipes():
        _console.print(name)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
