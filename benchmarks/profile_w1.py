"""Where a W1 step's GPU time goes: remat (no recompute, compiled regions) beside the anchor's
torch.compile run of its own model, kernel time by kind (GEMM, attention, compiled Triton, other)
and the top kernels, from torch.profiler over two forward+backward steps after warm-up.

  PYTHONPATH=src python benchmarks/profile_w1.py [--skip-anchor] [--trace] [--harness] [--gaps] [--nofuse]
  writes $OUT/profile_w1.json; --trace also one step of each as a gzipped Chrome trace (CPU ops
  with shapes, kernels) in $OUT/trace_*.json.gz; --harness also times remat's step through
  `remat bench`'s harness (bench_w1's spec) beside the plain loop; --gaps also finds where the GPU
  waits for the CPU in a step timed as the harnesses time it (synchronized before it starts):
  the CPU time to issue the forward and the backward beside their GPU time, and the largest
  idle gaps with the CPU ops that launched the kernel after each.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from remat.bench import BenchSpec
from remat.bench.run import run_bench
from remat.run.step import MockData, build_model

OUT = Path(os.environ.get("OUT", "."))
ANCHOR = Path(__file__).parent / "anchors" / "torch_baseline.py"
KINDS = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("triton", ("triton", "silu_mul", "rms_norm", "cross_entropy", "rotary_qkv")),
)  # remat's own Triton kernels too


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def median_cuda_seconds(fn, reps: int = 8, warmup: int = 0) -> float:
    """Median CUDA-event time of fn() over reps calls after warmup ones, as the anchor and the
    harness time a step (synchronized after each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[reps // 2]


def _export_trace(step, path: Path) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def _profile(step, warm: int = 3, steps: int = 2, trace: Path | None = None) -> dict:
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    plain_step_s = round(median_cuda_seconds(step), 4)
    if trace is not None:
        _export_trace(step, trace)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end) / 1e3 / steps
    by_kind: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        seconds = event.device_time_total / 1e6 / steps
        if seconds <= 0:
            continue
        by_kind[_kind(event.key)] += seconds
        kernels.append((seconds, event.count // steps, event.key[:120]))
    kernels.sort(reverse=True)
    busy = sum(by_kind.values())
    return dict(
        plain_step_s=plain_step_s,
        step_s=round(wall, 4),
        kernel_s=round(busy, 4),
        idle_s=round(wall - busy, 4),
        by_kind={k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        top=[dict(s=round(s, 5), calls=c, name=n) for s, c, n in kernels[:30]],
    )


def _phases(forward, reps: int = 5) -> dict:
    """Median CPU seconds to issue a synchronized step's forward and backward, beside their GPU
    seconds: where issuing is slower than running, the GPU waits."""
    rows = []
    for _ in range(reps):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        marks[0].record()
        loss = forward()
        t1 = time.perf_counter()
        marks[1].record()
        loss.backward()
        t2 = time.perf_counter()
        marks[2].record()
        torch.cuda.synchronize()
        rows.append((t1 - t0, t2 - t1, marks[0].elapsed_time(marks[1]) / 1e3, marks[1].elapsed_time(marks[2]) / 1e3))
    columns = [sorted(column)[reps // 2] for column in zip(*rows)]
    return dict(
        zip(("cpu_forward_s", "cpu_backward_s", "gpu_forward_s", "gpu_backward_s"), (round(c, 4) for c in columns))
    )


GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def _gaps(step, path: Path, top: int = 15, min_us: float = 20.0) -> dict:
    """GPU idle in one step started after a synchronize, from a CPU+CUDA Chrome trace: the total,
    and the largest gaps with their offset in the step, the kernels around them and the CPU ops
    (outermost first) that were running when the kernel after the gap was launched."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in GPU_EVENTS), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    ops = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation") and "dur" in e]
    start = min(e["ts"] for e in ops)

    def cpu_stack(ts: float, tid) -> list[str]:
        holding = [e for e in ops if e["tid"] == tid and e["ts"] <= ts <= e["ts"] + e["dur"]]
        return [e["name"][:80] for e in sorted(holding, key=lambda e: -e["dur"])]

    gaps = []
    for before, after in zip(kernels, kernels[1:]):
        idle = after["ts"] - (before["ts"] + before["dur"])
        if idle >= min_us:
            gaps.append((idle, before, after))
    first = kernels[0]
    launch = launches.get(first["args"].get("correlation"))
    rows = [
        dict(
            idle_us=round(idle, 1),
            at_ms=round((after["ts"] - start) / 1e3, 2),
            before=before["name"][:80],
            after=after["name"][:80],
            cpu=cpu_stack(launches[after["args"]["correlation"]]["ts"], launches[after["args"]["correlation"]]["tid"])
            if after["args"].get("correlation") in launches
            else [],
        )
        for idle, before, after in sorted(gaps, key=lambda g: -g[0])[:top]
    ]
    return dict(
        step_ms=round((kernels[-1]["ts"] + kernels[-1]["dur"] - start) / 1e3, 2),
        first_kernel_at_ms=round((first["ts"] - start) / 1e3, 2),
        first_kernel_cpu=cpu_stack(launch["ts"], launch["tid"]) if launch else [],
        idle_ms=round(sum(g[0] for g in gaps) / 1e3, 2),
        gaps_over_min=len(gaps),
        top=rows,
    )


W1_SPEC = dict(
    recipe="llama3_8b",
    overrides={"num_layers": 8, "seq_length": 8192},
    micro_batch_size=2,
    device="cuda",
    compile=True,
    optimizer=False,
)


def harness_step_s() -> float:
    """fwd+bwd step time of remat's no-recompute run through the bench harness (bench_w1's spec)."""
    result = run_bench(BenchSpec(**W1_SPEC, max_steps=11, warmup_steps=3))
    if result.fwd_bwd_time_s is None:
        raise SystemExit(f"the harness run ended {result.status}")
    return round(result.fwd_bwd_time_s, 4)


def remat_forward(**overrides: int | bool):
    """remat's W1 forward (no recompute, compiled regions); `overrides` change the recipe's config."""
    spec = BenchSpec(**{**W1_SPEC, "overrides": {**W1_SPEC["overrides"], **overrides}})
    model = build_model(spec)
    model.init_weights()
    ids, labels = MockData(spec).batch()
    return lambda: model(ids, labels)


def anchor_forward(compiled: bool = True):
    spec = importlib.util.spec_from_file_location("torch_baseline", ANCHOR)
    anchor = importlib.util.module_from_spec(spec)
    sys.modules["torch_baseline"] = anchor
    spec.loader.exec_module(anchor)
    model = anchor.Model().to("cuda", torch.bfloat16)
    run = torch.compile(model) if compiled else model
    ids = torch.randint(0, anchor.V, (anchor.B, anchor.S), device="cuda")
    tgt = torch.randint(0, anchor.V, (anchor.B, anchor.S), device="cuda")
    return lambda: run(ids, tgt)


def as_step(forward):
    return lambda: forward().backward()


def _run(forward, name: str, args: argparse.Namespace, warm: int) -> dict:
    result = _profile(as_step(forward), warm=warm, trace=OUT / f"trace_{name}.json.gz" if args.trace else None)
    if args.gaps:
        result["phases"] = _phases(forward)
        result["gaps"] = _gaps(as_step(forward), OUT / f"gaps_{name}.json")
    print(json.dumps(result, indent=1), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-anchor", action="store_true")
    parser.add_argument("--trace", action="store_true", help="export one step of each as a Chrome trace")
    parser.add_argument("--harness", action="store_true", help="also time remat's step through the harness")
    parser.add_argument("--gaps", action="store_true", help="also find where the GPU waits for the CPU")
    parser.add_argument(
        "--nofuse", action="store_true", help="also profile remat with gradient_accumulation_fusion off"
    )
    args = parser.parse_args()
    record = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        command="PYTHONPATH=src python benchmarks/profile_w1.py",
        runs={},
    )
    if args.harness:
        record["remat_harness_step_s"] = harness_step_s()
        print(json.dumps(dict(remat_harness_step_s=record["remat_harness_step_s"])), flush=True)
        torch.cuda.empty_cache()
    record["runs"]["remat_none_compiled"] = _run(remat_forward(), "remat", args, warm=3)
    torch.cuda.empty_cache()
    if args.nofuse:
        record["runs"]["remat_none_compiled_nofuse"] = _run(
            remat_forward(gradient_accumulation_fusion=False), "remat_nofuse", args, warm=3
        )
        torch.cuda.empty_cache()
    if not args.skip_anchor:
        record["runs"]["anchor_compile_1.0"] = _run(anchor_forward(), "anchor", args, warm=2)
    (OUT / "profile_w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
