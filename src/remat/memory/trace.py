"""trace(): measure what each site's action frees, per layer, and predict any plan's saved bytes.

A layer's sites interact (a discarded norm output is also the MLP's input), so the trace measures
every combination of actions in a layer, not each site alone; layers interact only through the
residual stream, so per-layer effects add up. Layers of the same structure (site labels and
parameter shapes) are measured once, on a representative layer.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.apply import apply, find_sites
from remat.config import ModelLayout, RecomputeConfig, check_model, check_plan
from remat.memory.live import measure_saved
from remat.plans import Plan

Combo = frozenset[tuple[str, str]]  # (label, action) pairs that differ from keep


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to leave alive after the forward pass, without running it."""

    saved_bytes: int


@dataclass(frozen=True)
class LayerEffects:
    """Bytes a layer frees under each combination of site actions, and under full recompute."""

    freed: dict[Combo, int]
    full_freed: int  # recomputing this layer alone as a group (its input kept)
    input_bytes: int  # the layer's input, freed too when the layer is inside a larger group


@dataclass(frozen=True)
class Trace:
    layout: ModelLayout
    baseline_saved_bytes: int  # no recompute
    layers: tuple[LayerEffects, ...]

    def predict(self, plan: RecomputeConfig | Plan | None) -> Prediction:
        resolved = _resolve(plan, self.layout)
        freed = 0
        grouped: set[int] = set()
        for start, end in resolved.full_recompute:
            freed += sum(self.layers[i].full_freed for i in range(start, end))
            freed += sum(self.layers[i].input_bytes for i in range(start + 1, end))
            grouped.update(range(start, end))
        for i, actions in enumerate(resolved.layers):
            if i not in grouped:
                freed += self.layers[i].freed[_combo(actions)]
        return Prediction(self.baseline_saved_bytes - freed)


def _combo(actions: dict[str, str]) -> Combo:
    return frozenset((label, action) for label, action in actions.items() if action != "keep")


def _resolve(plan: RecomputeConfig | Plan | None, layout: ModelLayout) -> Plan:
    if plan is None:
        return Plan.none(layout.num_layers)
    if isinstance(plan, RecomputeConfig):
        check_model(plan, layout)
        return Plan.from_config(plan, layout)
    check_plan(plan.layers, plan.full_recompute, layout)
    return plan


def _signature(model: nn.Module, layer_index: int, layout: ModelLayout) -> tuple[Any, ...]:
    """Layers with equal signatures free equal bytes: same site labels, same parameter shapes."""
    site = find_sites(model).layers[layer_index] if layout.has_layer_sites else None
    owner = _owner_module(model, site)
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in owner.named_parameters()) if owner else ()
    return layout.labels[layer_index], shapes


def _owner_module(model: nn.Module, site: nn.Module | None) -> nn.Module | None:
    if site is None:
        return None
    for module in model.modules():
        if any(child is site for child in module.children()):
            return module
    return None


def _combos(labels: frozenset[str], has_layer_sites: bool) -> list[Combo]:
    actions = ("keep", "recompute", "discard") if has_layer_sites else ("keep", "recompute")
    ordered = sorted(labels)
    return [_combo(dict(zip(ordered, choice))) for choice in itertools.product(actions, repeat=len(ordered))]


def trace(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> Trace:
    """Measure, with forward passes on this batch, what every action frees in every layer.

    The model's plan is restored afterwards (to no recompute). Dropout draws the same masks in
    every pass (fixed seed), so the passes differ only in what they keep.
    """
    layout = find_sites(model).layout
    n = layout.num_layers

    def saved(plan: Plan) -> int:
        apply(model, plan)
        torch.manual_seed(seed)
        loss, memory = measure_saved(lambda: model(input_ids, labels))
        del loss
        return memory.bytes

    baseline = saved(Plan.none(n))
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i in range(n):
        groups.setdefault(_signature(model, i, layout), []).append(i)
    effects: dict[int, LayerEffects] = {}
    for indices in groups.values():
        # the last layer of the kind has a predecessor to measure a two-layer group with
        measured = _measure_layer(saved, baseline, n, max(indices), layout)
        effects.update((i, measured) for i in indices)
    apply(model, None)
    return Trace(layout, baseline, tuple(effects[i] for i in range(n)))


def _measure_layer(saved: Any, baseline: int, n: int, i: int, layout: ModelLayout) -> LayerEffects:
    freed = {}
    for combo in _combos(layout.labels[i], layout.has_layer_sites):
        plan = Plan.none(n)
        plan.layers[i] = dict(combo)
        freed[combo] = baseline - saved(plan)
    full_freed = input_bytes = 0
    if layout.has_layer_sites:
        def group_freed(start: int, end: int) -> int:
            return baseline - saved(Plan(Plan.none(n).layers, [(start, end)]))

        full_freed = group_freed(i, i + 1)
        if i > 0:  # one group over layers i-1 and i frees layer i's input as well
            input_bytes = group_freed(i - 1, i + 1) - full_freed - group_freed(i - 1, i)
    return LayerEffects(freed, full_freed, input_bytes)
