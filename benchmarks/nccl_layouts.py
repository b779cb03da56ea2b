"""Every layout remat runs, on 2, 4 and 8 GPUs (NCCL), beside one process: are the losses the
same, and does `remat estimate` predict each rank's peak?

Launched once on a machine with 8 GPUs (runs needing more GPUs than there are are skipped):

    OUT=/tmp/out PYTHONPATH=src python benchmarks/nccl_layouts.py

Each layout is one `remat bench ... -ng N --json` (bench starts torchrun with N processes itself,
NCCL on CUDA), the same recipe, global batch and seed as the one-process run it is held against;
`remat estimate` with the same flags predicts its per-rank (per pipeline stage) peak. Initial
weights and data do not depend on the layout (remat.parallel.seeding, remat.run.step.MockData),
so the losses should match one process's to reduction-order rounding (bf16 by default: about
1e-3 relative; pass --compute_dtype fp32 for about 1e-6). One JSON summary is written to
$OUT/nccl_layouts.json (default ./nccl_layouts.json), each run with its losses, their largest
relative difference from one process's, its measured peak and the estimate's.

CPU smoke (gloo, 2 processes, the tiny recipes; a few minutes on 2 cores):

    OUT=/tmp/out PYTHONPATH=src python benchmarks/nccl_layouts.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Models whose one-process run fits one 80 GB GPU with AdamW, split over up to 8 (heads, query
# groups, FFN and experts divide by 8; 8 layers split over 8 stages or 4 x 2 virtual ones).
GPU_MODELS = {
    "dense": ["-mr", "llama3_8b", "--num_layers", "8", "--hidden_size", "2048", "-sl", "4096"],
    "moe": ["-mr", "qwen3_30b_a3b", "--num_layers", "4", "--num_moe_experts", "16", "-sl", "2048"],
}
SMOKE_MODELS = {"dense": ["-mr", "llama3_tiny"], "moe": ["-mr", "moe_tiny"]}
DEVICE = ["cuda"]  # the runs' device (bench's --device, estimate's --target), set by main


@dataclass(frozen=True)
class Layout:
    name: str
    model: str  # a key of the models
    flags: tuple[str, ...]


def layouts(n: int) -> list[Layout]:
    """Every layout remat runs on `n` GPUs: each parallelism alone, and the usual pairs."""
    half = str(n // 2)
    found = [
        Layout(f"dp{n}", "dense", ()),
        Layout(f"tp{n}", "dense", ("-tp", str(n))),
        Layout(f"tp{n}_sp", "dense", ("-tp", str(n), "--sequence_parallel")),
        Layout(f"pp{n}", "dense", ("-pp", str(n))),
        Layout(f"pp{n}_vp2", "dense", ("-pp", str(n), "-vp", "2"))
        if n < 8
        else Layout("pp4_vp2_dp2", "dense", ("-pp", "4", "-vp", "2")),
        Layout(f"cp{n}", "dense", ("-cp", str(n))),
        Layout(f"ep{n}", "moe", ("-ep", str(n))),
    ]
    if n >= 4:
        found += [
            Layout(f"tp2_dp{half}", "dense", ("-tp", "2")),
            Layout(f"tp2_pp{half}", "dense", ("-tp", "2", "-pp", half)),
            Layout(f"pp2_dp{half}", "dense", ("-pp", "2")),
            Layout(f"cp2_tp{half}", "dense", ("-cp", "2", "-tp", half)),
            Layout(f"ep{half}_pp2", "moe", ("-ep", half, "-pp", "2")),
        ]
    return found


def _run(argv: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """`python -m remat ARGV`, its output to `log`: its exit status and seconds."""
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            status = subprocess.run(
                [sys.executable, "-m", "remat", *argv], stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            status = 124
    return status, time.perf_counter() - start


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def bench(common: list[str], flags: list[str], folder: Path, name: str, timeout: float) -> dict[str, Any]:
    """One `remat bench` run: its result (losses, peak, times), or why there is none."""
    out = folder / f"{name}.bench.json"
    argv = ["bench", *common, *flags, "--device", DEVICE[0], "--no_history", "--warmup_steps", "1", "--json", str(out)]
    status, seconds = _run(argv, folder / f"{name}.bench.log", timeout)
    result = _read(out)
    if status or result is None:
        tail = (folder / f"{name}.bench.log").read_text()[-2000:]
        return {"status": f"failed ({status})", "seconds": seconds, "log_tail": tail}
    keep = (
        "status",
        "losses",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "step_time_s",
        "tflops_per_gpu",
        "memory",
    )
    return {"seconds": seconds, **{key: result.get(key) for key in keep}}


def estimate(common: list[str], flags: list[str], folder: Path, name: str, timeout: float) -> dict[str, Any]:
    """`remat estimate`'s peak of each pipeline stage (a rank's) for the same run."""
    out = folder / f"{name}.estimate.json"
    argv = ["estimate", *common, *flags, "--target", DEVICE[0], "--json", str(out)]
    status, _ = _run(argv, folder / f"{name}.estimate.log", timeout)
    result = _read(out)
    if status or not result:
        return {"status": f"failed ({status})"}
    stages = result[0]["stages"]
    return {"stage_peaks": [stage["peak"] for stage in stages], "peak": max(stage["peak"] for stage in stages)}


def compared(run: dict[str, Any], one: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """The run beside one process's losses and the estimate's peak."""
    losses, base = run.get("losses") or [], one.get("losses") or []
    diffs = [abs(a - b) / abs(b) for a, b in zip(losses, base) if b]
    measured, peak = run.get("peak_allocated_bytes"), predicted.get("peak")
    return {
        **run,
        "one_process_losses": base,
        "max_rel_loss_diff": max(diffs) if diffs else None,
        "estimate": predicted,
        "estimate_over_measured": peak / measured if peak and measured else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 processes, the tiny recipes")
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--compute_dtype", default="bf16")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    args = parser.parse_args()
    gpus, models, device, batch = _setting(args)
    DEVICE[0] = device
    # what bench and estimate both take; each adds its own (bench its steps, estimate its target)
    common = ["-gb", batch, "-mb", "1", "-c", args.compute_dtype, "--recompute_modules", "mlp", "--no_progress"]
    steps = [*common, "-ms", str(args.steps)]
    out = Path(os.environ.get("OUT", ".")) / "nccl_layouts.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"device": device, "command": " ".join(sys.argv), "one_process": {}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="nccl-layouts-") as tmp:
        folder = Path(tmp)
        for key, model in models.items():
            summary["one_process"][key] = bench(steps, model, folder, f"one_{key}", args.timeout)
        for n in gpus:
            for layout in layouts(n):
                flags = [*models[layout.model], *layout.flags, "-ng", str(n)]
                name = f"{n}gpu_{layout.name}"
                run = bench(steps, flags, folder, name, args.timeout)
                predicted = estimate(common, flags, folder, name, args.timeout)
                entry = {"gpus": n, "layout": layout.name, "flags": flags}
                summary["runs"].append({**entry, **compared(run, summary["one_process"][layout.model], predicted)})
                out.write_text(json.dumps(summary, indent=2) + "\n")  # what ran so far, if a later run hangs
                print(f"{name}: {_line(summary['runs'][-1])}", flush=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}")


def _setting(args: argparse.Namespace) -> tuple[list[int], dict[str, list[str]], str, str]:
    """The GPU counts to run (those this machine has), the models, the device and global batch."""
    if args.smoke:
        return [2], SMOKE_MODELS, "cpu", "2"
    import torch

    have = torch.cuda.device_count()
    return [n for n in args.gpus if n <= have], GPU_MODELS, "cuda", "16"


def _line(run: dict[str, Any]) -> str:
    diff, ratio = run.get("max_rel_loss_diff"), run.get("estimate_over_measured")
    if diff is None:
        return str(run.get("status"))
    return f"max loss diff {diff:.2e} relative; estimate / measured peak {ratio}"


if __name__ == "__main__":
    main()
