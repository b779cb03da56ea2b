"""Memory accounting: what a forward leaves alive for backward."""
from remat.memory.live import SavedMemory, measure_saved

__all__ = ["SavedMemory", "measure_saved"]
