"""Plan: an action for every site of every layer, plus the layer ranges recomputed whole.

`RecomputeConfig` (Megatron's fields) is the uniform way to say what to recompute; a `Plan` is
what it lowers to on a given model, and what remat's planner writes when layers differ. The
checks of a plan live here: a plan file's shape, and a plan against a model's sites.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from remat.config.fields import MIN_OFFLOADED_TENSOR_SIZE
from remat.config.model_sites import ModelSites
from remat.config.offload_rules import OFFLOAD_SITES
from remat.config.parallel import ParallelLayout
from remat.config.recompute import RecomputeConfig
from remat.core.labels import ACTIONS, LAYER, discard_labels, discard_only_labels, offload_only_labels, site_labels
from remat.core.problems import ConfigError, Problem, count, did_you_mean, load_mapping, one_of


@dataclass(frozen=True)
class PipelineStages:
    """The pipeline a plan was solved for, stage by stage (`remat plan` with pipeline parallelism):
    each stage's plan is the whole plan cut to the stage's layers; it holds only for this layout."""

    layout: ParallelLayout  # its pipeline sizes (pp, vp)
    predicted_peak_bytes: tuple[int, ...]  # each pipeline rank's, as planned

    def to_dict(self, num_layers: int) -> dict[str, Any]:
        return {
            "pipeline_model_parallel_size": self.layout.pp,
            "virtual_pipeline_model_parallel_size": self.layout.vp,
            "stages": [
                {"layers": list(self.layout.rank_layers(num_layers, k)), "predicted_peak_bytes": peak}
                for k, peak in enumerate(self.predicted_peak_bytes)
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineStages:
        return cls(ParallelLayout.from_megatron(data), tuple(stage["predicted_peak_bytes"] for stage in data["stages"]))

    def problems(self, layout: ParallelLayout) -> Iterator[Problem]:
        """A plan solved per stage holds for its own layout only."""
        planned, running = (self.layout.pp, self.layout.virtual), (layout.pp, layout.virtual)
        if planned != running:
            yield Problem(
                "pipeline",
                f"this plan was solved stage by stage for {_stages_words(*planned)}, and this"
                f" run has {_stages_words(*running)}; run it with -pp {planned[0]}"
                f"{f' -vp {planned[1]}' if planned[1] > 1 else ''} or plan again for this layout",
            )


def _stages_words(pp: int, vp: int) -> str:
    return f"{count(pp, 'pipeline stage')}" + (f" x {vp} virtual" if vp > 1 else "")


@dataclass
class Plan:
    """`layers[i]` maps a site label to its action in layer i (labels left out are kept);
    `full_recompute` lists half-open layer ranges [start, end) recomputed as one unit.

    `layers[i]["layer"] = "offload"` offloads everything layer i saves (what its recomputed sites
    keep included); on the first layer of a full-recompute range, the input the range keeps.
    `min_offloaded_tensor_size`: storages with fewer elements stay on the device.
    `pipeline`: the pipeline layout it was solved for stage by stage, if it was (not part of what
    the plan does: two plans that act alike are equal)."""

    layers: list[dict[str, str]]
    full_recompute: list[tuple[int, int]] = field(default_factory=list)
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    pipeline: PipelineStages | None = field(default=None, compare=False)

    @classmethod
    def none(cls, num_layers: int) -> Plan:
        return cls([{} for _ in range(num_layers)])

    @classmethod
    def from_config(cls, config: RecomputeConfig, model_sites: ModelSites) -> Plan:
        """Lower a Megatron-style config onto a model with `model_sites`."""
        plan = cls.none(model_sites.num_layers)
        if config.recompute_granularity == "selective":
            for labels, actions in zip(model_sites.labels, plan.layers):
                for label in config.recompute_modules or []:
                    if label in labels:
                        actions[label] = "discard" if label in discard_labels() else "recompute"
        elif config.recompute_granularity == "full":
            plan.full_recompute = _full_ranges(config, model_sites.num_layers)
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
            for i in range(model_sites.num_layers - 1):
                if i not in in_full:
                    plan.layers[i].update({label: "offload" for label in offloaded if label in model_sites.labels[i]})
        return plan

    def cut(self, layers: Sequence[int]) -> Plan:
        """The plan of a pipeline stage that runs `layers` of the model, in order (a range of full
        recompute lies within one stage: pipeline_range_problems)."""
        local = {layer: i for i, layer in enumerate(layers)}
        ranges = [(local[s], local[s] + e - s) for s, e in self.full_recompute if s in local]
        return Plan([dict(self.layers[i]) for i in layers], ranges, self.min_offloaded_tensor_size)

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
        if self.pipeline is not None:
            data["pipeline"] = self.pipeline.to_dict(len(self.layers))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        problems = plan_file_problems(data)
        if problems:
            raise ConfigError(problems)
        pipeline = PipelineStages.from_dict(data["pipeline"]) if "pipeline" in data else None
        return cls(
            [dict(a) for a in data["layers"]],
            [(int(s), int(e)) for s, e in data.get("full_recompute", [])],
            data.get("min_offloaded_tensor_size", MIN_OFFLOADED_TENSOR_SIZE),
            pipeline,
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        text = (
            json.dumps(self.to_dict(), indent=1)
            if path.suffix == ".json"
            else yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        )
        path.write_text(text)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_dict(load_mapping(Path(path)))

    def describe(self, numbers: Sequence[int] | None = None) -> str:
        """One line per run of consecutive layers that do the same thing; layer i is called
        `numbers[i]` if given (a pipeline rank's plan, in the model's numbers)."""
        name = list(numbers) if numbers is not None else list(range(len(self.layers)))
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
            if rows and rows[-1][2] == what and rows[-1][1] == name[i] - 1:
                rows[-1] = (rows[-1][0], name[i], what)
            else:
                rows.append((name[i], name[i], what))
        return "\n".join(f"layer {a}: {w}" if a == b else f"layers {a}-{b}: {w}" for a, b, w in rows)


def _full_ranges(config: RecomputeConfig, num_layers: int) -> list[tuple[int, int]]:
    """Megatron's uniform/block methods, applied to each (virtual) pipeline stage's chunk of layers."""
    per_chunk = num_layers // config.facts.layout.chunks
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


def load_plan_or_config(path: str | Path) -> Plan | RecomputeConfig:
    """What a plan file holds, as `remat plan -o` writes it: a per-layer plan (`remat_plan: 1`)
    or Megatron recompute keys (where a config expresses the plan); `remat.load_plan`."""
    data = load_mapping(Path(path))
    return Plan.from_dict(data) if "remat_plan" in data else RecomputeConfig.from_megatron(data)


# ---- checks ------------------------------------------------------------------------------


def _plan_layer(i: int, actions: Any, labels: frozenset[str], has_layer_sites: bool) -> Iterator[Problem]:
    if not isinstance(actions, Mapping):
        yield Problem(f"layers[{i}]", f"got {type(actions).__name__}; map each site label to an action")
        return
    for label, action in actions.items():
        name = f"layers[{i}].{label}"
        if label == LAYER:
            yield from _plan_layer_site(name, action, has_layer_sites)
            continue
        if label not in labels:
            yield Problem(
                name, f"layer {i} has no {label!r} site (its sites: {', '.join(sorted(labels)) or 'none'}); remove it"
            )
        if action not in ACTIONS:
            hint = did_you_mean(action, ACTIONS) if isinstance(action, str) else ""
            yield Problem(name, f"unknown action {action!r}{hint}; use one of {one_of(ACTIONS)}")
        elif action in ("recompute", "discard") and label in offload_only_labels():
            yield Problem(name, f"{label!r} marks a place to offload from; use 'offload' or 'keep'")
        elif action == "discard" and not has_layer_sites:
            yield Problem(
                name,
                "'discard' needs the enclosing 'layer' site as its scope and this model marks"
                " none; use 'recompute' or add layer sites",
            )
        elif action == "discard" and label not in discard_labels():
            yield Problem(
                name,
                f"only {one_of(sorted(discard_labels()))} outputs are discarded (their "
                f"consumers save them anyway); use 'recompute' for {label!r}",
            )
        elif action == "recompute" and label in discard_only_labels():
            yield Problem(
                name, f"{label!r}'s output is all its consumer saves, so a plain recompute frees nothing; use 'discard'"
            )


def _plan_layer_site(name: str, action: Any, has_layer_sites: bool) -> Iterator[Problem]:
    if not has_layer_sites:
        yield Problem(name, "this model marks no 'layer' sites; offload the sites inside its layers instead")
    elif action not in ("keep", "offload"):
        yield Problem(
            name,
            f"a whole layer can be kept or offloaded here (got {action!r}); recompute whole"
            " layers with full_recompute ranges",
        )


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plan_ranges(
    full_recompute: Sequence[Any], model_sites: ModelSites
) -> tuple[list[tuple[int, int, int]], list[Problem]]:
    """Check the [start, end) ranges; return the usable ones as (index, start, end) and the problems."""
    n = model_sites.num_layers
    usable: list[tuple[int, int, int]] = []
    problems: list[Problem] = []
    if full_recompute and not model_sites.has_layer_sites:
        problems.append(
            Problem(
                "full_recompute",
                "this model marks no 'layer' sites, so whole layers cannot be recomputed; leave full_recompute empty",
            )
        )
    for k, rng in enumerate(full_recompute):
        name = f"full_recompute[{k}]"
        if not (isinstance(rng, Sequence) and len(rng) == 2 and all(map(_is_index, rng))):
            problems.append(Problem(name, f"got {rng!r}; give a [start, end) pair of layer indices"))
            continue
        start, end = rng
        if start >= end:
            problems.append(Problem(name, f"[{start}, {end}) is empty; end must be greater than start"))
        elif start < 0 or end > n:
            problems.append(Problem(name, f"[{start}, {end}) reaches outside the model's layers [0, {n})"))
        elif usable and start < usable[-1][2]:
            j, prev_start, prev_end = usable[-1]
            how = "comes before" if start < prev_start else "overlaps"
            problems.append(
                Problem(
                    name,
                    f"[{start}, {end}) {how} full_recompute[{j}] [{prev_start}, {prev_end});"
                    " list disjoint ranges in layer order",
                )
            )
        else:
            usable.append((k, start, end))
    return usable, problems


def _plan_inside_full(layers: Sequence[Any], ranges: list[tuple[int, int, int]]) -> Iterator[Problem]:
    for k, start, end in ranges:
        for i in range(start, min(end, len(layers))):
            if not isinstance(layers[i], Mapping):
                continue
            for label, action in layers[i].items():
                if label == LAYER and action == "offload" and i != start:
                    yield Problem(
                        f"layers[{i}].{label}",
                        f"only the first layer of full_recompute[{k}] [{start}, {end})"
                        f" keeps an input to offload; set layers[{start}].layer",
                    )
                elif action != "keep" and not (label == LAYER and action == "offload"):
                    yield Problem(
                        f"layers[{i}].{label}",
                        f"layer {i} is inside full_recompute[{k}] [{start}, {end}),"
                        " which recomputes the whole layer; set it to 'keep'",
                    )


PLAN_FORMAT = 1  # the `remat_plan:` version a plan file starts with
_PLAN_KEYS = ("remat_plan", "layers", "full_recompute", "min_offloaded_tensor_size", "pipeline")


def plan_file_problems(data: Mapping[str, Any]) -> list[Problem]:
    """What is wrong with the shape of a per-layer plan file's mapping (before any model is known)."""
    problems = []
    if "remat_plan" not in data:
        problems.append(
            Problem(
                "remat_plan",
                f"expected `remat_plan: {PLAN_FORMAT}` at the top of a plan file; a file of Megatron"
                " recompute keys (what `remat plan -o` writes where a config expresses the plan) loads"
                " with remat.load_plan, which reads either",
            )
        )
    elif data["remat_plan"] != PLAN_FORMAT:
        problems.append(
            Problem(
                "remat_plan",
                f"{data['remat_plan']!r} is not a plan format this remat reads;"
                f" it reads `remat_plan: {PLAN_FORMAT}` (write the plan again with"
                " this version's `remat plan`)",
            )
        )
    layers = data.get("layers")
    if not isinstance(layers, list) or not all(isinstance(a, Mapping) for a in layers):
        problems.append(Problem("layers", "expected a list with one mapping of label: action per layer"))
    else:  # what needs no model: known labels and actions
        problems += [p for i, actions in enumerate(layers) for p in _layer_words(i, actions)]
    ranges = data.get("full_recompute", [])
    if not isinstance(ranges, list) or not all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(map(_is_index, r)) for r in ranges
    ):
        problems.append(Problem("full_recompute", "expected a list of [start, end) layer index pairs"))
    min_size = data.get("min_offloaded_tensor_size", MIN_OFFLOADED_TENSOR_SIZE)
    if not _is_index(min_size) or min_size < 0:
        problems.append(
            Problem("min_offloaded_tensor_size", f"got {min_size!r}; set it to a whole number of elements, 0 or more")
        )
    if "pipeline" in data:
        problems += _pipeline_section_problems(data["pipeline"], len(layers) if isinstance(layers, list) else None)
    unknown = sorted(map(str, set(data) - set(_PLAN_KEYS)))
    if unknown:
        problems.append(Problem(", ".join(unknown), f"unknown plan keys; a plan has {', '.join(_PLAN_KEYS)}"))
    return problems


