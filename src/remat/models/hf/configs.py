"""Configs of Hugging Face transformers models by family name, small enough for a CPU, with
shape overrides in Megatron's names; or a config.json. Nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from remat.core.problems import ConfigError, Problem, did_you_mean, read_file
from remat.models.hf import catalog

INSTALL = "Hugging Face models need transformers: pip install 'remat[hf]'"

# The families the README shows, by the name remat lists them under -> transformers' model_type.
# Every other decoder-only family of the installed transformers builds as `hf:<model_type>` too.
TINY: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "gpt2": "gpt2",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
}

# Megatron's names -> transformers' (the config's attribute_map takes GPT-2's n_embd etc. from these).
MEGATRON_NAMES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("intermediate_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "num_moe_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_router_topk": ("num_experts_per_tok", "top_k_experts", "moe_topk"),
    "attention_dropout": ("attention_dropout", "attn_pdrop"),
    "hidden_dropout": ("hidden_dropout", "resid_pdrop"),
}


def field_of(hf: Any, name: str) -> Any:
    """The value of Megatron's `name` in a transformers config, under whichever of its names the
    family uses (None where it has none, or leaves it unset)."""
    return next((v for n in MEGATRON_NAMES[name] if (v := getattr(hf, n, None))), None)


def layer_configs(hf: Any) -> list[Any]:
    """Each layer's config: a heterogeneous config's own per layer (Gemma 4's head sizes differ
    between its sliding and global layers), else the model's for every layer."""
    per_layer = getattr(hf, "per_layer_config", None)
    return [per_layer[i] for i in range(hf.num_hidden_layers)] if per_layer else [hf] * hf.num_hidden_layers


def transformers_module() -> Any:
    """transformers, or ImportError with the one line that installs it."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError(INSTALL) from err
    return transformers


def hf_config(family_or_json: str, **overrides: Any) -> Any:
    """A transformers config: a family's small default (TINY) or a config.json, with overrides in
    Megatron's names (num_layers, hidden_size, ...) or the config's own; every bad name at once."""
    transformers_module()  # ImportError with how to install it
    path = Path(family_or_json)
    model_type = TINY.get(family_or_json, family_or_json)
    if model_type in catalog.causal_lm_types():
        reason = catalog.scope(model_type)
        if reason is not None:
            raise ConfigError(
                [Problem("hf_config", f"{family_or_json!r} is {reason}; remat adapts decoder-only causal LMs")]
            )
        base = _refused_as_problem(model_type, catalog.tiny_fields, model_type)
    elif path.suffix == ".json" or path.is_file():
        base = read_file(path, json.loads, "JSON")
        found = base.pop("model_type", None) if isinstance(base, dict) else None
        if not isinstance(found, str):
            raise ConfigError(
                [Problem("hf_config", f"{path} is no transformers config (no model_type); give a config.json")]
            )
        model_type = found
    else:
        raise ConfigError(
            [
                Problem(
                    "hf_config",
                    f"{family_or_json!r} is neither a family"
                    f"{did_you_mean(family_or_json, [*TINY, *catalog.decoder_families()])}"
                    f" ({', '.join(TINY)}, or any causal LM model_type of transformers) nor a config.json",
                )
            ]
        )
    # built twice: the first tells the config's own names, the second sets them from the start
    # (fields derived in __init__, such as layer_types from num_hidden_layers, follow)
    probe = _refused_as_problem(model_type, transformers_module().AutoConfig.for_model, model_type, **base)
    problems, fields = [], dict(base)
    for key, value in overrides.items():
        names = [n for n in MEGATRON_NAMES.get(key, (key,)) if hasattr(probe, n)]
        if not names:
            problems.append(
                Problem(
                    key,
                    f"is not a field of {type(probe).__name__}{did_you_mean(key, [*MEGATRON_NAMES, *probe.to_dict()])}",
                )
            )
        fields.update((name, value) for name in names)
    if problems:
        raise ConfigError(problems)
    kinds, layers = fields.get("layer_types"), fields.get("num_hidden_layers")
    if isinstance(kinds, list) and kinds and isinstance(layers, int) and len(kinds) != layers:
        fields["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]  # the pattern, repeated
    config = _refused_as_problem(model_type, transformers_module().AutoConfig.for_model, model_type, **fields)
    if getattr(config, "is_heterogeneous", False):
        # sizes that differ by layer (heads, MLA ranks) are read per layer where they change a count
        # (FLOPs, tensor-parallel splits, the meta model); elsewhere the config's global value serves
        config.allow_global_per_layer_attribute_access = True
    return config


def _refused_as_problem(model_type: str, make: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`make(*args, **kwargs)`, building a `model_type` config; ConfigError with transformers'
    reason if it refuses the fields."""
    try:
        return make(*args, **kwargs)
    except Exception as err:  # transformers' validators raise their own types beside ValueError
        reason = str(err).strip().splitlines()[-1].strip() if str(err).strip() else type(err).__name__
        raise ConfigError([Problem("hf_config", f"transformers refuses this {model_type} config: {reason}")]) from err


def overrides_from(values: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides that were given (None: left as the config has it)."""
    return {k: v for k, v in values.items() if v is not None}
