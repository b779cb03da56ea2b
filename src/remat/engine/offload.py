"""Offloading saved tensors to host memory, built on saved-tensor hooks.

An `Offloader` copies each storage autograd saves to a host buffer taken from a `HostPool` (pinned
on CUDA, reused across steps) and drops the device copy; backward copies it back. The copies are
asynchronous on CUDA: device-to-host on a side stream that waits for the compute stream at the
moment the tensor is saved, host-to-device on another side stream, started for a whole group
(one layer) when backward reaches the output of the layer after it (`prefetch_on_grad`), so the
copy overlaps that layer's backward whatever the layer does; a group nobody prefetched loads at
its own first unpack. The layer two after a group waits for the group's copies out before it
runs (`await_copies`): the allocator cannot reuse a block until its copy out has run
(`record_stream`), so slow copies would otherwise pile up reserved memory. Only
events order the streams: nothing synchronizes the compute stream with the host.

Views are offloaded by storage: a storage saved several times (a tensor saved twice, q, k and v
sliced from one fused output) is copied once, and each saved view is rebuilt with its own size,
stride and offset. Small storages, parameters, leaves that require grad and the `resident`
tensors (a model's buffers) stay on the device: copying them would free nothing.

Without CUDA the same code runs with plain CPU copies and no streams, so every rule above can be
tested on a CPU.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from remat.engine.storage import holds_parts, storage_key

_local = threading.local()


def active_offloader() -> Offloader | None:
    """The offloader whose group is open on this thread, if any."""
    stack = getattr(_local, "offloaders", None)
    return stack[-1] if stack else None


@dataclass(frozen=True)
class OffloadStats:
    """Byte counters of an offloader (host bytes are those of the pooled buffers)."""

    offloaded_bytes: int  # device bytes copied to host since the last reset, each storage once
    host_bytes: int  # host bytes holding offloaded storages now
    peak_host_bytes: int  # the most host bytes held at once since the last reset
    pool_bytes: int  # host bytes the pool has allocated in all (held now or free for reuse)
    allocations: int  # host buffers allocated in all; stays put once steps repeat


class HostPool:
    """Host buffers keyed by byte size, reused across steps: cudaHostAlloc is slow. On the meta
    device (shapes-only estimates) the buffers are meta too: sizes without memory."""

    def __init__(self, pinned: bool, device: str = "cpu") -> None:
        self.pinned, self.device = pinned, device
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        self.allocated_bytes = 0
        self.allocations = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A buffer of `nbytes` and the event its last copy ends with (None: free to use now)."""
        free = self._free[nbytes]
        if free:
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += nbytes
        with _disable_current_modes():  # host memory: what meters of device memory must not count
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned, device=self.device), None

    def give(self, buffer: torch.Tensor, last_use: Any) -> None:
        self._free[buffer.numel()].append((buffer, last_use))


class _Streams:
    """The side streams of one CUDA device: one for each copy direction, so both run at once."""

    def __init__(self, device: torch.device) -> None:
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)


