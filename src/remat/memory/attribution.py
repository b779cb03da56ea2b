"""Who holds the memory: weights, gradients, optimizer state, and what each site of each layer,
the embedding and the loss head saved for backward.

While an `Attributor` is entered, a saved-tensor hook notes the storage of everything autograd
saves with the Sites running at the time (hooks on the model's Sites keep a stack of them): the
innermost, and the sites enclosing it within the layer (`mlp` around `mlp_act`). What a
recompute region saves never reaches this hook: the region keeps slots, not tensors, and the
inputs it keeps are left to "other allocated". At any moment `attribute()` sums the storages
still alive, each counted once, for the innermost site that saved it first; `sites()` gives each
site all it saved (with the sites inside it), with what of that is its own inputs and what sites
outside it save too.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from remat.core.labels import LAYER
from remat.engine import storage_key
from remat.memory.meter import storage_bytes
from remat.sites.apply import find_sites

Owner = tuple[int | None, str]  # (layer, site label); layer None: outside the layers
Chain = tuple[Owner, ...]  # the sites running when a tensor was saved, innermost first


def owner_name(owner: Owner) -> str:
    """'layer 3 mlp', 'layer 3 other ops' (its ops outside the inner sites), 'loss head'."""
    layer, label = owner
    return label if layer is None else f"layer {layer} " + ("other ops" if label == LAYER else label)


@dataclass(frozen=True)
class Attribution:
    weights: int
    grads: int
    optimizer_state: int
    activations: dict[Owner, int]  # saved for backward and alive, by (layer, site)

    def rows(self) -> list[tuple[str, int]]:
        """(what, bytes), for a report: static state, then activations by layer and site."""
        rows = [("weights", self.weights), ("grads", self.grads), ("optimizer state", self.optimizer_state)]
        for (layer, label), nbytes in sorted(self.activations.items(), key=lambda kv: (kv[0][0] is None, kv[0])):
            rows.append((owner_name((layer, label)), nbytes))
        return rows

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer_state + sum(self.activations.values())


@dataclass(frozen=True)
class SiteStorages:
    """The unique storages one site's ops saved for backward that are alive now."""

    saved_bytes: int
    input_bytes: int  # the site's inputs, saved or not: recomputing the site keeps them
    shared_bytes: int  # saved storages that are not its inputs and a site outside it saves too
    shared_with: frozenset[Owner]


class Attributor(AbstractContextManager):
    """`with Attributor(model, optimizer) as a:` around forward (and backward); `a.attribute()`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self._stack: list[Owner] = []
        self._after_layers = False
        self._saved: dict[int, tuple[weakref.ref[torch.UntypedStorage], list[Chain]]] = {}
        self._inputs: dict[Owner, dict[int, int]] = {}  # storage -> bytes each site took as input, this forward
        self._exit = ExitStack()

    def __enter__(self) -> Attributor:
        sites = find_sites(self.model)
        self._exit.callback(self.model.register_forward_pre_hook(lambda m, args: self._forward_begins()).remove)
        for i, layer_site in enumerate(sites.layers):
            last = i == len(sites.layers) - 1
            for site in [layer_site, *sites.inner[i]]:
                owner = (i, site.label)
                self._exit.callback(
                    site.register_forward_pre_hook(lambda m, args, owner=owner: self._enter(owner, args)).remove
                )
                # always: a recompute replay stops part way through a site by raising
                self._exit.callback(
                    site.register_forward_hook(lambda m, args, out, last=last: self._pop(last), always_call=True).remove
                )
        self._exit.enter_context(saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()

    def _forward_begins(self) -> None:
        """Before the embedding: the last forward's loss head is over, its inputs gone or replayed."""
        self._stack.clear()
        self._after_layers = False
        self._inputs.clear()

    def _enter(self, owner: Owner, args: tuple[object, ...]) -> None:
        self._inputs.setdefault(owner, {}).update(
            (storage_key(a), a.untyped_storage().nbytes()) for a in args if isinstance(a, torch.Tensor)
        )
        self._stack.append(owner)

    def _pop(self, last: bool) -> None:
        self._stack.pop()
        self._after_layers = last and not self._stack

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, storage = storage_key(t), t.untyped_storage()
        if not storage.nbytes():
            return t
        outside = "loss head" if self._after_layers else "embedding"
        inner = tuple(owner for owner in reversed(self._stack) if owner[1] != LAYER)
        chain = inner or ((self._stack[-1],) if self._stack else ((None, outside),))
        known = self._saved.get(key)
        if known is None or known[0]() is not storage:  # a new storage, or a dead one's address reused
            self._saved[key] = (weakref.ref(storage), [chain])
        elif chain not in known[1]:
            known[1].append(chain)
        return t

    def _alive(self) -> Iterator[tuple[int, torch.UntypedStorage, list[Chain]]]:
        """The saved storages alive now that are activations (not weights, grads, optimizer
        state or buffers such as RoPE tables, whose views may be saved too)."""
        static = self._static()
        for key, (ref, owners) in list(self._saved.items()):
            storage = ref()
            if storage is None:
                del self._saved[key]
            elif key not in static:
                yield key, storage, owners

    def sites(self) -> dict[Owner, SiteStorages]:
        """Each site's saved storages alive now (a storage two sites save counts for both)."""
        saved: Counter[Owner] = Counter()
        shared: Counter[Owner] = Counter()
        shared_with: defaultdict[Owner, set[Owner]] = defaultdict(set)
        for key, storage, chains in self._alive():
            for owner in dict.fromkeys(owner for chain in chains for owner in chain):
                saved[owner] += storage.nbytes()
                others = [chain[0] for chain in chains if owner not in chain]
                if others and key not in self._inputs.get(owner, {}):
                    shared[owner] += storage.nbytes()
                    shared_with[owner].update(others)
        static = self._static()
        inputs = {
            owner: sum(n for key, n in found.items() if key not in static) for owner, found in self._inputs.items()
        }
        return {
            owner: SiteStorages(nbytes, inputs.get(owner, 0), shared[owner], frozenset(shared_with[owner]))
            for owner, nbytes in saved.items()
        }

    def attribute(self) -> Attribution:
        activations: dict[Owner, int] = {}
        for _, storage, chains in self._alive():  # each storage once, for the site that saved it first
            activations[chains[0][0]] = activations.get(chains[0][0], 0) + storage.nbytes()
        weights, grads, state = self._held()
        return Attribution(storage_bytes(weights), storage_bytes(grads), storage_bytes(state), activations)

    def _static(self) -> set[int]:
        """Storages that live on anyway: weights, grads, optimizer state, buffers (RoPE tables)."""
        return {storage_key(t) for t in itertools.chain(*self._held(), self.model.buffers())}

    def _held(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Weights, gradients, optimizer state."""
        params: list[torch.Tensor] = list(self.model.parameters())
        state = (
            [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            if self.optimizer is not None
            else []
        )
        return params, [p.grad for p in params if p.grad is not None], state
