"""Activation offload on W1 (DESIGN 6), one GPU, forward+backward as the anchor measures it:

(a) full recompute uniform 1, with and without every layer's kept input offloaded;
(b) pinned D2H / H2D bandwidth (1 GiB copies, CUDA events; both directions at once on two
    streams) and the share of the transfer time the step hides: 1 - (step with offload - step
    without) / (offloaded bytes / D2H + the same / H2D);
(c) the lowest-memory plans (full recompute + offload, selective + layer or per-site offload):
    the lowest W1 peak at >= 450 TFLOP/s.

PYTHONPATH=src python benchmarks/bench_offload.py [--eager] [--min_tflops 450] [--anchor none,full]
writes $OUT/offload_w1.json ($OUT defaults to benchmarks/results/)
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
from bench_w1 import run_anchor  # benchmarks/ is the script's directory

from remat.bench import BenchSpec, sweep
from remat.bench.presets import parse_entry
from remat.bench.result import BenchResult
from remat.config.plan import Plan, PlanLike
from remat.config.recompute import RecomputeConfig

OUT = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
LAYERS = 8
FACTS = {"num_layers": LAYERS, "attention_dropout": 0.0, "hidden_dropout": 0.0}
GIB = 2**30


def full_offload_all(k: int) -> Plan:
    """Full recompute in groups of k, every group's input offloaded (the last one too)."""
    ranges = [(s, min(s + k, LAYERS)) for s in range(0, LAYERS, k)]
    layers = [{"layer": "offload"} if i % k == 0 else {} for i in range(LAYERS)]
    return Plan(layers, ranges)


def megatron(name: str, **keys) -> tuple[str, RecomputeConfig]:
    return name, RecomputeConfig.from_megatron({**FACTS, **keys})


def candidates() -> list[tuple[str, PlanLike]]:
    """Plans for (a) and (c): lowest memory first."""
    full = dict(recompute_granularity="full", recompute_method="uniform")
    return [
        parse_entry("full_uniform_1", FACTS),
        ("full_uniform_1+offload_all", full_offload_all(1)),
        ("full_uniform_2+offload_all", full_offload_all(2)),
        megatron(
            "full_uniform_1+offload_7", **full, recompute_num_layers=1, cpu_offloading=True, cpu_offloading_num_layers=7
        ),
        megatron(
            "full_block_4+offload_7",
            recompute_granularity="full",
            recompute_method="block",
            recompute_num_layers=4,
            cpu_offloading=True,
            cpu_offloading_num_layers=7,
        ),
        *[
            megatron(
                f"{'+'.join(mods)}+offload_{n}",
                recompute_granularity="selective",
                recompute_modules=mods,
                cpu_offloading=True,
                cpu_offloading_num_layers=n,
            )
            for mods in (["mlp", "layernorm"], ["mlp"])
            for n in (7, 4)
        ],
        megatron(
            "mlp+layernorm+offload_core_attn",
            recompute_granularity="selective",
            recompute_modules=["mlp", "layernorm"],
            fine_grained_activation_offloading=True,
            offload_modules=["core_attn"],
        ),
        megatron("none+offload_7", cpu_offloading=True, cpu_offloading_num_layers=7),
    ]


def bandwidth(nbytes: int = GIB, repeats: int = 5) -> dict[str, float]:
    """GB/s of pinned host <-> device copies, each direction alone and both at once."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def timed(copies: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for dst, src, stream in copies:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                for _ in range(repeats):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    d2h = timed([(host[0], dev[0], streams[0])])
    h2d = timed([(dev[1], host[1], streams[1])])
    both = timed([(host[0], dev[0], streams[0]), (dev[1], host[1], streams[1])])
    gb = nbytes * repeats / 1e9
    return dict(d2h_gb_s=round(gb / d2h, 1), h2d_gb_s=round(gb / h2d, 1), both_gb_s=round(2 * gb / both, 1))


def row(r: BenchResult) -> dict:
    ok = r.status == "ok"
    return dict(
        name=r.name,
        status=r.status,
        step_s=round(r.fwd_bwd_time_s, 4) if ok else None,
        tflops=round(r.tflops_fwd_bwd, 1) if ok else None,
        peak_gib=round(r.peak_allocated_bytes / GIB, 2) if ok else None,
        reserved_gib=round(r.peak_reserved_bytes / GIB, 2) if ok else None,
        host_gib=round(r.peak_host_bytes / GIB, 2) if ok and r.peak_host_bytes is not None else None,
        plan=r.config,
    )


def hidden_share(with_offload: dict, without: dict, bw: dict) -> float | None:
    """Share of the copy time the step hides (one micro-batch: host peak = bytes offloaded a step)."""
    if not (with_offload["step_s"] and without["step_s"] and with_offload["host_gib"]):
        return None
    transfer_s = with_offload["host_gib"] * GIB / 1e9 * (1 / bw["d2h_gb_s"] + 1 / bw["h2d_gb_s"])
    return round(1 - (with_offload["step_s"] - without["step_s"]) / transfer_s, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--eager", action="store_true", help="no compiled regions")
    parser.add_argument("--min_tflops", type=float, default=450.0)
    parser.add_argument(
        "--anchor",
        default="none,full",
        metavar="MODES",
        help="modes of ../shared/anchors/torch_baseline.py run in the same call ('' for none)",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    anchor = run_anchor(args.anchor) if args.anchor else []
    bw = bandwidth()
    print(json.dumps(bw), flush=True)
    spec = BenchSpec(
        recipe="llama3_8b",
        overrides={"num_layers": LAYERS, "seq_length": 8192},
        micro_batch_size=2,
        max_steps=11,
        warmup_steps=3,
        device="cuda",
        compile=not args.eager,
        optimizer=False,
    )
    rows = [row(r) for r in sweep(spec, candidates())]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "plan"}), flush=True)
    by_name = {r["name"]: r for r in rows}
    base = by_name["full_uniform_1"]
    hidden = {r["name"]: hidden_share(r, base, bw) for r in rows if r["name"].startswith("full_uniform_1+")}
    fast = [r for r in rows if r["tflops"] and r["tflops"] >= args.min_tflops]
    best = min(fast, key=lambda r: r["peak_gib"]) if fast else None
    record = dict(
        workload="W1",
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        compiled=not args.eager,
        command="PYTHONPATH=src python benchmarks/bench_offload.py",
        anchor=anchor,
        bandwidth=bw,
        hidden_share_vs_full_uniform_1=hidden,
        runs=rows,
        lowest_peak_at_min_tflops=dict(min_tflops=args.min_tflops, best=best),
    )
    print(json.dumps(dict(hidden=hidden, best=best and {k: best[k] for k in ("name", "tflops", "peak_gib")})))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "offload_w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
