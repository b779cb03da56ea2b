"""The performance harness: real training steps under a recompute plan, measured."""

from remat.bench.result import BenchResult, MemoryBreakdown, OomInfo
from remat.bench.run import OnStep, plan_name, run_bench, sweep
from remat.bench.spec import BenchSpec

__all__ = ["BenchResult", "BenchSpec", "MemoryBreakdown", "OnStep", "OomInfo", "plan_name", "run_bench", "sweep"]
