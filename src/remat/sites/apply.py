"""apply(model, plan): find a model's Sites, check the plan against them, install the actions."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from remat.config.model_sites import ModelSites, check_config
from remat.config.plan import Plan, check_plan
from remat.config.recompute import RecomputeConfig
from remat.core.labels import LAYER
from remat.core.problems import ConfigError, Problem, advise
from remat.engine import (
    DiscardScope,
    Offloader,
    Region,
    checkpoint,
    current_scope,
    offloading,
    output_tensors,
    refuse_compiled,
    traced_checkpoint,
)
from remat.sites.site import Site, SiteAction


@dataclass(frozen=True)
class FoundSites:
    """The Sites of a model, by layer: `layers[i]` is layer i's site, `inner[i]` the sites in it."""

    layers: list[Site]
    inner: list[list[Site]]
    model: str = "this model"

    @property
    def model_sites(self) -> ModelSites:
        all_sites = [s for group in self.inner for s in group]
        return ModelSites(
            labels=tuple(frozenset(s.label for s in group) for group in self.inner),
            fused=frozenset(s.label for s in all_sites if s.fused),
            has_layer_sites=bool(self.layers),
            model=self.model,
        )


def find_sites(model: nn.Module) -> FoundSites:
    """Group a model's Sites by the transformer layer (the module holding a `layer` Site) they sit in."""
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, Site)]
    prefixes = [n.rsplit(".", 1)[0] + "." if "." in n else "" for n, s in named if s.label == LAYER]
    layers = [s for _, s in named if s.label == LAYER]
    inner: list[list[Site]] = [[] for _ in layers]
    loose = []
    for name, site in named:
        if site.label == LAYER:
            continue
        owner = [i for i, p in enumerate(prefixes) if name.startswith(p)]
        if owner:
            inner[max(owner, key=lambda i: len(prefixes[i]))].append(site)
        else:
            loose.append(site)
    if not layers:  # a model without layer Sites: treat it as one layer holding every site
        inner = [loose] if loose else []
    return FoundSites(layers, inner, type(model).__name__)


def _not_a_plan(plan: object) -> Problem:
    example = "RecomputeConfig(recompute_granularity='selective', recompute_modules=['mlp'])"
    hints: dict[type, str] = {
        dict: f"Megatron keys go through RecomputeConfig.from_megatron({{...}}), e.g. {example}",
        str: f"a label is one of a config's recompute_modules, e.g. {example}; a file: remat.load_plan(path)",
    }
    hint = hints.get(type(plan), f"e.g. {example}")
    return Problem("plan", f"is a {type(plan).__name__}; give a RecomputeConfig, a Plan or None ({hint})")


def apply(model: nn.Module, plan: RecomputeConfig | Plan | None) -> Plan:
    """Set every Site of `model` to the actions of `plan`; returns the per-layer plan in force.

    `plan` is a Megatron-style RecomputeConfig, a per-layer Plan, or None for no recompute.
    Call again to change the plan; raises ConfigError (nothing changed) if it does not fit.
    """
    sites = find_sites(model)
    model_sites = sites.model_sites
    if plan is None:
        resolved = Plan.none(model_sites.num_layers)
    elif isinstance(plan, RecomputeConfig):
        check_config(plan, model_sites)
        resolved = Plan.from_config(plan, model_sites)
    elif isinstance(plan, Plan):
        check_plan(plan.layers, plan.full_recompute, model_sites)
        resolved = plan
    else:
        raise ConfigError([_not_a_plan(plan)])
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    offloader = (
        Offloader(
            resolved.min_offloaded_tensor_size,
            first.device.type if first is not None else None,
            resident=_module_tensors(weakref.ref(model)),
        )
        if resolved.offloads()
        else None
    )
    _install(sites, resolved, offloader)
    if offloader is None:
        _offloaders.pop(model, None)
    else:
        _offloaders[model] = offloader
    return resolved


# The offloader of each model whose plan offloads, for its byte counters.
_offloaders: weakref.WeakKeyDictionary[nn.Module, Offloader] = weakref.WeakKeyDictionary()


