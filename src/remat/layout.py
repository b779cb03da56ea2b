"""ModelLayout: the sites a real model has, layer by layer; and the rules a RecomputeConfig must
also meet on that model (labels it has sites for, layer counts, layer sites to recompute whole)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from remat.labels import discard_labels, recompute_labels
from remat.problems import ConfigError, Problem, count, warn
from remat.recompute import RecomputeConfig, layers_per_chunk
from remat.rules import OFFLOAD_MODULES, OFFLOAD_SITES, selected


@dataclass(frozen=True)
class ModelLayout:
    """The sites a real model has: the labels in each transformer layer, in layer order."""

    labels: tuple[frozenset[str], ...]
    # Labels whose sites wrap a kernel that already recomputes internally (flash/SDPA attention).
    fused: frozenset[str] = frozenset()
    has_layer_sites: bool = True
    model: str = "this model"  # the model's class, as errors name it

    @property
    def num_layers(self) -> int:
        return len(self.labels)


def _model_labels(layout: ModelLayout) -> frozenset[str]:
    return frozenset().union(*layout.labels)


def _model_offload(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    if c.cpu_offloading and not layout.has_layer_sites:
        yield Problem("cpu_offloading", "offloads whole layers, and this model marks no 'layer' sites; add layer"
                                        " sites or use fine_grained_activation_offloading")
    elif c.cpu_offloading and c.cpu_offloading_num_layers >= layout.num_layers:
        yield Problem("cpu_offloading_num_layers", f"{c.cpu_offloading_num_layers} is not fewer than the model's"
                                                   f" {count(layout.num_layers, 'layer')} (the last layer's backward"
                                                   f" comes at once); set it below {layout.num_layers}")
    if c.fine_grained_activation_offloading:
        present = _model_labels(layout)
        offloadable = [m for m in OFFLOAD_MODULES if OFFLOAD_SITES[m] in present]
        for label in c.offload_modules:
            if OFFLOAD_SITES.get(label) not in present:
                yield Problem("offload_modules", f"{label!r} matches no site in {layout.model} (it can offload:"
                                                 f" {', '.join(offloadable) or 'none'}); drop {label!r}, or"
                                                 " offload whole layers with cpu_offloading")


def _model_discard_scope(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    discarding = [label for label in selected(c) if label in discard_labels()]
    if discarding and not layout.has_layer_sites:
        yield Problem("recompute_modules", f"{', '.join(map(repr, discarding))} use output-discarding"
                                           " recompute, which needs the model's 'layer' sites as its scope"
                                           " and this model marks none; add layer sites or drop them")


def _model_selected_labels(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    present = _model_labels(layout)
    has = ", ".join(label for label in recompute_labels() if label in present) or "none"
    for label in selected(c):
        if label not in present:
            yield Problem("recompute_modules", f"{label!r} matches no site in {layout.model} (its sites: {has});"
                                               f" drop {label!r}")


def _model_layer_sites(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    if c.recompute_granularity == "full" and not layout.has_layer_sites:
        yield Problem("recompute_granularity", "this model marks no 'layer' sites, so full recompute has"
                                               " nothing to wrap; use selective recompute")


def _model_layer_count(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    f, n = c.facts, layout.num_layers
    stages = f.pipeline_model_parallel_size * (f.virtual_pipeline_model_parallel_size or 1)
    if f.num_layers is not None and f.num_layers != n:
        yield Problem("num_layers", f"is {f.num_layers} but the model has {count(n, 'layer')}; set num_layers={n}"
                                    " or leave it unset")
    elif f.num_layers is None and n % stages:
        yield Problem("num_layers", f"the model's {count(n, 'layer')} {'does' if n == 1 else 'do'} not split evenly into {stages} (virtual)"
                                    " pipeline stages; change the pipeline sizes")


def _model_recompute_num_layers(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    f, k = c.facts, c.recompute_num_layers
    per_stage = layers_per_chunk(
        layout.num_layers, f.pipeline_model_parallel_size, f.virtual_pipeline_model_parallel_size
    )
    if c.recompute_granularity == "full" and k is not None and per_stage is not None and k > per_stage:
        yield Problem("recompute_num_layers", f"{k} is more than the model's {count(per_stage, 'layer')} per virtual"
                                              f" pipeline stage; set it between 1 and {per_stage}")


_MODEL_CHECKS: tuple[Callable[[RecomputeConfig, ModelLayout], Iterator[Problem]], ...] = (
    _model_offload, _model_discard_scope, _model_selected_labels, _model_layer_sites, _model_layer_count,
    _model_recompute_num_layers,
)


def check_config(config: RecomputeConfig, layout: ModelLayout) -> None:
    """Raise ConfigError if `config` cannot apply to a model with this layout; warn about waste."""
    problems = [p for check in _MODEL_CHECKS for p in check(config, layout)]
    if problems:
        raise ConfigError(problems)
    for label in selected(config):
        missing = [i for i, labels in enumerate(layout.labels) if label not in labels]
        if missing and len(missing) < layout.num_layers:
            there = ", ".join(sorted(frozenset().union(*(layout.labels[i] for i in missing)) & set(recompute_labels())))
            warn(f"recompute_modules: {label!r} acts on {count(layout.num_layers - len(missing), 'layer')} of "
                 f"{layout.num_layers}; {_layer_ranges(missing)} {'has' if len(missing) == 1 else 'have'} no "
                 f"{label!r} site, and it does nothing there (as Megatron's 'mlp' on MoE layers): their sites are "
                 f"{there or 'none'}")
    if "core_attn" in selected(config) and "core_attn" in layout.fused:
        warn("recompute_modules: 'core_attn' saves almost nothing: flash/SDPA attention already recomputes"
              " the attention matrix; drop core_attn")



def index_runs(layers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> 'layers 0-2, 5'."""
    return f"layer{'s' if len(layers) > 1 else ''} {index_runs(layers)}"
