"""Non-reentrant, RNG-exact checkpointing with output discarding, built on saved-tensor hooks.

A `Region` runs one or more calls (one site, or a group of consecutive layers) with the autograd
graph built as usual, but every tensor autograd saves inside it is replaced by a slot number.
The first time backward asks for a slot, the region replays its calls once, with the RNG and
autocast state of the forward, and fills every slot. Because the original graph is used,
parameters get gradients even when no input requires grad, and `torch.autograd.grad` works.

A `DiscardScope` (entered around a whole layer) goes one step further for a region whose
*output* is itself saved by the ops that consume it (norm -> linear): the consumers save a
reference to the region instead of the tensor, and the region's single replay rebuilds the output
for all of them. Matching is by storage, so views of the output are caught too.

Inside `offloading(...)`, what would be kept on the device (saved tensors, a region's inputs)
goes to host through an `Offloader` instead (engine/offload.py).

A call's caller may also keep the call's inputs its own way (`KeptInputs` as its `before_replay`):
a stand-in instead of an input (this rank's shard of a tensor every rank holds), turned back
into the input when the replay needs it (the shards gathered).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import checkpoint as torch_checkpoint

from remat.engine.offload import Offloaded, OffloadedParts, Offloader, active_offloader
from remat.engine.rng import ReplayState, forked_rng
from remat.engine.storage import storage_key

_local = threading.local()


def _scopes() -> list[DiscardScope]:
    if not hasattr(_local, "scopes"):
        _local.scopes = []
    return _local.scopes


def inside_region() -> bool:
    """True while a Region runs or replays: Sites inside it then just call their function
    (a region already recomputes everything in it; nested actions would only pin memory)."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _region_running() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


_INPLACE = (
    "one of the tensors a recompute needs was modified by an in-place operation after "
    "it was saved (forward version {saved}, now {now}); clone it before modifying it, or "
    "keep this site instead of recomputing it"
)


def _check_version(t: torch.Tensor, version: int) -> None:
    if t._version != version:
        raise RuntimeError(_INPLACE.format(saved=version, now=t._version))


def current_scope() -> DiscardScope | None:
    scopes = _scopes()
    return scopes[-1] if scopes else None


def output_tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


@dataclass(frozen=True)
class _Link:
    """An argument that is output `index` of the previous call of the same region."""

    index: int


# A stand-in for a tensor input (what to keep instead) and how to turn it back into the input.
Restore = Callable[[torch.Tensor], torch.Tensor]
StandIn = Callable[[torch.Tensor], "tuple[torch.Tensor, Restore] | None"]


@dataclass(frozen=True)
class KeptInputs:
    """A call's `before_replay` that also chooses how the region keeps the call's tensor inputs
    (those it keeps at all: not a linked earlier call's output, not a discarded output's
    reference). `stand_in(t)` returns what to keep instead of `t` and how to rebuild `t` from it
    for the replay, or None to keep `t` as usual; `before` is the plain `before_replay` it wraps
    (e.g. gathering a sharded layer's parameters), run first."""

    stand_in: StandIn
    before: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.before is not None:
            self.before()


@dataclass(frozen=True)
class _Stored:
    """An argument kept for the replay: kept as itself, offloaded, or a discarded output's reference."""

    packed: Any
    requires_grad: bool


class _StandInKept:
    """An input kept as the stand-in `KeptInputs` chose (on the device or offloaded, as any
    input). A replay rebuilds the input from it; on the device, the first replay keeps the input
    instead, as it would have been kept, so the replay's peak holds the input alone (not the
    stand-in beside it) and a second backward through a retained graph needs no second rebuild."""

    def __init__(self, packed: Any, restore: Restore, requires_grad: bool) -> None:
        self.packed: Any = packed
        self.restore: Restore | None = restore
        self.requires_grad = requires_grad

    def tensor(self) -> torch.Tensor:
        if self.restore is None:
            return unpack_saved(self.packed)
        rebuilt = self.restore(unpack_saved(self.packed))
        if isinstance(self.packed, _Kept):
            self.packed, self.restore = _Kept(rebuilt, rebuilt._version), None
        return rebuilt


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: ReplayState
    before_replay: Callable[[], None] | None = None


