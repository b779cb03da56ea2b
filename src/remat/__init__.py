"""remat: activation recompute for PyTorch transformer training.

Models place `Site`s; `apply(model, plan)` sets what each site does, where `plan` is a
Megatron-style `RecomputeConfig`, a per-layer `Plan`, or None.
"""
from remat import doctor, models
from remat.apply import apply, find_sites
from remat.config import ConfigError, RecomputeConfig, RematWarning, TrainingFacts
from remat.engine import checkpoint
from remat.estimating import EstimateSpec, estimate
from remat.memory import measure_saved
from remat.memory.trace import Trace, trace
from remat.planning import PlanResult, plan
from remat.plans import Plan
from remat.sites import Site
from remat.verify import verify

__all__ = [
    "ConfigError", "EstimateSpec", "doctor", "Plan", "RecomputeConfig", "RematWarning", "Site", "Trace", "TrainingFacts",
    "PlanResult", "apply", "checkpoint", "estimate", "find_sites", "measure_saved", "models", "plan", "trace", "verify",
]
__version__ = "0.1.0"
