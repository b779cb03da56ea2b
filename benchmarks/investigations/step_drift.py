"""How much a W1 step's measured time moves within one process, and what synchronizing after each
step costs: blocks of synchronized steps (median of 8 each, as the harnesses time them) before and
after one torch.profiler session, and the mean of 8 steps run back to back without a synchronize,
for remat's no-recompute step (optionally at other loss-head chunk sizes) and the anchor's eager
and compiled ones. Tells run-to-run noise from a real difference before the two are compared.

  PYTHONPATH=src python benchmarks/investigations/step_drift.py [--what remat,remat:8192,remat:nofuse,anchor_eager,anchor_compile]
      [--blocks 4]
  (remat:N: loss_chunk_size N; remat:nofuse: gradient_accumulation_fusion off) writes $OUT/step_drift.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: profile_w1 stays there
from profile_w1 import anchor_forward, as_step, median_cuda_seconds, remat_forward
from torch.profiler import ProfilerActivity, profile

OUT = Path(os.environ.get("OUT", "."))


def build(name: str):
    variant = name.partition(":")[2]
    if name == "remat:nofuse":
        return remat_forward(gradient_accumulation_fusion=False)
    if name.partition(":")[0] == "remat" and (not variant or variant.isdigit()):
        return remat_forward(**({"loss_chunk_size": int(variant)} if variant else {}))
    if name in ("anchor_eager", "anchor_compile"):
        return anchor_forward(compiled=name == "anchor_compile")
    raise SystemExit(f"unknown step {name!r}: remat[:chunk], remat:nofuse, anchor_eager or anchor_compile")


def blocks(step, n: int) -> list[float]:
    return [round(median_cuda_seconds(step), 4) for _ in range(n)]


def back_to_back(step, steps: int = 8) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / 1e3 / steps, 4)


def drift(name: str, n: int) -> dict:
    step = as_step(build(name))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    before = blocks(step, n)
    unsynced = back_to_back(step)
    with profile(activities=[ProfilerActivity.CUDA]):
        step()
        torch.cuda.synchronize()
    after = blocks(step, n)
    row = dict(
        before_profiler_s=before,
        back_to_back_s=unsynced,
        after_profiler_s=after,
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        wall_s=round(time.perf_counter() - start, 1),
    )
    print(name, json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--what", default="remat,anchor_eager,anchor_compile")
    parser.add_argument("--blocks", type=int, default=4)
    args = parser.parse_args()
    record = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src python benchmarks/investigations/step_drift.py "
        + f"--what {args.what} --blocks {args.blocks}",
        runs={},
    )
    for name in args.what.split(","):
        torch.cuda.reset_peak_memory_stats()
        record["runs"][name] = drift(name, args.blocks)
        torch.cuda.empty_cache()
    (OUT / "step_drift.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
