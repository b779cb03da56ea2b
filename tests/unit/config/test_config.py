"""Tests for the recompute config (remat.config.recompute, remat.config.rules, remat.config.model_sites, remat.config.plan): every validation rule failing and passing, loading, round trips, model checks."""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.config import offload_rules, recompute, rules
from remat.config import plan as layer_plan
from remat.config.capture import CUDA_GRAPH_IMPLS, Capture
from remat.config.fields import public_name
from remat.config.fields import settings as settings_of
from remat.config.megatron import TrainingFacts
from remat.config.model_sites import ModelSites, check_config
from remat.config.parallel import ParallelLayout
from remat.config.plan import check_plan
from remat.config.precision import Precision
from remat.config.recompute import RULES, WARNING_RULES, RecomputeConfig, recorded_config
from remat.core import labels
from remat.core.labels import Label, labels_without_model, recompute_labels
from remat.core.problems import ConfigError, Problem, RematWarning

RECOMPUTE_MODULES = recompute_labels()


FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def sel(*modules: str) -> dict[str, Any]:
    return {"recompute_granularity": "selective", "recompute_modules": list(modules)}


def problems_of(settings_: dict[str, Any]) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_megatron(settings_)
    return info.value.problems


def has(problems: list[Problem], field: str, phrase: str) -> bool:
    return any(p.field == field and phrase in p.message for p in problems)


