"""remat on transformers' own LlamaForCausalLM at Llama-3-8B shapes, beside HF's own runs in the
same process: forward + backward + fused AdamW step, bf16, SDPA.

  PYTHONPATH=src python benchmarks/hf_llama.py [--layers 8 --seq 8192 --mb 2]
  writes $OUT/hf_llama.json (--name); --attention flex_attention runs the same under flex attention

Modes: HF without checkpointing, HF with `gradient_checkpointing_enable()`, then remat on the
same model: `adapt(model, loss_head=True)` (chunked loss head), `compile_sites` (norms and MLPs
compiled between the Sites), a trace, and the planner's plan at each HF run's measured peak as
the budget (and no recompute), and at tighter budgets (--budgets). TFLOP/s counts the model FLOPs of remat's Llama (6 x parameters x
tokens + attention), the same for every mode; recompute is not counted.
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

import remat
from remat.core.problems import RematWarning
from remat.planner import NoPlanFits, PlanResult, plan_from_trace
from remat.sites.calls import forward_loss
from remat.sites.placement import compile_sites

OUT = Path(os.environ.get("OUT", "."))
GIB = 2**30


def llama_config(layers: int, seq: int, attention: str = "sdpa") -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=seq,
        attn_implementation=attention,
        use_cache=False,
    )


def model_flops(c: transformers.LlamaConfig, batch: int, seq: int) -> float:
    h, f, d = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    layer = 2 * h * h + 2 * h * c.num_key_value_heads * d + 3 * h * f
    dense = 6 * (c.num_hidden_layers * layer + h * c.vocab_size) * batch * seq
    return float(dense + 6 * c.num_hidden_layers * 2 * batch * seq**2 * h)


def timing_fields(result: dict, flops: float) -> dict:
    """A measured step as a row's fields (step time, TFLOP/s, peak), or its failure as it is."""
    if "step_s" not in result:
        return dict(result)
    return dict(
        step_s=round(result["step_s"], 4),
        tflops=round(flops / result["step_s"] / 1e12, 1),
        peak_gib=round(result["peak_bytes"] / GIB, 3),
    )


def measure(model: torch.nn.Module, ids: torch.Tensor, warmup: int = 3, steps: int = 6) -> dict:
    """Median step time and the peak allocated over steady steps (weights, gradients, AdamW state)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step() -> None:
        forward_loss(model, ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return dict(step_s=sorted(times)[len(times) // 2], peak_bytes=torch.cuda.max_memory_allocated())
    except torch.OutOfMemoryError:
        return dict(status="oom")
    finally:
        optimizer.state.clear()  # the moments, freed with the gradients
        for p in model.parameters():
            p.grad = None
        torch.cuda.empty_cache()


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mb", type=int, default=2)
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[30.0, 26.0, 22.0],
        help="more budgets (GiB) whose plans are run, predicted peak against measured",
    )
    parser.add_argument("--attention", default="sdpa", help="transformers' attn_implementation (sdpa, flex_attention)")
    parser.add_argument("--name", default="hf_llama", help="writes $OUT/NAME.json")
    args = parser.parse_args()
    config = llama_config(args.layers, args.seq, args.attention)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (args.mb, args.seq), device="cuda")
    flops = model_flops(config, args.mb, args.seq)
    rows: list[dict] = []

    def record(name: str, result: dict, **extra: object) -> dict:
        row = dict(mode=name, **extra, **timing_fields(result, flops))
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    def plan_row(name: str, chosen: PlanResult, result: dict, **extra: object) -> None:
        predicted = chosen.prediction.peak_bytes
        if "peak_bytes" in result:
            extra["peak_error"] = round(predicted / result["peak_bytes"] - 1, 4)
        record(
            name,
            result,
            predicted_peak_gib=round(predicted / GIB, 3),
            plan=[list(r) for r in chosen.explain()],
            megatron=chosen.megatron_keys(),
            **extra,
        )

    hf = record("hf", measure(model, ids))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_gc = record("hf_gradient_checkpointing", measure(model, ids))
    model.gradient_checkpointing_disable()

    remat.adapt(model, loss_head=True)
    compiled = compile_sites(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    start = time.perf_counter()
    trace = remat.trace(model, (ids, ids), optimizer=optimizer, progress=lambda m: print("trace:", m, flush=True))
    trace_s = time.perf_counter() - start
    del optimizer
    torch.cuda.empty_cache()
    none = measure(model, ids)
    record(
        "remat_none",
        none,
        predicted_peak_gib=round(trace.predict(None).peak_bytes / GIB, 3),
        **(
            {"peak_error": round(trace.predict(None).peak_bytes / none["peak_bytes"] - 1, 4)}
            if "peak_bytes" in none
            else {}
        ),
    )
    for anchor in (hf_gc, hf):
        if "peak_gib" not in anchor:
            continue
        budget = int(anchor["peak_gib"] * GIB)
        try:
            chosen = plan_from_trace(trace, budget)
        except NoPlanFits as err:
            rows.append(dict(mode=f"remat_plan_at_{anchor['mode']}", status=str(err)))
            continue
        remat.apply(model, chosen.plan)
        result = measure(model, ids)
        extra = dict(ratio=round(flops / result["step_s"] / 1e12 / anchor["tflops"], 3)) if "step_s" in result else {}
        plan_row(f"remat_plan_at_{anchor['mode']}_peak", chosen, result, budget_gib=anchor["peak_gib"], **extra)
        remat.apply(model, None)
    for gib in args.budgets:  # tighter budgets: plans that recompute, predicted against measured
        try:
            chosen = plan_from_trace(trace, int(gib * GIB))
        except NoPlanFits as err:
            rows.append(dict(mode=f"remat_plan_at_{gib}_gib", status=str(err)))
            continue
        remat.apply(model, chosen.plan)
        plan_row(f"remat_plan_at_{gib}_gib", chosen, measure(model, ids), budget_gib=gib)
        remat.apply(model, None)

    result = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src python benchmarks/hf_llama.py " + " ".join(sys.argv[1:]),
        shape=vars(args),
        compiled_sites=compiled,
        trace_s=round(trace_s, 1),
        rows=rows,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