def _event(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class _Group:
    """The offloaded storages of one group (one layer's offloaded sites), in forward order."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.copies: list[weakref.ref[_HostCopy]] = []
        self.backward_started = False

    def start_backward(self) -> None:
        """Start copying every storage of the group back to the device."""
        self.backward_started = True
        for ref in self.copies:
            copy = ref()
            if copy is not None:
                copy.load()


class _HostCopy:
    """One device storage copied to a host buffer; back on the device while backward needs it."""

    def __init__(self, offloader: Offloader, group: _Group, source: torch.Tensor, version: int) -> None:
        self.offloader, self.group, self.version = offloader, group, version
        self.device = source.device
        self.storage = weakref.ref(source.untyped_storage())  # for the dedup check only
        self.nbytes = source.numel()
        self.refs = 0  # saved views that unpack from this copy
        self.unpacks = 0  # of those, unpacked since the last load
        self.loaded: torch.Tensor | None = None
        self.loaded_event: Any = None
        self.copied_event: Any = None
        self.host, last_use = offloader.pool.take(self.nbytes)
        streams = offloader.streams(self.device)
        if streams is None:
            self.host.copy_(source)
            return
        ready = _event(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(streams.d2h):
            streams.d2h.wait_event(ready)
            if last_use is not None:  # the buffer's previous host-to-device copy
                streams.d2h.wait_event(last_use)
            self.host.copy_(source, non_blocking=True)
            self.copied_event = _event(streams.d2h)
        source.record_stream(streams.d2h)  # the allocator keeps the storage until the copy ran

    def load(self) -> None:
        """Start the host-to-device copy (on the side stream), unless it is on the device already."""
        if self.loaded is not None:
            return
        streams = self.offloader.streams(self.device)
        if streams is None:
            self.loaded = self.host.clone()
            return
        with torch.cuda.stream(streams.h2d):
            streams.h2d.wait_event(self.copied_event)
            self.loaded = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            self.loaded.copy_(self.host, non_blocking=True)
            self.loaded_event = _event(streams.h2d)

    def take(self) -> torch.Tensor:
        """The storage's bytes on the device, ready for the current stream."""
        self.load()
        loaded = self.loaded
        assert loaded is not None
        if self.loaded_event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.loaded_event)
            loaded.record_stream(stream)
        self.unpacks += 1
        if self.unpacks >= self.refs:  # every saved view has it: drop the device copy
            self.loaded, self.unpacks = None, 0
        return loaded

    def __del__(self) -> None:
        # The graph let go of every view: the buffer is free once its last copy has run.
        last_use = self.loaded_event if self.loaded_event is not None else self.copied_event
        self.offloader._released(self.host, last_use)


@dataclass(frozen=True)
class Offloaded:
    """What autograd holds for an offloaded saved tensor: a view of a host copy."""

    copy: _HostCopy
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def unpack(self) -> torch.Tensor:
        group = self.copy.group
        if not group.backward_started:
            group.start_backward()
        data = self.copy.take().view(self.dtype)
        return data.as_strided(self.size, self.stride, self.offset)


@dataclass
class OffloadedParts:
    """What autograd holds for a saved wrapper subclass (torchao's FP8 tensor: FP8 data and a
    scale) whose inner tensors went to host: the subclass rebuilt around them when unpacked."""

    cls: type
    parts: dict[str, Offloaded | OffloadedParts | torch.Tensor]
    context: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def unpack(self) -> torch.Tensor:
        inner = {name: p if isinstance(p, torch.Tensor) else p.unpack() for name, p in self.parts.items()}
        return self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)  # type: ignore[attr-defined,no-any-return]


def _owned_by_module(t: torch.Tensor) -> bool:
    # Parameters and leaves that require grad (or views of them) outlive the step on the device.
    root = t._base if t._base is not None else t
    return isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad)


