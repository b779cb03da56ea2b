"""remat: activation recompute for PyTorch transformer training."""
from remat.sites import Site

__all__ = ["Site"]
__version__ = "0.1.0"
