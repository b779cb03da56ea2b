"""Per-layer plans: an action for every site of every layer, plus full-recompute layer ranges.

`RecomputeConfig` (Megatron's fields) is the uniform way to say what to recompute; a `Plan` is
what it lowers to on a given model, and what remat's planner writes when layers differ.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from remat.config import (
    DISCARD_MODULES,
    LAYER,
    MIN_OFFLOADED_TENSOR_SIZE,
    OFFLOAD_SITES,
    PLAN_FORMAT,
    ConfigError,
    ModelLayout,
    RecomputeConfig,
    load_mapping,
    plan_file_problems,
)


@dataclass
class Plan:
    """`layers[i]` maps a site label to its action in layer i (labels left out are kept);
    `full_recompute` lists half-open layer ranges [start, end) recomputed as one unit.

    `layers[i]["layer"] = "offload"` offloads everything layer i saves (what its recomputed sites
    keep included); on the first layer of a full-recompute range, the input the range keeps.
    `min_offloaded_tensor_size`: storages with fewer elements stay on the device."""

    layers: list[dict[str, str]]
    full_recompute: list[tuple[int, int]] = field(default_factory=list)
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE

    @classmethod
    def none(cls, num_layers: int) -> "Plan":
        return cls([{} for _ in range(num_layers)])

    @classmethod
    def from_config(cls, config: RecomputeConfig, layout: ModelLayout) -> "Plan":
        """Lower a Megatron-style config onto a model with `layout`."""
        plan = cls.none(layout.num_layers)
        if config.recompute_granularity == "selective":
            for labels, actions in zip(layout.labels, plan.layers):
                for label in config.recompute_modules or []:
                    if label in labels:
                        actions[label] = "discard" if label in DISCARD_MODULES else "recompute"
        elif config.recompute_granularity == "full":
            plan.full_recompute = _full_ranges(config, layout.num_layers)
        plan.min_offloaded_tensor_size = config.min_offloaded_tensor_size
        in_full = {i for s, e in plan.full_recompute for i in range(s, e)}
        starts = {s for s, _ in plan.full_recompute}
        if config.cpu_offloading:  # Megatron offloads the first N layers (N < num_layers)
            for i in range(config.cpu_offloading_num_layers):
                if i in starts or i not in in_full:
                    plan.layers[i][LAYER] = "offload"
        if config.fine_grained_activation_offloading:
            offloaded = {site for site in (OFFLOAD_SITES[m] for m in config.offload_modules) if site is not None}
            # the last layer's backward comes right after the forward: nothing to hide its copies
            for i in range(layout.num_layers - 1):
                if i not in in_full:
                    plan.layers[i].update({label: "offload" for label in offloaded if label in layout.labels[i]})
        return plan

    def offloads(self) -> bool:
        return any(a == "offload" for actions in self.layers for a in actions.values())

    # ---- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "remat_plan": PLAN_FORMAT,
            "layers": [dict(sorted(a.items())) for a in self.layers],
            "full_recompute": [list(r) for r in self.full_recompute],
        }
        if self.offloads() or self.min_offloaded_tensor_size != MIN_OFFLOADED_TENSOR_SIZE:
            data["min_offloaded_tensor_size"] = self.min_offloaded_tensor_size
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        problems = plan_file_problems(data)
        if problems:
            raise ConfigError(problems)
        return cls([dict(a) for a in data["layers"]], [(int(s), int(e)) for s, e in data.get("full_recompute", [])],
                   data.get("min_offloaded_tensor_size", MIN_OFFLOADED_TENSOR_SIZE))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        text = (json.dumps(self.to_dict(), indent=1) if path.suffix == ".json"
                else yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None))
        path.write_text(text)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(load_mapping(Path(path)))

    def describe(self) -> str:
        """One line per run of consecutive layers that do the same thing."""
        in_full = {i: (s, e) for s, e in self.full_recompute for i in range(s, e)}
        rows: list[tuple[int, int, str]] = []  # first layer, last layer, what they do
        for i, actions in enumerate(self.layers):
            if i in in_full:
                start, end = in_full[i]
                what = f"full recompute, groups of {end - start}"
                if self.layers[start].get(LAYER) == "offload":
                    what += ", inputs offloaded"
            else:
                shown = ", ".join(f"{k}={v}" for k, v in sorted(actions.items()) if v != "keep")
                what = shown or "keep everything"
            if rows and rows[-1][2] == what and rows[-1][1] == i - 1:
                rows[-1] = (rows[-1][0], i, what)
            else:
                rows.append((i, i, what))
        return "\n".join(f"layer {a}: {w}" if a == b else f"layers {a}-{b}: {w}" for a, b, w in rows)


def _full_ranges(config: RecomputeConfig, num_layers: int) -> list[tuple[int, int]]:
    """Megatron's uniform/block methods, applied to each (virtual) pipeline stage's chunk of layers."""
    facts = config.facts
    chunks = facts.pipeline_model_parallel_size * (facts.virtual_pipeline_model_parallel_size or 1)
    per_chunk = num_layers // chunks
    k = config.recompute_num_layers or 0
    ranges: list[tuple[int, int]] = []
    for first in range(0, num_layers, per_chunk):
        end = first + per_chunk
        if config.recompute_method == "uniform":
            ranges += [(s, min(s + k, end)) for s in range(first, end, k)]
        else:  # block: the first k layers of the chunk, one by one
            ranges += [(s, s + 1) for s in range(first, min(first + k, end))]
    return ranges


PlanLike = RecomputeConfig | Plan | None  # what apply() takes


def load_plan_or_config(path: str | Path) -> "Plan | RecomputeConfig":
    """A file may hold a per-layer plan (`remat_plan: 1`) or Megatron recompute keys."""
    data = load_mapping(Path(path))
    return Plan.from_dict(data) if "remat_plan" in data else RecomputeConfig.from_megatron(data)
