"""torch.compile (inductor) over a model under a remat plan, on CUDA, against the same model compiled
without a plan and the plan uncompiled: remat's llama3_8b shapes cut to 2 layers (hidden 4096,
seq 2048, micro-batch 1, bf16, dropout 0), compiled whole and layer by layer, for
mlp, core_attn, layernorm (discard) and full recompute. Records the loss, the largest gradient
difference (absolute, and relative to the largest gradient) and the peak memory of each.

  PYTHONPATH=src python benchmarks/compile_after_apply.py     writes $OUT/compile_after_apply.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import remat

OUT = Path(os.environ.get("OUT", "."))
PLANS = {
    "none": None,
    "mlp": remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]),
    "core_attn": remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "layernorm": remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "full_uniform_1": remat.RecomputeConfig(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
}


def step(dtype: torch.dtype, plan_name: str, how: str) -> dict:
    """Loss, gradients and peak of one compiled step (fresh model, same weights and batch)."""
    torch.manual_seed(0)
    model = remat.models.build(
        "llama3_8b",
        num_layers=2,
        seq_length=2048,
        dtype=dtype,
        device="cuda",
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    ids = torch.randint(
        0, model.config.vocab_size, (1, 2049), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    remat.apply(model, PLANS[plan_name])
    if how == "whole":
        run = torch.compile(model)
    elif how == "layers":
        for layer in model.decoder.layers:
            layer.compile()
        run = model
    else:
        run = model
    torch.cuda.reset_peak_memory_stats()
    loss = run(ids[:, :-1], labels=ids[:, 1:].contiguous())
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return {"loss": loss.item(), "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "grads": grads}


def difference(a: dict, b: dict) -> dict:
    worst = max((x - b["grads"][n]).abs().max().item() for n, x in a["grads"].items())
    scale = max(x.abs().max().item() for x in b["grads"].values())
    equal = all(torch.equal(x, b["grads"][n]) for n, x in a["grads"].items())
    return {"bit_identical": equal, "max_abs": worst, "max_rel": worst / scale, "loss_diff": a["loss"] - b["loss"]}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in (torch.bfloat16,):
        for how in ("whole", "layers"):
            baseline = step(dtype, "none", how)  # compiled, no plan
            for plan in PLANS:
                compiled = step(dtype, plan, how)
                eager = step(dtype, plan, "eager")
                rows.append(
                    {
                        "dtype": str(dtype),
                        "compiled": how,
                        "plan": plan,
                        "peak_gib": round(compiled["peak_gib"], 3),
                        "vs_compiled_without_plan": difference(compiled, baseline),
                        "vs_same_plan_uncompiled": difference(compiled, eager),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                torch._dynamo.reset()
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    (OUT / "compile_after_apply.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
