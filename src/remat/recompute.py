"""RecomputeConfig: Megatron Core's activation-recompute and offload settings, with its names.

A `RecomputeConfig` holds Megatron's recompute and offload knobs plus the `TrainingFacts`
(parallel sizes, CUDA graphs, FP8, MoE/MLA switches) its rules depend on. Building one parses
every field, then runs every rule of `remat.rules`: all problems are raised at once as a
`ConfigError`; advice goes out as `RematWarning`.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat.problems import ConfigError, Problem, count, did_you_mean, load_mapping, warn
from remat.rules import MIN_OFFLOADED_TENSOR_SIZE, RULES, WARNING_RULES, full_iteration_graph

# ---------------------------------------------------------------------------------------------
# Field parsing: type checks and normalization, before any rule runs.


class _BadValue(Exception):
    """A value of the wrong type; the message says what the field accepts."""


Parser = Callable[[Any], Any]


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _BadValue("true or false")


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _BadValue("a whole number")


def _float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _BadValue("a number")


def _str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _BadValue("a string")


def _split_labels(text: str) -> list[str]:
    # Accept what CLIs and Hydra overrides produce: "a,b", "[a, b]", "['a', 'b']" or "a".
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1]
    items = (item.strip().strip("'\"").strip() for item in inner.split(","))
    return [item for item in items if item]


def _labels(value: Any) -> list[str]:
    if isinstance(value, str):
        return _split_labels(value)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return list(value)
    raise _BadValue("a list of labels, or one string such as 'core_attn,mlp'")


def _labels_or_empty(value: Any) -> list[str]:
    return [] if value is None else _labels(value)


def _optional(parse: Parser) -> Parser:
    def parse_optional(value: Any) -> Any:
        if value is None:
            return None
        try:
            return parse(value)
        except _BadValue as bad:
            raise _BadValue(f"{bad} or null") from None

    return parse_optional


_RECOMPUTE_PARSERS: dict[str, Parser] = {
    "recompute_granularity": _optional(_str),
    "recompute_method": _optional(_str),
    "recompute_num_layers": _optional(_int),
    "recompute_modules": _optional(_labels),
    "distribute_saved_activations": _bool,
    "cpu_offloading": _bool,
    "cpu_offloading_num_layers": _int,
    "fine_grained_activation_offloading": _bool,
    "offload_modules": _labels_or_empty,
    "min_offloaded_tensor_size": _int,
    "activation_offload_fraction": _float,
}

_FACT_PARSERS: dict[str, Parser] = {
    "num_layers": _optional(_int),
    "tensor_model_parallel_size": _int,
    "pipeline_model_parallel_size": _int,
    "virtual_pipeline_model_parallel_size": _optional(_int),
    "context_parallel_size": _int,
    "sequence_parallel": _bool,
    "cuda_graph_impl": _str,
    "cuda_graph_scope": _labels_or_empty,
    "fp8": _optional(_str),
    "fp8_recipe": _str,
    "moe_grouped_gemm": _bool,
    "multi_latent_attention": _bool,
    "num_moe_experts": _optional(_int),
    "moe_shared_expert_intermediate_size": _optional(_int),
    "moe_shared_expert_overlap": _bool,
    "overlap_moe_expert_parallel_comm": _bool,
    "attention_dropout": _float,
    "hidden_dropout": _float,
    "attention_backend": _str,
}


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _parse_fields(obj: Any, parsers: Mapping[str, Parser]) -> tuple[dict[str, Any], list[Problem]]:
    """Parse each field of `obj`; a field of the wrong type is reported and falls back to its default."""
    defaults = {f.name: _default(f) for f in dataclasses.fields(obj)}
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for name, parse in parsers.items():
        raw = getattr(obj, name)
        try:
            values[name] = parse(raw)
        except _BadValue as bad:
            problems.append(Problem(name, f"got {raw!r} ({type(raw).__name__}); set it to {bad}"))
            values[name] = defaults[name]
    return values, problems


# ---------------------------------------------------------------------------------------------
# The configuration.


def layers_per_chunk(num_layers: int | None, pp: int, vpp: int | None) -> int | None:
    """Layers in one model chunk; None when unknown or when the layers do not split evenly."""
    stages = pp * (vpp or 1)
    if num_layers is None or num_layers < 1 or stages < 1 or num_layers % stages:
        return None
    return num_layers // stages


@dataclass
class TrainingFacts:
    """Facts about the training run that the recompute rules depend on (Megatron's names and defaults)."""

    num_layers: int | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    cuda_graph_impl: str = "none"
    cuda_graph_scope: list[str] = field(default_factory=list)
    fp8: str | None = None
    fp8_recipe: str = "delayed"
    moe_grouped_gemm: bool = False
    multi_latent_attention: bool = False
    num_moe_experts: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    attention_backend: str = "auto"

    @property
    def model_parallel_size(self) -> int:
        """GPUs one copy of the model spans: tp x pp x cp (at least 1)."""
        return max(self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size, 1)

    @property
    def layers_per_virtual_stage(self) -> int | None:
        """Layers per model chunk: num_layers // (PP * VPP); None if num_layers is unknown or invalid."""
        return layers_per_chunk(
            self.num_layers, self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        )


@dataclass
class RecomputeConfig:
    """Megatron Core's activation-recompute and offload settings, validated on construction."""

    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    distribute_saved_activations: bool = False
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    fine_grained_activation_offloading: bool = False
    offload_modules: list[str] = field(default_factory=list)
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    activation_offload_fraction: float = 1.0
    facts: TrainingFacts = field(default_factory=TrainingFacts)

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
        values, problems = _parse_fields(self, _RECOMPUTE_PARSERS)
        for name, value in values.items():
            setattr(self, name, value)
        if not isinstance(self.facts, TrainingFacts):
            problems.append(Problem("facts", f"got {type(self.facts).__name__}; pass a TrainingFacts(...)"))
            self.facts = TrainingFacts()
        fact_values, fact_problems = _parse_fields(self.facts, _FACT_PARSERS)
        self.facts = dataclasses.replace(self.facts, **fact_values)
        # Megatron's default module list, applied only where it means something.
        if self.recompute_granularity == "selective" and self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        return problems + fact_problems

    @classmethod
    def from_megatron(cls, d: Mapping[str, Any]) -> RecomputeConfig:
        """Build from Megatron TransformerConfig keys: flat, `model.`-prefixed, or nested under "model"."""
        settings, problems = _read_megatron(d)
        problems += _convert_moe_layer_recompute(settings)
        recompute = {k: v for k, v in settings.items() if k in _RECOMPUTE_PARSERS}
        facts = {k: v for k, v in settings.items() if k in _FACT_PARSERS}
        try:
            config = cls(**recompute, facts=TrainingFacts(**facts))
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

    def to_megatron(self) -> dict[str, Any]:
        """A flat dict of Megatron keys that `from_megatron` turns back into an equal config."""
        out = {name: _copy(getattr(self, name)) for name in _RECOMPUTE_PARSERS}
        out.update({name: _copy(getattr(self.facts, name)) for name in _FACT_PARSERS})
        return out

    def changed(self) -> list[str]:
        """The recompute and offload settings (not the facts) that differ from Megatron's defaults."""
        defaults = {f.name: _default(f) for f in dataclasses.fields(RecomputeConfig)}
        return [name for name in _RECOMPUTE_PARSERS if getattr(self, name) != defaults[name]]

    def describe(self) -> str:
        """A short human-readable summary of the resolved configuration."""
        return "\n".join(
            (_describe_recompute(self), _describe_offload(self), _describe_parallel(self.facts),
             _describe_model(self.facts), _describe_graphs(self.facts))
        )


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


# ---------------------------------------------------------------------------------------------
# Reading Megatron settings.

# The deprecated switch Megatron still accepts.
_MOE_LAYER_RECOMPUTE = "moe_layer_recompute"
# Megatron model-shape keys found in real configs that no recompute rule reads.
_IGNORED_MEGATRON_KEYS: frozenset[str] = frozenset({
    "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "seq_length", "max_position_embeddings", "vocab_size", "normalization", "layernorm_epsilon",
    "gated_linear_unit", "add_bias_linear", "position_embedding_type", "rotary_base",
    "moe_router_topk", "moe_ffn_hidden_size",
})
_KNOWN_KEYS: frozenset[str] = (
    frozenset(_RECOMPUTE_PARSERS) | frozenset(_FACT_PARSERS) | {_MOE_LAYER_RECOMPUTE}
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
            problems.append(Problem(key, f"not a setting remat reads{did_you_mean(name, _KNOWN_KEYS)};"
                                         " fix the name or remove it"))
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
        return [Problem(_MOE_LAYER_RECOMPUTE, "cannot be combined with recompute_granularity='full';"
                                              " remove moe_layer_recompute, or use selective recompute with 'moe'")]
    warn("moe_layer_recompute is deprecated; set recompute_granularity='selective' and add 'moe' to"
          " recompute_modules instead")
    if granularity not in (None, "selective"):
        return []  # the constructor reports the bad granularity
    modules = settings.get("recompute_modules")
    try:
        labels = ["core_attn"] if modules is None else _labels(modules)
    except _BadValue:
        return []  # the constructor reports the bad module list
    settings["recompute_granularity"] = "selective"
    settings["recompute_modules"] = labels if "moe" in labels else [*labels, "moe"]
    return []


def recorded_config(keys: Mapping[str, Any]) -> RecomputeConfig:
    """Megatron keys as a result recorded them, fields parsed but no rule applied: results from other
    harnesses may hold configs these rules refuse, and `remat doctor` runs single rules on them."""
    config = RecomputeConfig.__new__(RecomputeConfig)
    for f in dataclasses.fields(RecomputeConfig):
        setattr(config, f.name, keys.get(f.name, _default(f)))
    config.facts = TrainingFacts(**{k: v for k, v in keys.items() if k in _FACT_PARSERS})
    config._normalize()  # a field of the wrong type falls back to its default
    return config


# ---------------------------------------------------------------------------------------------
# A summary in words (`remat validate` prints it).


def _describe_recompute(c: RecomputeConfig) -> str:
    g, k, per_stage = c.recompute_granularity, c.recompute_num_layers, c.facts.layers_per_virtual_stage
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
        line += f"; saved layer inputs split over {c.facts.tensor_model_parallel_size} tensor-parallel ranks"
    return line


def _describe_offload(c: RecomputeConfig) -> str:
    if c.cpu_offloading:
        return f"offload: CPU, {count(c.cpu_offloading_num_layers, 'layer')}"
    if c.fine_grained_activation_offloading:
        return (f"offload: inputs of {', '.join(c.offload_modules)}"
                f" (tensors of {c.min_offloaded_tensor_size} elements or more)")
    return "offload: off"


def _describe_parallel(f: TrainingFacts) -> str:
    vpp = f.virtual_pipeline_model_parallel_size or "-"
    sp = "on" if f.sequence_parallel and f.tensor_model_parallel_size > 1 else "off"
    return (f"parallel: TP {f.tensor_model_parallel_size}, PP {f.pipeline_model_parallel_size}, VPP {vpp},"
            f" CP {f.context_parallel_size}, sequence parallel {sp}")


def _describe_model(f: TrainingFacts) -> str:
    parts = [count(f.num_layers, "layer") if f.num_layers is not None else "unknown number of layers"]
    if f.layers_per_virtual_stage is not None:
        parts[0] += f" ({f.layers_per_virtual_stage} per virtual stage)"
    if f.num_moe_experts is not None:
        parts.append(f"MoE with {f.num_moe_experts} experts")
    if f.multi_latent_attention:
        parts.append("MLA")
    if f.fp8 is not None:
        parts.append(f"fp8 {f.fp8} ({f.fp8_recipe})")
    parts.append(f"attention backend {f.attention_backend}")
    return "model: " + ", ".join(parts)


def _describe_graphs(f: TrainingFacts) -> str:
    if full_iteration_graph(f):
        return "cuda graphs: full iteration"
    if f.cuda_graph_impl == "none":
        return "cuda graphs: off"
    return f"cuda graphs: {f.cuda_graph_impl}, capturing {', '.join(f.cuda_graph_scope) or 'whole layers'}"
