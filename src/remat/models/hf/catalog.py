"""The causal LM families of the installed transformers, read from its auto mappings, and a small
config of each that a CPU trains in a moment.

A family is a `model_type` of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`. remat adapts decoder-only text
models; the others are listed with why they are not (`scope`): encoder-decoder models, encoders
that can run as decoders (BERT's family, also in the masked-LM mapping), and multimodal models
(whose text decoder has a family of its own or is left out).
"""

from __future__ import annotations

import functools
from typing import Any

# Every size a tiny config sets, where the family's config has the field (its attribute_map
# translates GPT-2's n_embd and the like).
_SIZES: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=8,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    top_k_experts=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,  # a dense layer, then an MoE one
)
# Multi-latent attention (DeepSeek's and its kind): a config with kv_lora_rank; its head_dim is
# the RoPE part and every head has its own key and value.
_MLA: dict[str, Any] = dict(
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    head_dim=8,
    num_key_value_heads=4,
)
VOCAB = _SIZES["vocab_size"]
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")

# A family's own fields beside the sizes, where its config ties them together.
TWEAKS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(mlp_only_layers=[0]),
    "mamba2": dict(num_heads=8, head_dim=16),  # hidden_size x expand = heads x head_dim
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # one layer of each, two in all
    "zaya": dict(num_experts_per_tok=1),
    "xlnet": dict(d_head=16),  # d_model / n_head
    "kolibri1_1": dict(index_num_heads=1, index_layers=[1]),
    "gemma3n_text": dict(num_kv_shared_layers=0),
}


# Sub-configs that hold a composite model's decoder or the encoders beside it.
_COMPOSITE = frozenset({"text_config", "decoder", "decoder_config", "encoder_config", "text_encoder"})


def _mappings() -> tuple[dict[str, str], frozenset[str]]:
    from transformers.models.auto import modeling_auto

    return dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), frozenset(
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )


@functools.lru_cache(maxsize=1)
def causal_lm_types() -> tuple[str, ...]:
    """Every model_type transformers builds a causal LM for, in its own order."""
    return tuple(_mappings()[0])


@functools.cache
def scope(model_type: str) -> str | None:
    """None for a decoder-only text causal LM; else why remat does not adapt this family."""
    from transformers import CONFIG_MAPPING

    causal, masked = _mappings()
    if model_type not in causal:
        return "not a causal LM of the installed transformers"
    config = CONFIG_MAPPING[model_type]  # the class: some defaults do not validate
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if model_type in masked:
        return "an encoder (masked LM) that can run as a decoder"
    if any(name in config.sub_configs for name in ("vision_config", "audio_config", "vq_config")):
        return "multimodal: adapt its text decoder"
    if _COMPOSITE & set(config.sub_configs):
        return f"a composite model (its decoder is set in {', '.join(sorted(_COMPOSITE & set(config.sub_configs)))}): adapt its decoder"
    return None


def decoder_families() -> tuple[str, ...]:
    """The decoder-only text causal LM families remat adapts."""
    return tuple(t for t in causal_lm_types() if scope(t) is None)


def tiny_fields(model_type: str) -> dict[str, Any]:
    """Config fields that make `model_type` small: the sizes its config has, token ids within the
    vocabulary, one layer of each kind it interleaves, and its own tweaks."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    # a field of its own or one its attribute_map names (a derived property cannot be set)
    own = {*config.to_dict(), *getattr(config, "attribute_map", {})}
    fields = {k: v for k, v in _SIZES.items() if k in own}
    if "kv_lora_rank" in own:
        fields.update((k, v) for k, v in _MLA.items() if k in own)
    for name in _TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= VOCAB:
            fields[name] = VOCAB - 1
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or ()))
    if len(kinds) > 1 and "layer_types" in own:
        fields["layer_types"] = kinds
        fields["num_hidden_layers"] = len(kinds)
    return {**fields, **TWEAKS.get(model_type, {})}
