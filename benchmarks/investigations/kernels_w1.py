"""Candidate kernels for W1's small-kernel time, each timed against what remat runs now, on W1's
shapes (tokens 16384, hidden 4096, FFN 14336, vocab 128256, bf16):

- SwiGLU on the fused gate/up tensor then linear_fc2: forward and backward, the activation
  compiled by inductor (and with inductor's cat lowered as a concat kernel) and remat's SwiGLU
  Function (Triton kernels, one-pass backward), each under torch's linear, with the bytes each
  saves (the activation kept: discarding it is the plan's `mlp_act` action);
- RMSNorm forward and backward (input and weight gradients): torch's fused kernel, inductor's,
  and remat's RMSNormFunction (Triton, one-pass backward), with its launch settings swept;
- the loss head's chunk (4096 tokens x 128256 logits): loss and gradients written over the
  logits, inductor's code against remat's Triton kernel, with its block and warps swept;
- scaling the loss head's weight gradient by grad_output (a 0-dim CUDA tensor);
- the linear layers' GEMMs: forward, input gradient, weight gradient in both operand orders, the
  weight gradient accumulated into an existing gradient (beta=1), and for the two projections
  that feed the residual stream the residual add in the GEMM's epilogue (addmm, beta=1) against
  a separate add;
- the loss head's three GEMMs at chunks of 2048-16384 tokens, the logits row-major and transposed;
- the QKV projection with RoPE: inductor's compiled formula against remat's RotaryQKV;
- causal attention (2 x 8192 tokens, 32 query heads, 8 groups, head dim 128): SDPA's cuDNN,
  flash and memory-efficient backends, on remat's sequence-major heads (transposed views) and
  on head-major contiguous ones, with grouped K/V or K/V expanded to every head.

  PYTHONPATH=src python benchmarks/investigations/kernels_w1.py [--sections swiglu,rmsnorm,loss,scale,gemm,head,rope,attention]
  writes $OUT/kernels_w1.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: profile_w1 stays there
from profile_w1 import median_cuda_seconds

from remat.models.kernels import rope
from remat.models.kernels.loss import chunk_loss_fusable, chunk_loss_in_place, chunk_loss_triton
from remat.models.kernels.rmsnorm import RMSNormFunction, rms_norm
from remat.models.kernels.swiglu import SwiGLU
from remat.models.kernels.triton_ops import launch
from remat.models.llama.config import LlamaConfig
from remat.models.llama.model import RotaryEmbedding, silu_mul, split_qkv

OUT = Path(os.environ.get("OUT", "."))
TOKENS, HIDDEN, FFN, VOCAB, QKV = 16384, 4096, 14336, 128256, 6144
dev, bf16 = "cuda", torch.bfloat16


def bench(fn: Callable[[], object]) -> float:
    return median_cuda_seconds(fn, reps=20, warmup=3)


def swiglu_rows() -> dict:
    gate_up = torch.randn(2, TOKENS // 2, 2 * FFN, device=dev, dtype=bf16, requires_grad=True)
    weight = (torch.randn(HIDDEN, FFN, device=dev, dtype=bf16) / FFN**0.5).requires_grad_()
    grad = torch.randn(2, TOKENS // 2, HIDDEN, device=dev, dtype=bf16)
    compiled, concat = (torch.compile(silu_mul), torch.compile(silu_mul, options={"max_pointwise_cat_inputs": 0}))
    variants = {
        "inductor": lambda x, w: F.linear(compiled(x), w),
        "inductor, cat as concat kernel": lambda x, w: F.linear(concat(x), w),
        "triton SwiGLU (remat)": lambda x, w: F.linear(SwiGLU.apply(x), w),
    }
    ref_in, ref_w = gate_up.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference = torch.autograd.grad(F.linear(silu_mul(ref_in), ref_w), (ref_in, ref_w), grad.double())
    rows = {}
    for name, fn in variants.items():
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn(gate_up, weight)
        activations = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in saved
            if t.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
        }
        mine = torch.autograd.grad(out, (gate_up, weight), grad, retain_graph=True)
        rows[name] = dict(
            fwd_s=bench(lambda: fn(gate_up, weight)),
            bwd_s=bench(lambda: torch.autograd.grad(out, (gate_up, weight), grad, retain_graph=True)),
            saved_mib=sum(activations.values()) / 2**20,
            **{
                f"d_{k}_max_rel_err_vs_fp64": float((m.double() - r).abs().max() / r.abs().max())
                for k, m, r in zip(("gate_up", "weight"), mine, reference)
            },
        )
    return rows


def rmsnorm_rows() -> dict:
    x = torch.randn(2, TOKENS // 2, HIDDEN, device=dev, dtype=bf16, requires_grad=True)
    weight = (1 + torch.randn(HIDDEN, device=dev, dtype=bf16) / 4).requires_grad_()
    grad = torch.randn_like(x)
    eps = 1e-5
    variants = {
        "torch F.rms_norm (eager)": rms_norm,
        "inductor": torch.compile(rms_norm),
        "triton RMSNormFunction (remat)": RMSNormFunction.apply,
    }
    ref_x, ref_w = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference = torch.autograd.grad(rms_norm(ref_x, ref_w, eps), (ref_x, ref_w), grad.double())
    rows: dict = {}
    for name, fn in variants.items():
        out = fn(x, weight, eps)
        mine = torch.autograd.grad(out, (x, weight), grad, retain_graph=True)
        rows[name] = dict(
            fwd_s=bench(lambda: fn(x, weight, eps)),
            bwd_s=bench(lambda: torch.autograd.grad(out, (x, weight), grad, retain_graph=True)),
            **{
                f"d_{k}_max_rel_err_vs_fp64": float((m.double() - r).abs().max() / r.abs().max())
                for k, m, r in zip(("x", "weight"), mine, reference)
            },
        )
    # the raw kernels' launch settings: warps, and rows per backward program
    rstd = torch.empty(TOKENS, device=dev)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    for warps in (4, 8, 16):
        rows[f"forward kernel, {warps} warps"] = bench(
            lambda: launch(
                "rms_norm_forward", (TOKENS,), y, x, weight, y, rstd, HIDDEN, eps, BLOCK=HIDDEN, num_warps=warps
            )
        )
        for per_program in (16, 32, 64, 128):
            partial = torch.empty(TOKENS // per_program, HIDDEN, device=dev)
            rows[f"backward kernel + sum, {warps} warps, {per_program} rows/program"] = bench(
                lambda: (
                    launch(
                        "rms_norm_backward",
                        (len(partial),),
                        dx,
                        x,
                        weight,
                        grad,
                        rstd,
                        dx,
                        partial,
                        TOKENS,
                        HIDDEN,
                        ROWS=per_program,
                        BLOCK=HIDDEN,
                        num_warps=warps,
                    ),
                    partial.sum(0),
                )
            )
    return rows


def loss_rows() -> dict:
    chunk = 4096
    logits = 3 * torch.randn(chunk, VOCAB, device=dev, dtype=bf16)
    labels = torch.randint(0, VOCAB, (chunk,), device=dev)
    valid = torch.ones(chunk, dtype=torch.bool, device=dev)
    scale = torch.full((chunk,), 1 / chunk, device=dev)
    want_loss, want_grad = chunk_loss_in_place(logits.double(), labels, valid, scale.double(), True)
    rows: dict = {}
    for name, fn in {
        "inductor (chunk_loss_fusable)": torch.compile(chunk_loss_fusable),
        "triton (remat)": chunk_loss_triton,
    }.items():
        loss, grad = fn(logits.clone(), labels, valid, scale, True)
        buffer = logits.clone()  # each call writes gradients over it: the same work every time
        rows[name] = dict(
            s=bench(lambda: fn(buffer, labels, valid, scale, True)),
            loss_rel_err_vs_fp64=float((loss.double() - want_loss).abs() / want_loss),
            grad_max_rel_err_vs_fp64=float((grad.double() - want_grad).abs().max() / want_grad.abs().max()),
        )
    losses = torch.empty(chunk, device=dev)
    for block in (2048, 4096, 8192, 16384):
        for warps in (8, 16, 32):
            rows[f"kernel, block {block}, {warps} warps"] = bench(
                lambda: launch(
                    "cross_entropy_chunk",
                    (chunk,),
                    logits,
                    logits,
                    labels,
                    scale,
                    losses,
                    VOCAB,
                    NEED_GRAD=True,
                    N_BLOCKS=-(-VOCAB // block),
                    BLOCK=block,
                    num_warps=warps,
                )
            )
    return rows


def scale_rows() -> dict:
    grad_w = torch.randn(VOCAB, HIDDEN, device=dev, dtype=bf16)
    grad_w32 = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.float32)
    grad_output = torch.ones((), device=dev)
    scale = torch.compile(lambda g, s: g * s)
    scale_cast = torch.compile(lambda g, s: (g * s).to(bf16))
    return {
        "bf16 * 0-dim (before)": bench(lambda: grad_w * grad_output),
        "_foreach_mul": bench(lambda: torch._foreach_mul([grad_w], grad_output)),
        "bf16 * 0-dim, compiled (remat)": bench(lambda: scale(grad_w, grad_output)),
        "fp32 -> bf16 cast": bench(lambda: grad_w32.to(bf16)),
        "fp32 * 0-dim -> bf16, compiled": bench(lambda: scale_cast(grad_w32, grad_output)),
    }


def gemm_rows() -> dict:
    rows = {}
    shapes = {
        "linear_qkv": (QKV, HIDDEN, TOKENS),
        "linear_proj": (HIDDEN, HIDDEN, TOKENS),
        "linear_fc1": (2 * FFN, HIDDEN, TOKENS),
        "linear_fc2": (HIDDEN, FFN, TOKENS),
        "output_layer chunk": (VOCAB, HIDDEN, 4096),
    }
    for name, (out_f, in_f, tokens) in shapes.items():
        x = torch.randn(tokens, in_f, device=dev, dtype=bf16)
        w = torch.randn(out_f, in_f, device=dev, dtype=bf16)
        g = torch.randn(tokens, out_f, device=dev, dtype=bf16)
        acc = torch.zeros(out_f, in_f, device=dev, dtype=bf16)
        flop = 2 * out_f * in_f * tokens
        times = {
            "fwd x@W^T": bench(lambda: F.linear(x, w)),
            "dgrad g@W": bench(lambda: g @ w),
            "wgrad g^T@x (autograd)": bench(lambda: g.t() @ x),
            "wgrad (x^T@g)^T": bench(lambda: (x.t() @ g).t()),
            "wgrad g^T@x + acc, beta=1": bench(lambda: acc.addmm_(g.t(), x)),
            "wgrad then add (autograd accumulation)": bench(lambda: acc.add_(g.t() @ x)),
        }
        if out_f == HIDDEN:  # linear_proj and linear_fc2 feed the residual stream
            residual = torch.randn(tokens, out_f, device=dev, dtype=bf16)
            times |= {
                "fwd + residual, addmm beta=1": bench(lambda: torch.addmm(residual, x, w.t())),
                "fwd then residual add": bench(lambda: residual + F.linear(x, w)),
            }
        rows[name] = {k: dict(s=round(v, 6), tflops=round(flop / v / 1e12, 1)) for k, v in times.items()}
    return rows


def rope_rows() -> dict:
    """The QKV projection with RoPE: inductor's compiled formula against remat's RotaryQKV."""
    x = torch.randn(2, TOKENS // 2, HIDDEN, device=dev, dtype=bf16, requires_grad=True)
    weight = (torch.randn(QKV, HIDDEN, device=dev, dtype=bf16) / HIDDEN**0.5).requires_grad_()
    rotary = RotaryEmbedding(
        LlamaConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=FFN,
            vocab_size=VOCAB,
            seq_length=TOKENS // 2,
        ),
        dtype=bf16,
        device=dev,
    )
    args = (*rotary(TOKENS // 2), 32, 8)
    compiled = torch.compile(split_qkv)
    variants = {
        "inductor (compiled split_qkv)": lambda x, w, *a: compiled(F.linear(x, w), *a),
        "triton RotaryQKV (remat)": lambda x, w, *a: rope.split_qkv(F.linear(x, w), *a),
    }
    want = split_qkv(F.linear(x.double(), weight.double()), *(t.double() for t in args[:2]), *args[2:])
    rows = {}
    for name, fn in variants.items():
        out = fn(x, weight, *args)
        grads = [torch.randn_like(t) for t in out]
        rows[name] = dict(
            forward_s=bench(lambda: fn(x, weight, *args)),
            forward_backward_s=bench(lambda: torch.autograd.grad(fn(x, weight, *args), (x, weight), grads)),
            q_max_abs_err_vs_fp64=float((out[0].detach().double() - want[0]).abs().max()),
        )
    return rows


def head_rows() -> dict:
    """The loss head's three GEMMs per chunk size, with the logits row-major [tokens, vocab] (what
    remat computes) and transposed [vocab, tokens] (the same product, other operand order)."""
    rows = {}
    w = torch.randn(VOCAB, HIDDEN, device=dev, dtype=bf16)
    acc = torch.zeros(VOCAB, HIDDEN, device=dev, dtype=torch.float32)
    for tokens in (2048, 4096, 8192, 16384):
        h = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
        d = torch.randn(tokens, VOCAB, device=dev, dtype=bf16)
        d_t = d.t().contiguous()
        out = torch.empty(tokens, HIDDEN, device=dev, dtype=bf16)
        flop = 2 * VOCAB * HIDDEN * tokens
        times = {
            "fwd h@W^T": bench(lambda: h @ w.t()),
            "fwd W@h^T (logits transposed)": bench(lambda: w @ h.t()),
            "dgrad d@W": bench(lambda: torch.mm(d, w, out=out)),
            "dgrad (d^T)^T@W": bench(lambda: torch.mm(d_t.t(), w, out=out)),
            "wgrad fp32 += d^T@h": bench(lambda: torch.addmm(acc, d.t(), h, out_dtype=torch.float32, out=acc)),
            "wgrad fp32 += d^T@h, d^T contiguous": bench(
                lambda: torch.addmm(acc, d_t, h, out_dtype=torch.float32, out=acc)
            ),
        }
        rows[f"{tokens} tokens"] = {k: dict(s=round(v, 6), tflops=round(flop / v / 1e12, 1)) for k, v in times.items()}
    return rows


def attention_rows() -> dict:
    """Causal attention forward and forward+backward per SDPA backend and head layout. Sequence-major
    is what remat feeds (q [b, s, heads, d] seen as [b, heads, s, d]; the output's gradient comes
    back in the same strides); head-major is each tensor contiguous as [b, heads, s, d]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, heads, groups, d = 2, TOKENS // 2, 32, 8, 128
    flop_fwd = 4 * b * heads * s * s * d / 2  # causal: half the score matrix
    rows = {}
    for layout in ("sequence-major", "head-major"):

        def make(n: int) -> torch.Tensor:
            shape = (b, s, n, d) if layout == "sequence-major" else (b, n, s, d)
            t = torch.randn(shape, device=dev, dtype=bf16)
            return (t.transpose(1, 2) if layout == "sequence-major" else t).requires_grad_()

        q, k, v, grad = make(heads), make(groups), make(groups), make(heads).detach()
        k_all, v_all = (t.detach().repeat_interleave(heads // groups, 1).requires_grad_() for t in (k, v))
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (True, False):
                keys, values = (k, v) if gqa else (k_all, v_all)

                def fwd() -> torch.Tensor:
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)

                name = f"{layout}, {backend.name.lower()}, {'grouped K/V' if gqa else 'K/V expanded'}"
                try:
                    fwd_s = bench(fwd)
                    both_s = bench(lambda: torch.autograd.grad(fwd(), (q, keys, values), grad))
                except RuntimeError as err:  # a backend that does not take these inputs
                    rows[name] = {"error": str(err).splitlines()[0][:200]}
                    continue
                rows[name] = dict(
                    forward_s=round(fwd_s, 6),
                    forward_tflops=round(flop_fwd / fwd_s / 1e12, 1),
                    forward_backward_s=round(both_s, 6),
                    forward_backward_tflops=round(3.5 * flop_fwd / both_s / 1e12, 1),
                )
    return rows


SECTIONS = {
    "swiglu": swiglu_rows,
    "rmsnorm": rmsnorm_rows,
    "loss": loss_rows,
    "scale": scale_rows,
    "gemm": gemm_rows,
    "head": head_rows,
    "rope": rope_rows,
    "attention": attention_rows,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    chosen = args.sections.split(",")
    if unknown := set(chosen) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    record = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        command="PYTHONPATH=src python benchmarks/investigations/kernels_w1.py " + " ".join(sys.argv[1:]),
        **{name: SECTIONS[name]() for name in chosen},
    )
    print(json.dumps(record, indent=1))
    (OUT / "kernels_w1.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
