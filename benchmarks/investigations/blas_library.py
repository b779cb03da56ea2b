"""Does cuBLASLt (torch.backends.cuda.preferred_blas_library) run W1's GEMMs faster than cuBLAS,
torch's default for a plain bf16 matmul? Both call NVIDIA's kernels, picked by different
heuristics; inductor's max-autotune found no faster Triton GEMM (gemm_autotune_h200.json).

Part 1: each W1 GEMM shape (benchmarks/investigations/gemm_autotune.py's) as `a @ b` under each library,
interleaved rounds, CUDA-event timed back to back. Part 2: remat's W1 no-recompute step with
compiled regions (forward+backward, as bench_w1.py) under each library, alternating A, B, A, B.
Writes $OUT/blas_library.json.

    PYTHONPATH=src python benchmarks/investigations/blas_library.py [--repeats 30] [--step-runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import warnings
from pathlib import Path

import torch
from gemm_autotune import SHAPES, _operands, _time

from remat.bench import BenchSpec, run_bench

LIBRARIES = ("cublas", "cublaslt")


def _gemms(repeats: int) -> dict:
    rows = {}
    for name, (m, k, n, weight_layout) in SHAPES.items():
        a, b = _operands(m, k, n, weight_layout)
        outputs = {}
        times: dict[str, list[float]] = {lib: [] for lib in LIBRARIES}
        for _ in range(3):
            for lib in LIBRARIES:
                torch.backends.cuda.preferred_blas_library(lib)
                outputs[lib] = a @ b  # warm, and kept to compare the two
                times[lib].append(_time(lambda x, y: x @ y, a, b, repeats))
        ms = {lib: statistics.median(t) * 1e3 for lib, t in times.items()}
        diff = (outputs["cublas"].float() - outputs["cublaslt"].float()).abs().max().item()
        rows[name] = {
            "mnk": [m, n, k],
            **{f"{lib}_ms": round(v, 4) for lib, v in ms.items()},
            **{f"{lib}_tflops": round(2 * m * k * n / v / 1e9, 1) for lib, v in ms.items()},
            "lt_speedup": round(ms["cublas"] / ms["cublaslt"], 3),
            "max_abs_diff": diff,
        }
        print(json.dumps({name: rows[name]}), flush=True)
        del a, b, outputs
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def _steps(runs: int) -> list[dict]:
    spec = BenchSpec(
        recipe="llama3_8b",
        overrides={"num_layers": 8, "seq_length": 8192},
        micro_batch_size=2,
        max_steps=11,
        warmup_steps=3,
        device="cuda",
        compile=True,
        optimizer=False,
    )
    rows = []
    for i in range(runs):
        for lib in LIBRARIES:
            torch.backends.cuda.preferred_blas_library(lib)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = run_bench(spec, None, name=f"none-{lib}")
            rows.append(
                {
                    "run": i,
                    "library": lib,
                    "tflops": round(r.tflops_fwd_bwd, 1),
                    "step_s": round(r.fwd_bwd_time_s, 4),
                    "peak_gib": round(r.peak_allocated_bytes / 2**30, 2),
                    "loss": r.losses[-1],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--step-runs", type=int, default=2, help="A/B pairs of W1 steps (0: GEMMs only)")
    args = parser.parse_args()
    record = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": f"PYTHONPATH=src python benchmarks/investigations/blas_library.py --repeats {args.repeats} "
        f"--step-runs {args.step_runs}",
        "gemms": _gemms(args.repeats),
    }
    out = Path(os.environ.get("OUT", "."))
    (out / "blas_library.json").write_text(json.dumps(record, indent=1))
    record["w1_steps"] = _steps(args.step_runs)
    (out / "blas_library.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
