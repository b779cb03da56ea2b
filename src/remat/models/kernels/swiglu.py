"""SwiGLU's activation silu(gate) * up as an autograd Function with two Triton kernels, for CUDA.

It saves only the fused gate/up input, which its backward needs; the activation it returns is
what linear_fc2 saves, and whether that is kept or discarded is the `mlp_act` Site's business.
The backward writes both halves of the gradient in one pass (inductor compiles it as a `cat`,
which measured slower: benchmarks/README.md). The kernels compute in float32 and round once, so a
discarded activation rebuilt in backward has the forward's bits. Launching, meta tensors and CPU
testing: remat.models.kernels.triton_ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from remat.models.kernels.triton_ops import KERNEL_DTYPES, dispatch, launch, refuse_double_backward

_BLOCK = 1024


def _launch(name: str, out: Tensor, ffn: int, *args: Tensor) -> None:
    """Run kernel `name` over out's rows (of 2 * ffn or ffn columns)."""
    launch(name, (out.numel() // out.shape[-1], -(-ffn // _BLOCK)), out, *args, ffn, BLOCK=_BLOCK)


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up for gate_up = [..., 2 * ffn] (gate first), saving gate_up. Not twice
    differentiable."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor) -> Tensor:  # type: ignore[override]
        if gate_up.shape[-1] % 2:
            raise ValueError(f"SwiGLU needs an even last dimension (gate then up), got {tuple(gate_up.shape)}")
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        act = gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))
        _launch("silu_mul_forward", act, act.shape[-1], gate_up, act)
        return act

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        refuse_double_backward("SwiGLU")
        (gate_up,) = ctx.saved_tensors
        # a saved-tensor hook may hand back other strides than it was given
        gate_up, grad = gate_up.contiguous(), grad.contiguous()
        d_gate_up = torch.empty_like(gate_up)
        _launch("silu_mul_backward", d_gate_up, grad.shape[-1], gate_up, grad, d_gate_up)
        return d_gate_up


ActivationFn = Callable[[Tensor], Tensor]


def activation(gate_up: Tensor) -> Tensor:
    """silu(gate) * up through SwiGLU."""
    return SwiGLU.apply(gate_up)


def on_cuda(fallback: ActivationFn) -> ActivationFn:
    """The activation through SwiGLU for CUDA tensors of KERNEL_DTYPES (when Triton is
    installed); `fallback` for anything else."""
    return dispatch(activation, fallback, lambda gate_up: gate_up.is_cuda and gate_up.dtype in KERNEL_DTYPES)