def offloader_of(model: nn.Module) -> Offloader | None:
    """The offloader `apply` installed on `model` (None when its plan offloads nothing)."""
    return _offloaders.get(model)


def nothing_offloaded_advice(offloaded_bytes: int, min_numel: int) -> Iterator[Problem]:
    """After steps under a plan that offloads: nothing reached the size threshold (a small model
    under the default), where a user would otherwise see no host bytes and no saving, and no reason."""
    if offloaded_bytes == 0:
        yield Problem(
            "min_offloaded_tensor_size",
            f"the plan offloads, but no saved tensor had {min_numel} "
            "elements or more, so nothing moved to host; lower it "
            "(--min_offloaded_tensor_size) to offload this model's tensors",
        )


def warn_if_nothing_offloaded(model: nn.Module) -> None:
    """After steps under a plan that offloads: advise when nothing moved."""
    offloader = offloader_of(model)
    if offloader is not None:
        advise(nothing_offloaded_advice(offloader.stats().offloaded_bytes, offloader.min_numel))


def _module_tensors(model: weakref.ref[nn.Module]) -> Callable[[], Iterator[Tensor]]:
    """A model's parameters and buffers, for the offloader to keep on the device (weakly held:
    the model owns the offloader, not the other way round)."""

    def tensors() -> Iterator[Tensor]:
        module = model()
        return itertools.chain(module.parameters(), module.buffers()) if module is not None else iter(())

    return tensors


def _install(sites: FoundSites, plan: Plan, offloader: Offloader | None) -> None:
    for site in [*sites.layers, *(s for group in sites.inner for s in group)]:
        site.action = None
    grouped: set[int] = set()
    for start, end in plan.full_recompute:
        offload = (
            _Offload(offloader, start) if offloader is not None and plan.layers[start].get(LAYER) == "offload" else None
        )
        group = _LayerGroup(end - start, offload)
        for position, i in enumerate(range(start, end)):
            sites.layers[i].action = _GroupMember(group, position)
            grouped.add(i)
    for i, group_sites in enumerate(sites.inner):
        if i in grouped:
            continue
        actions = plan.layers[i]
        offload = _Offload(offloader, i) if offloader is not None else None
        for site in group_sites:
            action = actions.get(site.label, "keep")
            site.action = offload if action == "offload" else _ACTIONS[action]
        layer_offload = offload if actions.get(LAYER) == "offload" else None
        if sites.layers and ("discard" in actions.values() or layer_offload is not None):
            sites.layers[i].action = _LayerScope("discard" in actions.values(), layer_offload)
    if offloader is not None and sites.layers:
        roles: dict[int, tuple[list[int], list[int]]] = {}  # layer -> (groups to prefetch, to wait for)
        for key, last in _offload_groups(plan):
            for layer, role in ((last + 1, 0), (last + 2, 1)):
                if layer < len(sites.layers):
                    roles.setdefault(layer, ([], []))[role].append(key)
        for layer, (prefetch, wait) in roles.items():
            site = sites.layers[layer]
            site.action = _OffloadNeighbour(site.action, offloader, tuple(prefetch), tuple(wait))


def _offload_groups(plan: Plan) -> Iterator[tuple[int, int]]:
    """(group key, its last layer) of every offload group: a layer with an offloaded site, or a
    full-recompute range whose input is offloaded."""
    ranges = dict(plan.full_recompute)
    for i, actions in enumerate(plan.layers):
        if "offload" in actions.values():
            yield i, ranges.get(i, i + 1) - 1


