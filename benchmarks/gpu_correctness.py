"""Engine correctness on CUDA: every recompute config against no recompute on the tiny recipe.

float64 (deterministic kernels): loss and every gradient must be bit-identical, dropout on, so the
CUDA generator's replay is exercised. bf16 with SDPA: the largest gradient difference is reported,
eager and with compiled regions (whose SwiGLU runs remat's Triton kernels on CUDA).

  python benchmarks/gpu_correctness.py      writes $OUT/gpu_correctness.json
"""

from __future__ import annotations

import itertools
import json
import os
import warnings

import torch

from remat import RecomputeConfig, RematWarning
from remat.models import build
from remat.run.verify import verify

LAYERS = 4


def configs() -> list[RecomputeConfig]:
    labels = ["core_attn", "layernorm", "mlp", "mlp_act"]
    subsets = [c for r in range(1, len(labels) + 1) for c in itertools.combinations(labels, r)]
    return [RecomputeConfig(recompute_granularity="selective", recompute_modules=list(s)) for s in subsets] + [
        RecomputeConfig(recompute_granularity="full", recompute_method=m, recompute_num_layers=k)
        for m in ("uniform", "block")
        for k in (1, 2, LAYERS)
    ]


def name(c: RecomputeConfig) -> str:
    return (
        "+".join(c.recompute_modules)
        if c.recompute_granularity == "selective"
        else f"full_{c.recompute_method}_{c.recompute_num_layers}"
    )


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)
    rows = []
    for dtype, backend, compiled in (
        (torch.float64, "eager", False),
        (torch.float64, "sdpa", False),
        (torch.bfloat16, "sdpa", False),
        (torch.bfloat16, "sdpa", True),
    ):
        torch.use_deterministic_algorithms(dtype == torch.float64)
        torch.manual_seed(0)
        model = build(
            "llama3_tiny",
            dtype=dtype,
            device="cuda",
            num_layers=LAYERS,
            seq_length=128,
            attention_backend=backend,
            attention_dropout=0.1,
            hidden_dropout=0.1,
        )
        if compiled:
            model.compile_regions()
        ids = torch.randint(0, model.config.vocab_size, (2, 129), device="cuda")
        for c in configs():
            r = verify(model, c, ids[:, :-1], ids[:, 1:], seed=1)
            rows.append(
                dict(
                    dtype=str(dtype),
                    backend=backend,
                    compiled=compiled,
                    config=name(c),
                    bit_identical=r.bit_identical,
                    max_grad_diff=r.max_grad_diff,
                    freed_bytes=r.freed_bytes,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    exact = [r for r in rows if r["dtype"] == "torch.float64"]
    print(f"float64: {sum(r['bit_identical'] for r in exact)}/{len(exact)} bit-identical")
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_correctness.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
