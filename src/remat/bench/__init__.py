"""The performance harness: real training steps under a recompute plan, measured."""
from remat.bench.result import BenchResult, MemoryBreakdown, OomInfo
from remat.bench.run import BenchSpec, plan_name, run_bench, sweep

__all__ = ["BenchResult", "BenchSpec", "MemoryBreakdown", "OomInfo", "plan_name", "run_bench", "sweep"]
