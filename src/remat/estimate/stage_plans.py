"""plan_stages(): a plan per pipeline rank, each the fastest that fits the budget on that rank.

Under 1F1B the ranks of a pipeline hold different memory: rank k keeps the activations of pp - k
micro-batches in flight, the first also holds the embedding, the last the loss head. A Megatron
config is one setting for every stage, so the rank with the most in flight decides it for all.
Here each kind of stage (first, middle, last) is traced on its own shard and layers, and each
rank's plan is solved with its own micro-batches in flight (`StageTrace.problem`), so later ranks
recompute less. The ranks' plans side by side are one per-layer plan over the whole model that
records the layout it was solved for and each rank's predicted peak. The fastest Megatron config
that fits every rank is found beside it, to show what planning per stage gains.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from remat.config.fields import MIN_OFFLOADED_TENSOR_SIZE
from remat.config.parallel import ParallelLayout
from remat.config.plan import PipelineStages, Plan
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError, Problem, RematWarning, raise_if_any
from remat.core.sizes import parse_bytes
from remat.estimate.spec import EstimateSpec
from remat.estimate.stages import Estimate, StageTrace, predict_stages, rank_plan, trace_stages
from remat.planner import NoPlanFits, facts_for_sites, host_budget_problems, megatron_keys, recompute_candidates
from remat.planner.solver import solve


@dataclass(frozen=True)
class StagePlan:
    """One pipeline rank's plan over its own layers."""

    stage: int
    layers: tuple[int, ...]  # the model's layers this rank runs, in order
    plan: Plan


@dataclass(frozen=True)
class PipelinePlan:
    budget_bytes: int
    stages: tuple[StagePlan, ...]
    estimate: Estimate  # each rank's memory under its plan, and the step's time
    plan: Plan  # the ranks' plans side by side over the whole model, with the layout (`plan.pipeline`)
    # the fastest Megatron config (one for every stage) that fits the budget on every rank, if one does
    uniform: tuple[RecomputeConfig, Estimate] | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "plan": self.plan.to_dict(),
            "stages": [{"stage": s.stage, "layers": list(s.layers), "plan": s.plan.to_dict()} for s in self.stages],
            "estimate": self.estimate.to_dict(),
            "uniform": None
            if self.uniform is None
            else {"megatron": megatron_keys(self.uniform[0]), **self.uniform[1].to_dict()},
        }


def plan_stages(
    spec: EstimateSpec,
    budget: int | str,
    *,
    offload: bool = False,
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE,
    host_budget: int | str | None = None,
    max_group: int = 16,
    device: str = "meta",
    progress: Callable[[str], None] | None = None,
) -> PipelinePlan:
    """Trace each kind of pipeline stage of `spec` (`device` "meta": by shape, at the spec's
    assumed speed; else on that device, which measures) and solve each rank's plan under `budget`
    (bytes, or text like '60GiB') with its own micro-batches in flight; `host_budget` caps what
    each rank offloads. Every rank that no plan fits is named in one ConfigError."""
    budget_bytes = parse_bytes(budget)
    host_bytes = None if host_budget is None else parse_bytes(host_budget, "host_memory_budget")
    raise_if_any(host_budget_problems(offload, host_bytes))
    traced = [
        dataclasses.replace(t, trace=dataclasses.replace(t.trace, max_group=max_group))
        for t in trace_stages(spec, progress, min_offloaded_tensor_size if offload else None, device)
    ]
    stages, missed = [], []
    for k, stage_trace in enumerate(traced):
        try:
            solution = solve(stage_trace.problem(k, spec), budget_bytes, host_bytes)
        except NoPlanFits as err:
            missed += [Problem(f"pipeline rank {k}", p.message) for p in err.problems]
            continue
        plan = solution.plan
        if plan.offloads():
            plan.min_offloaded_tensor_size = min_offloaded_tensor_size
        stages.append(StagePlan(k, spec.layout.rank_layers(spec.model_config.num_layers, k), plan))
    if missed:
        raise ConfigError(missed)
    planned = predict_stages("per stage", spec, traced, [s.plan for s in stages])
    return PipelinePlan(
        budget_bytes,
        tuple(stages),
        planned,
        _joined(stages, planned, spec),
        _fastest_uniform(spec, traced, budget_bytes),
    )


def _joined(stages: Sequence[StagePlan], planned: Estimate, spec: EstimateSpec) -> Plan:
    """The ranks' plans as one plan over the model's layers, stamped with the layout."""
    whole = Plan.none(spec.model_config.num_layers)
    for s in stages:
        for local, layer in enumerate(s.layers):
            whole.layers[layer] = dict(s.plan.layers[local])
        whole.full_recompute += [(s.layers[a], s.layers[b - 1] + 1) for a, b in s.plan.full_recompute]
        if s.plan.offloads():
            whole.min_offloaded_tensor_size = s.plan.min_offloaded_tensor_size
    whole.full_recompute.sort()
    whole.pipeline = PipelineStages(
        ParallelLayout(pp=spec.layout.pp, vp=spec.layout.vp), tuple(s.peak for s in planned.stages)
    )
    return whole


def _fastest_uniform(
    spec: EstimateSpec, traced: Sequence[StageTrace], budget: int
) -> tuple[RecomputeConfig, Estimate] | None:
    """The fastest of Megatron's usual configs (`recompute_candidates`) whose peak fits `budget`
    on every rank, each lowered onto each rank's layers as Megatron does; None if none fits."""
    labels = frozenset().union(*(label for t in traced for label in t.trace.model_sites.labels))
    facts = facts_for_sites(labels, spec.facts())
    layers = facts.layers_per_chunk
    assert layers is not None  # the spec's checks split the layers
    best: tuple[RecomputeConfig, Estimate] | None = None
    for keys in [{}, *recompute_candidates(labels, layers)]:
        try:
            with warnings.catch_warnings():  # the candidates are Megatron's choices, advice or not
                warnings.simplefilter("ignore", RematWarning)
                config = RecomputeConfig(**keys, facts=facts)
                result = predict_stages(
                    "uniform", spec, traced, [rank_plan(config, spec, k) for k in range(len(traced))]
                )
        except ConfigError:  # a setting Megatron's rules refuse on this model is no candidate
            continue
        if result.peak <= budget and (best is None or result.step_time_s < best[1].step_time_s):
            best = (config, result)
    return best
