"""Offload on CUDA: loss and gradients bit-identical to no offload (float64, deterministic kernels,
dropout on) on the tiny recipe and a mid-size one, device bytes freed, and no pinned host buffer
allocated after the first step.

  PYTHONPATH=src python benchmarks/gpu_offload_check.py      writes $OUT/gpu_offload_check.json
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch

from remat import RecomputeConfig, RematWarning
from remat.config.plan import Plan
from remat.models import build
from remat.run.verify import verify
from remat.sites import apply
from remat.sites.apply import offloader_of

OUT = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
LAYERS = 4
MODELS = {  # name -> (overrides, min_offloaded_tensor_size)
    "tiny": (dict(num_layers=LAYERS), 0),
    "mid": (
        dict(
            num_layers=LAYERS,
            hidden_size=1024,
            ffn_hidden_size=3584,
            num_attention_heads=8,
            num_query_groups=4,
            seq_length=1024,
        ),
        1024 * 1024,
    ),
}


def plans(min_size: int) -> dict[str, RecomputeConfig | Plan]:
    keys = dict(min_offloaded_tensor_size=min_size)
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return {
        "offload_3": RecomputeConfig(cpu_offloading=True, cpu_offloading_num_layers=3, **keys),
        "per_site": RecomputeConfig(
            fine_grained_activation_offloading=True, offload_modules=["attn_norm", "core_attn", "mlp_norm"], **keys
        ),
        "full_uniform_1+offload_3": RecomputeConfig(cpu_offloading=True, cpu_offloading_num_layers=3, **full, **keys),
        "mlp+layernorm+offload_3": RecomputeConfig(
            recompute_granularity="selective",
            recompute_modules=["mlp", "layernorm"],
            cpu_offloading=True,
            cpu_offloading_num_layers=3,
            **keys,
        ),
        "all_layers": Plan([{"layer": "offload"}] * LAYERS, min_offloaded_tensor_size=min_size),
    }


def steady_allocations(model: torch.nn.Module, plan, ids: torch.Tensor) -> tuple[int, int]:
    """Pinned buffers allocated after step 1 and after step 4 (must be equal)."""
    apply(model, plan)
    offloader = offloader_of(model)
    counts = []
    for _ in range(4):
        model(ids[:, :-1], ids[:, 1:]).backward()
        counts.append(offloader.stats().allocations)
    assert offloader.pool.pinned
    return counts[0], counts[-1]


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rows = []
    for model_name, (overrides, min_size) in MODELS.items():
        torch.manual_seed(0)
        model = build(
            "llama3_tiny",
            dtype=torch.float64,
            device="cuda",
            attention_backend="eager",
            attention_dropout=0.1,
            hidden_dropout=0.1,
            **overrides,
        )
        ids = torch.randint(0, model.config.vocab_size, (2, model.config.seq_length + 1), device="cuda")
        for plan_name, plan in plans(min_size).items():
            report = verify(model, plan, ids[:, :-1], ids[:, 1:])
            stats = offloader_of(model).stats()
            first, later = steady_allocations(model, plan, ids)
            row = dict(
                model=model_name,
                plan=plan_name,
                bit_identical=report.bit_identical,
                max_grad_diff=report.max_grad_diff,
                freed_bytes=report.freed_bytes,
                offloaded_bytes=stats.offloaded_bytes,
                pinned_after_step_1=first,
                pinned_after_step_4=later,
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    failed = [
        r
        for r in rows
        if not (
            r["bit_identical"]
            and r["offloaded_bytes"] > 0
            and r["freed_bytes"] > 0
            and r["pinned_after_step_1"] == r["pinned_after_step_4"]
        )
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_offload_check.json").write_text(
        json.dumps(
            dict(
                gpu=torch.cuda.get_device_name(),
                torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"),
                command="PYTHONPATH=src python benchmarks/gpu_offload_check.py",
                rows=rows,
                failed=len(failed),
            ),
            indent=1,
        )
    )
    assert not failed, f"{len(failed)} of {len(rows)} checks failed: {failed}"


if __name__ == "__main__":
    main()