def _pipeline_section_problems(section: Any, num_layers: int | None) -> list[Problem]:
    """A plan file's `pipeline:` section: the layout, and one stage entry per pipeline rank with
    the layers that rank runs."""
    shape = (
        "expected pipeline_model_parallel_size, virtual_pipeline_model_parallel_size and one entry per"
        " stage under stages, each with its layers and predicted_peak_bytes (as remat plan writes them)"
    )
    if not isinstance(section, Mapping):
        return [Problem("pipeline", shape)]
    pp: Any = section.get("pipeline_model_parallel_size")
    vpp: Any = section.get("virtual_pipeline_model_parallel_size")
    stages: Any = section.get("stages")
    if not (_is_index(pp) and pp >= 1 and (vpp is None or _is_index(vpp) and vpp >= 1)):
        return [Problem("pipeline", shape)]
    if not (
        isinstance(stages, list)
        and len(stages) == pp
        and all(isinstance(st, Mapping) and _is_index(st.get("predicted_peak_bytes")) for st in stages)
    ):
        return [Problem("pipeline", shape)]
    if num_layers is None:
        return []
    layout = ParallelLayout(pp=pp, vp=vpp)
    if layout.layers_per_chunk(num_layers) is None:
        return [Problem("pipeline", f"{count(num_layers, 'layer')} do not split into {pp} x {vpp or 1} model chunks")]
    return [
        Problem(f"pipeline.stages[{k}].layers", f"pipeline rank {k} runs layers {expected}, not {st.get('layers')}")
        for k, st in enumerate(stages)
        if st.get("layers") != (expected := list(layout.rank_layers(num_layers, k)))
    ]


