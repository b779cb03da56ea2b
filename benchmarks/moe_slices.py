"""remat's own MoE models (issue 26) at DeepSeek-V3- and Qwen3-30B-A3B-shaped slices, beside
transformers' implementation of the same family at the same shapes (grouped_mm experts, SDPA), run
without and with HF gradient checkpointing in the same process. Forward + backward + fused AdamW,
bf16. For remat: no recompute, every label alone, Megatron Bridge's presets, full recompute, and
the planner's plan at the best preset's measured peak, each with its predicted peak. Then the
experts' grouped GEMMs against one dense GEMM of the same FLOPs, and grouped against the
per-expert loop (the fallback) for agreement.

  PYTHONPATH=src:benchmarks python benchmarks/moe_slices.py [--only deepseek_v3|qwen3_moe] [--presets-only]
  writes $OUT/moe_slices.json

TFLOP/s counts active parameters (remat's moe family FLOPs) for every row, HF's included.
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
import transformers
from hf_llama import GIB, measure, timing_fields
from hf_moe import SLICES as HF_SLICES

import remat
from remat.config.megatron import TrainingFacts
from remat.config.recompute import RecomputeConfig
from remat.core.problems import RematWarning
from remat.models import family_of
from remat.models.moe.moe_layer import grouped_mm_loop, grouped_mm_torch
from remat.planner import NoPlanFits, plan_from_trace

OUT = Path(os.environ.get("OUT", "."))
# slice -> (remat recipe, overrides, Bridge's presets for the family)
SLICES = {
    "deepseek_v3": (
        "deepseek_v3",
        dict(num_layers=4, num_moe_experts=16, moe_layer_freq="[0]*1+[1]*3"),
        ["mla_up_proj", "mla_up_proj,mlp", "layernorm,moe_act", "moe"],
    ),
    "qwen3_moe": ("qwen3_30b_a3b", dict(num_layers=4), ["moe_act", "moe"]),
}
LABELS = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")


def selective(labels: str, facts: TrainingFacts) -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="selective", recompute_modules=labels.split(","), facts=facts)


def hf_anchor(name: str, seq: int, mb: int, flops: float) -> list[dict]:
    fields = HF_SLICES[name][0]
    hf = transformers.AutoConfig.for_model(
        name, max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa", **fields
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, hf.vocab_size, (mb, seq), device="cuda")
    rows = [dict(mode="hf", experts=model.config._experts_implementation, **timing_fields(measure(model, ids), flops))]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows.append(dict(mode="hf_gradient_checkpointing", **timing_fields(measure(model, ids), flops)))
    del model
    torch.cuda.empty_cache()
    return rows


def run_slice(name: str, single_labels: bool = True) -> list[dict]:
    recipe, overrides, presets = SLICES[name]
    seq, mb = HF_SLICES[name][1], HF_SLICES[name][2]
    family = family_of(recipe)
    config = family.config(recipe, seq_length=seq, **overrides)
    flops = family.flops(config, seq, mb)
    rows = [dict(model=name, **row) for row in hf_anchor(name, seq, mb, flops)]
    print(*map(json.dumps, rows), sep="\n", flush=True)

    torch.manual_seed(0)
    model = family.build(config, dtype=torch.bfloat16, device="cuda").train()
    family.use_kernels(model, "cuda", compiled=True)
    ids = torch.randint(0, config.vocab_size, (mb, seq), device="cuda")
    facts = TrainingFacts(
        **{k: v for k, v in config.megatron_facts().items() if k in TrainingFacts.__dataclass_fields__}
    )
    labels = [label for label in LABELS if label in set().union(*remat.find_sites(model).model_sites.labels)]

    def record(mode: str, result: dict, **extra: object) -> dict:
        row = dict(model=name, mode=mode, **extra, **timing_fields(result, flops))
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    trace = remat.trace(model, (ids, ids), optimizer=optimizer)
    del optimizer
    torch.cuda.empty_cache()

    def run(mode: str, plan: object) -> dict:
        remat.apply(model, plan)  # type: ignore[arg-type]  # noqa: F821 (run before the model is deleted)
        result = measure(model, ids)  # noqa: F821 (run before the model is deleted)
        predicted = trace.predict(plan).peak_bytes  # type: ignore[arg-type]
        extra = dict(predicted_peak_gib=round(predicted / GIB, 3))
        if "peak_bytes" in result:
            extra["peak_error"] = round(predicted / result["peak_bytes"] - 1, 4)
        return record(mode, result, **extra)

    run("remat_none", None)
    for label in labels if single_labels else []:
        run(f"remat_{label}", selective(label, facts))
    preset_rows = [run(f"preset_{preset}", selective(preset, facts)) for preset in presets]
    run(
        "remat_full_uniform_1",
        RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, facts=facts),
    )
    # the plan at every preset's measured peak; the target is the one at the fastest preset's
    for preset in sorted((row for row in preset_rows if "tflops" in row), key=lambda row: -row["tflops"]):
        try:
            chosen = plan_from_trace(trace, int(preset["peak_gib"] * GIB))
        except NoPlanFits as err:
            rows.append(dict(model=name, mode="remat_plan", preset=preset["mode"], status=str(err)))
            continue
        row = run(f"remat_plan_at_{preset['mode']}_peak", chosen.plan)
        row.update(
            budget_gib=preset["peak_gib"],
            preset=preset["mode"],
            plan=[list(r) for r in chosen.explain()],
            **({"ratio_to_preset": round(row["tflops"] / preset["tflops"], 3)} if "tflops" in row else {}),
        )
    remat.apply(model, None)
    del model
    torch.cuda.empty_cache()
    return rows


def gemm_rows(experts: int, tokens: int, hidden: int, ffn: int) -> list[dict]:
    """FC1 of `experts` experts over `tokens` routed rows (balanced), grouped GEMM against a dense
    GEMM of the same FLOPs, forward; and grouped against the per-expert loop."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, 2 * ffn, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    dense = torch.randn(2 * ffn, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (tokens // experts)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 20 / 1e3

    flops = 2 * tokens * hidden * 2 * ffn
    grouped = timed(lambda: grouped_mm_torch(x, w.transpose(1, 2), offsets))
    plain = timed(lambda: x @ dense.T)
    diff = (
        (
            grouped_mm_torch(x, w.transpose(1, 2), offsets).float()
            - grouped_mm_loop(x, w.transpose(1, 2), offsets).float()
        )
        .abs()
        .max()
        .item()
    )
    return [
        dict(
            mode="expert_fc1_gemm",
            experts=experts,
            tokens=tokens,
            hidden=hidden,
            ffn=ffn,
            grouped_tflops=round(flops / grouped / 1e12, 1),
            dense_tflops=round(flops / plain / 1e12, 1),
            ratio=round(plain / grouped, 3),
            grouped_vs_loop_max_abs_diff=diff,
        )
    ]


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=sorted(SLICES))
    parser.add_argument("--no-gemm", action="store_true")
    parser.add_argument("--presets-only", action="store_true", help="skip the single labels")
    args = parser.parse_args()
    rows = [] if args.no_gemm else gemm_rows(16, 2 * 4096 * 8, 7168, 2048) + gemm_rows(128, 4 * 4096 * 8, 2048, 768)
    print(*map(json.dumps, rows), sep="\n", flush=True)
    for name in [args.only] if args.only else SLICES:
        rows += run_slice(name, single_labels=not args.presets_only)
    result = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src:benchmarks python benchmarks/moe_slices.py " + " ".join(sys.argv[1:]),
        slices={k: dict(recipe=v[0], **v[1]) for k, v in SLICES.items()},
        rows=rows,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "moe_slices.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
