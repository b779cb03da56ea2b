"""Storage identity, shared by the engine's mechanisms and the memory accounting."""

from __future__ import annotations

import torch

# the dtypes FP8 training stores its casts in (e4m3 inputs and weights, e5m2 gradients)
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage (views of one storage share the key) while it is alive.

    The storage object's own address, not its data pointer: meta tensors (shape-only traces)
    and empty storages all have data pointer 0."""
    return t.untyped_storage()._cdata


def memory_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold `t`'s memory: `t` itself, or the inner tensors of a wrapper
    subclass (torchao's FP8 tensors: FP8 data and a scale), whose own storage holds no bytes
    however large it says it is. DTensor, whose accounting its shards' owners do, stays itself."""
    if not holds_parts(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return [inner for name in names for inner in memory_tensors(getattr(t, name))]


def holds_parts(t: torch.Tensor) -> bool:
    """Whether `t` is a wrapper subclass whose memory is its inner tensors' (not a DTensor)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t) and type(t).__name__ != "DTensor"
