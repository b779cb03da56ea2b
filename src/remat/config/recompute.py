"""RecomputeConfig: Megatron Core's activation-recompute and offload settings, with its names.

A `RecomputeConfig` holds Megatron's recompute and offload knobs plus the `TrainingFacts`
(parallel sizes, CUDA graphs, FP8, MoE/MLA switches) its rules depend on. Building one parses
every field, then runs every rule (`RULES`: those of `remat.config.rules`, then of
`remat.config.offload_rules`): all problems are raised at once as a `ConfigError`; advice goes out
as `RematWarning`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.config import offload_rules, rules
from remat.config.capture import Capture
from remat.config.fields import BadValue, default, parse_labels, parse_settings, public_names, to_public
from remat.config.megatron import RecomputeFields, TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.core.problems import ConfigError, Problem, count, did_you_mean, load_mapping, warn

RULES = [*rules.RULES, *offload_rules.RULES]
WARNING_RULES = rules.WARNING_RULES


@dataclass
class RecomputeConfig(RecomputeFields):
    """Megatron Core's activation-recompute and offload settings, validated on construction."""

    def __post_init__(self) -> None:
        problems = self._normalize()
        # A field with a type error already has its problem; rules judging its fallback would repeat it.
        reported = {p.field for p in problems}
        problems += [p for rule in RULES for p in rule(self) if p.field not in reported]
        if problems:
            raise ConfigError(problems)
        for rule in WARNING_RULES:
            for advice in rule(self):
                warn(str(advice))

    def _normalize(self) -> list[Problem]:
        values, problems = parse_settings(self)
        for name, value in values.items():
            setattr(self, name, value)
        problems += _facts_type_problems(self.facts)
        if problems and problems[-1].field == "facts":
            self.facts = TrainingFacts()
        self.facts, fact_problems = self.facts.parsed()
        # Megatron's default module list, applied only where it means something.
        if self.recompute_granularity == "selective" and self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        return problems + fact_problems

    @classmethod
    def from_megatron(cls, d: Mapping[str, Any]) -> RecomputeConfig:
        """Build from Megatron TransformerConfig keys: flat, `model.`-prefixed, or nested under "model"."""
        settings, problems = _read_megatron(d)
        problems += _convert_moe_layer_recompute(settings)
        recompute = {k: v for k, v in settings.items() if k in _RECOMPUTE_KEYS}
        try:
            config = cls(**recompute, facts=TrainingFacts.from_megatron(settings))
        except ConfigError as err:
            raise ConfigError(problems + err.problems) from None
        if problems:
            raise ConfigError(problems)
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RecomputeConfig:
        """Build from a YAML (.yaml, .yml) or JSON (.json) file holding Megatron settings."""
        return cls.from_megatron(load_mapping(Path(path)))

    def offloads(self) -> bool:
        """Whether anything goes to host memory (as Plan.offloads)."""
        return (self.cpu_offloading and self.cpu_offloading_num_layers > 0) or self.fine_grained_activation_offloading

    def on_layers(self, num_layers: int, stages: int = 1) -> RecomputeConfig:
        """This config as Megatron applies it to `num_layers` layers run as `stages` pipeline stages
        (one chunk's layers; a pipeline rank's chunks, back to back): `recompute_num_layers` counts
        per stage, as in each (virtual) stage of the whole run."""
        layout = dataclasses.replace(self.facts.layout, pp=stages, vp=None, schedule=None)
        return dataclasses.replace(self, facts=dataclasses.replace(self.facts, num_layers=num_layers, layout=layout))

    def to_megatron(self) -> dict[str, Any]:
        """A flat dict of Megatron keys that `from_megatron` turns back into an equal config."""
        return {**to_public(self), **self.facts.to_megatron()}

    def changed(self) -> list[str]:
        """The recompute and offload settings (not the facts) that differ from Megatron's defaults."""
        defaults = {f.name: default(f) for f in dataclasses.fields(RecomputeConfig)}
        return [name for name in _RECOMPUTE_KEYS if getattr(self, name) != defaults[name]]

    def describe(self) -> str:
        """A short human-readable summary of the resolved configuration."""
        return "\n".join(
            (
                _describe_recompute(self),
                _describe_offload(self),
                self.facts.layout.describe(),
                _describe_model(self.facts),
                self.facts.capture.describe(),
            )
        )


def _facts_type_problems(facts: Any) -> list[Problem]:
    """Facts, and their parts, of the wrong class."""
    if not isinstance(facts, TrainingFacts):
        return [Problem("facts", f"got {type(facts).__name__}; pass a TrainingFacts(...)")]
    kinds = {"layout": ParallelLayout, "capture": Capture, "precision": Precision}
    return [
        Problem(name, f"got {type(getattr(facts, name)).__name__}; pass a {kind.__name__}(...)")
        for name, kind in kinds.items()
        if not isinstance(getattr(facts, name), kind)
    ]


# The recompute and offload settings (Megatron's keys are their field names).
_RECOMPUTE_KEYS: tuple[str, ...] = tuple(public_names(RecomputeFields))


# ---------------------------------------------------------------------------------------------
# Reading Megatron settings.

# The deprecated switch Megatron still accepts.
_MOE_LAYER_RECOMPUTE = "moe_layer_recompute"
# Megatron model-shape keys found in real configs that no recompute rule reads.
_IGNORED_MEGATRON_KEYS: frozenset[str] = frozenset(
    {
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "seq_length",
        "max_position_embeddings",
        "vocab_size",
        "normalization",
        "layernorm_epsilon",
        "gated_linear_unit",
        "add_bias_linear",
        "position_embedding_type",
        "rotary_base",
        "moe_router_topk",
        "moe_ffn_hidden_size",
    }
)
_KNOWN_KEYS: frozenset[str] = (
    frozenset(_RECOMPUTE_KEYS)
    | frozenset(TrainingFacts().to_megatron())
    | {_MOE_LAYER_RECOMPUTE}
    | _IGNORED_MEGATRON_KEYS
)


