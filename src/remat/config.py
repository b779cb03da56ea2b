"""Recompute configuration with Megatron Core's field names, and every validation rule remat applies.

(vocabulary section written first; the rest of this module is filled in by the config work)
"""
from __future__ import annotations

# Megatron's selective-recompute labels that remat supports, in Megatron's order of documentation.
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj",
)
# Labels Megatron recomputes with its output-discarding checkpoint (the rest use a plain checkpoint).
DISCARD_MODULES: frozenset[str] = frozenset({"layernorm", "moe_act", "mla_up_proj"})
# A whole transformer layer: the unit of full (layer-level) recompute.
LAYER = "layer"
SITE_LABELS: tuple[str, ...] = RECOMPUTE_MODULES + (LAYER,)
# What a plan may do at a site.
ACTIONS: tuple[str, ...] = ("keep", "recompute", "discard")
