"""The planner on one GPU: trace + solve time, predicted against measured peak for plans spanning
the memory range, and (W1) the Pareto check: given each anchor point's measured peak as the
budget, the planner's plan against that point's TFLOP/s. Forward+backward, no optimizer, as the
anchor measures.

  PYTHONPATH=src python benchmarks/bench_plan.py --shape w1 [--anchor MODES] [--plans 12]
  PYTHONPATH=src python benchmarks/bench_plan.py --shape 70b
  PYTHONPATH=src python benchmarks/bench_plan.py --shape w1 --offload   (offload measured and chosen too)
  writes $OUT/plan_<shape>[_offload].json and .png

The anchor (benchmarks/anchors/torch_baseline.py) has Llama-3-8B shapes built in, so only W1 has
anchor points; the 70B-dims shape checks prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from bench_w1 import run_anchor
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from remat.bench import BenchSpec
from remat.bench.presets import megatron_presets, parse_entry
from remat.bench.run import run_bench
from remat.config.plan import Plan
from remat.core.problems import RematWarning
from remat.planner import NoPlanFits, megatron_keys, plan_from_trace
from remat.run.step import trace_spec

OUT = Path(os.environ.get("OUT", "."))
GIB = 2**30
SHAPES = {
    "w1": dict(recipe="llama3_8b", overrides={"num_layers": 8, "seq_length": 8192}, micro_batch_size=2),
    "70b": dict(recipe="llama3_70b", overrides={"num_layers": 4, "seq_length": 4096}, micro_batch_size=1),
    "tiny": dict(recipe="llama3_tiny", overrides={"num_layers": 4, "seq_length": 64}, micro_batch_size=2),  # CPU smoke
}
PARETO_MODES = "none,mlp,mlp+core_attn,full,sac_mm,compile:0.5,compile:0.2"


def _row(name: str, plan, prediction, result) -> dict:
    ok = result.status == "ok"
    measured = result.peak_allocated_bytes if ok else None
    if isinstance(plan, Plan):
        written = plan.to_dict()
    else:
        written = megatron_keys(plan) if plan else {}
    return dict(
        name=name,
        plan=written,
        status=result.status,
        predicted_peak_gib=round(prediction.peak_bytes / GIB, 3),
        measured_peak_gib=round(measured / GIB, 3) if ok else None,
        peak_error=round((prediction.peak_bytes - measured) / measured, 4) if ok else None,
        peak_window=prediction.peak_window,
        predicted_step_s=round(prediction.step_time_s, 4),
        measured_step_s=round(result.fwd_bwd_time_s, 4) if ok else None,
        tflops=round(result.tflops_fwd_bwd, 1) if ok else None,
        predicted_host_gib=round(prediction.host_bytes / GIB, 3),
        measured_host_gib=round(result.peak_host_bytes / GIB, 3) if ok and result.peak_host_bytes else None,
    )


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)  # core_attn under SDPA is measured, not advised on
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="w1")
    parser.add_argument("--anchor", default=PARETO_MODES, help="anchor modes for the Pareto check ('' to skip)")
    parser.add_argument("--plans", type=int, default=12, help="plans spanning the memory range")
    parser.add_argument("--offload", action="store_true", help="trace offload too and let the planner choose it")
    args = parser.parse_args()
    tag = args.shape + ("_offload" if args.offload else "")
    shape = SHAPES[args.shape]
    anchor = run_anchor(args.anchor) if args.anchor and args.shape == "w1" else []
    spec = BenchSpec(
        recipe=shape["recipe"],
        overrides=shape["overrides"],
        micro_batch_size=shape["micro_batch_size"],
        max_steps=8,
        warmup_steps=3,
        device="cuda" if torch.cuda.is_available() else "cpu",
        compile=torch.cuda.is_available(),
        optimizer=False,
    )
    start = time.perf_counter()
    model, trace = trace_spec(spec, offload=args.offload, progress=lambda what: print("trace:", what, flush=True))
    trace_s = time.perf_counter() - start
    start = time.perf_counter()
    highest = plan_from_trace(trace, 10**15).prediction.peak_bytes
    solve_s = time.perf_counter() - start
    try:
        plan_from_trace(trace, 1)
    except NoPlanFits as e:
        lowest = e.lowest.peak_bytes
    print(
        json.dumps(
            dict(
                trace_s=round(trace_s, 1), solve_s=round(solve_s, 2), lowest_gib=lowest / GIB, highest_gib=highest / GIB
            )
        ),
        flush=True,
    )

    # plans spanning the range: the planner's at evenly spaced budgets, then Megatron's presets
    candidates: list[tuple[str, object]] = []
    for k in range(args.plans):
        budget = int(lowest + (highest - lowest) * k / (args.plans - 1))
        result = plan_from_trace(trace, budget)
        candidates.append((f"budget {budget / GIB:.2f} GiB", result.config or result.plan))
    facts = {"num_layers": model.config.num_layers, "attention_dropout": 0.0, "hidden_dropout": 0.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidates += [
            parse_entry(e, facts)
            for e in megatron_presets(frozenset({"core_attn", "layernorm", "mlp", "mlp_act"}), model.config.num_layers)
        ]
    if args.offload:
        candidates += _offload_plans(model.config.num_layers)
    measured: dict[str, object] = {}  # plan -> bench result: each plan runs once

    def bench(name: str, plan):
        lowered = (
            plan
            if isinstance(plan, Plan)
            else (Plan.from_config(plan, trace.model_sites) if plan else Plan.none(trace.model_sites.num_layers))
        )
        key = json.dumps(lowered.to_dict(), sort_keys=True)
        if key not in measured:
            measured[key] = run_bench(spec, plan, model=model, name=name)
        return measured[key], key

    seen, rows = set(), []
    for name, plan in candidates:
        result, key = bench(name, plan)
        if key in seen:
            continue
        seen.add(key)
        rows.append(_row(name, plan, trace.predict(plan), result))
        print(json.dumps(rows[-1]), flush=True)

    pareto = []
    for point in anchor:
        if "peak_gib" not in point or point["mode"] in ("core_attn", "compile:1.0"):
            continue
        budget = int(point["peak_gib"] * GIB)
        try:
            chosen = plan_from_trace(trace, budget)
        except NoPlanFits as e:
            pareto.append(dict(anchor=point["mode"], budget_gib=point["peak_gib"], status=str(e)))
            continue
        plan = chosen.config or chosen.plan
        result, _ = bench(f"plan for {point['mode']}", plan)
        row = _row(f"plan for {point['mode']}", plan, chosen.prediction, result)
        row.update(
            anchor=point["mode"],
            budget_gib=point["peak_gib"],
            anchor_tflops=point["tflops"],
            ratio=round(row["tflops"] / point["tflops"], 3) if row["tflops"] else None,
            fits=row["measured_peak_gib"] is not None and row["measured_peak_gib"] <= point["peak_gib"],
        )
        pareto.append(row)
        print(json.dumps(row), flush=True)

    record = dict(
        shape=args.shape,
        spec=dict(
            recipe=spec.recipe, overrides=spec.overrides, micro_batch_size=spec.micro_batch_size, compile=spec.compile
        ),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src python benchmarks/bench_plan.py " + " ".join(sys.argv[1:]),
        trace_s=round(trace_s, 1),
        solve_s=round(solve_s, 2),
        base_step_s=trace.base_step_time_s,
        anchor=anchor,
        plans=rows,
        pareto=pareto,
    )
    (OUT / f"plan_{tag}.json").write_text(json.dumps(record, indent=1))
    _plot(record, OUT / f"plan_{tag}.png")


def _offload_plans(n: int) -> list[tuple[str, Plan]]:
    """Hand-written offload plans beside the planner's: every full-recompute input offloaded
    (issue 5's case), and every layer but the last offloading what mlp recompute and layernorm
    discard leave."""
    inputs = Plan([{"layer": "offload"} for _ in range(n - 1)] + [{}], [(i, i + 1) for i in range(n)])
    selective = Plan(
        [{"layer": "offload", "mlp": "recompute", "layernorm": "discard"} for _ in range(n - 1)]
        + [{"mlp": "recompute", "layernorm": "discard"}]
    )
    return [("full_uniform_1, inputs offloaded", inputs), ("mlp+layernorm, rest offloaded", selective)]


def _plot(record: dict, path: Path) -> None:
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    plans = [r for r in record["plans"] + record["pareto"] if r.get("tflops")]
    ax.scatter(
        [r["measured_peak_gib"] for r in plans],
        [r["tflops"] for r in plans],
        color="tab:blue",
        label="remat plans (measured)",
    )
    anchors = [a for a in record["anchor"] if "peak_gib" in a]
    ax.scatter(
        [a["peak_gib"] for a in anchors], [a["tflops"] for a in anchors], color="grey", marker="D", label="torch anchor"
    )
    for a in anchors:
        ax.annotate(a["mode"], (a["peak_gib"], a["tflops"]), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlabel("peak allocated memory (GiB)")
    ax.set_ylabel("TFLOP/s (forward+backward)")
    ax.set_title(f"{record['shape']} on {record['gpu']}: remat planner vs torch anchor")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=150)


if __name__ == "__main__":
    main()
