"""remat: activation recompute for PyTorch transformer training.

Models place `Site`s; `apply(model, plan)` sets what each site does, where `plan` is a
Megatron-style `RecomputeConfig`, a per-layer `Plan`, or None. `trace` measures what every
site saves and costs, `plan` picks the fastest plan under a memory budget, `estimate` predicts
peak memory from shapes alone, `verify` checks a plan's gradients, and `doctor` explains OOMs.
"""

from remat import doctor, models
from remat.config.capture import Capture
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan
from remat.config.plan import load_plan_or_config as load_plan
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError, RematWarning
from remat.core.version import remat_version
from remat.engine import checkpoint
from remat.estimate.spec import EstimateSpec
from remat.estimate.stages import estimate
from remat.memory import measure_saved
from remat.memory.measure import trace
from remat.memory.prediction import Trace
from remat.models.adapt import adapt, unadapt
from remat.planner import PlanResult, plan
from remat.run.fp8 import to_fp8
from remat.run.verify import verify
from remat.sites.apply import apply, find_sites
from remat.sites.calls import WithLoss, cross_entropy
from remat.sites.site import Site

__all__ = [
    "Capture",
    "ConfigError",
    "EstimateSpec",
    "ParallelLayout",
    "Precision",
    "doctor",
    "Plan",
    "RecomputeConfig",
    "RematWarning",
    "Site",
    "Trace",
    "TrainingFacts",
    "WithLoss",
    "PlanResult",
    "adapt",
    "apply",
    "checkpoint",
    "cross_entropy",
    "estimate",
    "find_sites",
    "load_plan",
    "measure_saved",
    "models",
    "plan",
    "trace",
    "unadapt",
    "verify",
    "to_fp8",
]
__version__ = remat_version()
