"""W1 (DESIGN 6: Llama-3-8B shapes, 8 layers, seq 8192, micro-batch 2, bf16, one GPU) measured as
the anchor measures it: forward+backward, no optimizer, gradients accumulating. Runs the anchor
(benchmarks/anchors/torch_baseline.py, a verbatim copy of shared/anchors) first in a subprocess,
then remat's Megatron presets, eager and with compiled regions, in this process.

  PYTHONPATH=src python benchmarks/bench_w1.py [--anchor MODES] [--remat eager,compiled]
  writes $OUT/w1.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from remat.bench import BenchSpec, sweep
from remat.bench.presets import megatron_presets, parse_entry

OUT = Path(os.environ.get("OUT", "."))
ANCHOR = Path(__file__).parent / "anchors" / "torch_baseline.py"
ANCHOR_MODES = "none,core_attn,mlp,mlp+core_attn,sac_mm,full,compile:1.0,compile:0.5,compile:0.2"
# anchor mode -> remat preset of the same recompute
SAME_PRESET = {
    "none": "none",
    "core_attn": "core_attn",
    "mlp": "mlp",
    "mlp+core_attn": "mlp+core_attn",
    "full": "full_uniform_1",
}


def run_anchor(modes: str) -> list[dict]:
    env = {**os.environ, "L": "8", "S": "8192", "B": "2"}
    proc = subprocess.run([sys.executable, str(ANCHOR), modes], env=env, capture_output=True, text=True)
    print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"mode"')]


def run_remat(compile_regions: bool) -> list[dict]:
    spec = BenchSpec(
        recipe="llama3_8b",
        overrides={"num_layers": 8, "seq_length": 8192},
        micro_batch_size=2,
        max_steps=11,
        warmup_steps=3,
        device="cuda",
        compile=compile_regions,
        optimizer=False,
    )
    facts = {"num_layers": 8, "attention_dropout": 0.0, "hidden_dropout": 0.0}
    entries = megatron_presets(frozenset({"core_attn", "layernorm", "mlp"}), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [parse_entry(e, facts) for e in entries]
    results = sweep(spec, plans)
    rows = []
    for r in results:
        row = dict(
            mode=r.name,
            compiled=compile_regions,
            status=r.status,
            tflops=round(r.tflops_fwd_bwd, 1) if r.tflops_fwd_bwd else None,
            step_s=round(r.fwd_bwd_time_s, 4) if r.fwd_bwd_time_s else None,
            peak_gib=round(r.peak_allocated_bytes / 2**30, 2) if r.peak_allocated_bytes else None,
            reserved_gib=round(r.peak_reserved_bytes / 2**30, 2) if r.peak_reserved_bytes else None,
            harness_overhead=r.harness_overhead,
            loss=r.losses[-1] if r.losses else None,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--anchor", default=ANCHOR_MODES, help="anchor modes ('' to skip)")
    parser.add_argument("--remat", default="eager,compiled", help="eager and/or compiled")
    parser.add_argument(
        "--remat-first",
        action="store_true",
        help="run remat before the anchor (the anchor runs first by default), to see "
        "whether the order (the GPU's warmth) moves the ratios",
    )
    args = parser.parse_args()
    anchor = run_anchor(args.anchor) if args.anchor and not args.remat_first else []
    remat_rows: list[dict] = []
    for variant in args.remat.split(","):
        try:
            remat_rows += run_remat(variant == "compiled")
        except Exception as e:  # keep the other variant's and the anchor's numbers
            print(f"{variant} failed: {e!r}"[:2000], flush=True)
            remat_rows.append(dict(mode="*", compiled=variant == "compiled", status=f"error: {e!r}"[:500]))
    if args.anchor and args.remat_first:
        anchor = run_anchor(args.anchor)
    by_mode = {a["mode"]: a for a in anchor}
    comparisons = []
    for mode, preset in SAME_PRESET.items():
        if mode not in by_mode:
            continue
        for row in (r for r in remat_rows if r["mode"] == preset and r.get("tflops")):
            comparisons.append(
                dict(
                    preset=preset,
                    compiled=row["compiled"],
                    remat_tflops=row["tflops"],
                    anchor_eager_tflops=by_mode[mode]["tflops"],
                    ratio=round(row["tflops"] / by_mode[mode]["tflops"], 3),
                    remat_peak_gib=row["peak_gib"],
                    anchor_peak_gib=by_mode[mode]["peak_gib"],
                )
            )
    if "compile:1.0" in by_mode:
        for row in (r for r in remat_rows if r["mode"] == "none" and r.get("tflops")):
            comparisons.append(
                dict(
                    preset="none vs compile:1.0",
                    compiled=row["compiled"],
                    remat_tflops=row["tflops"],
                    anchor_tflops=by_mode["compile:1.0"]["tflops"],
                    ratio=round(row["tflops"] / by_mode["compile:1.0"]["tflops"], 3),
                    remat_peak_gib=row["peak_gib"],
                    anchor_peak_gib=by_mode["compile:1.0"]["peak_gib"],
                )
            )
    for c in comparisons:
        print(json.dumps(c))
    record = dict(
        workload="W1",
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        command="PYTHONPATH=src python benchmarks/bench_w1.py",
        remat_first=args.remat_first,
        anchor=anchor,
        remat=remat_rows,
        comparisons=comparisons,
    )
    (OUT / "w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
