"""Count the bytes a forward pass leaves alive, by unique storage, on any device (CPU included).

A dispatch mode sees every tensor an op creates; weak references to their storages tell, once
the forward returns, which of them something (the autograd graph, a cache) still holds. Unique
storages are counted once however many views or saved references point at them.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _StorageRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            # an output sharing an input's storage (a view, an in-place op) allocated nothing
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and _key(t) not in inputs:
                self.storages.add(t.untyped_storage())
        return out


def _key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


@dataclass(frozen=True)
class SavedMemory:
    """Storages created during a call and still alive after it returned."""

    bytes: int
    storages: int


def measure_saved(fn: Callable[[], Any]) -> tuple[Any, SavedMemory]:
    """Run `fn()` and count the storages it allocated that are still alive when it returns."""
    recorder = _StorageRecorder()
    with recorder:
        result = fn()
    gc.collect()
    alive = list(recorder.storages)
    return result, SavedMemory(sum(s.nbytes() for s in alive), len(alive))


class _PeakTracker(TorchDispatchMode):
    """Live bytes of the storages ops create, and their maximum, updated as storages die."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and _key(t) not in inputs:
                storage = t.untyped_storage()
                if not hasattr(storage, "_remat_tracked"):
                    storage._remat_tracked = True  # one count per storage, however many outputs view it
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def peak_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn()`; return its result and the peak bytes of the tensors it allocated (any device).

    The peak counts tensors that ops create while `fn` runs, on top of whatever existed before.
    """
    tracker = _PeakTracker()
    with tracker:
        result = fn()
    return result, tracker.peak
