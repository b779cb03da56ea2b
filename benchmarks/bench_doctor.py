"""remat doctor on one GPU: (a) a constructed fragmentation OOM, classified as fragmentation, and the
rerun with the setting the doctor suggests succeeding; (b) a capacity OOM on W1 (Llama-3-8B shapes, 8
layers, seq 8192) at too large a micro-batch, classified as capacity, then the planner's plan at a
plan for the doctor's budget (traced without the cap, as on a larger card), benched under the cap:
its measured peak against the prediction.

  PYTHONPATH=src python benchmarks/bench_doctor.py [--limit-gib 80] [--mb 8]
  writes $OUT/doctor.json (OUT defaults to benchmarks/results/)

Each fragmentation variant runs in its own process: the allocator reads PYTORCH_CUDA_ALLOC_CONF once.
--limit-gib caps the process with torch.cuda.set_per_process_memory_fraction (an 80 GiB card's
budget by default), so the W1 OOM is certain on an H200 and both parts stay quick.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from remat import doctor
from remat.bench import BenchSpec
from remat.bench.run import run_bench
from remat.core.problems import RematWarning
from remat.planner import plan_from_trace
from remat.run.step import trace_spec

OUT = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
GIB, MIB = 2**30, 2**20
# The fragmentation pattern: segments of KEEP + HOLE bytes, every HOLE freed, then one request larger
# than any hole but far smaller than their sum.
SEGMENTS, KEEP, HOLE, REQUEST = 16, 192 * MIB, 320 * MIB, 448 * MIB
# The cap leaves less than REQUEST unreserved, so only the holes could serve it.
SPARE = 256 * MIB


def _cap(limit: int) -> None:
    torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(0).total_memory)


def fragmentation_child() -> None:
    """One variant, in this process's allocator setting; prints one JSON line."""
    _cap(SEGMENTS * (KEEP + HOLE) + SPARE)
    whole = [torch.empty(KEEP + HOLE, dtype=torch.uint8, device="cuda") for _ in range(SEGMENTS)]
    del whole  # cached: the next allocations split these segments
    pieces = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(SEGMENTS) for size in (KEEP, HOLE)]
    kept = pieces[::2]
    del pieces  # every HOLE-sized block is free now, inside a segment that stays reserved
    with doctor.watch(on_oom=None, reraise=False) as doc:
        big = torch.empty(REQUEST, dtype=torch.uint8, device="cuda")
        del big
    # reserved after the request, against the cap: the rerun passed within it, not around it
    record = dict(
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        kept=len(kept),
        status="oom" if doc.report else "ok",
        cap=SEGMENTS * (KEEP + HOLE) + SPARE,
        reserved_after=torch.cuda.memory_reserved(),
    )
    if doc.report:
        record.update(
            kind=doc.report.diagnosis.kind,
            evidence=doc.report.diagnosis.evidence(),
            explanation=doc.report.diagnosis.explanation,
            recommendations=[r.setting for r in doc.report.recommendations],
        )
    print(json.dumps(record), flush=True)