class _Recompute:
    """Keep the call's inputs, rebuild what its backward needs by one RNG-exact replay."""

    def __call__(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return checkpoint(fn, *args, **kwargs)

    def traced(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return traced_checkpoint(fn, args, kwargs)


class _Discard:
    """Recompute the call, and its consumers in the layer keep no copy of its output either."""

    def __call__(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        scope = current_scope()
        if scope is None:
            raise RuntimeError(
                f"site {site.label!r} is set to discard but was called outside its "
                "layer Site; place the layer Site around the layer's forward"
            )
        return scope.discard(fn, args, kwargs)

    def traced(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # Compiled, a checkpointed region's outputs are recomputed like its insides (AOTAutograd's
        # partitioner saves no tensor tagged for recompute), so consumers keep none: no scope needed.
        return traced_checkpoint(fn, args, kwargs)


_ACTIONS: dict[str, SiteAction | None] = {
    "keep": None,
    "recompute": _Recompute(),
    "discard": _Discard(),
}


def _refuse_offload(site: Site) -> Any:
    refuse_compiled(
        f"site {site.label!r} offloads, which cannot run inside torch.compile (remat offloads through"
        " saved-tensor hooks, which compiled graphs do not call); compile what runs between Sites instead"
        " (the CLI's --compile, remat.sites.placement.compile_sites), or drop offload from the plan"
    )


@dataclass(frozen=True)
class _Offload:
    """What the call saves goes to host, in the offload group of layer `key`."""

    offloader: Offloader
    key: int

    def context(self) -> contextlib.AbstractContextManager[None]:
        return offloading(self.offloader, self.key)

    def __call__(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with self.context():
            return fn(*args, **kwargs)

    def traced(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return _refuse_offload(site)


@dataclass(frozen=True)
class _OffloadNeighbour:
    """The action of a layer after offload groups, around its own (if any). For the group right
    before it, backward loads the group when it reaches this layer's output: one layer ahead of
    the group's own backward. For the group two before, this layer first waits for the group's
    copies to host to end, so they overlap one layer's forward and the blocks they keep from
    reuse pile up no further, however slow the copies; what that costs is measured time."""

    inner: Callable[..., Any] | None
    offloader: Offloader
    prefetch: tuple[int, ...]
    wait: tuple[int, ...]

    def __call__(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        for key in self.wait:
            self.offloader.await_copies(key)
        out = fn(*args, **kwargs) if self.inner is None else self.inner(site, fn, args, kwargs)
        first = next((t for t in output_tensors(out) if t.requires_grad), None)
        if first is not None:
            for key in self.prefetch:
                self.offloader.prefetch_on_grad(first, key)
        return out

    def traced(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return _refuse_offload(site)


@dataclass(frozen=True)
class _LayerScope:
    """A layer Site's action: the discard scope its discarding sites need, and/or its offload."""

    discard: bool
    offload: _Offload | None

    def __call__(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with contextlib.ExitStack() as stack:
            if self.discard:
                stack.enter_context(DiscardScope())
            if self.offload is not None:  # inside the scope: discarded outputs stay references
                stack.enter_context(self.offload.context())
            return fn(*args, **kwargs)

    def traced(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # compiled, discarding sites need no scope (see _Discard.traced)
        return fn(*args, **kwargs) if self.offload is None else _refuse_offload(site)


class _LayerGroup:
    """Consecutive layers recomputed as one unit: one Region spans their calls; with `offload`,
    what the region keeps (the first layer's input) goes to host."""

    def __init__(self, size: int, offload: _Offload | None) -> None:
        self.size = size
        self.offload = offload
        self.region: Region | None = None
        self.next = 0


@dataclass(frozen=True)
class _GroupMember:
    group: _LayerGroup
    position: int

    def __call__(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        group = self.group
        if self.position == 0:
            group.region, group.next = Region(), 0
        if group.region is None or group.next != self.position:
            raise RuntimeError(
                "the layers of a full-recompute group were called out of order; "
                "full recompute needs layers called once each, first to last"
            )
        try:
            with group.offload.context() if group.offload is not None else contextlib.nullcontext():
                out = group.region.call(fn, args, kwargs, site.before_replay)
        except BaseException:
            group.region = None  # an aborted forward (e.g. OOM) must not keep the group's tensors
            raise
        group.next += 1
        if group.next == group.size:
            group.region.close()
            group.region = None
        return out

    def traced(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # Compiled, each layer of the group is its own checkpoint: the gradients are the same,
        # but every layer's input is kept, not the group's first alone (AOTAutograd saves the
        # boundary between two checkpointed regions).
        if self.group.offload is not None:
            return _refuse_offload(site)
        return traced_checkpoint(fn, args, kwargs)
