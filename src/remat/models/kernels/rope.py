"""The fused QKV projection's split into heads with RoPE, as one autograd Function with one Triton
kernel each way, for CUDA.

The projection's output holds, per query group, its query heads then one key and one value head
(Megatron's layout; remat.models.llama.model.split_qkv). The forward kernel writes q and k rotated
and v copied, one program per token; the backward kernel writes their gradients back into that
layout, rotated back (inductor compiled the backward as a `cat` of strided slices, far below the
memory bandwidth: benchmarks/README.md). RoPE is linear, so the Function saves only the cos/sin
tables (slices of the model's buffers): the projection before it saves its own input. The
kernels compute in float32 and round once.
Launching, meta tensors and CPU testing: remat.models.kernels.triton_ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from remat.models.kernels.triton_ops import KERNEL_DTYPES, dispatch, launch, refuse_double_backward, row_block

SplitFn = Callable[[Tensor, Tensor, Tensor, int, int], tuple[Tensor, Tensor, Tensor]]


def _launch(fused: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, forward: bool) -> None:
    b, s, heads, head_dim = q.shape
    groups = k.shape[2]
    launch(
        "rotary_qkv",
        (b * s,),
        fused,
        fused,
        q,
        k,
        v,
        cos,
        sin,
        s,
        HEADS=heads,
        GROUPS=groups,
        PER_GROUP=heads // groups,
        HALF=head_dim // 2,
        HEADS_BLOCK=row_block(heads),
        GROUPS_BLOCK=row_block(groups),
        HALF_BLOCK=row_block(head_dim // 2),
        FORWARD=forward,
    )


class RotaryQKV(torch.autograd.Function):
    """qkv [b, s, groups * (heads / groups + 2) * d] -> q [b, s, heads, d], k and v [b, s, groups, d]
    (contiguous): q and k rotate-half RoPE'd with cos/sin [s, d], v copied. Saves cos and sin only.
    Not twice differentiable."""

    @staticmethod
    def forward(
        ctx: Any,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,  # type: ignore[override]
        num_heads: int,
        num_groups: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, s, width = qkv.shape
        head_dim = cos.shape[-1]
        if num_groups < 1 or num_heads % num_groups:
            raise ValueError(f"{num_heads} query heads do not split into {num_groups} groups")
        if head_dim % 2:
            raise ValueError(f"rotate-half RoPE needs an even head dim, got {head_dim}")
        if width != (num_heads + 2 * num_groups) * head_dim:
            raise ValueError(
                f"a fused QKV row of {num_heads} query heads and {num_groups} key and value heads "
                f"of dim {head_dim} has {(num_heads + 2 * num_groups) * head_dim} columns, got {width}"
            )
        if cos.shape != (s, head_dim) or sin.shape != cos.shape:
            raise ValueError(f"cos and sin must be [{s}, {head_dim}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = qkv.new_empty(b, s, num_heads, head_dim)
        k, v = (qkv.new_empty(b, s, num_groups, head_dim) for _ in range(2))
        _launch(qkv, q, k, v, cos, sin, forward=True)
        ctx.save_for_backward(cos, sin)
        return q, k, v

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        refuse_double_backward("QKV RoPE")
        cos, sin = ctx.saved_tensors
        # incoming gradients (expanded zeros for an unused output) and a saved-tensor hook's tensors
        # may have other strides
        dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
        b, s, heads, head_dim = dq.shape
        d_qkv = dq.new_empty(b, s, (heads + 2 * dk.shape[2]) * head_dim)
        _launch(d_qkv, dq, dk, dv, cos.contiguous(), sin.contiguous(), forward=False)
        return d_qkv, None, None, None, None


def split_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """remat.models.llama.model.split_qkv through RotaryQKV."""
    return RotaryQKV.apply(qkv, cos, sin, num_heads, num_groups)


def _kernel_takes(qkv: Tensor, cos: Tensor, sin: Tensor, *_: int) -> bool:
    # Under autocast, or with tables of another dtype, the formula would give q and k another
    # dtype than the kernel writes; tables that require grad get none from the Function.
    return (
        qkv.is_cuda
        and qkv.dtype in KERNEL_DTYPES
        and not torch.is_autocast_enabled("cuda")
        and all(t.dtype == qkv.dtype and t.device == qkv.device for t in (cos, sin))
        and not (cos.requires_grad or sin.requires_grad)
    )


def on_cuda(fallback: SplitFn) -> SplitFn:
    """split_qkv through RotaryQKV for CUDA inputs of KERNEL_DTYPES with cos/sin tables
    (constant) of qkv's dtype and device, autocast off (when Triton is installed); `fallback` for
    anything else."""
    return dispatch(split_qkv, fallback, _kernel_takes)
