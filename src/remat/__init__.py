"""remat: activation recompute for PyTorch transformer training.

Models place `Site`s; `apply(model, plan)` sets what each site does, where `plan` is a
Megatron-style `RecomputeConfig`, a per-layer `Plan`, or None. `trace` measures what every
site saves and costs, `plan` picks the fastest plan under a memory budget, `estimate` predicts
peak memory from shapes alone, `verify` checks a plan's gradients, and `doctor` explains OOMs.
"""
from remat import doctor, models
from remat.adapt import adapt, unadapt
from remat.apply import apply, find_sites
from remat.engine import checkpoint
from remat.estimating import EstimateSpec, estimate
from remat.layer_plan import Plan
from remat.memory import measure_saved
from remat.memory.measure import trace
from remat.memory.prediction import Trace
from remat.planner import PlanResult, plan
from remat.problems import ConfigError, RematWarning
from remat.recompute import RecomputeConfig, TrainingFacts
from remat.sites import Site
from remat.verify import verify

__all__ = [
    "ConfigError", "EstimateSpec", "doctor", "Plan", "RecomputeConfig", "RematWarning", "Site", "Trace", "TrainingFacts",
    "PlanResult", "adapt", "apply", "checkpoint", "estimate", "find_sites", "measure_saved", "models", "plan", "trace", "unadapt", "verify",
]
__version__ = "0.1.0"
