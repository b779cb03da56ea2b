"""Hugging Face transformers causal LMs: where remat's Sites go, found from the module tree.

A decoder layer is a `GradientCheckpointingLayer` (what HF's own checkpointing wraps). Inside it:
the attention module, found by what its forward calls (transformers' attention functions); the
norms whose output a sublayer takes (pre-norms; a post-norm feeds only the residual add and saves
nothing); the MoE block (the child holding `experts`) or the MLP. Core attention is the attention
*function* the module dispatches to through transformers' `ALL_ATTENTION_FUNCTIONS` (sdpa, flex,
flash, or the model file's own eager function, Gemma's soft-capped one included): remat puts a
routing function under every key, which calls through the module's Site when it has one and
straight through otherwise."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from remat.core.problems import ConfigError, Problem, warn
from remat.models.family import Fork
from remat.models.hf.loss_head import swap_loss_head
from remat.sites.placement import Adapter

# What a decoder layer's attention module calls: transformers' attention functions.
_ATTENTION_CALLS = frozenset({"ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"})
# A layer's feed-forward block, dense or MoE, by the names transformers' models give it.
_FEED_FORWARD = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
_SHARED_EXPERTS = ("shared_expert", "shared_experts", "shared_mlp")
# A norm whose output only goes into the residual add saves nothing for backward: transformers
# names them post_*. Llama's post_attention_layernorm is the exception: the pre-MLP norm of a
# layer whose only other norm is its input_layernorm.
_LLAMA_PRE_MLP = "post_attention_layernorm"


def _is_transformers(obj: type) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in obj.__mro__)


def hf_model(model: nn.Module) -> nn.Module:
    """The transformers model itself, inside a PEFT wrapper (LoRA) or not."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else None
    return base if isinstance(base, nn.Module) else model


def layer_paths(model: nn.Module) -> list[str]:
    """The decoder layers: GradientCheckpointingLayers, or in older model files (CTRL, GPT-1) the
    list of blocks of one class, one per layer of the config."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found = [name for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if found or not layers:
        return found
    stacks = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == layers and len({type(block) for block in m}) == 1
    ]
    return [f"{stacks[0]}.{i}" for i in range(layers)] if len(stacks) == 1 else []


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention module."""
    layers = [model.get_submodule(path) for path in layer_paths(model)]
    return [layer.get_submodule(name) for layer in layers for name in _attention(layer)]


def _attention_interfaces(module: nn.Module) -> list[Any]:
    """The attention function registries `module` may look its function up in: transformers' shared
    one, and its model file's own where that file declares one to override an entry (Doge)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = getattr(sys.modules[type(module).__module__], "ALL_ATTENTION_FUNCTIONS", ALL_ATTENTION_FUNCTIONS)
    return [ALL_ATTENTION_FUNCTIONS] if own is ALL_ATTENTION_FUNCTIONS else [ALL_ATTENTION_FUNCTIONS, own]


def _calls_attention(module: nn.Module) -> bool:
    """Whether `module`'s forward dispatches to one of transformers' attention functions."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and not _ATTENTION_CALLS.isdisjoint(code.co_names)


def _attention(layer: nn.Module) -> list[str]:
    return [name for name, child in layer.named_children() if _calls_attention(child)]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


def _pre_norms(layer: nn.Module) -> list[str]:
    """The norms whose output a sublayer takes (and saves), not those before a residual add."""
    norms = [name for name, child in layer.named_children() if _is_norm(child)]
    pre = [n for n in norms if not n.startswith("post")]
    if _LLAMA_PRE_MLP in norms and pre == ["input_layernorm"]:
        pre.append(_LLAMA_PRE_MLP)
    return pre


