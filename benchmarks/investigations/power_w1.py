"""Is a W1 step bound by the GPU's power limit? SM clock, power draw and the driver's clock-event
reasons, sampled by nvidia-smi (read only; no setting is changed) while each workload runs back to
back: W1's largest GEMM alone (linear_fc1's forward) and the whole step of remat (no recompute,
compiled regions) and of the anchor's torch.compile model.

  PYTHONPATH=src python benchmarks/investigations/power_w1.py [--seconds 8]
  writes $OUT/power_w1.json

Where the GEMM loop and the steps run at the power limit with the SM clock under its maximum,
GEMM throughput is set by energy per FLOP, which neither remat nor inductor changes (both call
cuBLAS for every GEMM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: profile_w1 stays there
from profile_w1 import anchor_forward, as_step, remat_forward

OUT = Path(os.environ.get("OUT", "."))
FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "enforced.power.limit", "temperature.gpu")
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # new name, old name
# bits of the reasons mask (nvml's clocksEventReasons)
REASON_BITS = {
    0x1: "gpu_idle",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
}


def _reason_field() -> str:
    for field in REASONS:
        probe = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True
        )
        if probe.returncode == 0 and "Field" not in probe.stdout:
            return field
    raise SystemExit("nvidia-smi knows neither clock-event reason field")


def sampled(work: Callable[[], None], seconds: float, reason_field: str) -> dict:
    """Run work() back to back for `seconds` while nvidia-smi samples every 50 ms; medians of the
    samples after the first second, the reasons seen, and how many times work() ran."""
    query = ",".join(FIELDS + (reason_field,))
    sampler = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        runs = 0
        while time.perf_counter() - start < seconds:
            work()
            runs += 1
            if runs % 4 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        sampler.terminate()
        lines = sampler.communicate(timeout=10)[0].strip().splitlines()
    rows = [[cell.strip() for cell in line.split(",")] for line in lines]
    steady = rows[20:] or rows  # skip the first second (50 ms samples)
    column = {
        name: [float(r[i]) for r in steady if r[i].replace(".", "", 1).isdigit()] for i, name in enumerate(FIELDS)
    }
    reasons: Counter[str] = Counter()
    for r in steady:
        mask = int(r[-1], 16)
        reasons.update(name for bit, name in REASON_BITS.items() if mask & bit)
    return dict(
        seconds_per_run=round(elapsed / runs, 5),
        runs=runs,
        samples=len(steady),
        **{f"median_{k.replace('.', '_')}": statistics.median(v) if v else None for k, v in column.items()},
        reasons={k: round(v / len(steady), 2) for k, v in reasons.most_common()},
    )


# W1's forward projections, (out features, in features) for 16384 tokens
GEMMS = {"linear_fc1": (28672, 4096), "linear_qkv": (6144, 4096)}


def forward_gemm(name: str, seconds: float, reason_field: str) -> dict:
    """One projection's forward GEMM at W1's shapes, back to back."""
    x = torch.randn(16384, GEMMS[name][1], device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*GEMMS[name], device="cuda", dtype=torch.bfloat16)
    result = sampled(lambda: torch.nn.functional.linear(x, w), seconds, reason_field)
    return dict(result, tflops=round(2 * x.shape[0] * w.shape[0] * w.shape[1] / result["seconds_per_run"] / 1e12, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    field = _reason_field()
    record: dict = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        command="PYTHONPATH=src python benchmarks/investigations/power_w1.py",
        runs={},
    )
    for name in GEMMS:
        record["runs"][f"{name}_forward_gemm"] = forward_gemm(name, args.seconds, field)
        print(name, json.dumps(record["runs"][f"{name}_forward_gemm"]), flush=True)
    for name, forward in (("remat_none_compiled", remat_forward), ("anchor_compile_1.0", anchor_forward)):
        step = as_step(forward())
        for _ in range(3):
            step()
        record["runs"][name] = sampled(step, args.seconds, field)
        print(name, json.dumps(record["runs"][name]), flush=True)
        del step
        torch.cuda.empty_cache()
    (OUT / "power_w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
