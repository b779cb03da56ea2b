"""RMSNorm as an autograd Function with two Triton kernels, for CUDA.

It saves what torch's fused CUDA RMSNorm saves (the input and a float32 1/rms per row), so every
byte count and plan stays as it was. The difference is the backward: torch reads the input and the
gradient twice, once for the input gradient and once more for the weight gradient; here one pass
over them writes the input gradient and sums the weight gradient per program (a fixed set of
rows each, so the result is deterministic), and a small sum over programs finishes it. The
kernels compute in float32 and round once. Launching, meta tensors and CPU testing:
remat.models.kernels.triton_ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from remat.models.kernels.triton_ops import KERNEL_DTYPES, dispatch, launch, refuse_double_backward, row_block

# A row lives in registers: wider hidden sizes take the fallback.
MAX_WIDTH = 65536
NormFn = Callable[[Tensor, Tensor, float | None], Tensor]


def _block(width: int) -> tuple[int, int]:
    """The kernels' block (the row, padded to a power of two) and warps for it."""
    block = row_block(width)
    return block, min(max(block // 512, 4), 16)


def _rows_per_program(rows: int, device: torch.device) -> int:
    """Rows each backward program takes (a power of two, few compiled variants): enough
    programs to fill the GPU, each adding one row of float32 partial weight gradients to sum."""
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return row_block(-(-rows // programs))


class RMSNormFunction(torch.autograd.Function):
    """F.rms_norm(x, (h,), weight, eps) for x [..., h] and weight [h] of x's dtype (eps None: the
    dtype's machine epsilon, as torch takes it). Not twice differentiable."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float | None) -> Tensor:  # type: ignore[override]
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"weight of shape {tuple(weight.shape)} does not fit inputs {tuple(x.shape)}")
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        x, weight = x.contiguous(), weight.contiguous()
        width = x.shape[-1]
        y = torch.empty_like(x)
        rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
        block, warps = _block(width)
        launch("rms_norm_forward", (rstd.numel(),), y, x, weight, y, rstd, width, eps, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, None]:  # type: ignore[override]
        refuse_double_backward("RMSNorm")
        x, weight, rstd = ctx.saved_tensors
        # a saved-tensor hook may hand back other strides than it was given
        x, grad = x.contiguous(), grad.contiguous()
        rows, width = rstd.numel(), x.shape[-1]
        dx = torch.empty_like(x)
        per_program = _rows_per_program(rows, x.device)
        dw_partial = x.new_empty((-(-rows // per_program), width), dtype=torch.float32)
        block, warps = _block(width)
        launch(
            "rms_norm_backward",
            (len(dw_partial),),
            dx,
            x,
            weight,
            grad,
            rstd,
            dx,
            dw_partial,
            rows,
            width,
            ROWS=per_program,
            BLOCK=block,
            num_warps=warps,
        )
        dw = dw_partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float | None) -> Tensor:
    """torch's RMSNorm over the last dimension."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def triton_rms_norm(x: Tensor, weight: Tensor, eps: float | None) -> Tensor:
    """RMSNorm over the last dimension through RMSNormFunction."""
    return RMSNormFunction.apply(x, weight, eps)


def on_cuda(fallback: NormFn = rms_norm) -> NormFn:
    """RMSNorm through RMSNormFunction for plain CUDA tensors of KERNEL_DTYPES with a weight of the
    same dtype and device (when Triton is installed and autocast is off, which would pick the
    norm's dtype); `fallback` for anything else (a sequence-parallel norm's DTensors among them)."""
    return dispatch(
        triton_rms_norm,
        fallback,
        lambda x, weight, eps: (
            type(x) is Tensor
            and x.is_cuda
            and x.dtype in KERNEL_DTYPES
            and weight.dtype == x.dtype
            and weight.device == x.device
            and x.shape[-1] <= MAX_WIDTH
            and not torch.is_autocast_enabled("cuda")
        ),
    )
