"""Megatron Core's fine-grained activation offloading rules, and remat's own, on a RecomputeConfig.

The offload modules Megatron names, the remat site each one offloads, and the rules on
`offload_modules` and its settings. Like `remat.config.rules` (whose `RULES` run first), each rule
yields the `Problem`s it finds and says in a comment whose rule it is.
"""

from __future__ import annotations

from collections.abc import Iterator

from remat.config.megatron import RecomputeFields
from remat.config.rules import Rule, selected
from remat.core.problems import Problem, did_you_mean, one_of

# Submodule inputs Megatron's fine-grained offloading can move to the host.
OFFLOAD_MODULES: tuple[str, ...] = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "expert_fc1",
    "moe_act",
    "fused_group_mlp",
    "gdp_qkv",
)
# Megatron's offload modules remat refuses: it has no Transformer Engine op fuser (fused_group_mlp)
# and no GatedDeltaProduct model (gdp_qkv).
REFUSED_OFFLOAD_MODULES: tuple[str, ...] = ("fused_group_mlp", "gdp_qkv")
# The site whose saved tensors (its input among them) each offload module sends to host; None
# where remat marks no site around that submodule.
OFFLOAD_SITES: dict[str, str | None] = {
    "attn_norm": "layernorm",
    "mlp_norm": "layernorm",
    "core_attn": "core_attn",
    "moe_act": "moe_act",
    "qkv_linear": None,
    "attn_proj": None,
    "expert_fc1": "expert_fc1",
    "fused_group_mlp": None,
    "gdp_qkv": None,
}
RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _usable_offload_modules() -> tuple[str, ...]:
    return tuple(m for m in OFFLOAD_MODULES if m not in REFUSED_OFFLOAD_MODULES)


@_rule
def rule_fine_grained_not_with_cpu_offload(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.fine_grained_activation_offloading and c.cpu_offloading:
        yield Problem("fine_grained_activation_offloading", "cannot be combined with cpu_offloading; turn one off")


@_rule
def rule_fine_grained_needs_modules(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.fine_grained_activation_offloading and not c.offload_modules:
        yield Problem(
            "offload_modules",
            f"fine-grained offloading with no modules offloads nothing; list some"
            f" of {one_of(_usable_offload_modules())}",
        )


@_rule
def rule_known_offload_modules(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    for label in c.offload_modules:
        if label not in OFFLOAD_MODULES:
            yield Problem(
                "offload_modules",
                f"unknown module {label!r}{did_you_mean(label, OFFLOAD_MODULES)};"
                f" use modules from {one_of(_usable_offload_modules())}",
            )


@_rule
def rule_fused_group_mlp_needs_op_fuser(c: RecomputeFields) -> Iterator[Problem]:  # Megatron, and remat has none
    if "fused_group_mlp" in c.offload_modules:
        yield Problem(
            "offload_modules",
            "'fused_group_mlp' offloads inside Transformer Engine's fused grouped"
            " expert MLP, which Megatron builds only with"
            " use_transformer_engine_op_fuser=True; remat has no TE op fuser:"
            " drop 'fused_group_mlp'",
        )


@_rule
def rule_fused_group_mlp_alone(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    # The fused op replaces the expert FC1 and activation those modules would offload.
    if not (c.fine_grained_activation_offloading and "fused_group_mlp" in c.offload_modules):
        return
    for label in ("expert_fc1", "moe_act"):
        if label in c.offload_modules:
            yield Problem(
                "offload_modules",
                f"'fused_group_mlp' fuses the expert MLP that {label!r} is part of,"
                f" so the two cannot be combined; drop {label!r} or"
                " 'fused_group_mlp'",
            )


@_rule
def rule_gdp_qkv_offload_without_model(c: RecomputeFields) -> Iterator[Problem]:  # remat: no model has it
    if "gdp_qkv" in c.offload_modules:
        yield Problem(
            "offload_modules",
            "'gdp_qkv' offloads the input of GatedDeltaProduct's QKV preparation;"
            " remat has no model with that layer yet: drop 'gdp_qkv'",
        )


@_rule
def rule_attn_proj_offload_needs_core_attn(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    offload = c.offload_modules
    if c.fine_grained_activation_offloading and "attn_proj" in offload and "core_attn" not in offload:
        yield Problem(
            "offload_modules",
            "the input of 'attn_proj' is the output of core_attn, which core_attn's"
            " backward also needs; offload 'core_attn' too or drop 'attn_proj'",
        )


@_rule
def rule_moe_recompute_blocks_expert_offload(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if not (c.fine_grained_activation_offloading and "moe" in selected(c)):
        return
    for label in ("expert_fc1", "moe_act", "fused_group_mlp"):
        if label in c.offload_modules:
            yield Problem(
                "offload_modules",
                f"'moe' recompute keeps nothing inside the MoE layer, so {label!r}"
                f" has nothing to offload; drop {label!r} or drop 'moe' from"
                " recompute_modules",
            )


@_rule
def rule_offloaded_site_not_recomputed(c: RecomputeFields) -> Iterator[Problem]:  # remat: one action a site
    if not c.fine_grained_activation_offloading:
        return
    for label in c.offload_modules:
        site = OFFLOAD_SITES.get(label)
        if site is not None and site in selected(c):
            yield Problem(
                "offload_modules",
                f"{label!r} offloads what the {site!r} site saves, and {site!r} is"
                " also recomputed, which saves (almost) nothing there; drop"
                f" {label!r} or drop {site!r} from recompute_modules",
            )


@_rule
def rule_norm_offload_together(c: RecomputeFields) -> Iterator[Problem]:  # remat: one 'layernorm' site label
    if not c.fine_grained_activation_offloading:
        return
    norms = [m for m in ("attn_norm", "mlp_norm") if m in c.offload_modules]
    if len(norms) == 1:
        other = "mlp_norm" if norms == ["attn_norm"] else "attn_norm"
        yield Problem(
            "offload_modules",
            f"remat marks both norms of a layer with one 'layernorm' site, so"
            f" {norms[0]!r} offloads {other!r} too; list both",
        )


@_rule
def rule_fine_grained_not_with_uniform_full(c: RecomputeFields) -> Iterator[Problem]:  # remat
    if c.fine_grained_activation_offloading and c.recompute_granularity == "full" and c.recompute_method == "uniform":
        yield Problem(
            "fine_grained_activation_offloading",
            "uniform full recompute saves nothing inside any"
            " layer, so there is nothing per module to offload;"
            " offload each group's input with cpu_offloading"
            " instead, or use the block method",
        )


@_rule
def rule_min_offload_size(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    yield from min_offload_size_problems(c.min_offloaded_tensor_size)


def min_offload_size_problems(size: int) -> Iterator[Problem]:
    if size < 0:
        yield Problem("min_offloaded_tensor_size", f"got {size}; set it to 0 or more (a tensor size in elements)")


@_rule
def rule_offload_fraction_range(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    fraction = c.activation_offload_fraction
    if not 0 <= fraction <= 1:  # NaN too
        yield Problem(
            "activation_offload_fraction",
            f"must be in range [0, 1], got {fraction}; set it to 1.0 (offload every tensor of each chosen module)",
        )


@_rule
def rule_offload_fraction_whole(c: RecomputeFields) -> Iterator[Problem]:  # remat: offloads whole sites
    fraction = c.activation_offload_fraction
    if 0 <= fraction < 1:
        yield Problem(
            "activation_offload_fraction",
            f"got {fraction}; remat offloads every tensor of each chosen"
            " module and cannot offload a fraction yet: set it to 1.0"
            " or remove it",
        )