def _layer_words(i: int, actions: Mapping[Any, Any]) -> Iterator[Problem]:
    for label, action in actions.items():
        name = f"layers[{i}].{label}"
        if label not in site_labels():
            hint = did_you_mean(label, site_labels()) if isinstance(label, str) else ""
            yield Problem(name, f"unknown site label {label!r}{hint}; use one of {one_of(site_labels())}")
        if action not in ACTIONS:
            hint = did_you_mean(action, ACTIONS) if isinstance(action, str) else ""
            yield Problem(name, f"unknown action {action!r}{hint}; use one of {one_of(ACTIONS)}")


def check_plan(
    layers: Sequence[Mapping[str, str]], full_recompute: Sequence[tuple[int, int]], model_sites: ModelSites
) -> None:
    """Raise ConfigError listing everything wrong with a per-layer plan for a model with these sites.

    `layers[i]` maps site label -> action; `full_recompute` lists [start, end) layer ranges recomputed
    as one unit.
    """
    problems: list[Problem] = []
    if len(layers) != model_sites.num_layers:
        problems.append(
            Problem(
                "layers",
                f"the plan has {count(len(layers), 'layer')} but the model has"
                f" {model_sites.num_layers}; give one entry per layer",
            )
        )
    for i, (actions, labels) in enumerate(zip(layers, model_sites.labels)):
        problems += _plan_layer(i, actions, labels, model_sites.has_layer_sites)
    ranges, range_problems = _plan_ranges(full_recompute, model_sites)
    problems += range_problems
    problems += _plan_inside_full(layers, ranges)
    if problems:
        raise ConfigError(problems)


