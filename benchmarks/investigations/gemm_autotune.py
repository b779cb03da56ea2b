"""Do inductor's max-autotune GEMMs (Triton templates against cuBLAS, chosen by measurement) beat
cuBLAS on W1's GEMM shapes? A faster GEMM is the only room left for remat's no-recompute step to
pull ahead of torch.compile (benchmarks/results/profile_w1_h200.json: GEMMs are ~78% of the step).

Each shape runs as eager `a @ b` (cuBLAS) and as `torch.compile(mode="max-autotune-no-cudagraphs")`
of the same expression, interleaved, CUDA-event timed; writes $OUT/gemm_autotune.json.

    PYTHONPATH=src python benchmarks/investigations/gemm_autotune.py [--shapes fc1_fwd,...] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

TOKENS, HIDDEN, FFN, QKV, VOCAB_CHUNK = 16384, 4096, 14336, 6144, (4096, 128256)
# name: (rows of a, inner, columns of b, b transposed as a weight [out, in] is)
SHAPES = {
    "qkv_fwd": (TOKENS, HIDDEN, QKV, True),
    "proj_fwd": (TOKENS, HIDDEN, HIDDEN, True),
    "fc1_fwd": (TOKENS, HIDDEN, 2 * FFN, True),
    "fc1_dgrad": (TOKENS, 2 * FFN, HIDDEN, False),
    "fc1_wgrad": (2 * FFN, TOKENS, HIDDEN, False),
    "fc2_fwd": (TOKENS, FFN, HIDDEN, True),
    "fc2_wgrad": (HIDDEN, TOKENS, FFN, False),
    "head_fwd": (VOCAB_CHUNK[0], HIDDEN, VOCAB_CHUNK[1], True),
}


def _operands(m: int, k: int, n: int, weight_layout: bool) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        if weight_layout
        else torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    )
    return a, b


def _time(fn, a, b, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn(a, b)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "."))
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "PYTHONPATH=src python benchmarks/investigations/gemm_autotune.py",
        "shapes": {},
    }

    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    for name in args.shapes.split(","):
        m, k, n, weight_layout = SHAPES[name]
        a, b = _operands(m, k, n, weight_layout)
        torch._dynamo.reset()
        tuned = torch.compile(matmul, mode="max-autotune-no-cudagraphs", dynamic=False)
        t0 = time.perf_counter()
        tuned(a, b)
        torch.cuda.synchronize()
        tune_s = time.perf_counter() - t0
        for fn in (matmul, tuned):  # warm
            _time(fn, a, b, 3)
        rounds = [(_time(matmul, a, b, args.repeats), _time(tuned, a, b, args.repeats)) for _ in range(3)]
        cublas, autotuned = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        flops = 2 * m * k * n
        row = {
            "mnk": [m, n, k],
            "cublas_ms": round(cublas * 1e3, 4),
            "autotuned_ms": round(autotuned * 1e3, 4),
            "cublas_tflops": round(flops / cublas / 1e12, 1),
            "autotuned_tflops": round(flops / autotuned / 1e12, 1),
            "speedup": round(cublas / autotuned, 3),
            "tune_s": round(tune_s, 1),
        }
        record["shapes"][name] = row
        print(json.dumps({name: row}), flush=True)
        (out / "gemm_autotune.json").write_text(json.dumps(record, indent=1))
        del a, b


if __name__ == "__main__":
    main()
