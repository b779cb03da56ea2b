"""Where a W1 step's GPU time goes: remat (no recompute, compiled regions) beside the anchor's
torch.compile run of its own model, kernel time by kind (GEMM, attention, compiled Triton, other)
and the top kernels, from torch.profiler over two forward+backward steps after warm-up.

  PYTHONPATH=src python benchmarks/profile_w1.py [--skip-anchor]   writes $OUT/profile_w1.json
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
from remat.bench.run import MockData, build_model

OUT = Path(os.environ.get("OUT", "."))
ANCHOR = Path(__file__).parent / "anchors" / "torch_baseline.py"
KINDS = (("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
         ("triton", ("triton",)))


def _kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def _profile(step, warm: int = 3, steps: int = 2) -> dict:
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
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
    return dict(step_s=round(wall, 4), kernel_s=round(busy, 4), idle_s=round(wall - busy, 4),
                by_kind={k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                top=[dict(s=round(s, 5), calls=c, name=n) for s, c, n in kernels[:30]])


def remat_step():
    spec = BenchSpec(recipe="llama3_8b", overrides={"num_layers": 8, "seq_length": 8192}, micro_batch_size=2,
                     device="cuda", compile=True, optimizer=False)
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
    args = parser.parse_args()
    record = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command="PYTHONPATH=src python benchmarks/profile_w1.py", runs={})
    record["runs"]["remat_none_compiled"] = _profile(remat_step())
    print(json.dumps(record["runs"]["remat_none_compiled"], indent=1), flush=True)
    torch.cuda.empty_cache()
    if not args.skip_anchor:
        record["runs"]["anchor_compile_1.0"] = _profile(anchor_step(), warm=2)
        print(json.dumps(record["runs"]["anchor_compile_1.0"], indent=1), flush=True)
    (OUT / "profile_w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