def plan_pipeline_problems(plan: Plan, layout: ParallelLayout) -> Iterator[Problem]:
    """A per-layer plan against a run's pipeline: its ranges within model chunks, and the layout
    it was solved for, if it was solved stage by stage."""
    yield from pipeline_range_problems(plan.full_recompute, len(plan.layers), layout)
    if plan.pipeline is not None:
        yield from plan.pipeline.problems(layout)


def pipeline_range_problems(
    full_recompute: Sequence[tuple[int, int]], num_layers: int, layout: ParallelLayout
) -> Iterator[Problem]:
    """A per-layer plan's full-recompute ranges under pipeline parallelism. Each model chunk (a
    pipeline stage, or one of a rank's virtual stages) runs as its own block, and Megatron
    recomputes within it: a range cannot reach into the next chunk, which runs apart from it (on
    another rank, or later on the same one)."""
    pp, vpp = layout.pp, layout.vp
    per_chunk = layout.layers_per_chunk(num_layers)
    if pp == 1 or per_chunk is None:  # no chunks, or a split the pipeline rules already refuse
        return
    for k, (start, end) in enumerate(full_recompute):
        cuts = list(range(start - start % per_chunk + per_chunk, end, per_chunk))
        if not cuts:
            continue
        shown = ", ".join(map(str, range(start // per_chunk, (end - 1) // per_chunk + 1)))
        where = (
            f"virtual pipeline stages {shown} ({per_chunk} layers each; stage c runs on pipeline rank c mod {pp})"
            if vpp
            else f"pipeline stages {shown} ({per_chunk} layers each)"
        )
        yield Problem(
            f"full_recompute[{k}]",
            f"[{start}, {end}) spans {where}, and each stage recomputes only "
            f"its own layers; split the range at layer"
            f"{'s' if len(cuts) > 1 else ''} {', '.join(map(str, cuts))}",
        )
