"""Configs of Hugging Face transformers models by family name, small enough for a CPU, with
shape overrides in Megatron's names; or a config.json. Nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remat.core.problems import ConfigError, Problem, did_you_mean

INSTALL = "Hugging Face models need transformers: pip install 'remat[hf]'"

_DENSE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
    head_dim=16,
)
_MOE_EAGER: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# family -> (transformers model_type, fields beside the dense defaults). Experts run in float64 on
# CPU only through transformers' eager experts (grouped_mm takes float16/32 only).
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "gpt2": (
        "gpt2",
        dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256, bos_token_id=0, eos_token_id=0),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(_MOE_EAGER, num_experts=4, shared_expert_intermediate_size=64)),
    "qwen3_moe": ("qwen3_moe", dict(_MOE_EAGER, num_experts=4, mlp_only_layers=[0])),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            _MOE_EAGER,
            n_routed_experts=4,
            n_shared_experts=1,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            head_dim=8,
        ),
    ),  # DeepSeek's head_dim is its RoPE part
}
_NO_DENSE_DEFAULTS = {"gpt2"}

# Megatron's names -> transformers' (the config's attribute_map takes GPT-2's n_embd etc. from these).
MEGATRON_NAMES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("intermediate_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "num_moe_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_router_topk": ("num_experts_per_tok",),
    "attention_dropout": ("attention_dropout", "attn_pdrop"),
    "hidden_dropout": ("hidden_dropout", "resid_pdrop"),
}


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
    transformers = transformers_module()
    path = Path(family_or_json)
    if family_or_json in TINY:
        model_type, fields = TINY[family_or_json]
        base = dict(fields) if family_or_json in _NO_DENSE_DEFAULTS else {**_DENSE, **fields}
    elif path.suffix == ".json" or path.is_file():
        try:
            base = json.loads(path.read_text())
            model_type = base.pop("model_type")
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(
                [Problem("hf_config", f"cannot read a transformers config from {path}: {err!r}")]
            ) from err
    else:
        raise ConfigError(
            [
                Problem(
                    "hf_config",
                    f"{family_or_json!r} is neither a family{did_you_mean(family_or_json, TINY)}"
                    f" ({', '.join(TINY)}) nor a config.json",
                )
            ]
        )
    # built twice: the first tells the config's own names, the second sets them from the start
    # (fields derived in __init__, such as layer_types from num_hidden_layers, follow)
    probe = transformers.AutoConfig.for_model(model_type, **base)
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
    return transformers.AutoConfig.for_model(model_type, **fields)


def overrides_from(values: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides that were given (None: left as the config has it)."""
    return {k: v for k, v in values.items() if v is not None}
