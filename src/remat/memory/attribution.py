"""Who holds the memory: weights, gradients, optimizer state, and what each site of each layer,
the embedding and the loss head saved for backward.

While an `Attributor` is entered, a saved-tensor hook notes the storage of everything autograd
saves with the Site running at the time (hooks on the model's Sites keep a stack of them). What a
recompute region saves never reaches this hook: the region keeps slots, not tensors, and the
inputs it keeps are left to "other allocated". At any moment `attribute()` sums the storages
still alive, each counted once, first owner first.
"""
from __future__ import annotations

import itertools
import weakref
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from remat.apply import find_sites
from remat.engine import storage_key
from remat.memory.meter import storage_bytes

Owner = tuple[int | None, str]  # (layer, site label); layer None: outside the layers


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
            rows.append((label if layer is None else f"layer {layer} {label}", nbytes))
        return rows

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer_state + sum(self.activations.values())


class Attributor(AbstractContextManager):
    """`with Attributor(model, optimizer) as a:` around forward (and backward); `a.attribute()`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self._stack: list[Owner] = []
        self._after_layers = False
        self._saved: dict[int, tuple[weakref.ref[torch.UntypedStorage], Owner]] = {}
        self._exit = ExitStack()

    def __enter__(self) -> Attributor:
        sites = find_sites(self.model)
        for i, layer_site in enumerate(sites.layers):
            for site in [layer_site, *sites.inner[i]]:
                owner = (i, site.label)
                self._exit.callback(site.register_forward_pre_hook(
                    lambda m, args, owner=owner: self._stack.append(owner)).remove)
                self._exit.callback(site.register_forward_hook(
                    lambda m, args, out, last=i == len(sites.layers) - 1: self._pop(last)).remove)
        self._exit.enter_context(saved_tensors_hooks(self._pack, lambda t: t))
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.close()

    def _pop(self, last: bool) -> None:
        self._stack.pop()
        self._after_layers = last and not self._stack

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self._saved and t.untyped_storage().nbytes():
            outside = "loss head" if self._after_layers else "embedding"
            owner = self._stack[-1] if self._stack else (None, outside)
            self._saved[key] = (weakref.ref(t.untyped_storage()), owner)
        return t

    def attribute(self) -> Attribution:
        params = list(self.model.parameters())
        state = ([v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                 if self.optimizer is not None else [])
        grads = [p.grad for p in params if p.grad is not None]
        # buffers (RoPE tables) live on anyway: a view of one saved for backward is not an activation
        static = {storage_key(t) for t in itertools.chain(params, grads, state, self.model.buffers())}
        activations: dict[Owner, int] = {}
        for key, (ref, owner) in list(self._saved.items()):
            storage = ref()
            if storage is None:
                del self._saved[key]
            elif key not in static:
                activations[owner] = activations.get(owner, 0) + storage.nbytes()
        return Attribution(storage_bytes(params), storage_bytes(grads), storage_bytes(state), activations)
