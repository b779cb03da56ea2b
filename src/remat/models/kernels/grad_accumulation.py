"""Gradient accumulation fused into the weight-gradient GEMM (Megatron's
``gradient_accumulation_fusion``).

When a weight's ``.grad`` already holds a gradient (a later micro-batch, or steps without
zero_grad), autograd computes the new weight gradient into a fresh tensor and then adds it into
``.grad`` with one more kernel, which reads both and writes the sum. Here the GEMM adds into
``.grad`` itself (beta = 1): no weight-sized temporary, no extra pass over it, and a GEMM that adds
into its output takes about as long as a plain one (benchmarks/README.md). The sum is rounded once
instead of twice. The loss head (remat.models.kernels.loss), which computes its weight gradient in
forward, adds it into ``.grad`` as it scales it, under the same conditions (accumulates_into_grad).

The Function then returns no weight gradient, so it accumulates only where autograd would have
accumulated the same sum: in ``backward()`` (not ``autograd.grad``, which returns gradients
instead), without create_graph, into a plain ``.grad`` of the weight's dtype and shape, and with no
tensor hooks on the weight that would expect to see the gradient. Otherwise it returns the
gradient as torch's linear does. Hooks registered on the weight's AccumulateGrad node itself (as
torch's DDP does) are not seen: they run with no gradient from a fused call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge


def kept_for_grad(weight: Tensor) -> Tensor | None:
    """What a Function keeps on its ctx to add into weight.grad in backward: the leaf itself, since
    what a saved-tensor hook (recompute, offload) hands back is another tensor, whose .grad is not
    the weight's; None for a weight that is not a leaf (no .grad of its own), which then stays
    held only through the saved-tensor hooks."""
    return weight if weight.is_leaf else None


def accumulates_into_grad(weight: Tensor | None, fuse: bool) -> bool:
    """Whether to add `weight`'s gradient (`weight` as kept_for_grad gives it) into weight.grad
    here: `fuse` asks for it, and the backward now running would add it there."""
    if not fuse or weight is None:
        return False
    grad = weight.grad
    if (
        grad is None
        or torch.is_grad_enabled()
        or grad.is_sparse
        or grad.shape != weight.shape
        or grad.dtype != weight.dtype
        or not grad.is_contiguous()
        or weight._backward_hooks
        or weight._post_accumulate_grad_hooks
    ):
        return False
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(weight).node)
    except RuntimeError:  # raised for a leaf that autograd.grad is asked for: it returns the gradient
        return False


def weight_grad(weight: Tensor | None, grad_out: Tensor, inputs: Tensor, fuse: bool) -> Tensor | None:
    """The gradient of ``inputs @ weight.T`` w.r.t. the weight (`weight` as kept_for_grad gives it)
    for grad_out (both 2-D, rows of tokens): with `fuse`, added into weight.grad by the GEMM when
    backward accumulates there (None is then returned); else computed as autograd would."""
    if accumulates_into_grad(weight, fuse):
        weight.grad.addmm_(grad_out.t(), inputs)  # type: ignore[union-attr]
        return None
    return grad_out.t().mm(inputs)


class _AccumulatingLinear(torch.autograd.Function):
    """F.linear(x, weight) without bias, saving x and weight as torch's linear does, whose
    backward adds the weight gradient into weight.grad where autograd would add it. Unlike
    torch's linear it saves when it returns, after its matmul: a recompute replay that stops at
    the last saved tensor runs the matmul (llama.MLP keeps torch's linear for linear_fc2)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.weight = kept_for_grad(weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        d_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = weight_grad(ctx.weight, grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]), True)
        return d_x, d_weight


def linear(x: Tensor, weight: Tensor, fuse: bool) -> Tensor:
    """F.linear(x, weight) (no bias); with `fuse`, its backward adds the weight gradient into
    weight.grad inside the GEMM when autograd would accumulate it there."""
    # under autocast F.linear casts its inputs, and the Function would save the uncast ones
    autocast = x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
    if fuse and torch.is_grad_enabled() and weight.requires_grad and not autocast:
        return _AccumulatingLinear.apply(x, weight)
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear without bias computed by `linear`: with `fuse_grads`, its backward adds the weight
    gradient into weight.grad. A module rather than a function call, so that hooks on it (torch's
    tensor-parallel styles) see the call."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        fuse_grads: bool,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)
        self.fuse_grads = fuse_grads

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.fuse_grads)
