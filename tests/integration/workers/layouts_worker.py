"""Runs remat bench's step (`run_bench`: build, reset_parameters, MockData, the optimizer) under
each layout of two processes in turn, in one torchrun launch; rank 0 saves each layout's result
(a BenchResult's dict: its losses, as a golden file holds them).

Launched by tests/integration/test_layouts_runs.py (which runs one process beside): torchrun
--standalone --nproc-per-node 2 layouts_worker.py OUT.json [DTYPE [LAYOUT...]]"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from remat import parallel
from remat.bench.run import run_bench
from remat.bench.spec import BenchSpec
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig

STEPS = 3
# layout name -> (recipe, the layout's sizes on two processes)
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "tp2": ("llama3_tiny", dict(tp=2)),
    "tp2_sp": ("llama3_tiny", dict(tp=2, sp=True)),
    "pp2": ("llama3_tiny", dict(pp=2)),
    "pp2_vp2": ("llama3_tiny", dict(pp=2, vp=2)),
    "cp2": ("llama3_tiny", dict(cp=2)),
    "dp2": ("llama3_tiny", dict(num_gpus=2)),
    "ep2": ("moe_tiny", dict(num_gpus=2, ep=2)),
    "moe_tp2": ("moe_tiny", dict(tp=2)),
    "moe_tp2_sp": ("moe_tiny", dict(tp=2, sp=True)),
    "moe_pp2": ("moe_tiny_4", dict(pp=2)),
    "moe_pp2_vp2": ("moe_tiny_4", dict(pp=2, vp=2)),
    "moe_cp2": ("moe_tiny", dict(cp=2)),
    "hf_tp2": ("hf:llama", dict(tp=2)),
    "hf_tp2_sp": ("hf:llama", dict(tp=2, sp=True)),
    "hf_pp2": ("hf:llama", dict(pp=2)),
    "hf_pp2_vp2": ("hf:llama_4", dict(pp=2, vp=2)),
    "hf_dp2": ("hf:llama", dict(num_gpus=2)),
    "hf_cp2": ("hf:llama", dict(cp=2)),
    "moe_dp2": ("moe_tiny", dict(num_gpus=2)),
}
# the layouts the fp32 test runs; the FP8 test runs every one (in fp32 the others have their own
# tests: test_hf_*_runs.py, test_moe_parallel_runs.py, test_context_parallel_runs.py)
FP32_LAYOUTS = ("tp2", "tp2_sp", "pp2", "pp2_vp2", "cp2", "dp2", "ep2", "moe_tp2", "moe_cp2")


# a recipe name above, for a recipe with other fields: four layers, for two stages of two chunks
VARIANTS: dict[str, dict[str, Any]] = {
    f"{recipe}_4": dict(recipe=recipe, overrides={"num_layers": 4}) for recipe in ("moe_tiny", "hf:llama")
}


def spec(recipe: str, layout: ParallelLayout, dtype: str = "fp32") -> BenchSpec:
    """The run every layout makes: fp32, so that only the order of the reductions can differ."""
    return BenchSpec(
        **{"recipe": recipe, **VARIANTS.get(recipe, {})},
        device="cpu",
        micro_batch_size=1,
        global_batch_size=2,
        max_steps=STEPS,
        warmup_steps=1,
        precision=Precision(dtype),
        layout=layout,
    )


def plan() -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"])


def main(out: Path, dtype: str = "fp32", names: list[str] | None = None) -> None:
    """Each layout's run under `plan()`; in FP8 also without recompute (as NAME@none)."""
    parallel.start("cpu")
    losses: dict[str, dict[str, Any]] = {}
    for name in names or LAYOUTS:
        recipe, sizes = LAYOUTS[name]
        run = spec(recipe, ParallelLayout(**sizes), dtype)
        losses[name] = run_bench(run, plan()).to_dict()
        if run.precision.is_fp8:
            losses[f"{name}@none"] = run_bench(run, None).to_dict()
    if parallel.is_main():
        out.write_text(json.dumps(losses))
    parallel.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:3], names=sys.argv[3:] or None)
