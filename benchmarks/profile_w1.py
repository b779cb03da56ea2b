"""Where a W1 step's GPU time goes: remat (no recompute, compiled regions) beside the anchor's
torch.compile run of its own model, kernel time by kind (GEMM, attention, compiled Triton, other)
and the top kernels, from torch.profiler over two forward+backward steps after warm-up.

  PYTHONPATH=src python benchmarks/profile_w1.py [--skip-anchor] [--trace] [--harness]
  writes $OUT/profile_w1.json; --trace also one step of each as a gzipped Chrome trace (CPU ops
  with shapes, kernels) in $OUT/trace_*.json.gz; --harness also times remat's step through
  `remat bench`'s harness (bench_w1's spec) beside the plain loop.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from remat.bench import BenchSpec
from remat.bench.run import MockData, build_model, run_bench

OUT = Path(os.environ.get("OUT", "."))
ANCHOR = Path(__file__).parent / "anchors" / "torch_baseline.py"
KINDS = (("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
         ("triton", ("triton", "silu_mul", "rms_norm", "cross_entropy", "rotary_qkv")))  # remat's own Triton kernels too


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
    return dict(plain_step_s=plain_step_s, step_s=round(wall, 4), kernel_s=round(busy, 4), idle_s=round(wall - busy, 4),
                by_kind={k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                top=[dict(s=round(s, 5), calls=c, name=n) for s, c, n in kernels[:30]])


W1_SPEC = dict(recipe="llama3_8b", overrides={"num_layers": 8, "seq_length": 8192}, micro_batch_size=2,
               device="cuda", compile=True, optimizer=False)


def harness_step_s() -> float:
    """fwd+bwd step time of remat's no-recompute run through the bench harness (bench_w1's spec)."""
    result = run_bench(BenchSpec(**W1_SPEC, max_steps=11, warmup_steps=3))
    if result.fwd_bwd_time_s is None:
        raise SystemExit(f"the harness run ended {result.status}")
    return round(result.fwd_bwd_time_s, 4)


def remat_step():
    spec = BenchSpec(**W1_SPEC)
    model = build_model(spec)
    model.init_weights()
    ids, labels = MockData(spec, model.config.vocab_size, model.config.seq_length).batch()

    def step() -> None:
        model(ids, labels).backward()
    return step


def anchor_step():
    spec = importlib.util.spec_from_file_location("torch_baseline", ANCHOR)
    anchor = importlib.util.module_from_spec(spec)
    sys.modules["torch_baseline"] = anchor
    spec.loader.exec_module(anchor)
    model = anchor.Model().to("cuda", torch.bfloat16)
    compiled = torch.compile(model)
    ids = torch.randint(0, anchor.V, (anchor.B, anchor.S), device="cuda")
    tgt = torch.randint(0, anchor.V, (anchor.B, anchor.S), device="cuda")

    def step() -> None:
        compiled(ids, tgt).backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-anchor", action="store_true")
    parser.add_argument("--trace", action="store_true", help="export one step of each as a Chrome trace")
    parser.add_argument("--harness", action="store_true", help="also time remat's step through the harness")
    args = parser.parse_args()
    record = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command="PYTHONPATH=src python benchmarks/profile_w1.py", runs={})
    if args.harness:
        record["remat_harness_step_s"] = harness_step_s()
        print(json.dumps(dict(remat_harness_step_s=record["remat_harness_step_s"])), flush=True)
        torch.cuda.empty_cache()
    record["runs"]["remat_none_compiled"] = _profile(
        remat_step(), trace=OUT / "trace_remat.json.gz" if args.trace else None)
    print(json.dumps(record["runs"]["remat_none_compiled"], indent=1), flush=True)
    torch.cuda.empty_cache()
    if not args.skip_anchor:
        record["runs"]["anchor_compile_1.0"] = _profile(
            anchor_step(), warm=2, trace=OUT / "trace_anchor.json.gz" if args.trace else None)
        print(json.dumps(record["runs"]["anchor_compile_1.0"], indent=1), flush=True)
    (OUT / "profile_w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
