"""Bit-identical gradients on CUDA for every Hugging Face family and label: the CPU test matrix of
tests/integration/test_hf_runs.py (float64, dropout on, every label alone, all together, full uniform and block),
with the models on the GPU; and core_attn under flex attention (no backward on CPU), in float32.

  PYTHONPATH=src:tests:tests/integration python benchmarks/hf_grads.py      writes $OUT/hf_grads.json
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch
import transformers
from helpers.hf import batch, build, selective
from test_hf_runs import CASES, _case_id

import remat
from remat.core.problems import RematWarning
from remat.run.verify import run_step, verify

OUT = Path(os.environ.get("OUT", "."))


def check(model: torch.nn.Module, config: remat.RecomputeConfig) -> dict:
    model.config.use_cache = False
    ids, labels = (t.cuda() for t in batch(model))
    plain = run_step(model, ids, labels, seed=5)
    remat.adapt(model)
    report = verify(model, config, ids, labels, seed=5)
    same = torch.equal(plain.loss, report.candidate.loss) and all(
        torch.equal(plain.grads[n], g) for n, g in report.candidate.grads.items()
    )
    return dict(
        bit_identical=bool(report.bit_identical and same), freed_bytes=report.freed_bytes, max_diff=report.max_grad_diff
    )


def main() -> None:
    warnings.simplefilter("ignore", RematWarning)
    torch.use_deterministic_algorithms(True, warn_only=True)
    rows = []
    for family, config in CASES:
        rows.append(dict(case=_case_id((family, config)), **check(build(family).cuda(), config)))
        print(json.dumps(rows[-1]), flush=True)
    flex = build("llama", attention="flex_attention", dropout=0.0).float().cuda()
    rows.append(dict(case="llama-flex_attention-core_attn-fp32", **check(flex, selective("core_attn"))))
    print(json.dumps(rows[-1]), flush=True)
    summary = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="PYTHONPATH=src:tests:tests/integration python benchmarks/hf_grads.py",
        identical=sum(r["bit_identical"] for r in rows),
        cases=len(rows),
        rows=rows,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "hf_grads.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
