"""remat.plan(): the fastest plan whose predicted peak fits a memory budget, explained.

The trace measures (`remat.memory`); the solver chooses (`remat.planner.solver`); this module
joins them and says what it chose in Megatron's terms when it can (a uniform plan is a
RecomputeConfig) and per layer otherwise.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.config.megatron import TrainingFacts
from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.core.labels import recompute_labels
from remat.core.problems import Problem, RematWarning, raise_if_any
from remat.core.sizes import format_bytes, parse_bytes
from remat.memory.measure import meta_offload_problems, trace
from remat.memory.meter import storage_bytes
from remat.memory.prediction import Prediction, Trace
from remat.memory.windows import Choice
from remat.planner.solver import NoPlanFits, solve
from remat.sites.calls import LossFn


@dataclass(frozen=True)
class PlanResult:
    budget_bytes: int
    plan: Plan
    config: RecomputeConfig | None  # the same plan as a Megatron config, when one expresses it
    prediction: Prediction
    choices: tuple[Choice, ...]

    def megatron_keys(self) -> dict[str, object] | None:
        """The Megatron keys that express the plan, or None when only a per-layer plan file does."""
        return None if self.config is None else megatron_keys(self.config)

    def explain(self) -> Iterator[tuple[str, str, int, float]]:
        """(layers, action, bytes freed per layer, seconds added per layer) for runs of layers
        doing the same at the same cost; layers that keep everything are left out."""
        rows: list[tuple[int, int, str, int, float]] = []
        for c in self.choices:
            if c.actions is None:
                what = f"full recompute, group of {c.end - c.start}" + (
                    ", input offloaded" if c.input_offloaded else ""
                )
            else:
                what = ", ".join(f"{k}={v}" for k, v in sorted(c.actions.items()) if v != "keep")
            if not what:
                continue
            per = c.end - c.start
            row = (c.start, c.end - 1, what, c.freed_bytes // per, c.added_time_s / per)
            if rows and rows[-1][2:] == row[2:] and rows[-1][1] == c.start - 1:
                rows[-1] = (rows[-1][0], *row[1:])
            else:
                rows.append(row)
        for first, last, what, freed, seconds in rows:
            yield (str(first) if first == last else f"{first}-{last}", what, freed, seconds)


def megatron_keys(config: RecomputeConfig) -> dict[str, object]:
    """The keys of `config` a planned plan sets: recompute, CPU offloading and its size threshold."""
    keys = {k: v for k, v in config.to_megatron().items() if k.startswith(("recompute_", "cpu_offloading")) and v}
    if config.cpu_offloading:
        keys["min_offloaded_tensor_size"] = config.min_offloaded_tensor_size
    return keys


def uniform_config(plan: Plan, trace_: Trace) -> RecomputeConfig | None:
    """The Megatron config that lowers to exactly `plan` on this model, if there is one."""
    model_sites = trace_.model_sites
    n = model_sites.num_layers
    if plan == Plan.none(n):
        return RecomputeConfig()
    labels = frozenset().union(*model_sites.labels)
    facts = facts_for_sites(labels, TrainingFacts(num_layers=n))
    candidates = recompute_candidates(labels, n)
    if plan.offloads():  # Megatron offloads the first k layers: k ends at the last offloading layer
        k = 1 + max(i for i, actions in enumerate(plan.layers) if "offload" in actions.values())
        candidates = (
            [
                dict(
                    keys,
                    cpu_offloading=True,
                    cpu_offloading_num_layers=k,
                    min_offloaded_tensor_size=plan.min_offloaded_tensor_size,
                )
                for keys in [{}, *candidates]
            ]
            if k < n
            else []
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        for keys in candidates:
            config = RecomputeConfig(**keys, facts=facts)
            if Plan.from_config(config, model_sites) == plan:
                return config
    return None


def facts_for_sites(labels: frozenset[str], facts: TrainingFacts) -> TrainingFacts:
    """`facts` for a model with these sites, which runs what their rules ask for (grouped GEMM
    experts, MLA)."""
    return dataclasses.replace(
        facts, moe_grouped_gemm="moe_act" in labels, multi_latent_attention="mla_up_proj" in labels
    )


def recompute_candidates(labels: frozenset[str], layers: int) -> list[dict[str, Any]]:
    """The recompute settings (RecomputeConfig keyword arguments) a Megatron user would try on a
    model with these site labels and `layers` per (virtual) pipeline stage: every set of selective
    modules, and full recompute, uniform or block, of 1 to all of the layers."""
    present = sorted(label for label in recompute_labels() if label in labels)  # not offload-only sites
    candidates: list[dict[str, Any]] = [
        dict(recompute_granularity="selective", recompute_modules=[x for i, x in enumerate(present) if mask >> i & 1])
        for mask in range(1, 2 ** len(present))
    ]
    candidates += [
        dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=k)
        for method in ("uniform", "block")
        for k in range(1, layers + 1)
    ]
    return candidates


def plan_from_trace(trace_: Trace, budget: int | str, host_budget: int | str | None = None) -> PlanResult:
    """Solve over a trace's measurements; NoPlanFits (a ConfigError) says by how much it misses.
    `host_budget` caps the bytes offload may move to host memory (a trace with offload measured)."""
    budget_bytes = parse_bytes(budget)
    host_bytes = None if host_budget is None else parse_bytes(host_budget, "host_memory_budget")
    raise_if_any(host_budget_problems(trace_.offload, host_bytes))
    solution = solve(trace_.problem(), budget_bytes, host_bytes)
    if solution.plan.offloads():
        solution.plan.min_offloaded_tensor_size = trace_.min_offloaded_tensor_size
    return PlanResult(
        budget_bytes,
        solution.plan,
        uniform_config(solution.plan, trace_),
        trace_.predict(solution.plan),
        solution.choices,
    )


def weight_bytes(model: nn.Module, device_type: str) -> int:
    """The weights this rank holds on the device it trains on: an FSDP2 parameter (a DTensor,
    whose storage reads as the whole tensor's) counts its local shard; weights kept on the host
    do not count."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return storage_bytes(t for t in local if t.device.type == device_type)


def plan(
    model: nn.Module,
    budget: int | str,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    micro_batches: int = 1,
    offload: bool = False,
    host_budget: int | str | None = None,
    loss_fn: LossFn | None = None,
) -> PlanResult:
    """Trace `model` on `batch` (one step per action, see `remat.trace`) and return the fastest
    plan whose predicted peak allocated memory fits `budget` (bytes, or text like '60GiB').
    The weights, gradients and optimizer state are left as they were: it can run mid-training.
    `offload`: consider offloading to host memory too, at most `host_budget` bytes if given; a
    model that returns logits takes `loss_fn(output, labels)` (e.g. `remat.cross_entropy`)."""
    budget_bytes = parse_bytes(budget)
    host_bytes = None if host_budget is None else parse_bytes(host_budget, "host_memory_budget")
    raise_if_any(
        [
            *host_budget_problems(offload, host_bytes),
            *meta_offload_problems(offload, batch[0].device.type, None),
            *plan_search_problems(budget_bytes, weight_bytes(model, batch[0].device.type), Trace.max_group),
        ]
    )
    traced = trace(model, batch, optimizer=optimizer, micro_batches=micro_batches, offload=offload, loss_fn=loss_fn)
    return plan_from_trace(traced, budget_bytes, host_bytes)


def host_budget_problems(offload: bool, host_budget_bytes: int | None) -> Iterator[Problem]:
    """A host budget caps what offload moves, so it needs offload."""
    if host_budget_bytes is not None and not offload:
        yield Problem(
            "host_memory_budget",
            "caps what offload moves to host memory; turn offload on (--offload) or drop the host budget",
        )


def plan_search_problems(budget_bytes: int, weight_bytes: int, max_group: int) -> Iterator[Problem]:
    """What the planner can be asked before it traces: a budget the weights leave room in, and
    whole-layer groups it may form."""
    if weight_bytes >= budget_bytes:
        yield Problem(
            "memory_budget",
            (
                f"the weights alone take {format_bytes(weight_bytes)}, more than the {format_bytes(budget_bytes)} "
                "budget: no recompute plan helps; shard them (FSDP2) or spread the model over more GPUs "
                "(tensor or pipeline parallel)"
            ),
        )
    yield from max_group_problems(max_group)


def max_group_problems(max_group: int) -> Iterator[Problem]:
    if max_group < 1:
        yield Problem("max_group", f"is {max_group}; use 1 or more (the most layers recomputed whole as one group)")


__all__ = [
    "NoPlanFits",
    "PlanResult",
    "host_budget_problems",
    "max_group_problems",
    "megatron_keys",
    "facts_for_sites",
    "plan",
    "plan_from_trace",
    "plan_search_problems",
    "recompute_candidates",
    "solve",
    "uniform_config",
    "weight_bytes",
]
