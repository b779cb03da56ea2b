"""Candidate kernels for W1's small-kernel time, each timed against what remat runs now, on W1's
shapes (tokens 16384, hidden 4096, FFN 14336, vocab 128256, bf16):

- SwiGLU on the fused gate/up tensor: forward and backward, compiled by inductor, compiled with
  inductor's cat lowered as a concat kernel, and remat's Triton kernels (one pass that reads each
  input once and writes both halves of the gradient);
- scaling the loss head's weight gradient by grad_output (a 0-dim CUDA tensor);
- the linear layers' GEMMs: forward, input gradient, weight gradient in both operand orders, and
  the weight gradient accumulated into an existing gradient (beta=1).

  PYTHONPATH=src python benchmarks/kernels_w1.py     writes $OUT/kernels_w1.json
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from profile_w1 import median_cuda_seconds

from remat.models.llama import silu_mul
from remat.models.swiglu import SiluMul

OUT = Path(os.environ.get("OUT", "."))
TOKENS, HIDDEN, FFN, VOCAB, QKV = 16384, 4096, 14336, 128256, 6144
dev, bf16 = "cuda", torch.bfloat16


def bench(fn: Callable[[], object]) -> float:
    return median_cuda_seconds(fn, reps=20, warmup=3)


def swiglu_rows() -> dict:
    gate_up = torch.randn(2, TOKENS // 2, 2 * FFN, device=dev, dtype=bf16, requires_grad=True)
    grad = torch.randn(2, TOKENS // 2, FFN, device=dev, dtype=bf16)
    rows = {}
    variants = {"inductor": torch.compile(silu_mul),
                "inductor, cat as concat kernel": torch.compile(silu_mul, options={"max_pointwise_cat_inputs": 0})}
    for name, fn in variants.items():
        out = fn(gate_up)
        rows[name] = dict(fwd_s=bench(lambda: fn(gate_up)),
                          bwd_s=bench(lambda: torch.autograd.grad(out, gate_up, grad, retain_graph=True)))
    out = SiluMul.apply(gate_up)
    rows["triton (remat)"] = dict(fwd_s=bench(lambda: SiluMul.apply(gate_up)),
                                  bwd_s=bench(lambda: torch.autograd.grad(out, gate_up, grad, retain_graph=True)))
    ref_in = gate_up.detach().double().requires_grad_()
    reference = torch.autograd.grad(silu_mul(ref_in), ref_in, grad.double())[0]
    for name, fn in {**variants, "triton (remat)": SiluMul.apply}.items():
        mine = torch.autograd.grad(fn(gate_up), gate_up, grad)[0]
        rows[name]["bwd_max_rel_err_vs_fp64"] = float(((mine.double() - reference).abs().max()
                                                       / reference.abs().max()))
    moved = (3 * TOKENS * FFN + 2 * TOKENS * FFN) * 2
    for row in rows.values():
        row["bwd_tb_per_s"] = round(moved / row["bwd_s"] / 1e12, 2)
    return rows


def scale_rows() -> dict:
    grad_w = torch.randn(VOCAB, HIDDEN, device=dev, dtype=bf16)
    grad_w32 = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.float32)
    grad_output = torch.ones((), device=dev)
    scale = torch.compile(lambda g, s: g * s)
    scale_cast = torch.compile(lambda g, s: (g * s).to(bf16))
    return {"bf16 * 0-dim (before)": bench(lambda: grad_w * grad_output),
            "_foreach_mul": bench(lambda: torch._foreach_mul([grad_w], grad_output)),
            "bf16 * 0-dim, compiled (remat)": bench(lambda: scale(grad_w, grad_output)),
            "fp32 -> bf16 cast": bench(lambda: grad_w32.to(bf16)),
            "fp32 * 0-dim -> bf16, compiled": bench(lambda: scale_cast(grad_w32, grad_output))}


def gemm_rows() -> dict:
    rows = {}
    shapes = {"linear_qkv": (QKV, HIDDEN, TOKENS), "linear_proj": (HIDDEN, HIDDEN, TOKENS),
              "linear_fc1": (2 * FFN, HIDDEN, TOKENS), "linear_fc2": (HIDDEN, FFN, TOKENS),
              "output_layer chunk": (VOCAB, HIDDEN, 4096)}
    for name, (out_f, in_f, tokens) in shapes.items():
        x = torch.randn(tokens, in_f, device=dev, dtype=bf16)
        w = torch.randn(out_f, in_f, device=dev, dtype=bf16)
        g = torch.randn(tokens, out_f, device=dev, dtype=bf16)
        acc = torch.zeros(out_f, in_f, device=dev, dtype=bf16)
        flop = 2 * out_f * in_f * tokens
        times = {"fwd x@W^T": bench(lambda: F.linear(x, w)),
                 "dgrad g@W": bench(lambda: g @ w),
                 "wgrad g^T@x (autograd)": bench(lambda: g.t() @ x),
                 "wgrad (x^T@g)^T": bench(lambda: (x.t() @ g).t()),
                 "wgrad g^T@x + acc, beta=1": bench(lambda: acc.addmm_(g.t(), x)),
                 "wgrad then add (autograd accumulation)": bench(lambda: acc.add_(g.t() @ x))}
        rows[name] = {k: dict(s=round(v, 6), tflops=round(flop / v / 1e12, 1)) for k, v in times.items()}
    return rows


def main() -> None:
    record = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  command="PYTHONPATH=src python benchmarks/kernels_w1.py",
                  swiglu=swiglu_rows(), scale=scale_rows(), gemm=gemm_rows())
    print(json.dumps(record, indent=1))
    (OUT / "kernels_w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
