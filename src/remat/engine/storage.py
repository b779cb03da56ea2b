"""Storage identity, shared by the engine's mechanisms and the memory accounting."""

from __future__ import annotations

import torch


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage (views of one storage share the key) while it is alive.

    The storage object's own address, not its data pointer: meta tensors (shape-only traces)
    and empty storages all have data pointer 0."""
    return t.untyped_storage()._cdata
