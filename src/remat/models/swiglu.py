"""SwiGLU on Megatron's fused gate/up tensor as two Triton kernels, for CUDA.

Inductor compiles SwiGLU's backward as a `cat` of the two halves' gradients, and that kernel
moved 2.0 TB/s on an H200 at W1's shapes; these read gate, up and the incoming gradient once and
write both halves of the gradient in one pass, at 3.9 TB/s (benchmarks/results/kernels_w1_h200.json).
Like inductor's code, they compute in float32 and round once, and save only the gate/up input.

Triton is imported when the kernels are first built, so CPU-only installs never need it; with
TRITON_INTERPRET=1 the same kernels run on CPU tensors (that is how the tests check them).
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch
from torch import Tensor

_BLOCK = 1024
# They compute in float32: float64 would lose precision, so it takes the fallback.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels() -> Any:
    from remat.models import swiglu_kernels
    return swiglu_kernels


def _grid(rows: int, ffn: int) -> tuple[int, int]:
    return rows, -(-ffn // _BLOCK)


class SiluMul(torch.autograd.Function):
    """silu(gate) * up for gate_up = [..., 2 * ffn] (gate first), on contiguous tensors."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor) -> Tensor:  # type: ignore[override]
        gate_up = gate_up.contiguous()
        ffn = gate_up.shape[-1] // 2
        out = gate_up.new_empty(gate_up.shape[:-1] + (ffn,))
        if out.numel():
            _kernels().silu_mul_forward[_grid(out.numel() // ffn, ffn)](gate_up, out, ffn, BLOCK=_BLOCK)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        (gate_up,) = ctx.saved_tensors
        grad = grad.contiguous()
        ffn = grad.shape[-1]
        out = torch.empty_like(gate_up)
        if out.numel():
            _kernels().silu_mul_backward[_grid(grad.numel() // ffn, ffn)](gate_up, grad, out, ffn, BLOCK=_BLOCK)
        return out


def on_cuda(fallback: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """SwiGLU that runs the Triton kernels on CUDA tensors of KERNEL_DTYPES (when Triton is
    installed) and `fallback` on anything else."""
    use_triton = triton_available()

    def silu_mul(gate_up: Tensor) -> Tensor:
        if use_triton and gate_up.is_cuda and gate_up.dtype in KERNEL_DTYPES:
            return SiluMul.apply(gate_up)
        return fallback(gate_up)

    return silu_mul
