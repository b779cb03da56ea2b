"""Megatron Core's recompute and offload rules, and remat's own, on a RecomputeConfig.

Each rule is a small function yielding the `Problem`s it finds in a well-typed config (field
types are checked before any rule runs). `RULES` are errors, `WARNING_RULES` advice. A comment
on each says whose rule it is: Megatron's (the same check, worded to say what to change) or
remat's (a combination Megatron accepts silently that does nothing or cannot run here). The
fine-grained offloading rules are in `remat.config.offload_rules`; rules that need the model's sites
(`ModelSites`) are in `remat.config.model_sites`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from remat.config.megatron import GRANULARITIES, METHODS, RecomputeFields
from remat.core.labels import WITHOUT_MODEL, enclosing, labels_without_model, offload_only_labels, recompute_labels
from remat.core.problems import Problem, did_you_mean, not_an_option, one_of

ATTENTION_BACKENDS: tuple[str, ...] = ("flash", "fused", "unfused", "local", "auto")

Rule = Callable[[RecomputeFields], Iterator[Problem]]
RULES: list[Rule] = []
WARNING_RULES: list[Rule] = []


def _rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _warning_rule(fn: Rule) -> Rule:
    WARNING_RULES.append(fn)
    return fn


def selected(c: RecomputeFields) -> list[str]:
    """The labels selective recompute acts on (none unless granularity is selective)."""
    return (c.recompute_modules or []) if c.recompute_granularity == "selective" else []


def _num_layers_range(c: RecomputeFields) -> str:
    per_stage = c.facts.layers_per_chunk
    if per_stage is None:
        return "a whole number of at least 1"
    return f"a number between 1 and {per_stage} (the layers in each virtual pipeline stage)"


def _named_value(field: str, value: str | None, choices: tuple[str, ...], kind: str, use: str) -> Iterator[Problem]:
    if value is not None and value not in choices:
        yield Problem(field, f"{value!r} is not a {kind}{did_you_mean(value, choices)}; use {use}")


@_rule
def rule_granularity_value(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    yield from _named_value(
        "recompute_granularity",
        c.recompute_granularity,
        GRANULARITIES,
        "granularity",
        "'selective', 'full' or null (no recompute)",
    )


@_rule
def rule_method_value(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    yield from _named_value("recompute_method", c.recompute_method, METHODS, "method", "'uniform' or 'block'")


@_rule
def rule_full_needs_method(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.recompute_granularity == "full" and c.recompute_method is None:
        yield Problem(
            "recompute_method",
            "full recompute needs a recompute_method: 'uniform' (every layer,"
            " in groups) or 'block' (the first recompute_num_layers layers)",
        )


@_rule
def rule_full_num_layers(c: RecomputeFields) -> Iterator[Problem]:  # Megatron, plus a range check
    # Megatron only rejects None; 0 makes its uniform loop never advance.
    if c.recompute_granularity != "full":
        return
    n, per_stage = c.recompute_num_layers, c.facts.layers_per_chunk
    if n is None:
        yield Problem(
            "recompute_num_layers", f"full recompute needs recompute_num_layers; set it to {_num_layers_range(c)}"
        )
    elif n < 1 or (per_stage is not None and n > per_stage):
        yield Problem("recompute_num_layers", f"{n} is out of range; set it to {_num_layers_range(c)}")


@_rule
def rule_selective_num_layers_none(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.recompute_granularity == "selective" and c.recompute_num_layers is not None:
        yield Problem(
            "recompute_num_layers",
            "only full recompute uses it (selective acts on every layer); remove it or set it to null",
        )


@_rule
def rule_selective_method_none(c: RecomputeFields) -> Iterator[Problem]:  # Megatron arguments.py selective check
    if c.recompute_granularity == "selective" and c.recompute_method is not None:
        yield Problem(
            "recompute_method",
            "only full recompute uses it (selective acts on every layer); remove it or set it to null",
        )


@_rule
def rule_selective_needs_modules(c: RecomputeFields) -> Iterator[Problem]:  # Megatron (accepts []; remat does not)
    if c.recompute_granularity == "selective" and not c.recompute_modules:
        yield Problem(
            "recompute_modules",
            "selective recompute with no modules recomputes nothing; list labels"
            " such as ['core_attn'], or set recompute_granularity to null for a"
            " no-recompute control run",
        )


@_rule
def rule_known_recompute_modules(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    known = (*recompute_labels(), *labels_without_model())
    for label in c.recompute_modules or []:
        if label in offload_only_labels():
            yield Problem(
                "recompute_modules",
                f"{label!r} is an offload module: recomputing it frees nothing; move it to offload_modules",
            )
        elif label not in known:
            yield Problem(
                "recompute_modules",
                f"unknown label {label!r}{did_you_mean(label, known)}; use labels from {one_of(recompute_labels())}",
            )


@_rule
def rule_recompute_labels_without_model(c: RecomputeFields) -> Iterator[Problem]:  # remat: no model has them
    for label in c.recompute_modules or []:
        if label in labels_without_model():
            yield Problem(
                "recompute_modules",
                f"{label!r} {WITHOUT_MODEL[label]}; remat has no model with that layer yet: drop {label!r}",
            )


@_rule
def rule_no_duplicate_labels(c: RecomputeFields) -> Iterator[Problem]:  # remat: Megatron ignores repeats
    for name, labels in (("recompute_modules", c.recompute_modules or []), ("offload_modules", c.offload_modules)):
        for label in sorted({x for x in labels if labels.count(x) > 1}):
            yield Problem(name, f"lists {label!r} more than once; list each label once")


@_rule
def rule_distribute_not_with_sequence_parallel(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.distribute_saved_activations and c.facts.layout.sp:
        yield Problem(
            "distribute_saved_activations",
            "sequence parallelism already splits the saved inputs across ranks; set distribute_saved_activations=False",
        )


@_rule
def rule_distribute_needs_full(c: RecomputeFields) -> Iterator[Problem]:  # Megatron arguments.py
    if c.distribute_saved_activations and c.recompute_granularity != "full":
        yield Problem(
            "distribute_saved_activations",
            "only full recompute stores layer inputs it could split; set recompute_granularity='full' or turn this off",
        )


@_rule
def rule_distribute_needs_tensor_parallel(c: RecomputeFields) -> Iterator[Problem]:  # Megatron arguments.py
    if c.distribute_saved_activations and c.facts.layout.tp <= 1:
        yield Problem(
            "distribute_saved_activations",
            "splits saved inputs across tensor-parallel ranks, so it needs tensor_model_parallel_size > 1; turn it off",
        )


@_rule
def rule_full_recompute_graph_scope(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.recompute_granularity == "full" and c.facts.capture.per_layer:
        yield Problem(
            "recompute_granularity",
            "full recompute cannot run inside per-layer CUDA graphs; use"
            " selective recompute, cuda_graph_impl='none', or a"
            " full_iteration graph",
        )


@_rule
def rule_cpu_offload_layer_count(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    k, n = c.cpu_offloading_num_layers, c.facts.num_layers
    if c.cpu_offloading and (k < 0 or (n is not None and k >= n)):
        allowed = f"between 0 and {n - 1} (fewer than num_layers={n})" if n is not None else "0 or more"
        yield Problem("cpu_offloading_num_layers", f"got {k}; set it to {allowed}")


@_rule
def rule_cpu_offload_not_with_pipeline(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.cpu_offloading and c.facts.layout.pp > 1:
        yield Problem(
            "cpu_offloading",
            "layer-level CPU offloading does not support pipeline parallelism;"
            " set pipeline_model_parallel_size=1 or cpu_offloading=False",
        )


# Megatron's refusal of CPU offloading with recompute is not a remat rule: remat offloads what a layer
# still saves under selective recompute, and each full-recompute group's input under full recompute.


@_rule
def rule_cpu_offload_graphs(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.cpu_offloading and c.facts.capture.per_layer:
        yield Problem(
            "cpu_offloading",
            "layer-level CPU offloading does not work with per-layer CUDA graphs;"
            " set cuda_graph_impl to 'none' or 'full_iteration', or turn offloading off",
        )


@_rule
def rule_moe_act_needs_grouped_gemm(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if "moe_act" in selected(c) and c.facts.moe_grouped_gemm is False:
        yield Problem(
            "recompute_modules", "'moe_act' recompute needs moe_grouped_gemm=True; enable it or drop 'moe_act'"
        )


@_rule
def rule_mla_up_proj_needs_mla(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if "mla_up_proj" in selected(c) and c.facts.multi_latent_attention is False:
        yield Problem(
            "recompute_modules",
            "'mla_up_proj' exists only with multi_latent_attention=True; enable it or drop 'mla_up_proj'",
        )


@_rule
def rule_shared_experts_not_with_overlap(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    f = c.facts
    if (
        "shared_experts" in selected(c)
        and f.moe_shared_expert_intermediate_size is not None
        and f.moe_shared_expert_overlap
    ):
        yield Problem(
            "recompute_modules",
            "'shared_experts' recompute does not work with moe_shared_expert_overlap=True; drop one of them",
        )


@_rule
def rule_fp8_delayed_discard_labels(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if c.facts.precision.fp8_format is None or c.facts.precision.recipe != "delayed":
        return
    for label in ("moe_act", "layernorm"):
        if label in selected(c):
            yield Problem(
                "recompute_modules",
                f"{label!r} cannot be recomputed under FP8 delayed scaling; drop it"
                " or use another fp8_recipe such as 'tensorwise'",
            )


@_rule
def rule_graphed_recompute_dropout(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    # A recompute region captured in a CUDA graph cannot replay random dropout masks.
    f, chosen = c.facts, selected(c)
    if "core_attn" in chosen and f.attention_dropout != 0 and f.capture.graphed("attn"):
        yield Problem(
            "recompute_modules",
            "'core_attn' recompute inside a CUDA graph cannot replay attention"
            " dropout; set attention_dropout=0, drop 'core_attn' or take 'attn'"
            " out of the graph",
        )
    for label in ("mlp", "moe"):
        if label in chosen and f.hidden_dropout != 0 and f.capture.graphed(label):
            yield Problem(
                "recompute_modules",
                f"{label!r} recompute inside a CUDA graph cannot replay hidden"
                f" dropout; set hidden_dropout=0, drop {label!r} or take"
                f" {label!r} out of the graph",
            )


@_rule
def rule_te_graph_moe_router(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    f = c.facts
    if (
        "moe" in selected(c)
        and f.capture.cuda_graph_impl == "transformer_engine"
        and "moe_router" in f.capture.cuda_graph_scope
    ):
        yield Problem(
            "recompute_modules",
            "'moe' recompute would span the graphed router (cuda_graph_scope"
            " 'moe_router'); a recompute region must lie wholly inside or outside"
            " a graph: drop 'moe' or remove 'moe_router' from the scope",
        )


@_rule
def rule_ep_overlap_limits(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if not c.facts.overlap_moe_expert_parallel_comm:
        return
    fix = "with overlap_moe_expert_parallel_comm=True; "
    if c.recompute_granularity == "full":
        yield Problem("recompute_granularity", f"full recompute does not work {fix}use selective recompute")
    if c.recompute_method is not None:
        yield Problem("recompute_method", f"must be null {fix}remove it")
    if c.recompute_num_layers is not None:
        yield Problem("recompute_num_layers", f"must be null {fix}remove it")
    if "moe" in selected(c):
        yield Problem("recompute_modules", f"'moe' recompute does not work {fix}drop 'moe' (try 'moe_act')")


@_rule
def rule_parallel_layout(c: RecomputeFields) -> Iterator[Problem]:  # Megatron ModelParallelConfig and arguments.py
    yield from c.facts.layout.problems(c.facts.num_layers)


@_rule
def rule_cuda_graph_values(c: RecomputeFields) -> Iterator[Problem]:  # Megatron cuda_graph_impl/scope choices
    yield from c.facts.capture.problems()


@_rule
def rule_fp8_values(c: RecomputeFields) -> Iterator[Problem]:  # Megatron --fp8-format and Fp8Recipe choices
    yield from c.facts.precision.fp8_problems()


@_rule
def rule_attention_backend_value(c: RecomputeFields) -> Iterator[Problem]:  # Megatron AttnBackend choices
    if c.facts.attention_backend not in ATTENTION_BACKENDS:
        yield not_an_option("attention_backend", c.facts.attention_backend, ATTENTION_BACKENDS)


@_rule
def rule_dropout_range(c: RecomputeFields) -> Iterator[Problem]:  # remat: a probability
    for name in ("attention_dropout", "hidden_dropout"):
        p = getattr(c.facts, name)
        if not 0 <= p < 1:  # 1 would zero every activation (and the models refuse it)
            yield Problem(name, f"got {p}; set a probability of at least 0 and below 1")


@_rule
def rule_settings_without_granularity(c: RecomputeFields) -> Iterator[Problem]:  # remat: Megatron ignores them
    # One verdict everywhere: a setting that would do nothing is refused, not run as no recompute.
    if c.recompute_granularity is not None:
        return
    for name in ("recompute_method", "recompute_num_layers"):
        if getattr(c, name) is not None:
            yield Problem(
                name,
                f"{getattr(c, name)!r} applies only to full recompute, which is off"
                " (recompute_granularity is null), so it would do nothing; set"
                " recompute_granularity: full (on the command line -rl N), or remove it",
            )


# What Megatron fills in whatever the granularity: a dump of any Megatron config lists it.
MEGATRON_DEFAULT_MODULES = ["core_attn"]


@_rule
def rule_modules_without_switch(c: RecomputeFields) -> Iterator[Problem]:  # remat: Megatron ignores them
    if c.recompute_modules and c.recompute_granularity is None and c.recompute_modules != MEGATRON_DEFAULT_MODULES:
        yield Problem(
            "recompute_modules",
            "has no effect while recompute_granularity is null; set"
            " recompute_granularity='selective' to recompute them, or remove it",
        )
    if c.offload_modules and not c.fine_grained_activation_offloading:
        yield Problem(
            "offload_modules",
            "has no effect while fine_grained_activation_offloading is off; set it"
            " to true to offload them, or remove offload_modules",
        )


@_warning_rule
def rule_sequence_parallel_without_tensor_parallel(c: RecomputeFields) -> Iterator[Problem]:  # Megatron turns it off
    yield from c.facts.layout.advice()


@_warning_rule
def rule_nested_labels(c: RecomputeFields) -> Iterator[Problem]:  # remat: Megatron allows nesting silently
    chosen = selected(c)
    for inner, outer in enclosing().items():
        if inner in chosen and outer in chosen:
            yield Problem(
                "recompute_modules",
                f"{outer!r} already recomputes the whole module, which contains"
                f" {inner!r}; listing both adds work for no saving:"
                f" drop {inner!r}",
            )


@_warning_rule
def rule_core_attn_fused_backend(c: RecomputeFields) -> Iterator[Problem]:  # Megatron
    if "core_attn" in selected(c) and c.facts.attention_backend in ("flash", "fused"):
        yield Problem(
            "recompute_modules",
            f"'core_attn' saves almost nothing with attention_backend"
            f" {c.facts.attention_backend!r}: fused attention already recomputes"
            " the attention matrix; drop 'core_attn'",
        )
