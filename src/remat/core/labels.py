"""Site labels: the names of the places a model marks for remat, and what each label allows.

Megatron Core's selective-recompute labels are known from the start; a model family registers
the labels of its own (remat's Llama registers `mlp_act`). A label says how its site is
recomputed: plainly (keep the inputs, rerun the call in backward) or by discarding its output,
for cheap ops whose output the next op saves anyway; and which label's site always runs it.
Megatron's labels for layers no remat model has are known by name only, and the rules refuse them.
"""

from __future__ import annotations

from dataclasses import dataclass

# A whole transformer layer: the unit of full (layer-level) recompute.
LAYER = "layer"
# What a plan may do at a site.
ACTIONS: tuple[str, ...] = ("keep", "recompute", "discard", "offload")


@dataclass(frozen=True)
class Label:
    """A selective-recompute label.

    discard: recomputed with the output-discarding checkpoint (its consumer saves its output).
    discard_only: its output is all its consumer saves, so a plain recompute frees nothing.
    offload_only: a site that exists so what its call saves (its input) can go to host memory,
    as Megatron's offload module of that name does; recomputing it would free nothing.
    enclosed_by: the label whose site always runs this one: recomputing that one replays this
    one too, so an action here does nothing there.
    """

    name: str
    discard: bool = False
    discard_only: bool = False
    offload_only: bool = False
    enclosed_by: str | None = None


_REGISTRY: dict[str, Label] = {}


def register(label: Label) -> Label:
    """Make `label` known to configs, plans and Sites; registering the same label again is a no-op."""
    known = _REGISTRY.get(label.name)
    if known is not None and known != label:
        raise ValueError(f"site label {label.name!r} is already registered as {known}; a family cannot redefine it")
    if label.name == LAYER:
        raise ValueError(f"{LAYER!r} is the whole-layer site, not a selective-recompute label")
    if label.enclosed_by is not None and label.enclosed_by not in _REGISTRY:
        raise ValueError(f"{label.name!r} is enclosed by {label.enclosed_by!r}, which is not registered")
    _REGISTRY[label.name] = label
    return label


# Megatron Core's recompute labels, in the order its documentation lists them, then its offload
# modules that need a site of their own.
for _label in (
    Label("core_attn"),
    Label("layernorm", discard=True),
    Label("mlp"),
    Label("moe"),
    Label("moe_act", discard=True, enclosed_by="moe"),
    Label("shared_experts", enclosed_by="moe"),
    Label("mla_up_proj", discard=True),
    # Megatron's offload module for the routed experts' FC1 input (the permuted tokens)
    Label("expert_fc1", offload_only=True, enclosed_by="moe"),
):
    register(_label)

# Megatron Core's labels for layers no remat model has yet, with what each recomputes and Megatron's
# own preconditions: known, so a config naming one is refused for what it is, not as a typo.
WITHOUT_MODEL: dict[str, str] = {
    "gdn_norm_out": "recomputes Gated DeltaNet's output norm (Megatron: only with experimental_attention_variant"
    " 'gdn' or 'gdn2')",
    "gdp_in_proj": "recomputes GatedDeltaProduct's input projection (and its context-parallel gather)",
    "gdp_qkv": "recomputes GatedDeltaProduct's causal convolution and QKV preparation",
    "mhc": "recomputes the HyperConnection (mHC) intermediates (Megatron: needs enable_mhc_connections=True,"
    " and neither 'mlp' nor full recompute beside it)",
}


def labels_without_model() -> tuple[str, ...]:
    """Megatron's labels no registered family has sites for yet (a family that registers one runs it)."""
    return tuple(name for name in WITHOUT_MODEL if name not in _REGISTRY)


def recompute_labels() -> tuple[str, ...]:
    """Every selective-recompute label, Megatron's first, then the families' in registration order."""
    return tuple(name for name, label in _REGISTRY.items() if not label.offload_only)


def site_labels() -> tuple[str, ...]:
    """The labels a Site may carry: the recompute labels and `layer`."""
    return (*_REGISTRY, LAYER)


def discard_labels() -> frozenset[str]:
    """Labels recomputed with the output-discarding checkpoint (the rest use a plain checkpoint)."""
    return frozenset(name for name, label in _REGISTRY.items() if label.discard)


def discard_only_labels() -> frozenset[str]:
    """Labels whose output is all their consumer saves: a plain checkpoint of them frees nothing."""
    return frozenset(name for name, label in _REGISTRY.items() if label.discard_only)


def offload_only_labels() -> frozenset[str]:
    """Labels whose sites are only kept or offloaded."""
    return frozenset(name for name, label in _REGISTRY.items() if label.offload_only)


def enclosing() -> dict[str, str]:
    """label -> the label whose site always runs it."""
    return {name: label.enclosed_by for name, label in _REGISTRY.items() if label.enclosed_by is not None}
