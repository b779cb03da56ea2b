"""What adding a weight gradient into .grad inside the GEMM (beta = 1, remat.models.grad_accumulation) costs
against computing it and adding it with a second kernel, at W1's shapes (16384 tokens): one
weight-gradient GEMM per projection of a layer, and the loss head's scaled add. CUDA events,
median of 20 after 3 warm-ups.

  PYTHONPATH=src python benchmarks/investigations/wgrad_fusion.py   writes $OUT/wgrad_fusion.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: profile_w1 stays there
from profile_w1 import median_cuda_seconds

OUT = Path(os.environ.get("OUT", "."))
TOKENS = 16384
# (out, in) of Llama-3-8B's projections and the loss head
SHAPES = {
    "linear_qkv": (6144, 4096),
    "linear_proj": (4096, 4096),
    "linear_fc1": (28672, 4096),
    "linear_fc2": (4096, 14336),
    "output_layer": (128256, 4096),
}


def median_ms(fn: Callable[[], object]) -> float:
    return round(median_cuda_seconds(fn, reps=20, warmup=3) * 1e3, 4)


def measure(name: str, n_out: int, n_in: int) -> dict[str, float]:
    grad_out = torch.randn(TOKENS, n_out, device="cuda", dtype=torch.bfloat16)
    inputs = torch.randn(TOKENS, n_in, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(n_out, n_in, device="cuda", dtype=torch.bfloat16)
    row = dict(
        gemm_ms=median_ms(lambda: grad_out.t().mm(inputs)),
        gemm_then_add_ms=median_ms(lambda: acc.add_(grad_out.t().mm(inputs))),
        gemm_beta1_ms=median_ms(lambda: acc.addmm_(grad_out.t(), inputs)),
    )
    if name == "output_layer":  # the loss head's gradient exists already: scale and add it
        computed, scale = torch.randn_like(acc), torch.tensor(0.5, device="cuda")
        row.update(
            scale_then_add_ms=median_ms(lambda: acc.add_(computed * scale)),
            addcmul_ms=median_ms(lambda: acc.addcmul_(computed, scale)),
        )
    return row


def main() -> None:
    rows = {}
    for name, (n_out, n_in) in SHAPES.items():
        rows[name] = measure(name, n_out, n_in)
        print(name, json.dumps(rows[name]), flush=True)
        torch.cuda.empty_cache()
    record = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src python benchmarks/investigations/wgrad_fusion.py",
        tokens=TOKENS,
        rows=rows,
    )
    (OUT / "wgrad_fusion.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
