"""Model-agnostic mechanisms: RNG-exact checkpoint regions and output discarding."""
from remat.engine.checkpoint import DiscardScope, Region, checkpoint, current_scope

__all__ = ["DiscardScope", "Region", "checkpoint", "current_scope"]