def _megatron_items(d: Mapping[Any, Any]) -> Iterator[tuple[Any, Any]]:
    for key, value in d.items():
        if key == "model" and isinstance(value, Mapping):
            yield from ((f"model.{k}" if isinstance(k, str) else k, v) for k, v in value.items())
        else:
            yield key, value


def _read_megatron(d: Any) -> tuple[dict[str, Any], list[Problem]]:
    """Strip `model.` prefixes; report non-string, repeated and unknown keys; drop ignored ones."""
    if not isinstance(d, Mapping):
        return {}, [Problem("config", f"got {type(d).__name__}; pass a mapping of Megatron settings")]
    settings: dict[str, Any] = {}
    problems: list[Problem] = []
    for key, value in _megatron_items(d):
        if not isinstance(key, str):
            problems.append(Problem(repr(key), "setting names must be strings; fix the key"))
            continue
        name = key.removeprefix("model.")
        if key == "model":
            problems.append(Problem(key, "expected a mapping of model settings; nest them under model:"))
        elif name not in _KNOWN_KEYS:
            problems.append(
                Problem(key, f"not a setting remat reads{did_you_mean(name, _KNOWN_KEYS)}; fix the name or remove it")
            )
        elif name in settings:
            problems.append(Problem(key, "given twice (with and without the 'model.' prefix); keep one"))
        elif name not in _IGNORED_MEGATRON_KEYS:
            settings[name] = value
    return settings, problems


def _convert_moe_layer_recompute(settings: dict[str, Any]) -> list[Problem]:
    # Megatron's reading: the deprecated switch means selective recompute with "moe" appended to the
    # module list (which defaults to ["core_attn"] first, as in Megatron).
    flag = settings.pop(_MOE_LAYER_RECOMPUTE, False)
    if flag is False:
        return []
    if flag is not True:
        return [Problem(_MOE_LAYER_RECOMPUTE, f"got {flag!r}; set it to true or false")]
    granularity = settings.get("recompute_granularity")
    if granularity == "full":
        return [
            Problem(
                _MOE_LAYER_RECOMPUTE,
                "cannot be combined with recompute_granularity='full';"
                " remove moe_layer_recompute, or use selective recompute with 'moe'",
            )
        ]
    warn(
        "moe_layer_recompute is deprecated; set recompute_granularity='selective' and add 'moe' to"
        " recompute_modules instead"
    )
    if granularity not in (None, "selective"):
        return []  # the constructor reports the bad granularity
    modules = settings.get("recompute_modules")
    try:
        labels = ["core_attn"] if modules is None else parse_labels(modules)
    except BadValue:
        return []  # the constructor reports the bad module list
    settings["recompute_granularity"] = "selective"
    settings["recompute_modules"] = labels if "moe" in labels else [*labels, "moe"]
    return []


def recorded_config(keys: Mapping[str, Any]) -> RecomputeConfig:
    """Megatron keys as a result recorded them, fields parsed but no rule applied: results from other
    harnesses may hold configs these rules refuse, and `remat doctor` runs single rules on them."""
    config = RecomputeConfig.__new__(RecomputeConfig)
    for f in dataclasses.fields(RecomputeConfig):
        setattr(config, f.name, keys.get(f.name, default(f)))
    config.facts = TrainingFacts.from_megatron(keys)
    config._normalize()  # a field of the wrong type falls back to its default
    return config


# ---------------------------------------------------------------------------------------------
# A summary in words (`remat validate` prints it).


def _describe_recompute(c: RecomputeConfig) -> str:
    g, k, per_stage = c.recompute_granularity, c.recompute_num_layers, c.facts.layers_per_chunk
    stage = f" ({count(per_stage, 'layer')} per virtual stage)" if per_stage is not None else ""
    if g == "selective":
        line = f"recompute: selective, in every layer: {', '.join(c.recompute_modules or [])}"
    elif g == "full" and c.recompute_method == "uniform":
        line = f"recompute: full, uniform: every layer, in groups of {k}{stage}"
    elif g == "full":
        line = f"recompute: full, block: the first {count(k or 0, 'layer')} of each virtual stage{stage}, the rest keep activations"
    else:
        line = "recompute: off"
    if c.distribute_saved_activations:
        line += f"; saved layer inputs split over {c.facts.layout.tp} tensor-parallel ranks"
    return line


def _describe_offload(c: RecomputeConfig) -> str:
    if c.cpu_offloading:
        return f"offload: CPU, {count(c.cpu_offloading_num_layers, 'layer')}"
    if c.fine_grained_activation_offloading:
        return (
            f"offload: inputs of {', '.join(c.offload_modules)}"
            f" (tensors of {c.min_offloaded_tensor_size} elements or more)"
        )
    return "offload: off"


def _describe_model(f: TrainingFacts) -> str:
    parts = [count(f.num_layers, "layer") if f.num_layers is not None else "unknown number of layers"]
    if f.layers_per_chunk is not None:
        parts[0] += f" ({f.layers_per_chunk} per virtual stage)"
    if f.num_moe_experts is not None:
        parts.append(f"MoE with {f.num_moe_experts} experts")
    if f.multi_latent_attention:
        parts.append("MLA")
    if f.precision.fp8_format is not None:
        parts.append(f"fp8 {f.precision.fp8_format} ({f.precision.recipe})")
    parts.append(f"attention backend {f.attention_backend}")
    return "model: " + ", ".join(parts)
