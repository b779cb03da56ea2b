"""Model-agnostic mechanisms: RNG-exact checkpoint regions and output discarding."""
from remat.engine.checkpoint import (
    DiscardScope, Region, checkpoint, current_scope, inside_region, storage_key,
)

__all__ = ["DiscardScope", "Region", "checkpoint", "current_scope", "inside_region", "storage_key"]
