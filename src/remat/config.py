"""Recompute configuration with Megatron Core's field names, and every validation rule remat applies.

`RecomputeConfig` holds Megatron's recompute and offload knobs plus the `TrainingFacts` (parallel
sizes, CUDA graphs, FP8, MoE/MLA switches) its rules depend on. Building one normalizes and validates
it: every problem is collected and raised once as a `ConfigError`; advice goes out as `RematWarning`.
`check_model` and `check_plan` apply the rules that need the real model's layout.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, Literal

import yaml

# Megatron's selective-recompute labels that remat supports, in Megatron's order of documentation,
# then remat's own: `mlp_act`, a dense MLP's activation between linear_fc1 and linear_fc2 (what
# `moe_act` is in Megatron's experts).
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj", "mlp_act",
)
# Labels recomputed with the output-discarding checkpoint (the rest use a plain checkpoint).
DISCARD_MODULES: frozenset[str] = frozenset({"layernorm", "moe_act", "mla_up_proj", "mlp_act"})
# Labels whose output is all their consumer saves: a plain checkpoint of them frees nothing.
DISCARD_ONLY: frozenset[str] = frozenset({"mlp_act"})
# label -> the label whose site always runs it: recomputing the outer one replays the inner one
# too, so an action at the inner one does nothing there.
ENCLOSING: dict[str, str] = {"moe_act": "moe", "shared_experts": "moe", "mlp_act": "mlp"}
# A whole transformer layer: the unit of full (layer-level) recompute.
LAYER = "layer"
SITE_LABELS: tuple[str, ...] = RECOMPUTE_MODULES + (LAYER,)
# What a plan may do at a site.
ACTIONS: tuple[str, ...] = ("keep", "recompute", "discard", "offload")

GRANULARITIES: tuple[str, ...] = ("full", "selective")
METHODS: tuple[str, ...] = ("uniform", "block")
# Submodule inputs Megatron's fine-grained offloading can move to the host.
OFFLOAD_MODULES: tuple[str, ...] = (
    "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
)
# The site whose saved tensors (its input among them) each offload module sends to host; None
# where remat marks no site around that submodule.
OFFLOAD_SITES: dict[str, str | None] = {
    "attn_norm": "layernorm", "mlp_norm": "layernorm", "core_attn": "core_attn", "moe_act": "moe_act",
    "qkv_linear": None, "attn_proj": None, "expert_fc1": None,
}
# Megatron's default min_offloaded_tensor_size, in elements: smaller tensors stay on the device.
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
CUDA_GRAPH_IMPLS: tuple[str, ...] = ("none", "local", "transformer_engine", "full_iteration")
CUDA_GRAPH_SCOPES: tuple[str, ...] = (
    "full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba",
)
FP8_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")
ATTENTION_BACKENDS: tuple[str, ...] = ("flash", "fused", "unfused", "local", "auto")


class RematWarning(UserWarning):
    """Advice about a configuration that is valid but probably not what was meant."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration: the setting at fault, what is wrong and what to change."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ConfigError(ValueError):
    """Every problem found in a configuration, raised together."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def _warn(message: str) -> None:
    # Point the warning at the first caller outside this module; "<string>" is a dataclass __init__.
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename in (__file__, "<string>"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RematWarning, stacklevel=level)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_bytes(n: float) -> str:
    """GiB, or MiB below a tenth of a GiB (tiny CPU models), for messages and tables."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


def _one_of(choices: Iterable[str]) -> str:
    return ", ".join(repr(c) for c in choices)