class Region:
    """A checkpointed unit: saved tensors are dropped in forward and rebuilt by one replay."""

    def __init__(self) -> None:
        self._calls: list[_Call] = []
        self._num_saved = 0
        self._slots: dict[int, torch.Tensor] = {}
        self._last_outputs: list[torch.Tensor] = []  # forward outputs of the latest call, for linking
        self._last_versions: list[int] = []
        self._rebuilt: dict[int, torch.Tensor] = {}  # replayed outputs awaiting consumers
        self._output_refs: dict[int, int] = {}  # consumer references still to be unpacked

    # ---- forward -------------------------------------------------------------------------
    def call(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        before_replay: Callable[[], None] | None = None,
    ) -> Any:
        """Run `fn(*args, **kwargs)` as the next call of this region and return its output.
        `before_replay` runs before the replay calls `fn` again (e.g. gathering the sharded
        parameters of a layer replayed from a later layer's backward); a `KeptInputs` also
        chooses how the call's inputs are kept."""
        if torch.compiler.is_compiling():
            refuse_compiled(_TRACED)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        stand_in = before_replay.stand_in if isinstance(before_replay, KeptInputs) else None
        self._calls.append(
            _Call(
                fn,
                tuple(self._keep(a, stand_in) for a in args),
                {k: self._keep(v, stand_in) for k, v in kwargs.items()},
                ReplayState.capture(tensors),
                before_replay,
            )
        )
        with _region_running(), saved_tensors_hooks(self._pack, self._unpack):
            out = fn(*args, **kwargs)
        self._last_outputs = output_tensors(out)
        self._last_versions = [t._version for t in self._last_outputs]
        return out

    def close(self) -> None:
        """The region's forward is over: let go of the outputs kept for linking calls."""
        self._last_outputs, self._last_versions = [], []

    def _keep(self, arg: Any, stand_in: StandIn | None) -> Any:
        if not isinstance(arg, torch.Tensor):
            return arg
        for i, out in enumerate(self._last_outputs):
            if arg is out and arg._version == self._last_versions[i]:  # not modified in between
                return _Link(i)
        scope = current_scope()
        ref = scope.reference(arg) if scope is not None else None
        if ref is not None:
            return _Stored(ref, arg.requires_grad)
        chosen = stand_in(arg) if stand_in is not None else None
        if chosen is not None:  # a copy is exact whatever `arg` becomes; a view keeps its version
            kept, restore = chosen
            return _StandInKept(_keep_tensor(kept), restore, arg.requires_grad)
        if _views_larger_buffer(arg):
            # e.g. v sliced from a fused qkv output: keep v's bytes, not the whole buffer's
            return _Stored(_keep_tensor(arg.detach().clone()), arg.requires_grad)
        return _Stored(_keep_tensor(arg), arg.requires_grad)

    def _pack(self, _tensor: torch.Tensor) -> int:
        slot = self._num_saved
        self._num_saved += 1
        return slot

    # ---- backward ------------------------------------------------------------------------
    def _unpack(self, slot: int) -> torch.Tensor:
        if slot not in self._slots:
            self._replay(keep=set())
        return self._slots.pop(slot)

    def has_output_refs(self, index: int) -> bool:
        return self._output_refs.get(index, 0) > 0

    def add_output_ref(self, index: int) -> None:
        self._output_refs[index] = self._output_refs.get(index, 0) + 1

    def take_output(self, index: int) -> torch.Tensor:
        """A rebuilt output for one consumer; dropped once its last consumer has it."""
        if index not in self._rebuilt:
            self._replay(keep={index})
        out = self._rebuilt[index]
        self._output_refs[index] -= 1
        if self._output_refs[index] <= 0:
            del self._rebuilt[index]
        return out

    def _replay(self, keep: set[int]) -> None:
        keep = keep | {i for i, n in self._output_refs.items() if n > 0}
        # Without outputs to rebuild, stop as soon as the last saved tensor is back: autograd
        # saves an op's inputs before running it, so the region's last op (e.g. an MLP's down
        # projection) is not recomputed at all; an autograd Function saves when it returns.
        stop_early = not keep
        slots: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor) -> None:
            slots[len(slots)] = t.detach()
            if stop_early and len(slots) == self._num_saved:
                raise _ReplayDone

        outputs: list[torch.Tensor] = []
        devices = sorted({d for c in self._calls for d in c.state.devices})
        streams = [stream for c in self._calls for stream, _ in c.state.streams]
        with forked_rng(devices, streams), torch.enable_grad(), _region_running():
            try:
                for call in self._calls:
                    if call.before_replay is not None:
                        call.before_replay()
                    call.state.restore_rng()
                    args = tuple(self._restore(a, outputs) for a in call.args)
                    kwargs = {k: self._restore(v, outputs) for k, v in call.kwargs.items()}
                    with call.state.replay_context(), saved_tensors_hooks(pack, _never_unpacked):
                        outputs = output_tensors(call.fn(*args, **kwargs))
            except _ReplayDone:
                pass
        if len(slots) != self._num_saved:
            raise RuntimeError(
                f"recompute saved {len(slots)} tensors where the forward saved {self._num_saved}: "
                "the recomputed code took a different path (data-dependent control flow or state "
                "changed between forward and backward); keep this site instead of recomputing it"
            )
        self._slots = slots
        self._rebuilt = {i: outputs[i].detach() for i in keep}

    @staticmethod
    def _restore(arg: Any, previous: list[torch.Tensor]) -> Any:
        if isinstance(arg, _Link):
            return previous[arg.index]
        if isinstance(arg, _Stored):
            return unpack_saved(arg.packed).detach().requires_grad_(arg.requires_grad)
        if isinstance(arg, _StandInKept):
            return arg.tensor().detach().requires_grad_(arg.requires_grad)
        return arg


