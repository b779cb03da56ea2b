"""Model-agnostic mechanisms: RNG-exact checkpoint regions, output discarding, offloading."""

from remat.engine.checkpoint import (
    DiscardScope,
    KeptInputs,
    Region,
    Restore,
    StandIn,
    checkpoint,
    current_scope,
    inside_region,
    offloading,
    output_tensors,
    refuse_compiled,
    traced_checkpoint,
)
from remat.engine.offload import HostPool, Offloader, OffloadStats
from remat.engine.rng import RNGStream, register_stream
from remat.engine.storage import storage_key

__all__ = [
    "DiscardScope",
    "HostPool",
    "KeptInputs",
    "OffloadStats",
    "Offloader",
    "RNGStream",
    "Region",
    "Restore",
    "StandIn",
    "checkpoint",
    "current_scope",
    "inside_region",
    "offloading",
    "output_tensors",
    "refuse_compiled",
    "register_stream",
    "storage_key",
    "traced_checkpoint",
]
