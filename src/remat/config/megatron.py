"""Megatron's recompute and offload settings as declared fields, and the facts of a run that
their rules read. `RecomputeFields` holds the settings alone; `remat.config.recompute.RecomputeConfig`
adds their checks. Each field's parser checks its type before any rule runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from remat.config.capture import Capture
from remat.config.fields import (
    MIN_OFFLOADED_TENSOR_SIZE,
    from_public,
    optional,
    parse_bool,
    parse_float,
    parse_int,
    parse_labels,
    parse_labels_or_empty,
    parse_settings,
    parse_str,
    setting,
    to_public,
)
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.core.labels import labels_without_model, recompute_labels
from remat.core.problems import Problem

# The values Megatron accepts for each setting.
GRANULARITIES: tuple[str, ...] = ("full", "selective")
METHODS: tuple[str, ...] = ("uniform", "block")


@dataclass(frozen=True)
class TrainingFacts:
    """What the recompute rules read of a run: the model's layers, dropout and MoE/MLA switches
    (Megatron's names and defaults), and the run's parallel layout, CUDA graphs and precision."""

    num_layers: int | None = setting(None, parse=optional(parse_int))
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    capture: Capture = field(default_factory=Capture)
    precision: Precision = field(default_factory=Precision)
    # None: not said; the model a config is applied to tells (its moe_act and mla_up_proj Sites)
    moe_grouped_gemm: bool | None = setting(None, parse=optional(parse_bool))
    multi_latent_attention: bool | None = setting(None, parse=optional(parse_bool))
    num_moe_experts: int | None = setting(None, parse=optional(parse_int))
    moe_shared_expert_intermediate_size: int | None = setting(None, parse=optional(parse_int))
    moe_shared_expert_overlap: bool = setting(False, parse=parse_bool)
    overlap_moe_expert_parallel_comm: bool = setting(False, parse=parse_bool)
    attention_dropout: float = setting(0.1, parse=parse_float)
    hidden_dropout: float = setting(0.1, parse=parse_float)
    attention_backend: str = setting("auto", parse=parse_str)

    @property
    def layers_per_chunk(self) -> int | None:
        """Layers per model chunk: num_layers // (pp x vp); None if num_layers is unknown or does not split."""
        return self.layout.layers_per_chunk(self.num_layers)

    def parsed(self) -> tuple[TrainingFacts, list[Problem]]:
        """These facts with every value parsed, its parts' too; a value of the wrong type is a
        problem and falls back to its default."""
        values, problems = parse_settings(self)
        for name in PARTS:
            part_values, part_problems = parse_settings(getattr(self, name))
            values[name] = dataclasses.replace(getattr(self, name), **part_values)
            problems += part_problems
        return dataclasses.replace(self, **values), problems

    @classmethod
    def from_megatron(cls, keys: Mapping[str, Any]) -> TrainingFacts:
        """The facts among flat Megatron keys (others ignored)."""
        return cls(
            layout=ParallelLayout.from_megatron(keys),
            capture=Capture.from_megatron(keys),
            precision=Precision.from_megatron(keys),
            **from_public(cls, keys),
        )

    def to_megatron(self) -> dict[str, Any]:
        return {
            **to_public(self),
            **self.layout.to_megatron(),
            **self.capture.to_megatron(),
            **self.precision.to_megatron(),
        }


# The values a TrainingFacts holds whole, each with Megatron keys of its own.
PARTS = ("layout", "capture", "precision")


def _modules_help() -> str:
    megatron = [label for label in recompute_labels() if label != "mlp_act"]
    return (
        f"selective labels, comma separated ({', '.join(megatron)}; remat's mlp_act; Megatron's "
        f"{', '.join(labels_without_model())} are refused: no remat model has their layers yet); "
        "implies --recompute_granularity selective"
    )


@dataclass
class RecomputeFields:
    """Megatron Core's activation-recompute and offload settings (its names and defaults), unchecked."""

    recompute_granularity: str | None = setting(
        None,
        parse=optional(parse_str),
        flag=True,
        choices=GRANULARITIES,
        help="full: whole layers; selective: the modules in --recompute_modules",
    )
    recompute_method: str | None = setting(None, parse=optional(parse_str), flag=True, choices=METHODS)
    recompute_num_layers: int | None = setting(
        None,
        parse=optional(parse_int),
        flag=True,
        short="-rl",
        metavar="N",
        help="full recompute of N layers per (virtual) stage; implies full"
        " granularity and, unless --recompute_method says otherwise,"
        " the block method",
    )
    recompute_modules: list[str] | None = setting(
        None, parse=optional(parse_labels), flag=True, metavar="A,B", help=_modules_help
    )
    distribute_saved_activations: bool = setting(
        False,
        parse=parse_bool,
        flag=True,
        help="full recompute keeps 1/tp of each range's input on each"
        " tensor-parallel rank, all-gathered before its replay (not"
        " with --sequence_parallel)",
    )
    cpu_offloading: bool = setting(False, parse=parse_bool)
    cpu_offloading_num_layers: int = setting(
        0,
        parse=parse_int,
        flag="--activation_offload_layers",
        short="-ol",
        metavar="N",
        help="offload what the first N layers save to host"
        " memory (cpu_offloading); with full recompute,"
        " the inputs its groups keep",
    )
    fine_grained_activation_offloading: bool = setting(False, parse=parse_bool)
    offload_modules: list[str] = setting(parse=parse_labels_or_empty, default_factory=list)
    min_offloaded_tensor_size: int = setting(
        MIN_OFFLOADED_TENSOR_SIZE,
        parse=parse_int,
        flag=True,
        metavar="N",
        help=f"tensors of fewer elements stay on the GPU (default {MIN_OFFLOADED_TENSOR_SIZE})",
    )
    activation_offload_fraction: float = setting(1.0, parse=parse_float)
    facts: TrainingFacts = field(default_factory=TrainingFacts)
