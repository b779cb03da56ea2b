"""Count the bytes tensors take, by unique storage, on any device (CPU included).

A dispatch mode sees every tensor an op creates; weak references to their storages tell which
are still alive later. Unique storages are counted once however many views point at them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.engine import storage_key
from remat.engine.storage import memory_tensors

# The CUDA caching allocator rounds every block up to this many bytes.
CUDA_BLOCK = 512


class NewStorages(TorchDispatchMode):
    """Calls `created(storage)` once for each storage an op allocates while the mode is active
    (of a tensor `only` accepts, where given)."""

    def __init__(
        self, created: Callable[[torch.UntypedStorage], None], only: Callable[[torch.Tensor], bool] | None = None
    ) -> None:
        super().__init__()
        self.created, self.only = created, only
        self.seen: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in _memory_tensors((args, kwargs))}
        for t in _memory_tensors(out):
            # an output sharing an input's storage (a view, an in-place op) allocated nothing
            if storage_key(t) not in inputs and (self.only is None or self.only(t)):
                storage = t.untyped_storage()
                if storage not in self.seen:
                    self.seen.add(storage)
                    self.created(storage)
        return out


def _memory_tensors(tree: Any) -> list[torch.Tensor]:
    return [m for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) for m in memory_tensors(t)]


@dataclass(frozen=True)
class SavedMemory:
    """Storages created during a call and still alive after it returned."""

    bytes: int
    storages: int


def measure_saved(
    fn: Callable[[], Any],
    device: torch.device | str | None = None,
    resident: Callable[[], Iterable[torch.Tensor]] | None = None,
) -> tuple[Any, SavedMemory]:
    """Run `fn()` and count the storages it allocated that are still alive when it returns.

    `resident`: what outlives the step anyway, asked for after `fn` (a model's parameters: under
    FSDP2 the root's gathered parameters are created by the forward and stay until backward);
    their storages are not counted.
    On a CUDA `device` the caching allocator counts them (in its 512-byte blocks): compiled
    higher-order ops such as flex attention refuse to run under the dispatch mode used elsewhere.
    """
    if device is not None and torch.device(device).type == "cuda":
        return _measure_saved_cuda(fn, torch.device(device), resident)
    recorder = NewStorages(lambda storage: None)
    with recorder:
        result = fn()
    gc.collect()
    kept = {storage_key(t) for t in resident()} if resident is not None else set()
    # FSDP2 frees a gathered layer by resizing its storage to nothing: alive, but holding no bytes
    alive = [s for s in recorder.seen if s._cdata not in kept and s.nbytes() > 0]
    return result, SavedMemory(sum(s.nbytes() for s in alive), len(alive))


def _measure_saved_cuda(
    fn: Callable[[], Any], device: torch.device, resident: Callable[[], Iterable[torch.Tensor]] | None
) -> tuple[Any, SavedMemory]:
    def held() -> tuple[int, int]:
        gc.collect()
        torch.cuda.synchronize(device)
        stats = torch.cuda.memory_stats(device)
        return stats.get("allocated_bytes.all.current", 0), stats.get("allocation.all.current", 0)

    def resident_storages() -> dict[int, int]:
        return {storage_key(t): t.untyped_storage().nbytes() for t in resident()} if resident is not None else {}

    before = resident_storages()
    bytes_before, count_before = held()
    result = fn()
    bytes_after, count_after = held()
    new = [n for key, n in resident_storages().items() if key not in before and n > 0]
    gathered = sum(-(-n // CUDA_BLOCK) * CUDA_BLOCK for n in new)
    return result, SavedMemory(bytes_after - bytes_before - gathered, count_after - count_before - len(new))


class LiveBytes:
    """Live bytes and their maximum, updated as storages are created and die."""

    def __init__(self) -> None:
        self.bytes = 0
        self.peak = 0

    def created(self, storage: torch.UntypedStorage) -> None:
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(storage, self.freed, storage.nbytes())

    def freed(self, nbytes: int) -> None:
        self.bytes -= nbytes


def peak_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn()`; return its result and the peak bytes of the tensors it allocated (any device).

    The peak counts tensors that ops create while `fn` runs, on top of whatever existed before.
    """
    live = LiveBytes()
    with NewStorages(live.created):
        result = fn()
    return result, live.peak