@torch.compiler.disable
def refuse_compiled(message: str) -> NoReturn:
    """Raise `message` from code torch.compile traces. Raised while dynamo traces, an error only
    makes dynamo give up on the frame and run it eagerly (here: an eager Region around compiled
    calls, the wrong backward this refusal exists to prevent); a call dynamo may not trace runs
    when the compiled code does, and its error reaches the caller."""
    raise RuntimeError(message)


_TRACED = (
    "remat's recompute region cannot run inside torch.compile: its saved-tensor hooks would see "
    "the compiled graph's saved tensors while its replay runs eagerly; under torch.compile use "
    "remat.checkpoint or a Site's action (they lower to torch's compile-aware checkpoint)"
)


def traced_checkpoint(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`fn(*args, **kwargs)` recomputed in backward, the way torch.compile can trace it: torch's
    non-reentrant checkpoint, which dynamo turns into a higher-order op whose ops AOTAutograd
    recomputes in the compiled backward (random ops saved or replayed, never drawn anew). A
    Region cannot be traced: dynamo breaks the graph at its hooks, so they would number the
    compiled graph's saved tensors while the replay (in backward, outside dynamo) saves eager ones."""
    call = functools.partial(fn, **kwargs) if kwargs else fn  # kwargs never clash with checkpoint's own
    return torch_checkpoint.checkpoint(call, *args, use_reentrant=False)


class _ReplayDone(BaseException):  # not an Exception: user fallbacks must not catch it
    """Raised inside a replay once every saved tensor is back."""


def _views_larger_buffer(t: torch.Tensor) -> bool:
    # Only activations (they require grad): a view of a buffer or constant is alive anyway.
    return t.requires_grad and t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size()


def _never_unpacked(_packed: None) -> torch.Tensor:
    raise RuntimeError("the graph built by a recompute is internal and never run backward")


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `fn` keeping only its inputs; rebuild what backward needs by one RNG-exact replay."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        return traced_checkpoint(fn, args, kwargs)
    region = Region()
    out = region.call(fn, args, kwargs)
    region.close()
    return out


@dataclass(frozen=True)
class _OutputRef:
    """What a consumer saves instead of a discarded output (or a view of it)."""

    region: Region
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset relative to the output's own


@dataclass(frozen=True)
class _Registered:
    region: Region
    index: int
    tensor: torch.Tensor  # held only while the scope is open, so the storage key stays unique
    version: int


@dataclass(frozen=True)
class _Kept:
    """A tensor saved as itself: detached (no reference cycle through its own grad_fn when a
    node saves its output) and with its version, so in-place changes are still caught."""

    tensor: torch.Tensor
    version: int


class DiscardScope:
    """Saved-tensor hooks around a layer: consumers of a discarded output save a reference."""

    def __init__(self) -> None:
        self._registered: dict[int, _Registered] = {}  # by storage_key
        self._hooks = saved_tensors_hooks(self.pack, unpack_saved)

    def __enter__(self) -> DiscardScope:
        _scopes().append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self._hooks.__exit__(exc_type, *exc)
        _scopes().pop()
        registered, self._registered = self._registered, {}
        if exc_type is None:
            for entry in registered.values():
                if entry.region.has_output_refs(entry.index):
                    # a consumer saved a reference, then the output changed: the replay would
                    # rebuild the value from before the change
                    _check_version(entry.tensor, entry.version)

    def discard(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Run `fn` as a checkpointed region whose outputs consumers in this scope will not keep."""
        region = Region()
        out = region.call(fn, args, kwargs)
        region.close()
        for index, tensor in enumerate(output_tensors(out)):
            if tensor.untyped_storage().nbytes() == 0:
                continue  # empty storage: nothing to free
            self._registered[storage_key(tensor)] = _Registered(region, index, tensor, tensor._version)
        return out

    def reference(self, t: torch.Tensor) -> _OutputRef | None:
        """What a consumer saves instead of `t` if `t` is (a view of) a discarded output."""
        entry = self._registered.get(storage_key(t)) if self._registered else None
        if entry is None or entry.tensor.dtype != t.dtype or entry.tensor._version != entry.version:
            return None
        entry.region.add_output_ref(entry.index)
        return _OutputRef(
            entry.region,
            entry.index,
            tuple(t.size()),
            tuple(t.stride()),
            int(t.storage_offset() - entry.tensor.storage_offset()),
        )

    def pack(self, t: torch.Tensor) -> Any:
        ref = self.reference(t)
        return ref if ref is not None else _keep_tensor(t)


def _keep_tensor(t: torch.Tensor) -> Any:
    """A saved tensor kept as itself: to host inside an offload group, else on the device."""
    offloader = active_offloader()
    offloaded = offloader.pack(t) if offloader is not None else None
    return offloaded if offloaded is not None else _Kept(t.detach(), t._version)


def unpack_saved(packed: Any) -> torch.Tensor:
    """The tensor behind whatever `DiscardScope.pack`, `_pack_saved` or a region kept."""
    if isinstance(packed, _Kept):
        _check_version(packed.tensor, packed.version)
        return packed.tensor
    if isinstance(packed, Offloaded | OffloadedParts):
        return packed.unpack()
    if not isinstance(packed, _OutputRef):
        return packed
    out = packed.region.take_output(packed.index)
    return out.as_strided(packed.size, packed.stride, out.storage_offset() + packed.offset)


def _pack_saved(t: torch.Tensor) -> Any:
    scope = current_scope()
    return scope.pack(t) if scope is not None else _keep_tensor(t)


@contextlib.contextmanager
def offloading(offloader: Offloader, key: int) -> Iterator[None]:
    """What autograd saves inside goes to host through `offloader`, in its group `key` (calls
    in a row with one key, e.g. the sites of one layer, are one group). A region entered inside
    offloads the inputs it keeps; consumers of a discarded output still save a reference."""
    with offloader.group(key), saved_tensors_hooks(_pack_saved, unpack_saved):
        yield
