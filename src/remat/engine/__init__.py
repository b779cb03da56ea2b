"""Model-agnostic mechanisms: RNG-exact checkpoint regions, output discarding, offloading."""
from remat.engine.checkpoint import (
    DiscardScope,
    Region,
    checkpoint,
    current_scope,
    inside_region,
    offloading,
    output_tensors,
)
from remat.engine.offload import HostPool, Offloader, OffloadStats
from remat.engine.storage import storage_key

__all__ = ["DiscardScope", "HostPool", "OffloadStats", "Offloader", "Region",
           "checkpoint", "current_scope", "inside_region", "offloading", "output_tensors", "storage_key"]
