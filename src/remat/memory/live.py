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
