"""SwiGLU and the down projection (linear_fc2) after it, as one autograd Function with two
Triton kernels, for CUDA.

The activation silu(gate) * up is what linear_fc2 would save for its weight gradient: 448 MiB a
layer at W1's shapes. The Function saves only the fused gate/up input (which the activation's
own backward needs anyway) and writes the activation again from the kernel that computes its
gradient, which reads gate/up already: one extra write instead of a saved tensor, as inductor's
partitioner does for compiled code. That kernel also writes both halves of the gradient in one
pass (inductor compiles it as a `cat`, which moved 2.25 TB/s on an H200 at W1's shapes, against
3.4 for this one: benchmarks/results/kernels_w1_h200.json). The kernels compute in float32 and
round once; the backward's activation is bit-identical to the forward's. Launching, meta
tensors and CPU testing: remat.models.triton_ops.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from remat.models.grad_accumulation import kept_for_grad, weight_grad
from remat.models.triton_ops import KERNEL_DTYPES, dispatch, launch, refuse_double_backward

_BLOCK = 1024


def _launch(name: str, out: Tensor, ffn: int, *args: Tensor) -> None:
    """Run kernel `name` over out's rows (of 2 * ffn or ffn columns)."""
    launch(name, (out.numel() // out.shape[-1], -(-ffn // _BLOCK)), out, *args, ffn, BLOCK=_BLOCK)


class SwiGLUDown(torch.autograd.Function):
    """F.linear(silu(gate) * up, weight) for gate_up = [..., 2 * ffn] (gate first), saving
    gate_up and the weight only; `fuse_grads` as remat.models.grad_accumulation.linear's `fuse`. Not twice
    differentiable."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor, weight: Tensor, fuse_grads: bool) -> Tensor:  # type: ignore[override]
        if gate_up.shape[-1] % 2:
            raise ValueError(f"SwiGLU needs an even last dimension (gate then up), got {tuple(gate_up.shape)}")
        gate_up = gate_up.contiguous()
        ffn = gate_up.shape[-1] // 2
        ctx.save_for_backward(gate_up, weight)
        ctx.weight, ctx.fuse_grads = kept_for_grad(weight), fuse_grads
        act = gate_up.new_empty(gate_up.shape[:-1] + (ffn,))
        _launch("silu_mul_forward", act, ffn, gate_up, act)
        return F.linear(act, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, None]:  # type: ignore[override]
        refuse_double_backward("SwiGLU")
        gate_up, weight = ctx.saved_tensors
        # a saved-tensor hook may hand back other strides than it was given
        gate_up, grad = gate_up.contiguous(), grad.contiguous()
        ffn = gate_up.shape[-1] // 2
        d_act = grad.matmul(weight)
        d_gate_up, act = torch.empty_like(gate_up), torch.empty_like(d_act)
        _launch("silu_mul_backward", d_gate_up, ffn, gate_up, d_act, d_gate_up, act)
        del d_act
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = weight_grad(ctx.weight, grad.reshape(-1, grad.shape[-1]), act.reshape(-1, ffn),
                                   ctx.fuse_grads)
        return d_gate_up, d_weight, None


ActivationDownFn = Callable[[Tensor, Tensor, bool], Tensor]


def activation_down(gate_up: Tensor, weight: Tensor, fuse_grads: bool) -> Tensor:
    """F.linear(silu(gate) * up, weight) through SwiGLUDown."""
    return SwiGLUDown.apply(gate_up, weight, fuse_grads)


def on_cuda(fallback: ActivationDownFn) -> ActivationDownFn:
    """SwiGLU then linear_fc2 through SwiGLUDown for CUDA tensors of KERNEL_DTYPES (when Triton
    is installed); `fallback` for anything else."""
    return dispatch(activation_down, fallback, lambda gate_up, weight, fuse_grads: (
        gate_up.is_cuda and gate_up.dtype in KERNEL_DTYPES))