def build_quietly(settings_: dict[str, Any]) -> RecomputeConfig:
    """Build, failing the test on any RematWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        return RecomputeConfig.from_megatron(settings_)


# (rule, settings, field, phrase): each setting breaks exactly the named rule's condition.
FAILING: list[tuple[str, dict[str, Any], str, str]] = [
    ("rule_granularity_value", {"recompute_granularity": "ful"}, "recompute_granularity", "did you mean 'full'"),
    ("rule_method_value", {**FULL, "recompute_method": "uniformm"}, "recompute_method", "did you mean 'uniform'"),
    (
        "rule_full_needs_method",
        {"recompute_granularity": "full", "recompute_num_layers": 1},
        "recompute_method",
        "needs a recompute_method",
    ),
    (
        "rule_full_num_layers",
        {"recompute_granularity": "full", "recompute_method": "block"},
        "recompute_num_layers",
        "needs recompute_num_layers",
    ),
    ("rule_full_num_layers", {**FULL, "recompute_num_layers": 0}, "recompute_num_layers", "at least 1"),
    (
        "rule_full_num_layers",
        {
            **FULL,
            "recompute_num_layers": 3,
            "num_layers": 8,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
        },
        "recompute_num_layers",
        "between 1 and 2",
    ),
    (
        "rule_selective_num_layers_none",
        {**sel("core_attn"), "recompute_num_layers": 2},
        "recompute_num_layers",
        "only full recompute uses it",
    ),
    (
        "rule_selective_method_none",
        {**sel("core_attn"), "recompute_method": "block"},
        "recompute_method",
        "only full recompute uses it",
    ),
    ("rule_selective_needs_modules", sel(), "recompute_modules", "no-recompute control"),
    ("rule_known_recompute_modules", sel("core_atn"), "recompute_modules", "did you mean 'core_attn'"),
    ("rule_known_recompute_modules", sel("mch"), "recompute_modules", "did you mean 'mhc'"),
    (
        "rule_recompute_labels_without_model",
        sel("gdn_norm_out"),
        "recompute_modules",
        "'gdn_norm_out' recomputes Gated DeltaNet's output norm (Megatron: only with experimental_attention_variant"
        " 'gdn' or 'gdn2'); remat has no model with that layer yet: drop 'gdn_norm_out'",
    ),
    (
        "rule_recompute_labels_without_model",
        sel("gdp_in_proj"),
        "recompute_modules",
        "'gdp_in_proj' recomputes GatedDeltaProduct's input projection",
    ),
    (
        "rule_recompute_labels_without_model",
        sel("gdp_qkv"),
        "recompute_modules",
        "GatedDeltaProduct's causal convolution and QKV preparation; remat has no model with that layer yet",
    ),
    (
        "rule_recompute_labels_without_model",
        sel("mhc", "core_attn"),
        "recompute_modules",
        "(Megatron: needs enable_mhc_connections=True, and neither 'mlp' nor full recompute beside it); remat has no"
        " model with that layer yet: drop 'mhc'",
    ),
    ("rule_no_duplicate_labels", sel("mlp", "mlp"), "recompute_modules", "'mlp' more than once"),
    (
        "rule_no_duplicate_labels",
        {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "core_attn"]},
        "offload_modules",
        "more than once",
    ),
    (
        "rule_distribute_not_with_sequence_parallel",
        {**FULL, "distribute_saved_activations": True, "tensor_model_parallel_size": 2, "sequence_parallel": True},
        "distribute_saved_activations",
        "sequence parallelism",
    ),
    (
        "rule_distribute_needs_full",
        {**sel("core_attn"), "distribute_saved_activations": True, "tensor_model_parallel_size": 2},
        "distribute_saved_activations",
        "only full recompute",
    ),
    (
        "rule_distribute_needs_tensor_parallel",
        {**FULL, "distribute_saved_activations": True},
        "distribute_saved_activations",
        "tensor_model_parallel_size > 1",
    ),
    (
        "rule_full_recompute_graph_scope",
        {**FULL, "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["mlp"]},
        "recompute_granularity",
        "per-layer CUDA graphs",
    ),
    (
        "rule_cpu_offload_layer_count",
        {"cpu_offloading": True, "cpu_offloading_num_layers": 4, "num_layers": 4},
        "cpu_offloading_num_layers",
        "between 0 and 3",
    ),
    (
        "rule_cpu_offload_layer_count",
        {"cpu_offloading": True, "cpu_offloading_num_layers": -1},
        "cpu_offloading_num_layers",
        "0 or more",
    ),
    (
        "rule_cpu_offload_not_with_pipeline",
        {"cpu_offloading": True, "pipeline_model_parallel_size": 2},
        "cpu_offloading",
        "pipeline parallelism",
    ),
    (
        "rule_cpu_offload_graphs",
        {"cpu_offloading": True, "cuda_graph_impl": "local"},
        "cpu_offloading",
        "per-layer CUDA graphs",
    ),
    (
        "rule_moe_act_needs_grouped_gemm",
        {**sel("moe_act"), "moe_grouped_gemm": False},
        "recompute_modules",
        "moe_grouped_gemm=True",
    ),
    (
        "rule_mla_up_proj_needs_mla",
        {**sel("mla_up_proj"), "multi_latent_attention": False},
        "recompute_modules",
        "multi_latent_attention=True",
    ),
    (
        "rule_shared_experts_not_with_overlap",
        {**sel("shared_experts"), "moe_shared_expert_intermediate_size": 1024, "moe_shared_expert_overlap": True},
        "recompute_modules",
        "moe_shared_expert_overlap=True",
    ),
    ("rule_fp8_delayed_discard_labels", {**sel("layernorm"), "fp8": "e4m3"}, "recompute_modules", "delayed scaling"),
    (
        "rule_graphed_recompute_dropout",
        {**sel("core_attn"), "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["attn"]},
        "recompute_modules",
        "attention dropout",
    ),
    (
        "rule_graphed_recompute_dropout",
        {**sel("core_attn"), "cuda_graph_impl": "local"},
        "recompute_modules",
        "attention dropout",
    ),
    (
        "rule_graphed_recompute_dropout",
        {**sel("mlp"), "cuda_graph_impl": "full_iteration"},
        "recompute_modules",
        "hidden dropout",
    ),
    (
        "rule_graphed_recompute_dropout",
        {**sel("moe"), "cuda_graph_impl": "local", "cuda_graph_scope": "moe"},
        "recompute_modules",
        "hidden dropout",
    ),
    (
        "rule_te_graph_moe_router",
        {**sel("moe"), "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["moe_router"]},
        "recompute_modules",
        "'moe_router'",
    ),
    (
        "rule_ep_overlap_limits",
        {**FULL, "overlap_moe_expert_parallel_comm": True},
        "recompute_granularity",
        "full recompute does not work",
    ),
    (
        "rule_ep_overlap_limits",
        {"recompute_method": "block", "overlap_moe_expert_parallel_comm": True},
        "recompute_method",
        "overlap_moe_expert_parallel_comm",
    ),
    (
        "rule_ep_overlap_limits",
        {"recompute_num_layers": 2, "overlap_moe_expert_parallel_comm": True},
        "recompute_num_layers",
        "overlap_moe_expert_parallel_comm",
    ),
    (
        "rule_ep_overlap_limits",
        {**sel("moe"), "overlap_moe_expert_parallel_comm": True},
        "recompute_modules",
        "'moe' recompute does not work",
    ),
    (
        "rule_fine_grained_not_with_cpu_offload",
        {"fine_grained_activation_offloading": True, "cpu_offloading": True, "offload_modules": ["core_attn"]},
        "fine_grained_activation_offloading",
        "cpu_offloading",
    ),
    (
        "rule_fine_grained_needs_modules",
        {"fine_grained_activation_offloading": True},
        "offload_modules",
        "offloads nothing",
    ),
    ("rule_known_offload_modules", {"offload_modules": "core_atn"}, "offload_modules", "did you mean 'core_attn'"),
    (
        "rule_fused_group_mlp_needs_op_fuser",
        {"fine_grained_activation_offloading": True, "offload_modules": ["fused_group_mlp"]},
        "offload_modules",
        "use_transformer_engine_op_fuser=True; remat has no TE op fuser: drop 'fused_group_mlp'",
    ),
    (
        "rule_fused_group_mlp_alone",
        {"fine_grained_activation_offloading": True, "offload_modules": ["fused_group_mlp", "expert_fc1"]},
        "offload_modules",
        "cannot be combined; drop 'expert_fc1' or 'fused_group_mlp'",
    ),
    (
        "rule_fused_group_mlp_alone",
        {"fine_grained_activation_offloading": True, "offload_modules": ["moe_act", "fused_group_mlp"]},
        "offload_modules",
        "cannot be combined; drop 'moe_act' or 'fused_group_mlp'",
    ),
    (
        "rule_gdp_qkv_offload_without_model",
        {"fine_grained_activation_offloading": True, "offload_modules": ["gdp_qkv"]},
        "offload_modules",
        "GatedDeltaProduct's QKV preparation; remat has no model with that layer yet: drop 'gdp_qkv'",
    ),
    (
        "rule_attn_proj_offload_needs_core_attn",
        {"fine_grained_activation_offloading": True, "offload_modules": ["attn_proj"]},
        "offload_modules",
        "offload 'core_attn' too",
    ),
    (
        "rule_moe_recompute_blocks_expert_offload",
        {**sel("moe"), "fine_grained_activation_offloading": True, "offload_modules": ["moe_act"]},
        "offload_modules",
        "nothing to offload",
    ),
    (
        "rule_moe_recompute_blocks_expert_offload",
        {**sel("moe"), "fine_grained_activation_offloading": True, "offload_modules": ["fused_group_mlp"]},
        "offload_modules",
        "so 'fused_group_mlp' has nothing to offload; drop 'fused_group_mlp' or drop 'moe'",
    ),
    ("rule_min_offload_size", {"min_offloaded_tensor_size": -1}, "min_offloaded_tensor_size", "0 or more"),
    (
        "rule_offload_fraction_range",
        {"activation_offload_fraction": 1.5},
        "activation_offload_fraction",
        "must be in range [0, 1], got 1.5; set it to 1.0",
    ),
    (
        "rule_offload_fraction_range",
        {"activation_offload_fraction": -0.25},
        "activation_offload_fraction",
        "must be in range [0, 1], got -0.25",
    ),
    (
        "rule_offload_fraction_range",
        {"activation_offload_fraction": float("nan")},
        "activation_offload_fraction",
        "must be in range [0, 1], got nan",
    ),
    (
        "rule_offload_fraction_whole",
        {
            "fine_grained_activation_offloading": True,
            "offload_modules": ["core_attn"],
            "activation_offload_fraction": 0.5,
        },
        "activation_offload_fraction",
        "got 0.5; remat offloads every tensor of each chosen module and cannot offload a fraction yet: set it to 1.0",
    ),
    (
        "rule_offload_fraction_whole",
        {"activation_offload_fraction": 0},
        "activation_offload_fraction",
        "cannot offload a fraction yet",
    ),
    (
        "rule_offloaded_site_not_recomputed",
        {**sel("core_attn"), "fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]},
        "offload_modules",
        "also recomputed",
    ),
    (
        "rule_norm_offload_together",
        {"fine_grained_activation_offloading": True, "offload_modules": ["attn_norm"]},
        "offload_modules",
        "offloads 'mlp_norm' too",
    ),
    (
        "rule_fine_grained_not_with_uniform_full",
        {**FULL, "fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]},
        "fine_grained_activation_offloading",
        "nothing per module to offload",
    ),
    ("rule_parallel_layout", {"tensor_model_parallel_size": 0}, "tensor_model_parallel_size", "1 or more"),
    ("rule_parallel_layout", {"pipeline_model_parallel_size": -1}, "pipeline_model_parallel_size", "1 or more"),
    ("rule_parallel_layout", {"context_parallel_size": 0}, "context_parallel_size", "1 or more"),
    ("rule_parallel_layout", {"num_layers": 0}, "num_layers", "1 or more"),
    (
        "rule_parallel_layout",
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 0},
        "virtual_pipeline_model_parallel_size",
        "1 or more",
    ),
    (
        "rule_parallel_layout",
        {"virtual_pipeline_model_parallel_size": 2},
        "virtual_pipeline_model_parallel_size",
        "pipeline_model_parallel_size > 1",
    ),
    ("rule_parallel_layout", {"num_layers": 6, "pipeline_model_parallel_size": 4}, "num_layers", "split evenly"),
    (
        "rule_cuda_graph_values",
        {"cuda_graph_impl": "transformer-engine"},
        "cuda_graph_impl",
        "did you mean 'transformer_engine'",
    ),
    ("rule_cuda_graph_values", {"cuda_graph_scope": "attn,mpl"}, "cuda_graph_scope", "did you mean 'mlp'"),
    ("rule_fp8_values", {"fp8": "e5m2"}, "fp8", "not an option"),
    ("rule_fp8_values", {"fp8_recipe": "tensor_wise"}, "fp8_recipe", "did you mean 'tensorwise'"),
    ("rule_attention_backend_value", {"attention_backend": "flsh"}, "attention_backend", "did you mean 'flash'"),
    ("rule_dropout_range", {"attention_dropout": 1.5}, "attention_dropout", "probability"),
    ("rule_dropout_range", {"hidden_dropout": -0.1}, "hidden_dropout", "probability"),
    ("rule_dropout_range", {"hidden_dropout": 1.0}, "hidden_dropout", "below 1"),
    (
        "rule_parallel_layout",
        {"tensor_model_parallel_size": 2**21},
        "tensor_model_parallel_size",
        "sizes up to 1,048,576",
    ),
    (
        "rule_settings_without_granularity",
        {"recompute_method": "block"},
        "recompute_method",
        "applies only to full recompute",
    ),
    ("rule_settings_without_granularity", {"recompute_num_layers": 2}, "recompute_num_layers", "would do nothing"),
    ("rule_modules_without_switch", {"recompute_modules": ["mlp"]}, "recompute_modules", "recompute_granularity"),
    (
        "rule_modules_without_switch",
        {"offload_modules": ["core_attn"]},
        "offload_modules",
        "fine_grained_activation_offloading",
    ),
]


# (rule, settings): a nearby valid configuration for each rule.
PASSING: list[tuple[str, dict[str, Any]]] = [
    ("rule_granularity_value", {"recompute_granularity": "selective"}),
    ("rule_method_value", FULL),
    ("rule_full_needs_method", {**FULL, "recompute_method": "block"}),
    (
        "rule_full_num_layers",
        {
            **FULL,
            "recompute_num_layers": 2,
            "num_layers": 8,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
        },
    ),
    ("rule_selective_num_layers_none", sel("core_attn")),
    ("rule_selective_method_none", sel("mlp")),
    ("rule_selective_needs_modules", sel("mlp")),
    (
        "rule_known_recompute_modules",
        {**sel("core_attn", "layernorm", "mlp", "moe", "mla_up_proj"), "multi_latent_attention": True},
    ),
    ("rule_no_duplicate_labels", sel("mlp", "core_attn")),
    (
        "rule_distribute_not_with_sequence_parallel",
        {**FULL, "distribute_saved_activations": True, "sequence_parallel": False, "tensor_model_parallel_size": 2},
    ),
    (
        "rule_distribute_needs_full",
        {**FULL, "recompute_method": "block", "distribute_saved_activations": True, "tensor_model_parallel_size": 4},
    ),
    (
        "rule_distribute_needs_tensor_parallel",
        {**FULL, "tensor_model_parallel_size": 2, "distribute_saved_activations": True},
    ),
    ("rule_full_recompute_graph_scope", {**FULL, "cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}),
    ("rule_full_recompute_graph_scope", {**FULL, "cuda_graph_impl": "full_iteration"}),
    ("rule_cpu_offload_layer_count", {"cpu_offloading": True, "cpu_offloading_num_layers": 3, "num_layers": 4}),
    ("rule_cpu_offload_not_with_pipeline", {"cpu_offloading": True, "tensor_model_parallel_size": 2}),
    ("rule_cpu_offload_graphs", {"cpu_offloading": True, "cuda_graph_impl": "full_iteration"}),
    ("rule_moe_act_needs_grouped_gemm", {**sel("moe_act"), "moe_grouped_gemm": True}),
    ("rule_mla_up_proj_needs_mla", {**sel("mla_up_proj"), "multi_latent_attention": True}),
    # not said: the model the config is applied to tells
    ("rule_moe_act_needs_grouped_gemm", sel("moe_act")),
    ("rule_mla_up_proj_needs_mla", sel("mla_up_proj")),
    ("rule_shared_experts_not_with_overlap", {**sel("shared_experts"), "moe_shared_expert_intermediate_size": 1024}),
    ("rule_fp8_delayed_discard_labels", {**sel("layernorm"), "fp8": "e4m3", "fp8_recipe": "tensorwise"}),
    (
        "rule_graphed_recompute_dropout",
        {
            **sel("core_attn"),
            "cuda_graph_impl": "transformer_engine",
            "cuda_graph_scope": ["attn"],
            "attention_dropout": 0.0,
        },
    ),
    (
        "rule_graphed_recompute_dropout",
        {**sel("mlp"), "cuda_graph_impl": "local", "cuda_graph_scope": ["attn"], "attention_dropout": 0},
    ),
    (
        "rule_te_graph_moe_router",
        {
            **sel("moe_act"),
            "moe_grouped_gemm": True,
            "cuda_graph_impl": "transformer_engine",
            "cuda_graph_scope": ["moe_router"],
        },
    ),
    ("rule_ep_overlap_limits", {**sel("moe_act"), "moe_grouped_gemm": True, "overlap_moe_expert_parallel_comm": True}),
    (
        "rule_fine_grained_not_with_cpu_offload",
        {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]},
    ),
    ("rule_fine_grained_needs_modules", {"fine_grained_activation_offloading": True, "offload_modules": "core_attn"}),
    (
        "rule_recompute_labels_without_model",
        {**sel("core_attn", "mlp", "moe", "mla_up_proj"), "multi_latent_attention": True},
    ),
    (
        "rule_known_offload_modules",
        {
            "fine_grained_activation_offloading": True,
            "offload_modules": [
                m for m in offload_rules.OFFLOAD_MODULES if m not in offload_rules.REFUSED_OFFLOAD_MODULES
            ],
        },
    ),
    # fused_group_mlp itself is refused (no op fuser): its true passing cases are in
    # test_rules_accept_what_only_another_rule_refuses.
    (
        "rule_fused_group_mlp_needs_op_fuser",
        {"fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1", "moe_act"]},
    ),
    (
        "rule_fused_group_mlp_alone",
        {"fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1", "moe_act"]},
    ),
    (
        "rule_gdp_qkv_offload_without_model",
        {"fine_grained_activation_offloading": True, "offload_modules": ["qkv_linear", "core_attn"]},
    ),
    (
        "rule_attn_proj_offload_needs_core_attn",
        {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "attn_proj"]},
    ),
    (
        "rule_moe_recompute_blocks_expert_offload",
        {**sel("moe"), "fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]},
    ),
    ("rule_min_offload_size", {"min_offloaded_tensor_size": 0}),
    ("rule_offload_fraction_range", {"activation_offload_fraction": 1}),
    (
        "rule_offload_fraction_whole",
        {
            "fine_grained_activation_offloading": True,
            "offload_modules": ["core_attn"],
            "activation_offload_fraction": 1.0,
        },
    ),
    (
        "rule_offloaded_site_not_recomputed",
        {**sel("layernorm"), "fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]},
    ),
    (
        "rule_norm_offload_together",
        {"fine_grained_activation_offloading": True, "offload_modules": ["attn_norm", "mlp_norm"]},
    ),
    (
        "rule_fine_grained_not_with_uniform_full",
        {
            **FULL,
            "recompute_method": "block",
            "fine_grained_activation_offloading": True,
            "offload_modules": ["core_attn"],
        },
    ),
    (
        "rule_parallel_layout",
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
            "num_layers": 4,
        },
    ),
    ("rule_parallel_layout", {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    ("rule_parallel_layout", {"num_layers": 8, "pipeline_model_parallel_size": 4}),
    ("rule_cuda_graph_values", {"cuda_graph_impl": "transformer_engine"}),
    ("rule_cuda_graph_values", {"cuda_graph_impl": "local", "cuda_graph_scope": "attn,mlp"}),
    ("rule_fp8_values", {"fp8": "hybrid"}),
    ("rule_fp8_values", {"fp8_recipe": "mxfp8"}),
    ("rule_attention_backend_value", {"attention_backend": "flash"}),
    ("rule_dropout_range", {"attention_dropout": 0, "hidden_dropout": 0.99}),
    ("rule_settings_without_granularity", {**FULL, "recompute_method": "block"}),
    ("rule_modules_without_switch", sel("mlp")),
    ("rule_modules_without_switch", {"recompute_modules": ["core_attn"]}),  # Megatron's default, in every dump
    ("rule_modules_without_switch", {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]}),
]


# (warning rule, settings, field, phrase) and a nearby setting that stays quiet.
WARNING_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "rule_sequence_parallel_without_tensor_parallel",
        {"sequence_parallel": True},
        "sequence_parallel",
        "Megatron turns it off",
    ),
    ("rule_nested_labels", {**sel("moe", "moe_act"), "moe_grouped_gemm": True}, "recompute_modules", "'moe_act'"),
    ("rule_nested_labels", sel("moe", "shared_experts"), "recompute_modules", "'shared_experts'"),
    ("rule_nested_labels", sel("mlp", "mlp_act"), "recompute_modules", "drop 'mlp_act'"),
    (
        "rule_core_attn_fused_backend",
        {**sel("core_attn"), "attention_backend": "flash"},
        "recompute_modules",
        "saves almost nothing",
    ),
    (
        "rule_core_attn_fused_backend",
        {**sel("core_attn"), "attention_backend": "fused"},
        "recompute_modules",
        "saves almost nothing",
    ),
]


QUIET: list[tuple[str, dict[str, Any]]] = [
    ("rule_sequence_parallel_without_tensor_parallel", {"sequence_parallel": True, "tensor_model_parallel_size": 2}),
    ("rule_nested_labels", {**sel("moe", "mlp")}),
    ("rule_nested_labels", {**sel("mlp_act", "layernorm")}),
    ("rule_core_attn_fused_backend", {**sel("core_attn"), "attention_backend": "unfused"}),
]


def _without(rules: list[Any], name: str) -> list[Any]:
    return [r for r in rules if r.__name__ != name]


@pytest.mark.parametrize("rule, settings_, field, phrase", FAILING, ids=[c[0] for c in FAILING])
def test_rule_rejects(
    rule: str, settings_: dict[str, Any], field: str, phrase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert has(problems_of(settings_), field, phrase)
    # The named rule, and no other, reports it.
    monkeypatch.setattr(recompute, "RULES", _without(RULES, rule))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        try:
            RecomputeConfig.from_megatron(settings_)
        except ConfigError as err:
            assert not has(err.problems, field, phrase)


@pytest.mark.parametrize("rule, settings_", PASSING, ids=[c[0] for c in PASSING])
def test_rule_accepts(rule: str, settings_: dict[str, Any]) -> None:
    build_quietly(settings_)


@pytest.mark.parametrize("rule, settings_, field, phrase", WARNING_CASES, ids=[c[0] for c in WARNING_CASES])
def test_warning_rule_warns(
    rule: str, settings_: dict[str, Any], field: str, phrase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.warns(RematWarning, match=phrase) as record:
        RecomputeConfig.from_megatron(settings_)
    assert any(str(w.message).startswith(f"{field}: ") for w in record)
    monkeypatch.setattr(recompute, "WARNING_RULES", _without(WARNING_RULES, rule))
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        RecomputeConfig.from_megatron(settings_)
    assert not any(phrase in str(w.message) for w in quiet)


@pytest.mark.parametrize("rule, settings_", QUIET, ids=[c[0] for c in QUIET])
def test_warning_rule_quiet(rule: str, settings_: dict[str, Any]) -> None:
    build_quietly(settings_)


def test_every_rule_has_failing_and_passing_cases() -> None:
    assert {r.__name__ for r in RULES} == {c[0] for c in FAILING} == {c[0] for c in PASSING}
    assert {r.__name__ for r in WARNING_RULES} == {c[0] for c in WARNING_CASES} == {c[0] for c in QUIET}


# Megatron Core's allowed recompute_modules and offload_modules (spec 1.2 and 1.3).
MEGATRON_RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
    "gdn_norm_out",
    "gdp_in_proj",
    "gdp_qkv",
    "mhc",
)


MEGATRON_OFFLOAD_MODULES = (
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


def problems_if_any(settings_: dict[str, Any]) -> list[Problem]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        try:
            RecomputeConfig.from_megatron(settings_)
        except ConfigError as err:
            return err.problems
    return []


@pytest.mark.parametrize("label", MEGATRON_RECOMPUTE_MODULES)
def test_every_megatron_recompute_label_is_known(label: str) -> None:
    assert label in {*recompute_labels(), *labels_without_model()}
    assert not any("unknown" in p.message for p in problems_if_any(sel(label)))


@pytest.mark.parametrize("module", MEGATRON_OFFLOAD_MODULES)
def test_every_megatron_offload_module_is_known(module: str) -> None:
    assert module in offload_rules.OFFLOAD_MODULES
    offload = {"fine_grained_activation_offloading": True, "offload_modules": [module]}
    assert not any("unknown" in p.message for p in problems_if_any(offload))


def test_remat_refuses_the_megatron_options_it_cannot_run() -> None:
    assert set(labels_without_model()) == {"gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc"}
    assert set(offload_rules.OFFLOAD_MODULES) == set(MEGATRON_OFFLOAD_MODULES)
    assert set(offload_rules.REFUSED_OFFLOAD_MODULES) == {"fused_group_mlp", "gdp_qkv"}
    # Choices offered in messages are the ones remat runs.
    [unknown] = problems_of(sel("nope"))
    assert not any(f"'{label}'" in unknown.message for label in labels_without_model())
    [unknown] = problems_of({"fine_grained_activation_offloading": True, "offload_modules": ["nope"]})
    assert not any(f"'{m}'" in unknown.message for m in offload_rules.REFUSED_OFFLOAD_MODULES)


def test_a_family_that_registers_a_megatron_label_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert has(problems_of(sel("gdp_qkv")), "recompute_modules", "remat has no model with that layer yet")
    monkeypatch.setattr(labels, "_REGISTRY", dict(labels._REGISTRY))
    labels.register(Label("gdp_qkv", discard=True))
    assert "gdp_qkv" not in labels_without_model()
    assert build_quietly(sel("gdp_qkv")).recompute_modules == ["gdp_qkv"]


FUSED_ALONE = {"fine_grained_activation_offloading": True, "offload_modules": ["fused_group_mlp"]}


@pytest.mark.parametrize(
    "rule, settings_, refused",
    [
        # fused_group_mlp alone, and without 'moe' recompute: only the op-fuser rule refuses these.
        (offload_rules.rule_fused_group_mlp_alone, FUSED_ALONE, False),
        (
            offload_rules.rule_fused_group_mlp_alone,
            {**FUSED_ALONE, "offload_modules": ["fused_group_mlp", "moe_act"]},
            True,
        ),
        (offload_rules.rule_moe_recompute_blocks_expert_offload, {**sel("moe_act"), **FUSED_ALONE}, False),
        (offload_rules.rule_moe_recompute_blocks_expert_offload, {**sel("moe"), **FUSED_ALONE}, True),
    ],
)
def test_rules_accept_what_only_another_rule_refuses(rule: Any, settings_: dict[str, Any], refused: bool) -> None:
    assert bool(list(rule(recorded_config(settings_)))) == refused


def test_megatron_options_remat_cannot_run_are_reported_together() -> None:
    problems = problems_of(
        {
            **sel("moe", "mhc"),
            "fine_grained_activation_offloading": True,
            "offload_modules": ["fused_group_mlp", "moe_act", "gdp_qkv"],
            "activation_offload_fraction": 2,
        }
    )
    for field, phrase in [
        ("recompute_modules", "drop 'mhc'"),
        ("offload_modules", "remat has no TE op fuser: drop 'fused_group_mlp'"),
        ("offload_modules", "cannot be combined; drop 'moe_act' or 'fused_group_mlp'"),
        ("offload_modules", "drop 'gdp_qkv'"),
        ("offload_modules", "so 'fused_group_mlp' has nothing to offload"),
        ("offload_modules", "so 'moe_act' has nothing to offload"),
        ("activation_offload_fraction", "must be in range [0, 1], got 2.0"),
    ]:
        assert has(problems, field, phrase), phrase


def test_warning_points_at_caller() -> None:
    with pytest.warns(RematWarning) as record:
        RecomputeConfig(facts=TrainingFacts(layout=ParallelLayout(sp=True)))
    assert record[0].filename == __file__


@pytest.mark.parametrize(
    "field, value",
    [
        ("recompute_num_layers", "abc"),
        ("distribute_saved_activations", 3),
        ("recompute_modules", 5),
        ("recompute_modules", ["mlp", 1]),
        ("recompute_granularity", ["full"]),
        ("min_offloaded_tensor_size", 1.5),
        ("activation_offload_fraction", "all"),
        ("activation_offload_fraction", True),
        ("tensor_model_parallel_size", 1.5),
        ("num_layers", True),
        ("sequence_parallel", "yes"),
        ("attention_dropout", "x"),
        ("cuda_graph_scope", {"attn": 1}),
        ("fp8", 8),
    ],
)
def test_type_errors_are_problems(field: str, value: Any) -> None:
    assert has(problems_of({field: value}), field, "set it to")


def test_type_error_is_not_repeated_by_rules() -> None:
    problems = problems_of({**FULL, "recompute_num_layers": "abc"})
    assert [p.field for p in problems] == ["recompute_num_layers"]


def test_facts_must_be_training_facts() -> None:
    with pytest.raises(ConfigError) as info:
        RecomputeConfig(facts={"num_layers": 4})  # type: ignore[arg-type]
    assert has(info.value.problems, "facts", "TrainingFacts")


def test_all_problems_reported_at_once() -> None:
    problems = problems_of(
        {
            "recompute_granularity": "full",
            "cpu_offloading": True,
            "pipeline_model_parallel_size": 2,
            "tensor_model_parallel_size": 0,
            "offload_modules": ["bogus"],
            "bogus_key": 1,
        }
    )
    fields = {p.field for p in problems}
    assert {
        "recompute_method",
        "recompute_num_layers",
        "cpu_offloading",
        "tensor_model_parallel_size",
        "offload_modules",
        "bogus_key",
    } <= fields


def test_config_error_lists_one_problem_per_line() -> None:
    err = ConfigError([Problem("a", "first"), Problem("b", "second")])
    assert str(err) == "a: first\nb: second"
    assert isinstance(err, ValueError) and len(err.problems) == 2


def test_selective_defaults_to_core_attn() -> None:
    assert RecomputeConfig(recompute_granularity="selective").recompute_modules == ["core_attn"]
    assert RecomputeConfig().recompute_modules is None


def test_validation_does_not_mutate_inputs() -> None:
    modules = ["mlp"]
    facts = TrainingFacts(capture=Capture(cuda_graph_scope="attn"))  # type: ignore[arg-type]
    c = RecomputeConfig(recompute_granularity="selective", recompute_modules=modules, facts=facts)
    c.recompute_modules.append("core_attn")  # type: ignore[union-attr]
    assert (
        modules == ["mlp"]
        and facts.capture.cuda_graph_scope == "attn"
        and c.facts.capture.cuda_graph_scope == ("attn",)
    )


@pytest.mark.parametrize(
    "facts, expected",
    [
        (TrainingFacts(), None),
        (TrainingFacts(num_layers=32), 32),
        (TrainingFacts(num_layers=32, layout=ParallelLayout(pp=4)), 8),
        (TrainingFacts(num_layers=32, layout=ParallelLayout(pp=4, vp=2)), 4),
        (TrainingFacts(num_layers=6, layout=ParallelLayout(pp=4)), None),
    ],
)
def test_layers_per_virtual_stage(facts: TrainingFacts, expected: int | None) -> None:
    assert facts.layers_per_chunk == expected


def test_from_megatron_model_prefix_and_nested() -> None:
    expected = RecomputeConfig(
        recompute_granularity="selective", recompute_modules=["mlp"], facts=TrainingFacts(num_layers=4)
    )
    prefixed = {"model.recompute_granularity": "selective", "model.recompute_modules": ["mlp"], "model.num_layers": 4}
    nested = {"model": {"recompute_granularity": "selective", "recompute_modules": ["mlp"], "num_layers": 4}}
    mixed = {"recompute_granularity": "selective", "model": {"recompute_modules": ["mlp"]}, "model.num_layers": 4}
    for d in (prefixed, nested, mixed):
        assert RecomputeConfig.from_megatron(d) == expected


@pytest.mark.parametrize(
    "value",
    [
        "core_attn,mlp",
        "[core_attn, mlp]",
        "['core_attn', 'mlp']",
        " core_attn , mlp ",
        ["core_attn", "mlp"],
        ("core_attn", "mlp"),
    ],
)
def test_list_fields_accept_strings(value: Any) -> None:
    c = RecomputeConfig.from_megatron({"recompute_granularity": "selective", "recompute_modules": value})
    assert c.recompute_modules == ["core_attn", "mlp"]


def test_single_label_string() -> None:
    c = RecomputeConfig.from_megatron(
        {**sel(), "recompute_modules": "mlp", "cuda_graph_scope": "attn", "offload_modules": "[]"}
    )
    assert (c.recompute_modules, c.facts.capture.cuda_graph_scope, c.offload_modules) == (["mlp"], ("attn",), [])


def test_unknown_key_suggests_the_right_one() -> None:
    problems = problems_of({"model.recompute_granularty": "full"})
    assert has(problems, "model.recompute_granularty", "did you mean 'recompute_granularity'")
    assert has(problems_of({"zzz_qqq": 1}), "zzz_qqq", "not a setting remat reads")


def test_shape_keys_are_ignored() -> None:
    c = RecomputeConfig.from_megatron(
        {
            "hidden_size": 4096,
            "ffn_hidden_size": 14336,
            "num_attention_heads": 32,
            "num_query_groups": 8,
            "seq_length": 8192,
            "vocab_size": 128256,
            "kv_channels": 128,
            "normalization": "RMSNorm",
        }
    )
    assert c == RecomputeConfig()


@pytest.mark.parametrize(
    "d, field, phrase",
    [
        (
            {"recompute_granularity": "full", "model.recompute_granularity": "full"},
            "model.recompute_granularity",
            "twice",
        ),
        ({"model": 3}, "model", "mapping"),
        ({1: "x"}, "1", "strings"),
    ],
)
def test_from_megatron_key_problems(d: dict[Any, Any], field: str, phrase: str) -> None:
    assert has(problems_of(d), field, phrase)


def test_from_megatron_needs_a_mapping() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        RecomputeConfig.from_megatron(["recompute_granularity"])  # type: ignore[arg-type]


def test_moe_layer_recompute_converts_with_warning() -> None:
    with pytest.warns(RematWarning, match="deprecated"):
        c = RecomputeConfig.from_megatron({"moe_layer_recompute": True})
    assert (c.recompute_granularity, c.recompute_modules) == ("selective", ["core_attn", "moe"])
    with pytest.warns(RematWarning, match="deprecated"):
        c = RecomputeConfig.from_megatron({**sel("mlp"), "moe_layer_recompute": True})
    assert c.recompute_modules == ["mlp", "moe"]
    assert build_quietly({"moe_layer_recompute": False}) == RecomputeConfig()


@pytest.mark.parametrize(
    "d, phrase",
    [
        ({**FULL, "moe_layer_recompute": True}, "recompute_granularity='full'"),
        ({"moe_layer_recompute": "yes"}, "true or false"),
    ],
)
def test_moe_layer_recompute_problems(d: dict[str, Any], phrase: str) -> None:
    assert has(problems_of(d), "moe_layer_recompute", phrase)


RICH = {
    **FULL,
    "recompute_method": "block",
    "recompute_num_layers": 2,
    "num_layers": 8,
    "pipeline_model_parallel_size": 2,
    "tensor_model_parallel_size": 2,
    "distribute_saved_activations": True,
    "cuda_graph_impl": "full_iteration",
    "fp8": "hybrid",
    "fp8_recipe": "tensorwise",
    "num_moe_experts": 8,
}


@pytest.mark.parametrize(
    "d",
    [
        {},
        RICH,
        {**sel("core_attn", "mlp"), "attention_backend": "unfused"},
        {
            **sel("mla_up_proj", "moe_act"),
            "multi_latent_attention": True,
            "moe_grouped_gemm": True,
            "fine_grained_activation_offloading": True,
            "offload_modules": ["core_attn", "attn_proj"],
            "min_offloaded_tensor_size": 0,
            "activation_offload_fraction": 1,
        },
        {"cpu_offloading": True, "cpu_offloading_num_layers": 2, "num_layers": 4},
    ],
)
def test_to_megatron_round_trip(d: dict[str, Any], tmp_path: Any) -> None:
    c = build_quietly(d)
    flat = c.to_megatron()
    assert RecomputeConfig.from_megatron(flat) == c
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(flat))
    assert RecomputeConfig.from_file(path) == c


def test_to_megatron_covers_every_field() -> None:
    names = {f.name for f in dataclasses.fields(RecomputeConfig) if f.name != "facts"}
    names |= {
        public_name(f) for cls in (TrainingFacts, ParallelLayout, Capture, Precision) for f, _ in settings_of(cls)
    }
    names -= {"compute_dtype"}  # Megatron Bridge's flag, not a Megatron config key
    assert set(RecomputeConfig().to_megatron()) == names


@pytest.mark.parametrize("suffix, dump", [(".yaml", yaml.safe_dump), (".yml", yaml.safe_dump), (".json", json.dumps)])
def test_files_load_like_the_dict(suffix: str, dump: Any, tmp_path: Any) -> None:
    d = {"model": {**sel("core_attn", "mlp"), "num_layers": 4, "cuda_graph_scope": "attn", "attention_dropout": 0}}
    path = tmp_path / f"c{suffix}"
    path.write_text(dump(d))
    assert RecomputeConfig.from_file(path) == RecomputeConfig.from_megatron(d)


@pytest.mark.parametrize(
    "name, text, phrase",
    [
        ("missing.yaml", None, "cannot read"),
        ("bad.yaml", "a: [1, 2", "not valid YAML"),
        ("bad.json", "{'a': 1}", "not valid JSON"),
        ("list.yaml", "- 1\n- 2\n", "mapping"),
        ("empty.yml", "", "mapping"),
        ("c.toml", "a = 1", "unsupported file type"),
        ("typo.json", '{"recompute_granularty": "full"}', "did you mean"),
    ],
)
def test_file_problems(name: str, text: str | None, phrase: str, tmp_path: Any) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=phrase):
        RecomputeConfig.from_file(path)


def test_describe() -> None:
    text = RecomputeConfig.from_megatron(RICH).describe()
    assert "full, block: the first 2 layers" in text and "(4 layers per virtual stage)" in text
    assert "TP 2, PP 2" in text and "fp8 hybrid" in text and "full iteration" in text
    assert "recompute: off" in RecomputeConfig().describe()
    assert "selective" in RecomputeConfig(recompute_granularity="selective").describe()


DENSE = frozenset({"core_attn", "layernorm", "mlp", "mlp_act"})


LAYOUT = ModelSites(labels=(DENSE,) * 4)


def test_check_model_accepts() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        check_config(RecomputeConfig(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]), LAYOUT)
        check_config(
            RecomputeConfig.from_megatron(
                {**FULL, "recompute_num_layers": 2, "pipeline_model_parallel_size": 2, "num_layers": 4}
            ),
            LAYOUT,
        )
        check_config(RecomputeConfig(), ModelSites(labels=(), has_layer_sites=False))
        check_config(
            RecomputeConfig.from_megatron({**FULL, "cpu_offloading": True, "cpu_offloading_num_layers": 3}), LAYOUT
        )
        check_config(
            RecomputeConfig.from_megatron(
                {
                    **sel("mlp"),
                    "fine_grained_activation_offloading": True,
                    "offload_modules": ["attn_norm", "core_attn", "mlp_norm"],
                }
            ),
            LAYOUT,
        )


@pytest.mark.parametrize(
    "d, layout, field, phrase",
    [
        (
            sel("moe"),
            LAYOUT,
            "recompute_modules",
            "matches no site in this model (its sites: core_attn, layernorm, mlp, mlp_act)",
        ),
        (FULL, ModelSites(labels=(DENSE,) * 4, has_layer_sites=False), "recompute_granularity", "no 'layer' sites"),
        (
            {**FULL, "recompute_num_layers": 3, "pipeline_model_parallel_size": 2},
            LAYOUT,
            "recompute_num_layers",
            "between 1 and 2",
        ),
        ({"num_layers": 8}, LAYOUT, "num_layers", "the model has 4 layers"),
        ({"pipeline_model_parallel_size": 3}, LAYOUT, "num_layers", "split evenly"),
        (
            {"cpu_offloading": True, "cpu_offloading_num_layers": 4},
            LAYOUT,
            "cpu_offloading_num_layers",
            "not fewer than the model's 4 layers",
        ),
        (
            {"cpu_offloading": True, "cpu_offloading_num_layers": 1},
            ModelSites(labels=(DENSE,) * 4, has_layer_sites=False),
            "cpu_offloading",
            "no 'layer' sites",
        ),
        (
            {"fine_grained_activation_offloading": True, "offload_modules": ["core_attn", "qkv_linear"]},
            LAYOUT,
            "offload_modules",
            "'qkv_linear' matches no site in this model (it can offload: attn_norm, core_attn, mlp_norm)",
        ),
        (
            {"fine_grained_activation_offloading": True, "offload_modules": ["moe_act"], "moe_grouped_gemm": True},
            LAYOUT,
            "offload_modules",
            "'moe_act' matches no site",
        ),
    ],
)
def test_check_model_rejects(d: dict[str, Any], layout: ModelSites, field: str, phrase: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_config(RecomputeConfig.from_megatron(d), layout)
    assert has(info.value.problems, field, phrase)


def test_check_model_warns_on_fused_core_attn() -> None:
    fused = ModelSites(labels=(DENSE,) * 4, fused=frozenset({"core_attn"}))
    with pytest.warns(RematWarning, match="saves almost nothing"):
        check_config(RecomputeConfig(recompute_granularity="selective"), fused)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        check_config(RecomputeConfig(recompute_granularity="selective"), LAYOUT)
        check_config(RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]), fused)


KEEP = {"core_attn": "keep", "layernorm": "keep", "mlp": "keep"}


def plan_problems(layers: list[Any], full: list[Any], layout: ModelSites = LAYOUT) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        check_plan(layers, full, layout)
    return info.value.problems


def test_check_plan_accepts() -> None:
    layers = [KEEP, KEEP, {"mlp": "recompute", "layernorm": "discard"}, {"core_attn": "recompute"}]
    check_plan(layers, [(0, 1), [1, 2]], LAYOUT)
    offloads = [
        {"layer": "offload"},
        {"layer": "keep"},
        {"layer": "offload", "mlp": "recompute"},
        {"core_attn": "offload"},
    ]
    check_plan(offloads, [(0, 2)], LAYOUT)
    check_plan([{"mlp": "recompute"}] * 2, [], ModelSites(labels=(DENSE,) * 2, has_layer_sites=False))


@pytest.mark.parametrize(
    "layers, full, field, phrase",
    [
        ([KEEP] * 3, [], "layers", "the plan has 3 layers but the model has 4"),
        ([KEEP, {"moe": "recompute"}, KEEP, KEEP], [], "layers[1].moe", "no 'moe' site"),
        ([KEEP, KEEP, {"mlp": "recompte"}, KEEP], [], "layers[2].mlp", "did you mean 'recompute'"),
        ([KEEP, KEEP, {"mlp": 3}, KEEP], [], "layers[2].mlp", "unknown action 3"),
        ([KEEP, KEEP, {"mlp": "discard"}, KEEP], [], "layers[2].mlp", "use 'recompute' for 'mlp'"),
        ([KEEP, KEEP, {"mlp_act": "recompute"}, KEEP], [], "layers[2].mlp_act", "frees nothing; use 'discard'"),
        ([KEEP, KEEP, KEEP, "keep"], [], "layers[3]", "map each site label"),
        ([KEEP] * 4, [(2, 5)], "full_recompute[0]", "outside the model's layers [0, 4)"),
        ([KEEP] * 4, [(-1, 2)], "full_recompute[0]", "outside"),
        ([KEEP] * 4, [(2, 2)], "full_recompute[0]", "empty"),
        ([KEEP] * 4, [(3, 1)], "full_recompute[0]", "empty"),
        ([KEEP] * 4, [(2, 3), (0, 1)], "full_recompute[1]", "comes before full_recompute[0]"),
        ([KEEP] * 4, [(0, 2), (1, 3)], "full_recompute[1]", "overlaps full_recompute[0]"),
        ([KEEP] * 4, [(0,)], "full_recompute[0]", "[start, end) pair"),
        ([KEEP] * 4, ["ab"], "full_recompute[0]", "[start, end) pair"),
        ([KEEP] * 4, [(True, 2)], "full_recompute[0]", "[start, end) pair"),
        ([KEEP, {"mlp": "recompute"}, KEEP, KEEP], [(0, 2)], "layers[1].mlp", "inside full_recompute[0] [0, 2)"),
        ([KEEP, {"mlp": "offload"}, KEEP, KEEP], [(0, 2)], "layers[1].mlp", "inside full_recompute[0] [0, 2)"),
        ([KEEP, {"layer": "offload"}, KEEP, KEEP], [(0, 2)], "layers[1].layer", "set layers[0].layer"),
        ([KEEP, {"layer": "recompute"}, KEEP, KEEP], [], "layers[1].layer", "full_recompute ranges"),
    ],
)
def test_check_plan_rejects(layers: list[Any], full: list[Any], field: str, phrase: str) -> None:
    assert has(plan_problems(layers, full), field, phrase)


def test_check_plan_without_layer_sites() -> None:
    layout = ModelSites(labels=(DENSE,) * 2, has_layer_sites=False)
    problems = plan_problems([{"layernorm": "discard", "layer": "offload"}, KEEP], [(0, 1)], layout)
    assert has(problems, "layers[0].layer", "no 'layer' sites")
    assert has(problems, "full_recompute", "no 'layer' sites")
    assert has(problems, "layers[0].layernorm", "needs the enclosing 'layer' site")


def test_check_plan_reports_everything() -> None:
    problems = plan_problems([{"moe": "offlaod"}], [(0, 9)])
    assert {p.field for p in problems} == {"layers", "layers[0].moe", "full_recompute[0]"}


KNOWN_KEYS = sorted(recompute._KNOWN_KEYS)


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.floats(allow_nan=True),
    st.sampled_from(
        [
            *RECOMPUTE_MODULES,
            *offload_rules.OFFLOAD_MODULES,
            *CUDA_GRAPH_IMPLS,
            *rules.METHODS,
            *rules.GRANULARITIES,
            "e4m3",
            "delayed",
            "flash",
            "core_attn,mlp",
            "[mlp]",
            "",
        ]
    ),
    st.text(max_size=8),
    st.lists(st.one_of(st.sampled_from(RECOMPUTE_MODULES), st.text(max_size=5), st.integers()), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


KEYS = st.one_of(st.sampled_from(KNOWN_KEYS), st.sampled_from(KNOWN_KEYS).map("model.{}".format), st.text(max_size=12))


@settings(max_examples=300, deadline=None)
@given(
    d=st.one_of(
        st.dictionaries(KEYS, VALUES, max_size=12),
        st.dictionaries(KEYS, VALUES, max_size=6).map(lambda inner: {"model": inner}),
    )
)
def test_from_megatron_only_raises_config_error(d: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        try:
            c = RecomputeConfig.from_megatron(d)
        except ConfigError as err:
            assert err.problems and all(isinstance(p, Problem) for p in err.problems)
        else:
            assert isinstance(c, RecomputeConfig)
            assert RecomputeConfig.from_megatron(c.to_megatron()) == c


def test_check_model_rejects_discard_labels_without_layer_sites() -> None:
    layout = ModelSites(labels=(frozenset({"layernorm", "mlp"}),), has_layer_sites=False)
    config = RecomputeConfig(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])
    with pytest.raises(ConfigError, match="output-discarding"):
        check_config(config, layout)
    check_config(RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]), layout)


GOOD_PLAN_FILE = {
    "remat_plan": 1,
    "layers": [{"mlp": "recompute"}, {}],
    "full_recompute": [[1, 2]],
    "min_offloaded_tensor_size": 0,
}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"remat_plan": 2}, "remat_plan"),
        ({"layers": 3}, "layers"),
        ({"layers": [{}, "mlp"]}, "layers"),
        ({"full_recompute": [[0, 1, 2]]}, "full_recompute"),
        ({"full_recompute": [[True, 2]]}, "full_recompute"),
        ({"min_offloaded_tensor_size": -1}, "min_offloaded_tensor_size"),
        ({"min_offloaded_tensor_size": 1.5}, "min_offloaded_tensor_size"),
        ({"recompute_modules": ["mlp"]}, "recompute_modules"),
    ],
)
def test_plan_file_problems_name_the_key_at_fault(change: dict[str, Any], field: str) -> None:
    assert layer_plan.plan_file_problems(GOOD_PLAN_FILE) == []
    assert [p.field for p in layer_plan.plan_file_problems({**GOOD_PLAN_FILE, **change})] == [field]


def test_a_plan_file_of_another_format_version_is_told_apart_from_a_config() -> None:
    newer = {k: v for k, v in GOOD_PLAN_FILE.items() if k != "remat_plan"}
    [missing] = layer_plan.plan_file_problems(newer)
    assert "a file of Megatron recompute keys" in missing.message and "remat.load_plan" in missing.message
    [other] = layer_plan.plan_file_problems({**newer, "remat_plan": 2})
    assert other.message.startswith("2 is not a plan format this remat reads; it reads `remat_plan: 1`")


def test_an_estimate_takes_at_most_2_to_the_22_tokens_of_a_micro_batch_per_gpu() -> None:
    from remat.run.spec import MAX_TOKENS_PER_GPU, micro_batch_tokens_problems

    assert list(micro_batch_tokens_problems(MAX_TOKENS_PER_GPU, 1, 1)) == []
    assert list(micro_batch_tokens_problems(MAX_TOKENS_PER_GPU, 4, 4)) == []  # context parallel splits it
    [problem] = micro_batch_tokens_problems(MAX_TOKENS_PER_GPU, 2, 1)
    assert problem.field == "seq_length" and "lower -sl or -mb, or raise -cp" in problem.message


def test_a_label_on_some_layers_only_says_it_does_nothing_on_the_others() -> None:
    """Megatron's 'mlp' on a model with MoE layers acts on the dense ones only; remat says so."""
    moe = frozenset({"core_attn", "layernorm", "moe", "moe_act"})
    layout = ModelSites(labels=(DENSE, moe, moe, DENSE, moe))
    mlp = RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"])
    with pytest.warns(
        RematWarning,
        match=r"'mlp' acts on 2 layers of 5; layers 1-2, 4 have no 'mlp' site.*"
        r"their sites are core_attn, layernorm, moe, moe_act",
    ):
        check_config(mlp, layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)
        check_config(mlp, ModelSites(labels=(DENSE,) * 5))  # every layer has it: nothing to say
