"""Memory accounting: what a forward leaves alive for backward."""

from remat.memory.live import SavedMemory, measure_saved, peak_during

__all__ = ["SavedMemory", "measure_saved", "peak_during"]