_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str | int, field: str = "memory_budget", bare: Literal["gib", "b"] = "gib",
                zero: bool = False) -> int:
    """'60GiB', '60 GB', '512MiB', 64424509440 (bytes); a bare number in text is in unit `bare`
    (GiB for budgets; bytes for doctor's sizes, copied from allocator logs). Problems are
    reported under `field`; 0 is a size only where `zero`."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0 or text == 0 and not zero:
            raise ConfigError([Problem(field, f"is {text} bytes; give a positive size")])
        return text
    if not isinstance(text, str):  # a float could mean bytes or GiB: make the caller say which
        raise ConfigError([Problem(field, f"{text!r} is a {type(text).__name__}; give bytes as an int or "
                                          f"text with a unit, like '60GiB'")])
    bare_means = "a bare number is bytes" if bare == "b" else "a bare number means GiB"
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = (match.group(2) or bare).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError([Problem(field, f"cannot read {text!r} as a memory size; write it like 60GiB, 80GB "
                                          f"or 512MiB ({bare_means})")])
    amount = float(match.group(1)) * _UNITS[unit]
    if unit == "b" and amount != int(amount):
        raise ConfigError([Problem(field, f"{text!r} is not a whole number of bytes ({bare_means}); give a unit,"
                                          f" like {match.group(1)}GiB")])
    if amount < 0 or amount == 0 and not zero:
        raise ConfigError([Problem(field, f"{text!r} is no memory; give a positive size")])
    return int(amount)


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


def _layers_per_virtual_stage(num_layers: int | None, pp: int, vpp: int | None) -> int | None:
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
    def layers_per_virtual_stage(self) -> int | None:
        """Layers per model chunk: num_layers // (PP * VPP); None if num_layers is unknown or invalid."""
        return _layers_per_virtual_stage(
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
                _warn(str(advice))

    def _normalize(self) -> list[Problem]:
        values, problems = _parse_fields(self, _RECOMPUTE_PARSERS)
        for name, value in values.items():
            setattr(self, name, value)
        if not isinstance(self.facts, TrainingFacts):
            problems.append(Problem("facts", f"got {type(self.facts).__name__}; pass a TrainingFacts(...)"))
            self.facts = TrainingFacts()
        fact_values, fact_problems = _parse_fields(self.facts, _FACT_PARSERS)
        self.facts = dataclasses.replace(self.facts, **fact_values)
        # Megatron's default module list (R10), applied only where it means something.
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

# The deprecated switch Megatron still accepts (R17).
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
            problems.append(Problem(key, f"not a setting remat reads{_did_you_mean(name, _KNOWN_KEYS)};"
                                         " fix the name or remove it"))
        elif name in settings:
            problems.append(Problem(key, "given twice (with and without the 'model.' prefix); keep one"))
        elif name not in _IGNORED_MEGATRON_KEYS:
            settings[name] = value
    return settings, problems


def _convert_moe_layer_recompute(settings: dict[str, Any]) -> list[Problem]:
    # Megatron R17: the deprecated switch means selective recompute with "moe" appended to the
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
    _warn("moe_layer_recompute is deprecated; set recompute_granularity='selective' and add 'moe' to"
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


def read_file(path: Path, parse: Callable[[bytes], Any], kind: str) -> Any:
    """parse(the file's bytes); ConfigError naming the file when it cannot be read or parsed."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError([Problem(str(path), f"cannot read the file ({err}); check the path")]) from None
    try:
        return parse(raw)
    except Exception as err:  # whatever the parser raises, the file is not what it should be
        raise ConfigError([Problem(str(path), f"is not valid {kind} ({err}); check the file")]) from None


def load_mapping(path: Path) -> Mapping[str, Any]:
    """The top-level mapping of a YAML or JSON file; ConfigError saying what is wrong otherwise."""
    kind = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}.get(path.suffix.lower())
    if kind is None:
        raise ConfigError([Problem(str(path), "unsupported file type; use a .yaml, .yml or .json file")])
    data = read_file(path, json.loads if kind == "JSON" else yaml.safe_load, kind)
    if not isinstance(data, Mapping):
        raise ConfigError([Problem(str(path), "must hold a mapping at the top level, e.g."
                                              " 'recompute_granularity: selective' or 'remat_plan: 1'")])
    return data


# ---------------------------------------------------------------------------------------------
# Rules. Each yields the problems it finds in a well-typed config; RULES are errors, WARNING_RULES advice.

Rule = Callable[[RecomputeConfig], Iterator[Problem]]
RULES: list[Rule] = []
WARNING_RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _warning_rule(fn: Rule) -> Rule:
    WARNING_RULES.append(fn)
    return fn


def _selected(c: RecomputeConfig) -> list[str]:
    """The labels selective recompute acts on (none unless granularity is selective)."""
    return (c.recompute_modules or []) if c.recompute_granularity == "selective" else []


def _full_iteration_graph(f: TrainingFacts) -> bool:
    # Megatron migrates the deprecated scope value "full_iteration" to the full-iteration implementation.
    return f.cuda_graph_impl == "full_iteration" or "full_iteration" in f.cuda_graph_scope


def _per_layer_graph(f: TrainingFacts) -> bool:
    return f.cuda_graph_impl in ("local", "transformer_engine") and not _full_iteration_graph(f)


def _graphed(f: TrainingFacts, scope: str) -> bool:
    """Whether a CUDA graph captures the `scope` part of each layer."""
    # A per-layer graph with an empty scope captures the whole layer (Megatron's default).
    in_scope = not f.cuda_graph_scope or scope in f.cuda_graph_scope
    return _full_iteration_graph(f) or (_per_layer_graph(f) and in_scope)


def _num_layers_range(c: RecomputeConfig) -> str:
    per_stage = c.facts.layers_per_virtual_stage
    if per_stage is None:
        return "a whole number of at least 1"
    return f"a number between 1 and {per_stage} (the layers in each virtual pipeline stage)"


@_rule
def rule_granularity_value(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R4
    g = c.recompute_granularity
    if g is not None and g not in GRANULARITIES:
        yield Problem("recompute_granularity", f"{g!r} is not a granularity{_did_you_mean(g, GRANULARITIES)};"
                                               " use 'selective', 'full' or null (no recompute)")


@_rule
def rule_method_value(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R5
    m = c.recompute_method
    if m is not None and m not in METHODS:
        yield Problem("recompute_method", f"{m!r} is not a method{_did_you_mean(m, METHODS)};"
                                          " use 'uniform' or 'block'")


@_rule
def rule_full_needs_method(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R6
    if c.recompute_granularity == "full" and c.recompute_method is None:
        yield Problem("recompute_method", "full recompute needs a recompute_method: 'uniform' (every layer,"
                                          " in groups) or 'block' (the first recompute_num_layers layers)")


@_rule
def rule_full_num_layers(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R7, plus a range check
    # Megatron only rejects None; 0 makes its uniform loop never advance.
    if c.recompute_granularity != "full":
        return
    n, per_stage = c.recompute_num_layers, c.facts.layers_per_virtual_stage
    if n is None:
        yield Problem("recompute_num_layers", f"full recompute needs recompute_num_layers; set it to"
                                              f" {_num_layers_range(c)}")
    elif n < 1 or (per_stage is not None and n > per_stage):
        yield Problem("recompute_num_layers", f"{n} is out of range; set it to {_num_layers_range(c)}")


@_rule
def rule_selective_num_layers_none(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R8
    if c.recompute_granularity == "selective" and c.recompute_num_layers is not None:
        yield Problem("recompute_num_layers", "only full recompute uses it (selective acts on every layer);"
                                              " remove it or set it to null")


@_rule
def rule_selective_method_none(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron arguments.py selective check
    if c.recompute_granularity == "selective" and c.recompute_method is not None:
        yield Problem("recompute_method", "only full recompute uses it (selective acts on every layer);"
                                          " remove it or set it to null")


@_rule
def rule_selective_needs_modules(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R11 (accepts []; remat does not)
    if c.recompute_granularity == "selective" and not c.recompute_modules:
        yield Problem("recompute_modules", "selective recompute with no modules recomputes nothing; list labels"
                                           " such as ['core_attn'], or set recompute_granularity to null for a"
                                           " no-recompute control run")


@_rule
def rule_known_recompute_modules(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R11
    for label in c.recompute_modules or []:
        if label not in RECOMPUTE_MODULES:
            yield Problem("recompute_modules", f"unknown label {label!r}{_did_you_mean(label, RECOMPUTE_MODULES)};"
                                               f" use labels from {_one_of(RECOMPUTE_MODULES)}")


@_rule
def rule_no_duplicate_labels(c: RecomputeConfig) -> Iterator[Problem]:  # remat: Megatron ignores repeats
    for name, labels in (("recompute_modules", c.recompute_modules or []), ("offload_modules", c.offload_modules)):
        for label in sorted({x for x in labels if labels.count(x) > 1}):
            yield Problem(name, f"lists {label!r} more than once; list each label once")


@_rule
def rule_distribute_not_with_sequence_parallel(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R9
    if c.distribute_saved_activations and c.facts.sequence_parallel:
        yield Problem("distribute_saved_activations", "sequence parallelism already splits the saved inputs"
                                                      " across ranks; set distribute_saved_activations=False")


@_rule
def rule_distribute_needs_full(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron arguments.py
    if c.distribute_saved_activations and c.recompute_granularity != "full":
        yield Problem("distribute_saved_activations", "only full recompute stores layer inputs it could split;"
                                                      " set recompute_granularity='full' or turn this off")


@_rule
def rule_distribute_needs_tensor_parallel(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron arguments.py
    if c.distribute_saved_activations and c.facts.tensor_model_parallel_size <= 1:
        yield Problem("distribute_saved_activations", "splits saved inputs across tensor-parallel ranks, so it"
                                                      " needs tensor_model_parallel_size > 1; turn it off")


@_rule
def rule_full_recompute_graph_scope(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R27
    if c.recompute_granularity == "full" and _per_layer_graph(c.facts):
        yield Problem("recompute_granularity", "full recompute cannot run inside per-layer CUDA graphs; use"
                                               " selective recompute, cuda_graph_impl='none', or a"
                                               " full_iteration graph")


@_rule
def rule_cpu_offload_layer_count(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R1
    k, n = c.cpu_offloading_num_layers, c.facts.num_layers
    if c.cpu_offloading and (k < 0 or (n is not None and k >= n)):
        allowed = f"between 0 and {n - 1} (fewer than num_layers={n})" if n is not None else "0 or more"
        yield Problem("cpu_offloading_num_layers", f"got {k}; set it to {allowed}")


@_rule
def rule_cpu_offload_not_with_pipeline(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R2
    if c.cpu_offloading and c.facts.pipeline_model_parallel_size > 1:
        yield Problem("cpu_offloading", "layer-level CPU offloading does not support pipeline parallelism;"
                                        " set pipeline_model_parallel_size=1 or cpu_offloading=False")


# Megatron R3 (no CPU offloading with recompute) is not a remat rule: remat offloads what a layer
# still saves under selective recompute, and each full-recompute group's input under full recompute.


@_rule
def rule_cpu_offload_graphs(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R26
    if c.cpu_offloading and _per_layer_graph(c.facts):
        yield Problem("cpu_offloading", "layer-level CPU offloading does not work with per-layer CUDA graphs;"
                                        " set cuda_graph_impl to 'none' or 'full_iteration', or turn offloading off")


@_rule
def rule_moe_act_needs_grouped_gemm(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R12
    if "moe_act" in _selected(c) and not c.facts.moe_grouped_gemm:
        yield Problem("recompute_modules", "'moe_act' recompute needs moe_grouped_gemm=True; enable it or"
                                           " drop 'moe_act'")


@_rule
def rule_mla_up_proj_needs_mla(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R13
    if "mla_up_proj" in _selected(c) and not c.facts.multi_latent_attention:
        yield Problem("recompute_modules", "'mla_up_proj' exists only with multi_latent_attention=True; enable"
                                           " it or drop 'mla_up_proj'")


@_rule
def rule_shared_experts_not_with_overlap(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R16
    f = c.facts
    if ("shared_experts" in _selected(c) and f.moe_shared_expert_intermediate_size is not None
            and f.moe_shared_expert_overlap):
        yield Problem("recompute_modules", "'shared_experts' recompute does not work with"
                                           " moe_shared_expert_overlap=True; drop one of them")


@_rule
def rule_fp8_delayed_discard_labels(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R16b
    if c.facts.fp8 is None or c.facts.fp8_recipe != "delayed":
        return
    for label in ("moe_act", "layernorm"):
        if label in _selected(c):
            yield Problem("recompute_modules", f"{label!r} cannot be recomputed under FP8 delayed scaling; drop it"
                                               " or use another fp8_recipe such as 'tensorwise'")


@_rule
def rule_graphed_recompute_dropout(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R28
    # A recompute region captured in a CUDA graph cannot replay random dropout masks.
    f, selected = c.facts, _selected(c)
    if "core_attn" in selected and f.attention_dropout != 0 and _graphed(f, "attn"):
        yield Problem("recompute_modules", "'core_attn' recompute inside a CUDA graph cannot replay attention"
                                           " dropout; set attention_dropout=0, drop 'core_attn' or take 'attn'"
                                           " out of the graph")
    for label in ("mlp", "moe"):
        if label in selected and f.hidden_dropout != 0 and _graphed(f, label):
            yield Problem("recompute_modules", f"{label!r} recompute inside a CUDA graph cannot replay hidden"
                                               f" dropout; set hidden_dropout=0, drop {label!r} or take"
                                               f" {label!r} out of the graph")


@_rule
def rule_te_graph_moe_router(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R28
    f = c.facts
    if ("moe" in _selected(c) and f.cuda_graph_impl == "transformer_engine"
            and "moe_router" in f.cuda_graph_scope):
        yield Problem("recompute_modules", "'moe' recompute would span the graphed router (cuda_graph_scope"
                                           " 'moe_router'); a recompute region must lie wholly inside or outside"
                                           " a graph: drop 'moe' or remove 'moe_router' from the scope")


@_rule
def rule_ep_overlap_limits(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R30
    if not c.facts.overlap_moe_expert_parallel_comm:
        return
    fix = "with overlap_moe_expert_parallel_comm=True; "
    if c.recompute_granularity == "full":
        yield Problem("recompute_granularity", f"full recompute does not work {fix}use selective recompute")
    if c.recompute_method is not None:
        yield Problem("recompute_method", f"must be null {fix}remove it")
    if c.recompute_num_layers is not None:
        yield Problem("recompute_num_layers", f"must be null {fix}remove it")
    if "moe" in _selected(c):
        yield Problem("recompute_modules", f"'moe' recompute does not work {fix}drop 'moe' (try 'moe_act')")


@_rule
def rule_fine_grained_not_with_cpu_offload(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R19
    if c.fine_grained_activation_offloading and c.cpu_offloading:
        yield Problem("fine_grained_activation_offloading", "cannot be combined with cpu_offloading; turn one off")


@_rule
def rule_fine_grained_needs_modules(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R19
    if c.fine_grained_activation_offloading and not c.offload_modules:
        yield Problem("offload_modules", f"fine-grained offloading with no modules offloads nothing; list some"
                                         f" of {_one_of(OFFLOAD_MODULES)}")


@_rule
def rule_known_offload_modules(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R19
    for label in c.offload_modules:
        if label not in OFFLOAD_MODULES:
            yield Problem("offload_modules", f"unknown module {label!r}{_did_you_mean(label, OFFLOAD_MODULES)};"
                                             f" use modules from {_one_of(OFFLOAD_MODULES)}")


@_rule
def rule_attn_proj_offload_needs_core_attn(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R20
    offload = c.offload_modules
    if c.fine_grained_activation_offloading and "attn_proj" in offload and "core_attn" not in offload:
        yield Problem("offload_modules", "the input of 'attn_proj' is the output of core_attn, which core_attn's"
                                         " backward also needs; offload 'core_attn' too or drop 'attn_proj'")


@_rule
def rule_moe_recompute_blocks_expert_offload(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R22
    if not (c.fine_grained_activation_offloading and "moe" in _selected(c)):
        return
    for label in ("expert_fc1", "moe_act"):
        if label in c.offload_modules:
            yield Problem("offload_modules", f"'moe' recompute keeps nothing inside the MoE layer, so {label!r}"
                                             f" has nothing to offload; drop {label!r} or drop 'moe' from"
                                             " recompute_modules")


@_rule
def rule_offloaded_site_not_recomputed(c: RecomputeConfig) -> Iterator[Problem]:  # remat: one action a site
    if not c.fine_grained_activation_offloading:
        return
    for label in c.offload_modules:
        site = OFFLOAD_SITES.get(label)
        if site is not None and site in _selected(c):
            yield Problem("offload_modules", f"{label!r} offloads what the {site!r} site saves, and {site!r} is"
                                             " also recomputed, which saves (almost) nothing there; drop"
                                             f" {label!r} or drop {site!r} from recompute_modules")


@_rule
def rule_norm_offload_together(c: RecomputeConfig) -> Iterator[Problem]:  # remat: one 'layernorm' site label
    if not c.fine_grained_activation_offloading:
        return
    norms = [m for m in ("attn_norm", "mlp_norm") if m in c.offload_modules]
    if len(norms) == 1:
        other = "mlp_norm" if norms == ["attn_norm"] else "attn_norm"
        yield Problem("offload_modules", f"remat marks both norms of a layer with one 'layernorm' site, so"
                                         f" {norms[0]!r} offloads {other!r} too; list both")


@_rule
def rule_fine_grained_not_with_uniform_full(c: RecomputeConfig) -> Iterator[Problem]:  # remat
    if c.fine_grained_activation_offloading and c.recompute_granularity == "full" and c.recompute_method == "uniform":
        yield Problem("fine_grained_activation_offloading", "uniform full recompute saves nothing inside any"
                                                            " layer, so there is nothing per module to offload;"
                                                            " offload each group's input with cpu_offloading"
                                                            " instead, or use the block method")


@_rule
def rule_min_offload_size(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R23
    yield from _min_offload_size_problems(c.min_offloaded_tensor_size)


def _min_offload_size_problems(size: int) -> Iterator[Problem]:
    if size < 0:
        yield Problem("min_offloaded_tensor_size", f"got {size}; set it to 0 or more (a tensor size in elements)")


@_rule
def rule_positive_sizes(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron ModelParallelConfig sizes
    f = c.facts
    sizes = {
        "num_layers": f.num_layers,
        "tensor_model_parallel_size": f.tensor_model_parallel_size,
        "pipeline_model_parallel_size": f.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": f.virtual_pipeline_model_parallel_size,
        "context_parallel_size": f.context_parallel_size,
    }
    for name, size in sizes.items():
        if size is not None and size < 1:
            yield Problem(name, f"got {size}; set it to 1 or more")


@_rule
def rule_virtual_pipeline_needs_pipeline(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron arguments.py
    f = c.facts
    if f.virtual_pipeline_model_parallel_size is not None and f.pipeline_model_parallel_size == 1:
        yield Problem("virtual_pipeline_model_parallel_size", "virtual pipeline stages need"
                                                              " pipeline_model_parallel_size > 1; set it to null"
                                                              " or raise the pipeline size")


@_rule
def rule_layers_divisible(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron arguments.py
    f = c.facts
    stages = f.pipeline_model_parallel_size * (f.virtual_pipeline_model_parallel_size or 1)
    if f.num_layers is not None and f.num_layers >= 1 and stages >= 1 and f.num_layers % stages:
        yield Problem("num_layers", f"{f.num_layers} layers do not split evenly into {stages} (virtual) pipeline"
                                    f" stages; use a multiple of {stages} or change the pipeline sizes")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> Iterator[Problem]:
    if value not in choices:
        yield Problem(name, f"{value!r} is not an option{_did_you_mean(value, choices)}; use one of {_one_of(choices)}")


@_rule
def rule_cuda_graph_impl_value(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron cuda_graph_impl choices
    yield from _choice("cuda_graph_impl", c.facts.cuda_graph_impl, CUDA_GRAPH_IMPLS)


@_rule
def rule_cuda_graph_scope_values(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron cuda_graph_scope choices
    for scope in c.facts.cuda_graph_scope:
        yield from _choice("cuda_graph_scope", scope, CUDA_GRAPH_SCOPES)


@_rule
def rule_fp8_value(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron --fp8-format choices
    if c.facts.fp8 is not None:
        yield from _choice("fp8", c.facts.fp8, FP8_FORMATS)


@_rule
def rule_fp8_recipe_value(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron Fp8Recipe choices
    yield from _choice("fp8_recipe", c.facts.fp8_recipe, FP8_RECIPES)


@_rule
def rule_attention_backend_value(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron AttnBackend choices
    yield from _choice("attention_backend", c.facts.attention_backend, ATTENTION_BACKENDS)


@_rule
def rule_dropout_range(c: RecomputeConfig) -> Iterator[Problem]:  # remat: a probability
    for name in ("attention_dropout", "hidden_dropout"):
        p = getattr(c.facts, name)
        if not 0 <= p < 1:  # 1 would zero every activation (and the models refuse it)
            yield Problem(name, f"got {p}; set a probability of at least 0 and below 1")


@_warning_rule
def rule_settings_without_granularity(c: RecomputeConfig) -> Iterator[Problem]:  # remat: Megatron ignores them
    if c.recompute_granularity is not None:
        return
    for name in ("recompute_method", "recompute_num_layers"):
        if getattr(c, name) is not None:
            yield Problem(name, "has no effect while recompute_granularity is null; set"
                                " recompute_granularity='full' to use it, or remove it")


@_warning_rule
def rule_modules_without_switch(c: RecomputeConfig) -> Iterator[Problem]:  # remat: Megatron ignores them
    if c.recompute_modules and c.recompute_granularity is None:
        yield Problem("recompute_modules", "has no effect while recompute_granularity is null; set"
                                           " recompute_granularity='selective' to recompute them, or remove it")
    if c.offload_modules and not c.fine_grained_activation_offloading:
        yield Problem("offload_modules", "has no effect while fine_grained_activation_offloading is off; set it"
                                         " to true to offload them, or remove offload_modules")


@_warning_rule
def rule_sequence_parallel_without_tensor_parallel(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron turns it off
    if c.facts.sequence_parallel and c.facts.tensor_model_parallel_size == 1:
        yield Problem("sequence_parallel", "has no effect with tensor_model_parallel_size 1 (Megatron turns it"
                                           " off); raise tensor_model_parallel_size or drop sequence_parallel")


@_warning_rule
def rule_nested_labels(c: RecomputeConfig) -> Iterator[Problem]:  # remat: Megatron allows nesting silently
    selected = _selected(c)
    for inner, outer in ENCLOSING.items():
        if inner in selected and outer in selected:
            yield Problem("recompute_modules", f"{outer!r} already recomputes the whole module, which contains"
                                               f" {inner!r}; listing both adds work for no saving:"
                                               f" drop {inner!r}")


@_warning_rule
def rule_core_attn_fused_backend(c: RecomputeConfig) -> Iterator[Problem]:  # Megatron R15
    if "core_attn" in _selected(c) and c.facts.attention_backend in ("flash", "fused"):
        yield Problem("recompute_modules", f"'core_attn' saves almost nothing with attention_backend"
                                           f" {c.facts.attention_backend!r}: fused attention already recomputes"
                                           " the attention matrix; drop 'core_attn'")


# ---------------------------------------------------------------------------------------------
# Summary for `remat validate`.


def _describe_recompute(c: RecomputeConfig) -> str:
    g, k, per_stage = c.recompute_granularity, c.recompute_num_layers, c.facts.layers_per_virtual_stage
    stage = f" ({per_stage} layers per virtual stage)" if per_stage is not None else ""
    if g == "selective":
        line = f"recompute: selective, in every layer: {', '.join(c.recompute_modules or [])}"
    elif g == "full" and c.recompute_method == "uniform":
        line = f"recompute: full, uniform: every layer, in groups of {k}{stage}"
    elif g == "full":
        line = f"recompute: full, block: the first {k} layers of each virtual stage{stage}, the rest keep activations"
    else:
        line = "recompute: off"
    if c.distribute_saved_activations:
        line += f"; saved layer inputs split over {c.facts.tensor_model_parallel_size} tensor-parallel ranks"
    return line


def _describe_offload(c: RecomputeConfig) -> str:
    if c.cpu_offloading:
        return f"offload: CPU, {c.cpu_offloading_num_layers} layers"
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
    parts = [f"{f.num_layers if f.num_layers is not None else 'unknown number of'} layers"]
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
    if _full_iteration_graph(f):
        return "cuda graphs: full iteration"
    if f.cuda_graph_impl == "none":
        return "cuda graphs: off"
    return f"cuda graphs: {f.cuda_graph_impl}, capturing {', '.join(f.cuda_graph_scope) or 'whole layers'}"


# ---------------------------------------------------------------------------------------------
# The reference models' shapes (remat.models.LlamaConfig's fields).

# remat's models compute attention with torch's SDPA (fused kernels) or eagerly (s x s scores kept).
MODEL_ATTENTION_BACKENDS: tuple[str, ...] = ("sdpa", "eager")
_MODEL_SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "seq_length", "vocab_size", "loss_chunk_size")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def model_shape_problems(shape: Mapping[str, Any]) -> list[Problem]:
    """What is wrong with a reference model's shape, each problem naming the field to change."""
    problems = [Problem(name, f"must be a positive integer, got {shape[name]!r}")
                for name in _MODEL_SIZES if not _positive_int(shape[name])]
    problems += [Problem(name, f"must be positive, got {shape[name]!r}")
                 for name in ("norm_epsilon", "rotary_base", "init_method_std") if not shape[name] > 0]
    problems += [Problem(name, f"must be in [0, 1), got {shape[name]!r}")
                 for name in ("attention_dropout", "hidden_dropout") if not 0.0 <= shape[name] < 1.0]
    if shape["attention_backend"] not in MODEL_ATTENTION_BACKENDS:
        problems.append(Problem("attention_backend", f"must be one of {', '.join(MODEL_ATTENTION_BACKENDS)}, "
                                                     f"got {shape['attention_backend']!r}"))
    kv_channels = shape["kv_channels"]
    if kv_channels is not None and not _positive_int(kv_channels):
        problems.append(Problem("kv_channels", f"must be a positive integer or None, got {kv_channels!r}"))
    if problems:  # the divisibility rules need valid sizes
        return problems
    hidden, heads, groups = shape["hidden_size"], shape["num_attention_heads"], shape["num_query_groups"]
    if kv_channels is None and hidden % heads:
        problems.append(Problem("hidden_size", f"({hidden}) must be divisible by num_attention_heads ({heads}); "
                                               "change one so that the head dim is an integer"))
    if heads % groups:
        problems.append(Problem("num_query_groups", f"num_attention_heads ({heads}) must be divisible by "
                                                    f"num_query_groups ({groups}); pick a divisor of it"))
    head_dim = kv_channels or hidden // heads
    if head_dim % 2:
        problems.append(Problem("kv_channels" if kv_channels else "hidden_size",
                                f"head dim {head_dim} must be even for rotary embeddings; change kv_channels, "
                                "or hidden_size or num_attention_heads"))
    return problems


# ---------------------------------------------------------------------------------------------
# Checks against a real model.


@dataclass(frozen=True)
class ModelLayout:
    """The sites a real model has: the labels in each transformer layer, in layer order."""

    labels: tuple[frozenset[str], ...]
    # Labels whose sites wrap a kernel that already recomputes internally (flash/SDPA attention).
    fused: frozenset[str] = frozenset()
    has_layer_sites: bool = True

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
                                                   f" {layout.num_layers} layers (the last layer's backward"
                                                   f" comes at once); set it below {layout.num_layers}")
    if c.fine_grained_activation_offloading:
        present = _model_labels(layout)
        offloadable = [m for m in OFFLOAD_MODULES if OFFLOAD_SITES[m] in present]
        for label in c.offload_modules:
            if OFFLOAD_SITES.get(label) not in present:
                yield Problem("offload_modules", f"{label!r} matches no site in this model (it can offload:"
                                                 f" {', '.join(offloadable) or 'none'}); drop {label!r}, or"
                                                 " offload whole layers with cpu_offloading")


def _model_distribute(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    if c.distribute_saved_activations:
        yield Problem("distribute_saved_activations", "splitting saved inputs over tensor-parallel ranks"
                                                      " is not available yet (it needs the parallel"
                                                      " runtime); set it to False")


def _model_discard_scope(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    discarding = [label for label in _selected(c) if label in DISCARD_MODULES]
    if discarding and not layout.has_layer_sites:
        yield Problem("recompute_modules", f"{', '.join(map(repr, discarding))} use output-discarding"
                                           " recompute, which needs the model's 'layer' sites as its scope"
                                           " and this model marks none; add layer sites or drop them")


def _model_selected_labels(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    present = _model_labels(layout)
    has = ", ".join(label for label in RECOMPUTE_MODULES if label in present) or "none"
    for label in _selected(c):
        if label not in present:
            yield Problem("recompute_modules", f"{label!r} matches no site in this model (its sites: {has});"
                                               f" drop {label!r}")


def _model_layer_sites(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    if c.recompute_granularity == "full" and not layout.has_layer_sites:
        yield Problem("recompute_granularity", "this model marks no 'layer' sites, so full recompute has"
                                               " nothing to wrap; use selective recompute")


def _model_layer_count(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    f, n = c.facts, layout.num_layers
    stages = f.pipeline_model_parallel_size * (f.virtual_pipeline_model_parallel_size or 1)
    if f.num_layers is not None and f.num_layers != n:
        yield Problem("num_layers", f"is {f.num_layers} but the model has {n} layers; set num_layers={n}"
                                    " or leave it unset")
    elif f.num_layers is None and n % stages:
        yield Problem("num_layers", f"the model's {n} layers do not split evenly into {stages} (virtual)"
                                    " pipeline stages; change the pipeline sizes")


def _model_recompute_num_layers(c: RecomputeConfig, layout: ModelLayout) -> Iterator[Problem]:
    f, k = c.facts, c.recompute_num_layers
    per_stage = _layers_per_virtual_stage(
        layout.num_layers, f.pipeline_model_parallel_size, f.virtual_pipeline_model_parallel_size
    )
    if c.recompute_granularity == "full" and k is not None and per_stage is not None and k > per_stage:
        yield Problem("recompute_num_layers", f"{k} is more than the model's {per_stage} layers per virtual"
                                              f" pipeline stage; set it between 1 and {per_stage}")


_MODEL_CHECKS: tuple[Callable[[RecomputeConfig, ModelLayout], Iterator[Problem]], ...] = (
    _model_offload, _model_distribute, _model_discard_scope, _model_selected_labels, _model_layer_sites, _model_layer_count,
    _model_recompute_num_layers,
)


def check_model(config: RecomputeConfig, layout: ModelLayout) -> None:
    """Raise ConfigError if `config` cannot apply to a model with this layout; warn about waste."""
    problems = [p for check in _MODEL_CHECKS for p in check(config, layout)]
    if problems:
        raise ConfigError(problems)
    if "core_attn" in _selected(config) and "core_attn" in layout.fused:
        _warn("recompute_modules: 'core_attn' saves almost nothing: flash/SDPA attention already recomputes"
              " the attention matrix; drop core_attn")


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
            yield Problem(name, f"layer {i} has no {label!r} site (its sites: {', '.join(sorted(labels)) or 'none'});"
                                " remove it")
        if action not in ACTIONS:
            hint = _did_you_mean(action, ACTIONS) if isinstance(action, str) else ""
            yield Problem(name, f"unknown action {action!r}{hint}; use one of {_one_of(ACTIONS)}")
        elif action == "discard" and not has_layer_sites:
            yield Problem(name, "'discard' needs the enclosing 'layer' site as its scope and this model marks"
                                " none; use 'recompute' or add layer sites")
        elif action == "discard" and label not in DISCARD_MODULES:
            yield Problem(name, f"only {_one_of(sorted(DISCARD_MODULES))} outputs are discarded (their "
                                f"consumers save them anyway); use 'recompute' for {label!r}")
        elif action == "recompute" and label in DISCARD_ONLY:
            yield Problem(name, f"{label!r}'s output is all its consumer saves, so a plain recompute frees"
                                " nothing; use 'discard'")


def _plan_layer_site(name: str, action: Any, has_layer_sites: bool) -> Iterator[Problem]:
    if not has_layer_sites:
        yield Problem(name, "this model marks no 'layer' sites; offload the sites inside its layers instead")
    elif action not in ("keep", "offload"):
        yield Problem(name, f"a whole layer can be kept or offloaded here (got {action!r}); recompute whole"
                            " layers with full_recompute ranges")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plan_ranges(
    full_recompute: Sequence[Any], layout: ModelLayout
) -> tuple[list[tuple[int, int, int]], list[Problem]]:
    """Check the [start, end) ranges; return the usable ones as (index, start, end) and the problems."""
    n = layout.num_layers
    usable: list[tuple[int, int, int]] = []
    problems: list[Problem] = []
    if full_recompute and not layout.has_layer_sites:
        problems.append(Problem("full_recompute", "this model marks no 'layer' sites, so whole layers cannot be"
                                                  " recomputed; leave full_recompute empty"))
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
            problems.append(Problem(name, f"[{start}, {end}) {how} full_recompute[{j}] [{prev_start}, {prev_end});"
                                          " list disjoint ranges in layer order"))
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
                    yield Problem(f"layers[{i}].{label}", f"only the first layer of full_recompute[{k}] [{start}, {end})"
                                                          f" keeps an input to offload; set layers[{start}].layer")
                elif action != "keep" and not (label == LAYER and action == "offload"):
                    yield Problem(f"layers[{i}].{label}", f"layer {i} is inside full_recompute[{k}] [{start}, {end}),"
                                                          " which recomputes the whole layer; set it to 'keep'")


PLAN_FORMAT = 1  # the `remat_plan:` version a plan file starts with
_PLAN_KEYS = ("remat_plan", "layers", "full_recompute", "min_offloaded_tensor_size")


def plan_file_problems(data: Mapping[str, Any]) -> list[Problem]:
    """What is wrong with the shape of a per-layer plan file's mapping (before any model is known)."""
    problems = []
    if "remat_plan" not in data:
        problems.append(Problem("remat_plan", f"expected `remat_plan: {PLAN_FORMAT}` at the top "
                                "of a plan file; is this a RecomputeConfig instead?"))
    elif data["remat_plan"] != PLAN_FORMAT:
        problems.append(Problem("remat_plan", f"{data['remat_plan']!r} is not a plan format this remat reads;"
                                              f" it reads `remat_plan: {PLAN_FORMAT}` (write the plan again with"
                                              " this version's `remat plan`)"))
    layers = data.get("layers")
    if not isinstance(layers, list) or not all(isinstance(a, Mapping) for a in layers):
        problems.append(Problem("layers", "expected a list with one mapping of label: action per layer"))
    ranges = data.get("full_recompute", [])
    if not isinstance(ranges, list) or not all(
        isinstance(r, (list, tuple)) and len(r) == 2 and all(map(_is_index, r)) for r in ranges
    ):
        problems.append(Problem("full_recompute", "expected a list of [start, end) layer index pairs"))
    min_size = data.get("min_offloaded_tensor_size", MIN_OFFLOADED_TENSOR_SIZE)
    if not _is_index(min_size) or min_size < 0:
        problems.append(Problem("min_offloaded_tensor_size", f"got {min_size!r}; set it to a whole number"
                                " of elements, 0 or more"))
    unknown = sorted(map(str, set(data) - set(_PLAN_KEYS)))
    if unknown:
        problems.append(Problem(", ".join(unknown), f"unknown plan keys; a plan has {', '.join(_PLAN_KEYS)}"))
    return problems


def check_plan(
    layers: Sequence[Mapping[str, str]], full_recompute: Sequence[tuple[int, int]], layout: ModelLayout
) -> None:
    """Raise ConfigError listing everything wrong with a per-layer plan for a model with this layout.

    `layers[i]` maps site label -> action; `full_recompute` lists [start, end) layer ranges recomputed
    as one unit.
    """
    problems: list[Problem] = []
    if len(layers) != layout.num_layers:
        problems.append(Problem("layers", f"the plan has {len(layers)} layers but the model has"
                                          f" {layout.num_layers}; give one entry per layer"))
    for i, (actions, labels) in enumerate(zip(layers, layout.labels)):
        problems += _plan_layer(i, actions, labels, layout.has_layer_sites)
    ranges, range_problems = _plan_ranges(full_recompute, layout)
    problems += range_problems
    problems += _plan_inside_full(layers, ranges)
    if problems:
        raise ConfigError(problems)


ESTIMATE_TARGETS: tuple[str, ...] = ("cuda", "cpu")
# Sustained bf16 dense throughput assumed for estimated step times: remat's W1 plans on an H200
# measured 520-655 TFLOP/s (benchmarks/results/plan_w1_h200.json).
DEFAULT_TFLOPS = 600.0
# Host link bandwidth assumed for estimated offload copies, each way: pinned copies on the H200
# measured 55 GB/s (benchmarks/results/offload_w1_h200.json).
DEFAULT_HOST_GBPS = 55.0
# cuBLAS keeps a workspace per handle, allocated through torch's caching allocator and held for the
# process's life; torch makes a handle per thread that runs GEMMs: the forward's and autograd's CUDA
# backward thread. Each took 32 MiB on an H200 with torch 2.11 (workspace_bytes_h200.json).
DEFAULT_CUBLAS_WORKSPACE = 32 * 2**20
CUBLAS_HANDLES = 2


def cublas_workspace_bytes(config: str | None) -> int:
    """One cuBLAS handle's workspace for a CUBLAS_WORKSPACE_CONFIG value (':SIZE:COUNT' pairs, SIZE in
    KiB, summed), or the default where it is unset."""
    if config is None:
        return DEFAULT_CUBLAS_WORKSPACE
    if not re.fullmatch(r"(:\d+:\d+)+", config.strip()):
        raise ConfigError([Problem("CUBLAS_WORKSPACE_CONFIG", f"cannot read {config!r}; cuBLAS takes ':SIZE:COUNT'"
                                                              " pairs with SIZE in KiB, like ':4096:8' (32 MiB): fix"
                                                              " or unset it, or give the size as cublas_workspace"
                                                              " (--cublas_workspace)")])
    numbers = [int(n) for n in config.strip().split(":")[1:]]
    return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2]))


def estimate_problems(target: str, micro_batch_size: int, micro_batches: int, tflops: float,
                      host_gbps: float = DEFAULT_HOST_GBPS, cublas_workspace: int | None = None) -> Iterator[Problem]:
    """The settings of a shapes-only estimate (`remat estimate`)."""
    if target not in ESTIMATE_TARGETS:
        yield Problem("target", f"{target!r} is not a target; use one of {_one_of(ESTIMATE_TARGETS)}")
    if micro_batch_size < 1 or micro_batches < 1:
        yield Problem("micro_batch_size", f"micro-batch size {micro_batch_size} and count {micro_batches} must"
                                          " be 1 or more")
    if not tflops > 0:
        yield Problem("tflops", f"is {tflops}; give the sustained TFLOP/s one GPU reaches, e.g. 600")
    if not host_gbps > 0:
        yield Problem("host_gbps", f"is {host_gbps}; give the host link's bandwidth each way in GB/s, "
                                   f"e.g. {DEFAULT_HOST_GBPS:g}")
    if cublas_workspace is not None and cublas_workspace < 0:
        yield Problem("cublas_workspace", f"is {cublas_workspace} bytes; give 0 or more (one cuBLAS handle's"
                                          " workspace)")
    if cublas_workspace is not None and target != "cuda":
        yield Problem("cublas_workspace", f"counts only on the cuda target, not {target!r}; drop it")


def pipeline_range_problems(full_recompute: Sequence[tuple[int, int]], num_layers: int,
                            facts: TrainingFacts) -> Iterator[Problem]:
    """A per-layer plan's full-recompute ranges under pipeline parallelism. Each model chunk (a
    pipeline stage, or one of a rank's virtual stages) runs as its own block, and Megatron
    recomputes within it: a range cannot reach into the next chunk, which runs apart from it (on
    another rank, or later on the same one)."""
    pp, vpp = facts.pipeline_model_parallel_size, facts.virtual_pipeline_model_parallel_size
    per_chunk = _layers_per_virtual_stage(num_layers, pp, vpp)
    if pp == 1 or per_chunk is None:  # no chunks, or a split the pipeline rules already refuse
        return
    for k, (start, end) in enumerate(full_recompute):
        cuts = list(range(start - start % per_chunk + per_chunk, end, per_chunk))
        if not cuts:
            continue
        shown = ", ".join(map(str, range(start // per_chunk, (end - 1) // per_chunk + 1)))
        where = (f"virtual pipeline stages {shown} ({per_chunk} layers each; stage c runs on pipeline rank "
                 f"c mod {pp})" if vpp else f"pipeline stages {shown} ({per_chunk} layers each)")
        yield Problem(f"full_recompute[{k}]", f"[{start}, {end}) spans {where}, and each stage recomputes only "
                                              f"its own layers; split the range at layer"
                                              f"{'s' if len(cuts) > 1 else ''} {', '.join(map(str, cuts))}")


def offload_prediction_problems(layers: Sequence[Mapping[str, str]],
                                 full_recompute: Sequence[tuple[int, int]]) -> Iterator[Problem]:
    """Offload the trace cannot price: in the last layer (of a model or pipeline stage), whose
    backward comes right after its forward, nothing hides the copies or prefetches them."""
    last = len(layers) - 1
    ends = {s: e for s, e in full_recompute}
    for i, actions in enumerate(layers):
        if "offload" in actions.values() and ends.get(i, i + 1) - 1 == last:
            yield Problem(f"layers[{i}]", f"offloads in the last layer ({last}), whose backward comes right after"
                                          f" its forward: nothing hides the copies; keep it on the GPU (as Megatron"
                                          f" does) or split the range before it")


def planning_problems(offload: bool, host_budget_bytes: int | None, device_type: str | None = None,
                      host_bytes_per_s: float | None = None) -> Iterator[Problem]:
    """What a trace (`remat.trace`, `remat plan`, `remat estimate`) may measure and the planner choose."""
    if host_budget_bytes is not None and not offload:
        yield Problem("host_memory_budget", "caps what offload moves to host memory; turn offload on "
                                            "(--offload) or drop the host budget")
    if offload and device_type == "meta" and not (host_bytes_per_s or 0) > 0:
        yield Problem("host_gbps", "a shapes-only trace (meta device) runs no copies: give the host link's "
                                   f"bandwidth to time them (host_bytes_per_s; `--host_gbps`, e.g. "
                                   f"{DEFAULT_HOST_GBPS:g})")


def plan_search_problems(budget_bytes: int, weight_bytes: int, max_group: int) -> Iterator[Problem]:
    """What the planner can be asked before it traces: a budget the weights leave room in, and
    whole-layer groups it may form."""
    if weight_bytes >= budget_bytes:
        yield Problem("memory_budget", (
            f"the weights alone take {format_bytes(weight_bytes)}, more than the {format_bytes(budget_bytes)} "
            "budget: no recompute plan helps; shard them (FSDP2) or spread the model over more GPUs "
            "(tensor or pipeline parallel)"))
    if max_group < 1:
        yield Problem("max_group", f"is {max_group}; use 1 or more (the most layers recomputed whole as one group)")


def estimate_threshold_problems(thresholds: Iterable[int]) -> Iterator[Problem]:
    """One estimate traces offload at one min_offloaded_tensor_size."""
    if len(distinct := sorted(set(thresholds))) > 1:
        yield Problem("min_offloaded_tensor_size", f"the offload plans use thresholds {distinct}; one estimate "
                                                   "traces one: give them the same")


def nothing_offloaded_advice(offloaded_bytes: int, min_numel: int) -> Iterator[Problem]:
    """After steps under a plan that offloads: nothing reached the size threshold (a small model
    under the default), where a user would otherwise see no host bytes and no saving, and no reason."""
    if offloaded_bytes == 0:
        yield Problem("min_offloaded_tensor_size", f"the plan offloads, but no saved tensor had {min_numel} "
                                                   "elements or more, so nothing moved to host; lower it "
                                                   "(--min_offloaded_tensor_size) to offload this model's tensors")


def offload_threshold_problems(offload: bool, min_offloaded_tensor_size: int | None) -> Iterator[Problem]:
    """remat plan's --min_offloaded_tensor_size: for offload only, and a size."""
    if min_offloaded_tensor_size is None:
        return
    if not offload:
        yield Problem("min_offloaded_tensor_size", "sets which tensors offload moves, and offload is off; pass "
                                                   "--offload or drop it")
    else:
        yield from _min_offload_size_problems(min_offloaded_tensor_size)


# ---------------------------------------------------------------------------------------------
# Benchmark settings (`remat bench`, `remat sweep`).

BRIDGE_COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp8_cs", "fp8_mx", "fp8_sc", "nvfp4")
SUPPORTED_COMPUTE_DTYPES: tuple[str, ...] = ("bf16",)
BRIDGE_TASKS: tuple[str, ...] = ("pretrain", "sft", "peft")
TASKS: tuple[str, ...] = ("pretrain", "sft")
GPUS: tuple[str, ...] = ("h100", "h200", "b200", "b300", "gb200", "gb300", "vr200", "r100")
# Above this a CPU step takes minutes and tens of GiB: such shapes are for a GPU.
CPU_MAX_PARAMETERS = 300_000_000


@dataclass(frozen=True)
class BenchSettings:
    """The run settings `check_bench` validates (the recompute config is checked on its own)."""

    compute_dtype: str = "bf16"
    device: str = "cpu"
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    max_steps: int = 10
    warmup_steps: int = 3
    task: str = "pretrain"
    num_parameters: int | None = None
    gpu: str | None = None
    num_gpus: int = 1
    compile: bool = False


def _bench_problems(s: BenchSettings) -> Iterator[Problem]:
    if s.compute_dtype not in SUPPORTED_COMPUTE_DTYPES:
        known = s.compute_dtype in BRIDGE_COMPUTE_DTYPES
        # a typo is pointed at what runs, not at a Bridge dtype that would be refused next
        yield Problem("compute_dtype", f"{s.compute_dtype!r} is " + (
            "not supported yet" if known else
            f"not a compute dtype{_did_you_mean(s.compute_dtype, SUPPORTED_COMPUTE_DTYPES)}; Megatron Bridge's "
            f"are {_one_of(BRIDGE_COMPUTE_DTYPES)}") + "; use -c bf16")
    if s.task not in TASKS:
        yield Problem("task", f"{s.task!r} is " + (
            "not supported yet" if s.task in BRIDGE_TASKS else
            f"not a task{_did_you_mean(s.task, TASKS)}; Megatron Bridge's are {_one_of(BRIDGE_TASKS)}")
            + f"; use {' or '.join(TASKS)}")
    if s.gpu is not None and s.gpu not in GPUS:
        yield Problem("gpu", f"{s.gpu!r} is not a GPU name{_did_you_mean(s.gpu, GPUS)}; use one of {_one_of(GPUS)}")
    yield from micro_batch_problems(s.micro_batch_size)
    if s.micro_batch_size >= 1 and s.global_batch_size is not None and (
        s.global_batch_size < s.micro_batch_size or s.global_batch_size % s.micro_batch_size
    ):
        yield Problem("global_batch_size", f"{s.global_batch_size} is not a positive multiple of the"
                                           f" micro-batch size {s.micro_batch_size}; use a multiple of it")
    if s.warmup_steps < 0:
        yield Problem("warmup_steps", f"is {s.warmup_steps}; use --warmup_steps 0 or more")
    elif s.max_steps <= s.warmup_steps:
        yield Problem("max_steps", f"{s.max_steps} steps leave no steady step after {s.warmup_steps} warm-up"
                                   f" steps; use -ms {s.warmup_steps + 1} or more")
    if s.compile and s.warmup_steps == 0:
        yield Problem("warmup_steps", "is 0 with --compile: the first step compiles and would be timed as a"
                                      " steady step; use --warmup_steps 1 or more")
    if s.num_gpus != 1:
        yield Problem("num_gpus", f"is {s.num_gpus}; remat bench runs on one GPU for now (multi-GPU runs"
                                  " through torchrun arrive with the parallel issue); use -ng 1")
    yield from _device_problems(s)


def device_problems(device: str) -> list[Problem]:
    """A device a command runs on: cpu, cuda or cuda:N, and a GPU where one is asked for."""
    import torch  # config stays importable without touching torch until a run is checked

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        return [Problem("device", f"{device!r} is not a device; use cpu, cuda or cuda:N")]
    if device.startswith("cuda") and not torch.cuda.is_available():
        return [Problem("device", "a CUDA GPU was asked for but this machine has none; run on CPU with a"
                                  " tiny recipe (remat recipes lists it)")]
    return []


def _device_problems(s: BenchSettings) -> Iterator[Problem]:
    import torch

    problems = device_problems(s.device)
    yield from problems
    if problems:
        return
    if s.device == "cpu" and s.num_parameters is not None and s.num_parameters > CPU_MAX_PARAMETERS:
        yield Problem("device", f"{s.num_parameters / 1e9:.2f}B parameters is a GPU job; on CPU use a tiny"
                                " recipe or shrink it (--num_layers, --hidden_size)")
    if s.device == "cpu" and s.gpu is not None:
        yield Problem("gpu", f"-g {s.gpu} names a GPU but this run is on CPU; drop -g or run on a GPU")
    elif s.gpu in GPUS and s.device.startswith("cuda") and torch.cuda.is_available():
        present = torch.cuda.get_device_name(s.device)
        # whole words of the name: "b200" is not a GB200
        if s.gpu not in re.findall(r"[a-z0-9]+", present.lower()):
            yield Problem("gpu", f"-g {s.gpu} but this machine's GPU is {present}; fix -g or drop it")


def recompute_flag_problems(recompute_num_layers: int | None, recompute_modules: str | None,
                            recompute_granularity: str | None = None) -> Iterator[Problem]:
    """Bridge's perf flags: -rl and --recompute_modules each choose the granularity."""
    if recompute_num_layers is not None and recompute_modules is not None:
        yield Problem("-rl/--recompute_modules", "pass one of them: -rl N recomputes whole layers, "
                                                 "--recompute_modules recomputes the listed modules in every layer")
    elif recompute_modules is not None and recompute_granularity == "full":
        yield Problem("--recompute_granularity", "full recomputes whole layers and --recompute_modules lists modules"
                                                 " for selective recompute; drop --recompute_granularity full (the"
                                                 " modules imply selective), or drop --recompute_modules and pass"
                                                 " -rl N")
    elif recompute_num_layers is not None and recompute_granularity == "selective":
        yield Problem("--recompute_granularity", "selective recomputes modules in every layer and -rl N recomputes"
                                                 " N whole layers (full); drop --recompute_granularity selective (-rl"
                                                 " implies full), or drop -rl and pass --recompute_modules")


def plan_file_flag_problems(other_flags: Mapping[str, Any], model_given: bool = True) -> Iterator[Problem]:
    """A per-layer plan file passed with --config, beside the command's other flags."""
    if other_flags:
        yield Problem("--config", "a per-layer plan file sets every action itself; drop the recompute and "
                                  "parallel flags")
    if not model_given:
        yield Problem("--config", "a per-layer plan is checked against a model: pass -mr RECIPE")


def configs_flag_problems(flags: RecomputeConfig | None) -> Iterator[Problem]:
    """`remat estimate --configs` estimates the entries it lists: a config the recompute and
    offload flags (or --config) choose beside them would be dropped. `flags` is what they resolve
    to; None for a per-layer plan file."""
    defaults = {f.name: _default(f) for f in dataclasses.fields(RecomputeConfig)}
    chosen = (["--config (a per-layer plan)"] if flags is None
              else [name for name in _RECOMPUTE_PARSERS if getattr(flags, name) != defaults[name]])
    if chosen:
        yield Problem("--configs", f"estimates only the entries it lists, so what the flags set ({', '.join(chosen)})"
                                   " would be ignored; give it as an entry (like mlp+core_attn or full_block_2; "
                                   "offload in a config or plan file) or drop either the flags or --configs")


def execution_problems(facts: TrainingFacts) -> Iterator[Problem]:
    """What the recompute rules accept but remat's one-process runs (bench, verify) do not execute (yet)."""
    sizes = {"tensor_model_parallel_size": facts.tensor_model_parallel_size,
             "pipeline_model_parallel_size": facts.pipeline_model_parallel_size,
             "context_parallel_size": facts.context_parallel_size}
    for name, size in sizes.items():
        if size != 1:
            yield Problem(name, f"is {size}; this runs one device without model parallelism for now"
                                " (parallel execution arrives with its own issue); use 1")
    if facts.virtual_pipeline_model_parallel_size is not None:
        yield Problem("virtual_pipeline_model_parallel_size", "needs pipeline parallelism, which this run"
                                                              " does not execute yet; drop -vp")
    if facts.cuda_graph_impl != "none" or facts.cuda_graph_scope:
        yield Problem("cuda_graph_impl", "this runs without CUDA graphs; drop --cuda_graph_impl and"
                                         " --cuda_graph_scope")


def bench_config_problems(c: RecomputeConfig) -> Iterator[Problem]:
    """A config the bench would not measure as asked: what it does not execute, and the settings that
    take effect only with their switch on while it is off (Megatron ignores them and the library
    warns, but a bench would silently measure without them)."""
    yield from execution_problems(c.facts)
    for p in rule_settings_without_granularity(c):
        yield Problem(p.field, f"{getattr(c, p.field)!r} applies only to full recompute, which is off, so this run"
                               f" would recompute nothing; add -rl N (in a config file: recompute_granularity:"
                               f" full with recompute_method and recompute_num_layers), or drop {p.field}")
    yield from rule_modules_without_switch(c)


def parallel_shape_problems(facts: TrainingFacts, *, num_attention_heads: int, num_query_groups: int,
                            ffn_hidden_size: int, seq_length: int) -> Iterator[Problem]:
    """What a model's shapes need to split across tensor- and context-parallel ranks."""
    tp, cp = facts.tensor_model_parallel_size, facts.context_parallel_size
    for name, size in (("num_attention_heads", num_attention_heads), ("num_query_groups", num_query_groups),
                       ("ffn_hidden_size", ffn_hidden_size)):
        if tp >= 1 and size % tp:
            yield Problem("tensor_model_parallel_size", f"{name}={size} does not split over {tp} tensor-parallel"
                                                        f" ranks; use a tensor-parallel size that divides it")
    # causal load balancing gives each context-parallel rank two chunks of the sequence
    chunks = 2 * cp if cp > 1 else 1
    if cp >= 1 and seq_length % chunks:
        yield Problem("context_parallel_size", f"seq_length={seq_length} does not split into {chunks} chunks"
                                               f" for {cp} context-parallel ranks; use a sequence length that"
                                               f" is a multiple of {chunks}")
    elif facts.sequence_parallel and tp > 1 and cp >= 1 and (seq_length // cp) % tp:
        yield Problem("sequence_parallel", f"each rank's {seq_length // cp} tokens do not split over {tp}"
                                           f" tensor-parallel ranks; use a sequence length that is a multiple"
                                           f" of {tp * cp}, or turn sequence parallelism off")


# Tokens of one micro-batch on one GPU that remat estimates: 2^22 of a 4096-wide bf16 hidden state
# are 32 GiB a layer, past what a GPU trains; the shapes-only trace of far more loops for hours.
MAX_TOKENS_PER_GPU = 1 << 22


def micro_batch_tokens_problems(seq_length: int, micro_batch_size: int, context_parallel_size: int) -> Iterator[Problem]:
    tokens = seq_length * micro_batch_size // max(context_parallel_size, 1)
    if tokens > MAX_TOKENS_PER_GPU:
        yield Problem("seq_length", f"{seq_length} x micro-batch {micro_batch_size} over {context_parallel_size}"
                                    f" context-parallel rank(s) puts {tokens:,} tokens on each GPU; remat"
                                    f" estimates at most {MAX_TOKENS_PER_GPU:,} (2^22: at hidden size 4096 their"
                                    f" hidden state alone is 32 GiB a layer); lower -sl or -mb, or raise -cp")


def batch_split_problems(facts: TrainingFacts, num_gpus: int, micro_batch_size: int,
                         global_batch_size: int | None) -> Iterator[Problem]:
    """GPUs = data parallel x tp x pp x cp, and the global batch = micro-batches x mb x data parallel."""
    model_parallel = (facts.tensor_model_parallel_size * facts.pipeline_model_parallel_size
                      * facts.context_parallel_size)
    if num_gpus < 1:
        yield Problem("num_gpus", f"is {num_gpus}; use at least {max(model_parallel, 1)} (tp x pp x cp)")
    elif model_parallel < 1 or num_gpus % model_parallel:
        yield Problem("num_gpus", f"{num_gpus} GPUs do not split into data-parallel groups of tp x pp x cp ="
                                  f" {model_parallel}; use a multiple of {model_parallel}")
    elif global_batch_size is not None and micro_batch_size >= 1:
        per_step = micro_batch_size * (num_gpus // model_parallel)
        if global_batch_size < per_step or global_batch_size % per_step:
            yield Problem("global_batch_size", f"{global_batch_size} is not a multiple of micro-batch x data"
                                               f" parallel = {per_step}; use a multiple of it")


def recorded_config(keys: Mapping[str, Any]) -> RecomputeConfig:
    """Megatron keys as a result recorded them, fields parsed but no rule applied: results from other
    harnesses may hold configs these rules refuse, and `remat doctor` runs single rules on them."""
    config = RecomputeConfig.__new__(RecomputeConfig)
    for f in dataclasses.fields(RecomputeConfig):
        setattr(config, f.name, keys.get(f.name, _default(f)))
    config.facts = TrainingFacts(**{k: v for k, v in keys.items() if k in _FACT_PARSERS})
    config._normalize()  # a field of the wrong type falls back to its default
    return config


def snapshot_limit_problems(reserved: int, limit: int) -> Iterator[Problem]:
    """A memory snapshot records no device size; the one given must hold what the snapshot reserves."""
    if limit < reserved:
        yield Problem("limit", f"{format_bytes(limit)} is less than the {format_bytes(reserved)} the snapshot"
                               " reserves; pass the device's memory (e.g. --limit 80GiB, or 141GiB on an H200)"
                               " or the per-process fraction's share of it")


def threshold_problems(threshold: float) -> Iterator[Problem]:
    if not threshold >= 0:
        yield Problem("threshold", f"is {threshold}; a golden comparison needs a relative threshold >= 0,"
                                   " e.g. 0.05")


def output_path_problems(flag: str, path: str | os.PathLike[str]) -> Iterator[Problem]:
    """A file written once a run is over, checked before it starts (the writers create missing folders)."""
    target = Path(path)
    if target.is_dir():
        yield Problem(flag, f"{path} is a directory; give a file path in it")
        return
    folder = next(p for p in target.absolute().parents if p.exists())  # the nearest that exists
    # tried, not looked up: os.access says yes to root everywhere, read-only mounts included
    if target.exists():
        if (error := _open_error(lambda: target.open("ab"))) is not None:
            yield Problem(flag, f"{path} cannot be overwritten ({error}); choose another path")
    elif not folder.is_dir():
        yield Problem(flag, f"{folder} is a file, so {path} cannot be created in it; choose another path")
    elif (error := _open_error(lambda: tempfile.NamedTemporaryFile(dir=folder))) is not None:
        yield Problem(flag, f"{path} cannot be created in {folder} ({error}); choose another folder")


def _open_error(opener: Callable[[], IO[bytes]]) -> str | None:
    """Why opening fails (the OS's words), or None when it opens; closed at once."""
    try:
        opener().close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def doctor_flag_problems(*, results: bool, state: bool, oom_message: bool, timeline: bool, request: bool,
                         limit: bool) -> list[Problem]:
    """remat doctor does one thing per call: flags that the chosen one would ignore are refused."""
    problems = []
    if timeline and (results or state):
        problems.append(Problem("--timeline", "plots a run of the recipe, not a file or message; drop --timeline or"
                                              " the --results / --snapshot / --oom_message"))
    if not state:
        problems += [Problem(flag, "describes an OOM's allocator state, for --snapshot or --oom_message only;"
                                   f" drop {flag}") for flag, given in (("--request", request), ("--limit", limit))
                     if given]
    elif limit and oom_message:
        problems.append(Problem("--limit", "the OOM message gives the device's capacity; drop --limit"))
    elif not limit and not oom_message:
        problems.append(Problem("--limit", "a snapshot records no device size; pass --limit (e.g. 80GiB)"))
    return problems


def doctor_run_problems(cuda_available: bool) -> Iterator[Problem]:
    """remat doctor -mr runs the bench to catch an OOM, and an OOM is a GPU's."""
    if not cuda_available:
        yield Problem("doctor", "-mr runs the bench on a CUDA GPU and this machine has none; pass --results, "
                                "--snapshot or --oom_message instead")


def tolerance_problems(tolerance: float) -> Iterator[Problem]:
    if not tolerance >= 0:  # NaN too
        yield Problem("tolerance", f"is {tolerance}; use 0 (bit-identical) or the largest gradient difference to accept")


def micro_batch_problems(micro_batch_size: int) -> Iterator[Problem]:
    if micro_batch_size < 1:
        yield Problem("micro_batch_size", f"is {micro_batch_size}; use at least 1")


def history_file_problems(path: str | os.PathLike[str]) -> Iterator[Problem]:
    """An existing --history file must be a run history (SQLite), or the run's record is lost at its end."""
    target = Path(path)
    if target.is_file() and target.stat().st_size:  # SQLite starts an empty file itself
        with target.open("rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                yield Problem("--history", f"{path} is not a run history (not an SQLite database); choose another file")


def history_flag_problems(history: str | None, no_history: bool) -> Iterator[Problem]:
    """Where to record a run, and not to record it."""
    if history and no_history:
        yield Problem("--history", "names a history file and --no_history records none; drop one")


def png_path_problems(flag: str, path: str | os.PathLike[str] | None) -> Iterator[Problem]:
    """remat's plots are PNG files: a name that says otherwise would mislead whoever opens it."""
    if path is not None and Path(path).suffix.lower() != ".png":
        yield Problem(flag, f"{path}: the plot is a PNG; end the name in .png")


def plan_run_flag_problems(verify: bool, given: Iterable[str]) -> Iterator[Problem]:
    """remat plan's run flags (-ms, --warmup_steps, --history) set the --verify run; the trace ignores them."""
    if not verify:
        for flag in given:
            yield Problem(flag, "sets the run --verify makes, and there is none; pass --verify or drop it")


def plan_output_problems(flag: str, path: str | os.PathLike[str]) -> Iterator[Problem]:
    """A plan or config file is read back by its suffix (remat bench --config, remat.apply)."""
    if Path(path).suffix.lower() not in (".yaml", ".yml", ".json"):
        yield Problem(flag, f"{path}: a plan is read back by its suffix; end the name in .yaml, .yml or .json")


def dryrun_output_problems(flags: Iterable[str]) -> Iterator[Problem]:
    """Output flags beside -d, which runs nothing and so writes nothing."""
    for flag in flags:
        yield Problem(flag, "a dry run (-d) runs nothing, so nothing is written; drop it or drop -d")


def golden_flag_problems(threshold: float | None, golden_given: bool) -> Iterator[Problem]:
    """--threshold only means something for a golden comparison."""
    if threshold is not None and not golden_given:
        yield Problem("threshold", "sets how much a golden comparison may differ, and there is none; pass"
                                   " --golden FILE or drop --threshold")
    elif threshold is not None:
        yield from threshold_problems(threshold)


def offload_device_advice(device: str, offloading: Sequence[str]) -> Iterator[Problem]:
    """Runs that offload, on a device where that saves nothing (advice: the CPU path tests the mechanism)."""
    if offloading and device == "cpu":
        yield Problem("device", f"offload on CPU ({', '.join(offloading)}) copies CPU memory to CPU memory: it"
                                " exercises the mechanism only, and the lower peak allocated and the peak host it"
                                " reports are no saving; measure offload on a GPU")


def advise(problems: Iterable[Problem]) -> None:
    """Each problem as a RematWarning: advice, not an error."""
    for problem in problems:
        _warn(str(problem))


def golden_match_problems(differences: Sequence[str]) -> Iterator[Problem]:
    """A golden of another recipe or shape measured another run (golden.run_differences)."""
    if differences:
        yield Problem("golden", f"was measured on another run ({'; '.join(differences)}); run with the golden's"
                                " recipe and shape, or store this run as a new golden with --save-golden")


def check_bench(settings: BenchSettings) -> None:
    """Raise ConfigError listing every problem with a benchmark's run settings."""
    problems = list(_bench_problems(settings))
    if problems:
        raise ConfigError(problems)