def _feed_forward(layer: nn.Module) -> str | None:
    """The layer's MLP or MoE block: a child holding experts, else one by a feed-forward name."""
    # not attention (JetMoE's has experts) nor a container, which would run a Site as a child
    children = {n: c for n, c in layer.named_children() if not _calls_attention(c) and not isinstance(c, nn.Sequential)}
    moe = next((n for n, c in children.items() if isinstance(getattr(c, "experts", None), nn.Module)), None)
    return moe or next((n for n in _FEED_FORWARD if isinstance(children.get(n), nn.Module)), None)


def _first_child(module: nn.Module, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


def _layer_sites(layer: nn.Module) -> Iterator[tuple[str, str]]:
    """(label, path inside the layer) of one decoder layer's sites. No mla_up_proj: transformers'
    multi-latent attention runs its up-projections inline, and a Site on q_b_proj or kv_b_proj
    alone frees nothing (attention keeps the query, key and value after RoPE, not their outputs)."""
    yield "layer", ""
    for norm in _pre_norms(layer):
        yield "layernorm", norm
    for attention in _attention(layer):
        yield "core_attn", attention
    block = _feed_forward(layer)
    if block is None:
        return
    module = layer.get_submodule(block)
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        yield "mlp", block
        return
    yield "moe", block
    if isinstance(getattr(experts, "act_fn", None), nn.Module):
        yield "moe_act", f"{block}.experts.act_fn"
    shared = _first_child(module, _SHARED_EXPERTS)
    if shared is not None:
        yield "shared_experts", f"{block}.{shared}"


def _compress(hits: list[tuple[str, str]], layers: list[str]) -> tuple[str, ...]:
    """(layer, path inside it) pairs as patterns: `model.layers.*.mlp` where every layer has the
    path and the layers share one parent, else each layer's own path."""
    parents = {layer.rsplit(".", 1)[0] for layer in layers}
    by_inner: dict[str, list[str]] = {}
    for layer, inner in hits:
        by_inner.setdefault(inner, []).append(layer)
    patterns: list[str] = []
    for inner, owners in by_inner.items():
        suffix = f".{inner}" if inner else ""
        if len(parents) == 1 and len(layers) > 1 and sorted(owners) == sorted(layers):
            patterns.append(f"{next(iter(parents))}.*{suffix}")
        else:
            patterns.extend(f"{owner}{suffix}" for owner in owners)
    return tuple(patterns)


class _Router:
    """Stands under one key of ALL_ATTENTION_FUNCTIONS: calls the attention function through the
    calling module's Site when it has one."""

    def __init__(self, adapter: HfAdapter, key: str, inner: Callable[..., Any] | None) -> None:
        self.adapter, self.key, self.inner = adapter, key, inner

    def function(self, module: nn.Module) -> Callable[..., Any]:
        if self.inner is not None:
            return self.inner
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise RuntimeError(
                f"{type(module).__name__} runs eager attention but its module defines no "
                "eager_attention_forward for remat's core_attn Site to call; use sdpa"
            )
        return eager

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        site = self.adapter.attention_sites.get(module)
        fn = self.function(module)
        fork = self.adapter.forks.get(module)
        with fork() if fork is not None else contextlib.nullcontext():
            if site is None:
                return fn(module, *args, **kwargs)
            if "flash" not in self.key:
                # only flash kernels read position_ids (packed sequences); a recomputed call would keep
                # the tensor, shared by every layer, alive as its input
                kwargs.pop("position_ids", None)
            return site(fn, module, *args, **kwargs)


class HfAdapter(Adapter):
    name = "hf"

    def __init__(self) -> None:
        self.attention_sites: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
        # (attention interface, key, the router standing there): transformers' shared interface, and
        # a model file's own (Doge's) where it has one
        self.routers: list[tuple[Any, str, _Router]] = []
        # attention modules whose function draws its randoms from a tensor-parallel rank's stream
        self.forks: weakref.WeakKeyDictionary[nn.Module, Fork] = weakref.WeakKeyDictionary()

    def handles(self, model: nn.Module) -> bool:
        return _is_transformers(type(hf_model(model)))

    def site_map(self, model: nn.Module) -> dict[str, tuple[str, ...]]:
        layers = layer_paths(model)
        if not layers:
            raise ConfigError(
                [
                    Problem(
                        "site_map",
                        f"{type(model).__name__} has no decoder layers remat recognises"
                        " (GradientCheckpointingLayer, or one list of blocks); give a site map",
                    )
                ]
            )
        found: dict[str, list[tuple[str, str]]] = {}
        for path in layers:
            for label, inner in _layer_sites(model.get_submodule(path)):
                found.setdefault(label, []).append((path, inner))
        return {label: _compress(hits, layers) for label, hits in found.items()}

    def place(self, label: str, module: nn.Module, site: nn.Module) -> Callable[[], None] | None:
        if label != "core_attn" or not hasattr(module, "config"):
            return None
        self._route_attention(_attention_interfaces(module))
        self.attention_sites[module] = site

        def undo() -> None:
            self.attention_sites.pop(module, None)
            if not self.attention_sites:
                self._unroute_attention()

        return undo

    def fork_attention(self, module: nn.Module, fork: Fork) -> None:
        """`module`'s attention function runs inside `fork` (dropout over a rank's own heads); the
        routers stand wherever a core_attn Site was placed."""
        self.forks[module] = fork

    def _route_attention(self, interfaces: list[Any]) -> None:
        for interface in interfaces:
            if any(routed is interface for routed, _, _ in self.routers):
                continue
            for key in ["eager", *interface.keys()]:
                router = _Router(self, key, None if key == "eager" else interface[key])
                self.routers.append((interface, key, router))
                interface[key] = router

    def _unroute_attention(self) -> None:
        for interface, key, router in self.routers:
            if interface._local_mapping.get(key) is router:
                del interface[key]
        self.routers.clear()

    def loss_head(self, model: nn.Module) -> Callable[[], None]:
        return swap_loss_head(hf_model(model))

    def prepare(self, model: nn.Module) -> Callable[[], None]:
        """HF's own gradient checkpointing off (remat's `full` recompute does what it does), and
        no key/value cache while training, as HF's checkpointing sets it."""
        was_checkpointing = _checkpointing(model)
        if was_checkpointing:
            _set_checkpointing(model, False)
            warn(
                f"remat turned off {type(model).__name__}'s gradient checkpointing: remat's Sites recompute"
                " instead (recompute_granularity='full' is what it did); remat.unadapt turns it back on"
            )
        # the modules HF's checkpointing switches, found once: the hook runs before every forward
        switches = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        handle = model.register_forward_pre_hook(functools.partial(_training_call, switches), with_kwargs=True)

        def undo() -> None:
            handle.remove()
            if was_checkpointing:
                _set_checkpointing(model, True)

        return undo


def _checkpointing(model: nn.Module, switches: list[nn.Module] | None = None) -> bool:
    """Whether HF's own checkpointing is on (5.25 renamed it activation checkpointing), by the
    `gradient_checkpointing` flag of `switches` (default: every module's)."""
    return any(
        getattr(m, "gradient_checkpointing", False) is True for m in (model.modules() if switches is None else switches)
    )


def _set_checkpointing(model: Any, on: bool) -> None:
    new = getattr(model, f"activation_checkpointing_{'enable' if on else 'disable'}", None)
    (new or getattr(model, f"gradient_checkpointing_{'enable' if on else 'disable'}"))()


def _training_call(switches: list[nn.Module], model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Before each forward: in training, no cache (as HF's checkpointing does); HF's checkpointing
    turned on again after adapt would recompute inside remat's Sites, so it is refused."""
    if model.training and _checkpointing(model, switches):
        raise ConfigError(
            [
                Problem(
                    "gradient_checkpointing",
                    f"{type(model).__name__} has remat's Sites and HF"
                    " gradient checkpointing on at once; call"
                    " model.gradient_checkpointing_disable() and let"
                    " remat recompute (full recompute of every layer is"
                    " what HF's did)",
                )
            ]
        )
    if model.training:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


ADAPTER = HfAdapter()