def _run_child(env_setting: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if env_setting:
        key, value = env_setting.split("=", 1)
        env[key] = value
    out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def fragmentation() -> dict:
    default = _run_child(None)
    print("default allocator:", json.dumps(default), flush=True)
    suggested = (default.get("recommendations") or [None])[0]
    rerun = _run_child(suggested) if suggested == doctor.EXPANDABLE_SEGMENTS else None
    print("with the suggestion:", json.dumps(rerun), flush=True)
    return dict(
        default=default,
        suggested=suggested,
        rerun=rerun,
        passed=default.get("kind") == "fragmentation"
        and rerun is not None
        and rerun["status"] == "ok"
        and rerun["reserved_after"] <= rerun["cap"],
    )


def _spec(mb: int) -> BenchSpec:
    # W1 as benchmarks/bench_plan.py runs it: forward+backward, compiled regions
    return BenchSpec(
        recipe="llama3_8b",
        overrides={"num_layers": 8, "seq_length": 8192},
        micro_batch_size=mb,
        max_steps=6,
        warmup_steps=2,
        device="cuda",
        compile=True,
        optimizer=False,
    )


def capacity(mb: int, limit: int) -> dict:
    _cap(limit)
    doc = doctor.Doctor(on_oom=None, micro_batch_size=mb)
    failed = run_bench(_spec(mb), None, name=f"none mb{mb}", on_oom=doc.observe)
    record: dict = dict(micro_batch_size=mb, limit_gib=limit / GIB, status=failed.status)
    if doc.report is None:
        return dict(record, passed=False, note="no OOM: lower --limit-gib or raise --mb")
    diagnosis = doc.report.diagnosis
    record.update(
        kind=diagnosis.kind,
        evidence=diagnosis.evidence(),
        explanation=diagnosis.explanation,
        advice=[r.setting for r in doc.report.recommendations],
    )
    print("capacity OOM:", json.dumps(record), flush=True)
    # The planner's trace runs the no-recompute step: trace without the cap (as on a larger card), at
    # this micro-batch if the GPU holds it, else a smaller one; plan for the doctor's budget; bench
    # the plan under the cap.
    for traced in (m for m in (mb, mb // 2, mb // 4, 1) if m >= 1):
        _cap(torch.cuda.get_device_properties(0).total_memory)
        try:
            model, measured = trace_spec(_spec(traced))
        except torch.cuda.OutOfMemoryError:
            print(f"trace at mb {traced}: OOM", flush=True)
            torch.cuda.empty_cache()
            continue
        finally:
            _cap(limit)
        recs = doctor.recommend(
            diagnosis, plan_fn=lambda budget: plan_from_trace(measured, budget), micro_batch_size=traced
        )
        chosen = next((r.plan for r in recs if r.plan is not None), None)
        record.update(traced_micro_batch_size=traced, advice_with_plan=[r.setting for r in recs])
        if chosen is None:
            print(f"mb {traced}: no plan fits", record["advice_with_plan"], flush=True)
            continue
        bench = run_bench(_spec(traced), chosen.config or chosen.plan, model=model, name="doctor plan")
        predicted, peak = chosen.prediction.peak_bytes, bench.peak_allocated_bytes
        record.update(
            plan=(
                chosen.plan.to_dict()
                if chosen.config is None
                else {k: v for k, v in chosen.config.to_megatron().items() if k.startswith("recompute_")}
            ),
            budget_gib=chosen.budget_bytes / GIB,
            predicted_peak_gib=predicted / GIB,
            measured_status=bench.status,
            measured_peak_gib=peak / GIB if peak else None,
            measured_reserved_gib=(bench.peak_reserved_bytes or 0) / GIB,
            peak_error=(predicted - peak) / peak if peak else None,
            tflops=bench.tflops_fwd_bwd,
        )
        return dict(record, passed=diagnosis.kind == "capacity" and bench.status == "ok")
    return dict(record, passed=False, note="no micro-batch traced with a plan that fits")


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--limit-gib", type=float, default=80.0, help="memory cap for the W1 part")
    parser.add_argument("--mb", type=int, default=8, help="the micro-batch that should not fit")
    args = parser.parse_args()
    if args.child:
        return fragmentation_child()
    start = time.perf_counter()
    frag = fragmentation()
    cap = capacity(args.mb, int(args.limit_gib * GIB))
    record = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command=f"PYTHONPATH=src python benchmarks/bench_doctor.py --limit-gib {args.limit_gib:g} --mb {args.mb}",
        seconds=round(time.perf_counter() - start, 1),
        fragmentation=frag,
        capacity=cap,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "doctor.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(dict(fragmentation=frag["passed"], capacity=cap["passed"])), flush=True)
    sys.exit(0 if frag["passed"] and cap["passed"] else 1)


if __name__ == "__main__":
    main()