class Offloader:
    """Moves saved tensors to host memory inside its groups; one per model, reused across steps.

    `min_numel`: storages with fewer elements (of the saved tensor's dtype) stay on the device.
    `device_type`: where offloaded tensors live, "cuda" (pinned host buffers, side streams),
    "cpu" (plain copies into pooled CPU buffers: the same logic, for tests) or "meta" (shapes
    only, for estimates; default: cuda when there is a GPU, else cpu).
    `resident`: tensors that live on anyway (a model's parameters and buffers), asked for again
    at the start of each forward, since a model may replace its buffers.
    """

    def __init__(
        self,
        min_numel: int,
        device_type: str | None = None,
        resident: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        self.min_numel = min_numel
        self._resident = resident
        self._resident_keys: set[int] = set()
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self.pool = HostPool(pinned=self.device_type == "cuda", device="meta" if self.device_type == "meta" else "cpu")
        self._streams: dict[torch.device, _Streams] = {}
        self._by_storage: weakref.WeakValueDictionary[int, _HostCopy] = weakref.WeakValueDictionary()
        self._group: _Group | None = None
        self._latest: weakref.WeakValueDictionary[int, _Group] = weakref.WeakValueDictionary()
        self.offloaded_bytes = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0

    # ---- forward -------------------------------------------------------------------------
    @contextlib.contextmanager
    def group(self, key: int) -> Iterator[None]:
        """Make this the active offloader; groups entered in a row with one key are one group."""
        if self._group is None or self._group.key != key or self._group.backward_started:
            # a forward begins (nothing before, or the last group's backward ran): read the
            # resident tensors once per forward, not once per layer
            forward_begins = self._group is None or self._group.backward_started
            self._group = _Group(key)
            self._latest[key] = self._group
            if forward_begins and self._resident is not None:
                self._resident_keys = {storage_key(t) for t in self._resident()}
        stack = _local.__dict__.setdefault("offloaders", [])
        stack.append(self)
        try:
            yield
        finally:
            stack.pop()

    def offloads(self, t: torch.Tensor) -> bool:
        """Whether `t` goes to host: a large enough dense tensor that no module owns."""
        if t.device.type != self.device_type or t.layout != torch.strided or _owned_by_module(t):
            return False
        if type(t) is not torch.Tensor or storage_key(t) in self._resident_keys:
            return False  # fake, functional and other subclasses stay too
        nbytes = t.untyped_storage().nbytes()
        if nbytes == 0 or nbytes % t.element_size():
            return False
        return nbytes >= self.min_numel * t.element_size()

    def pack(self, t: torch.Tensor) -> Offloaded | OffloadedParts | None:
        """Offload `t`'s storage (once per storage and version), or a wrapper subclass's inner
        tensors; None if `t` stays on the device."""
        if self._group is None:
            return None
        if holds_parts(t):
            return self._pack_parts(t)
        if not self.offloads(t):
            return None
        storage = t.untyped_storage()
        key = storage_key(t)
        copy = self._by_storage.get(key)
        if copy is None or copy.storage() is not storage or copy.version != t._version:
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            copy = _HostCopy(self, self._group, source, t._version)
            self._group.copies.append(weakref.ref(copy))
            self._by_storage[key] = copy
            self.offloaded_bytes += copy.nbytes
            self.host_bytes += copy.nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        copy.refs += 1
        return Offloaded(copy, t.dtype, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))

    def _pack_parts(self, t: torch.Tensor) -> OffloadedParts | None:
        names, context = t.__tensor_flatten__()  # type: ignore[attr-defined]
        parts: dict[str, Offloaded | OffloadedParts | torch.Tensor] = {
            name: self.pack(getattr(t, name)) or getattr(t, name) for name in names
        }
        if all(isinstance(p, torch.Tensor) for p in parts.values()):
            return None
        return OffloadedParts(type(t), parts, context, tuple(t.size()), tuple(t.stride()))

    def prefetch_on_grad(self, tensor: torch.Tensor, key: int) -> None:
        """Load the latest group `key` when backward reaches `tensor` (the output of the layer
        after the group's, so the copies overlap that layer's backward)."""
        group = self._latest.get(key)
        if group is None or not tensor.requires_grad:
            return
        ref = weakref.ref(group)

        def load(grad: torch.Tensor) -> None:
            target = ref()
            if target is not None and not target.backward_started:
                target.start_backward()

        tensor.register_hook(load)

    def await_copies(self, key: int) -> None:
        """Make the current stream wait until the latest group `key` is copied to host (on CPU the
        copies are done already)."""
        group = self._latest.get(key)
        for ref in reversed(group.copies if group is not None else []):
            copy = ref()
            if copy is not None and copy.copied_event is not None:  # the side stream runs in order
                torch.cuda.current_stream(copy.device).wait_event(copy.copied_event)
                return

    # ---- bookkeeping ---------------------------------------------------------------------
    def streams(self, device: torch.device) -> _Streams | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = _Streams(device)
        return self._streams[device]

    def _released(self, buffer: torch.Tensor, last_use: Any) -> None:
        self.host_bytes -= buffer.numel()
        self.pool.give(buffer, last_use)

    def stats(self) -> OffloadStats:
        return OffloadStats(
            self.offloaded_bytes,
            self.host_bytes,
            self.peak_host_bytes,
            self.pool.allocated_bytes,
            self.pool.allocations,
        )

    def reset_stats(self) -> None:
        """Start counting offloaded bytes and the host peak afresh (e.g. after warm-up steps)."""
        self.offloaded_bytes = 0
        self.peak_host_bytes = self.host_bytes
