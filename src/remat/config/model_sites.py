"""ModelSites: the sites a real model has, layer by layer; and the rules a RecomputeConfig must
also meet on that model (labels it has sites for, layer counts, layer sites to recompute whole)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from remat.config.offload_rules import OFFLOAD_MODULES, OFFLOAD_SITES
from remat.config.recompute import RecomputeConfig
from remat.config.rules import selected
from remat.core.labels import discard_labels, recompute_labels
from remat.core.problems import ConfigError, Problem, count, warn


@dataclass(frozen=True)
class ModelSites:
    """The sites a real model has: the labels in each transformer layer, in layer order."""

    labels: tuple[frozenset[str], ...]
    # Labels whose sites wrap a kernel that already recomputes internally (flash/SDPA attention).
    fused: frozenset[str] = frozenset()
    has_layer_sites: bool = True
    model: str = "this model"  # the model's class, as errors name it

    @property
    def num_layers(self) -> int:
        return len(self.labels)


def _model_labels(model_sites: ModelSites) -> frozenset[str]:
    return frozenset().union(*model_sites.labels)


def _model_offload(c: RecomputeConfig, model_sites: ModelSites) -> Iterator[Problem]:
    if c.cpu_offloading and not model_sites.has_layer_sites:
        yield Problem(
            "cpu_offloading",
            "offloads whole layers, and this model marks no 'layer' sites; add layer"
            " sites or use fine_grained_activation_offloading",
        )
    elif c.cpu_offloading and c.cpu_offloading_num_layers >= model_sites.num_layers:
        yield Problem(
            "cpu_offloading_num_layers",
            f"{c.cpu_offloading_num_layers} is not fewer than the model's"
            f" {count(model_sites.num_layers, 'layer')} (the last layer's backward"
            f" comes at once); set it below {model_sites.num_layers}",
        )
    if c.fine_grained_activation_offloading:
        present = _model_labels(model_sites)
        offloadable = [m for m in OFFLOAD_MODULES if OFFLOAD_SITES[m] in present]
        for label in c.offload_modules:
            if OFFLOAD_SITES.get(label) not in present:
                yield Problem(
                    "offload_modules",
                    f"{label!r} matches no site in {model_sites.model} (it can offload:"
                    f" {', '.join(offloadable) or 'none'}); drop {label!r}, or"
                    " offload whole layers with cpu_offloading",
                )


def _model_discard_scope(c: RecomputeConfig, model_sites: ModelSites) -> Iterator[Problem]:
    discarding = [label for label in selected(c) if label in discard_labels()]
    if discarding and not model_sites.has_layer_sites:
        yield Problem(
            "recompute_modules",
            f"{', '.join(map(repr, discarding))} use output-discarding"
            " recompute, which needs the model's 'layer' sites as its scope"
            " and this model marks none; add layer sites or drop them",
        )


def _model_selected_labels(c: RecomputeConfig, model_sites: ModelSites) -> Iterator[Problem]:
    present = _model_labels(model_sites)
    has = ", ".join(label for label in recompute_labels() if label in present) or "none"
    for label in selected(c):
        if label not in present:
            yield Problem(
                "recompute_modules",
                f"{label!r} matches no site in {model_sites.model} (its sites: {has}); drop {label!r}",
            )


def _model_layer_sites(c: RecomputeConfig, model_sites: ModelSites) -> Iterator[Problem]:
    if c.recompute_granularity == "full" and not model_sites.has_layer_sites:
        yield Problem(
            "recompute_granularity",
            "this model marks no 'layer' sites, so full recompute has nothing to wrap; use selective recompute",
        )


def _model_layer_count(c: RecomputeConfig, model_sites: ModelSites) -> Iterator[Problem]:
    f, n = c.facts, model_sites.num_layers
    stages = f.layout.chunks
    if f.num_layers is not None and f.num_layers != n:
        yield Problem(
            "num_layers",
            f"is {f.num_layers} but the model has {count(n, 'layer')}; set num_layers={n} or leave it unset",
        )
    elif f.num_layers is None and n % stages:
        yield Problem(
            "num_layers",
            f"the model's {count(n, 'layer')} {'does' if n == 1 else 'do'} not split evenly into {stages} (virtual)"
            " pipeline stages; change the pipeline sizes",
        )


def _model_recompute_num_layers(c: RecomputeConfig, model_sites: ModelSites) -> Iterator[Problem]:
    f, k = c.facts, c.recompute_num_layers
    per_stage = f.layout.layers_per_chunk(model_sites.num_layers)
    if c.recompute_granularity == "full" and k is not None and per_stage is not None and k > per_stage:
        yield Problem(
            "recompute_num_layers",
            f"{k} is more than the model's {count(per_stage, 'layer')} per virtual"
            f" pipeline stage; set it between 1 and {per_stage}",
        )


_MODEL_CHECKS: tuple[Callable[[RecomputeConfig, ModelSites], Iterator[Problem]], ...] = (
    _model_offload,
    _model_discard_scope,
    _model_selected_labels,
    _model_layer_sites,
    _model_layer_count,
    _model_recompute_num_layers,
)


def check_config(config: RecomputeConfig, model_sites: ModelSites) -> None:
    """Raise ConfigError if `config` cannot apply to a model with these sites; warn about waste."""
    problems = [p for check in _MODEL_CHECKS for p in check(config, model_sites)]
    if problems:
        raise ConfigError(problems)
    for label in selected(config):
        missing = [i for i, labels in enumerate(model_sites.labels) if label not in labels]
        if missing and len(missing) < model_sites.num_layers:
            there = ", ".join(
                sorted(frozenset().union(*(model_sites.labels[i] for i in missing)) & set(recompute_labels()))
            )
            warn(
                f"recompute_modules: {label!r} acts on {count(model_sites.num_layers - len(missing), 'layer')} of "
                f"{model_sites.num_layers}; {_layer_ranges(missing)} {'has' if len(missing) == 1 else 'have'} no "
                f"{label!r} site, and it does nothing there (as Megatron's 'mlp' on MoE layers): their sites are "
                f"{there or 'none'}"
            )
    if "core_attn" in selected(config) and "core_attn" in model_sites.fused:
        warn(
            "recompute_modules: 'core_attn' saves almost nothing: flash/SDPA attention already recomputes"
            " the attention matrix; drop core_attn"
        )


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
