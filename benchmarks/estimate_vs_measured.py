"""remat estimate (shapes only, on this machine's CPU) against peaks measured on the H200.

For every plan that benchmarks/bench_plan.py measured (benchmarks/results/plan_{w1,w1_offload,70b}_h200.json:
forward+backward, compiled regions, no optimizer), estimate the same recipe, shape and plan on
the meta device for a CUDA target and compare peak allocated memory, host memory (offload) and
step time.

  PYTHONPATH=src python benchmarks/estimate_vs_measured.py   # writes $OUT/estimate_vs_h200.json
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from pathlib import Path

import torch

from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.estimate.spec import DEFAULT_CUBLAS_WORKSPACE
from remat.estimate.stages import EstimateSpec, estimate

RESULTS = Path(__file__).parent / "results"
OUT = Path(os.environ.get("OUT", RESULTS))
GIB = 2**30
MEASURED = ("w1", "w1_offload", "70b")


def plan_of(record: dict, num_layers: int) -> Plan | RecomputeConfig | None:
    if not record:
        return None
    if "remat_plan" in record:
        return Plan.from_dict(record)
    return RecomputeConfig.from_megatron({**record, "num_layers": num_layers})


def compare(path: Path) -> dict:
    measured = json.loads(path.read_text())
    spec = measured["spec"]
    runs = [r for r in measured["plans"] if r["status"] == "ok"]
    plans = [(r["name"], plan_of(r["plan"], spec["overrides"]["num_layers"])) for r in runs]
    start = time.perf_counter()
    estimates = estimate(
        EstimateSpec(
            spec["recipe"],
            spec["overrides"],
            micro_batch_size=spec["micro_batch_size"],
            optimizer=False,
            compile=spec["compile"],
            cublas_workspace=DEFAULT_CUBLAS_WORKSPACE,
        ),
        plans,
    )  # the H200 runs' default
    seconds = time.perf_counter() - start
    rows = []
    for run, est in zip(runs, estimates):
        peak = est.peak / GIB
        rows.append(
            dict(
                plan=run["name"],
                measured_peak_gib=run["measured_peak_gib"],
                estimated_peak_gib=round(peak, 3),
                peak_error=round(peak / run["measured_peak_gib"] - 1, 4),
                measured_step_s=run["measured_step_s"],
                estimated_step_s=round(est.step_time_s, 4),
                measured_host_gib=run.get("measured_host_gib"),
                estimated_host_gib=round(sum(s.host for s in est.stages) / GIB, 3),
            )
        )
        print(
            f"{path.stem:20s} {run['name']:34s} measured {run['measured_peak_gib']:7.3f} GiB  estimated {peak:7.3f}"
            f" GiB ({rows[-1]['peak_error']:+.1%})  step {run['measured_step_s']:.3f} s vs {est.step_time_s:.3f} s"
        )
    return dict(
        measured=path.name,
        measured_gpu=measured["gpu"],
        measured_torch=measured["torch"],
        spec=spec,
        estimate_s=round(seconds, 1),
        rows=rows,
        max_abs_peak_error=max(abs(r["peak_error"]) for r in rows),
    )


def main() -> None:
    warnings.simplefilter("ignore")
    record = dict(
        torch=torch.__version__,
        machine=platform.processor() or platform.machine(),
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src python benchmarks/estimate_vs_measured.py",
        shapes=[compare(RESULTS / f"plan_{shape}_h200.json") for shape in MEASURED],
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "estimate_vs_h200.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
