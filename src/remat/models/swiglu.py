"""SwiGLU on Megatron's fused gate/up tensor as two Triton kernels, for CUDA.

Inductor compiles SwiGLU's backward as a `cat` of the two halves' gradients, and that kernel
moved 2.25 TB/s on an H200 at W1's shapes; these read gate, up and the incoming gradient once and
write both halves of the gradient in one pass, at 3.4 TB/s (benchmarks/results/kernels_w1_h200.json).
Like inductor's code, they compute in float32 and round once, and save only the gate/up input.

Triton is imported when the kernels are first built, so CPU-only installs never need it; with
TRITON_INTERPRET=1 the same kernels run on CPU tensors (that is how the tests check them).
"""
from __future__ import annotations

import contextlib
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


def _launch(name: str, out: Tensor, ffn: int, *args: Tensor) -> Tensor:
    """Run kernel `name` over out's rows (of ffn columns) on out's device; Triton launches on the
    current device otherwise."""
    if out.numel():
        guard = torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext()
        with guard:
            getattr(_kernels(), name)[out.numel() // out.shape[-1], -(-ffn // _BLOCK)](*args, out, ffn, BLOCK=_BLOCK)
    return out


class SiluMul(torch.autograd.Function):
    """silu(gate) * up for gate_up = [..., 2 * ffn] (gate first). Not twice differentiable."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor) -> Tensor:  # type: ignore[override]
        if gate_up.shape[-1] % 2:
            raise ValueError(f"SwiGLU needs an even last dimension (gate then up), got {tuple(gate_up.shape)}")
        gate_up = gate_up.contiguous()
        ffn = gate_up.shape[-1] // 2
        ctx.save_for_backward(gate_up)
        return _launch("silu_mul_forward", gate_up.new_empty(gate_up.shape[:-1] + (ffn,)), ffn, gate_up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: the kernel's result would have no graph
            raise RuntimeError("remat's Triton SwiGLU is not twice differentiable; for second derivatives "
                               "run the model without compile_regions()")
        (gate_up,) = ctx.saved_tensors
        # a saved-tensor hook may hand back other strides than it was given
        gate_up, grad = gate_up.contiguous(), grad.contiguous()
        return _launch("silu_mul_backward", torch.empty_like(gate_up), grad.shape[-1], gate_up, grad)


def on_cuda(fallback: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """SwiGLU that runs the Triton kernels on CUDA tensors of KERNEL_DTYPES (when Triton is
    installed) and `fallback` on anything else."""
    use_triton = triton_available()

    def silu_mul(gate_up: Tensor) -> Tensor:
        if use_triton and gate_up.is_cuda and gate_up.dtype in KERNEL_DTYPES:
            return SiluMul.apply(gate_up)
        return fallback(gate_up)

    return silu_mul
