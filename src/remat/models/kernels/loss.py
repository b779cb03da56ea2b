"""Chunked linear + cross-entropy: the loss head without the full [tokens, vocab] fp32 logits.

With a 128K vocabulary the fp32 logits of 16K tokens take 8 GiB, more than several layers of
kept activations. Here the logits exist one token chunk at a time, and the gradients w.r.t. the
hidden states and the output weight are computed in the forward pass, chunk by chunk, so the
backward pass only scales them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from remat.models.kernels.grad_accumulation import accumulates_into_grad, kept_for_grad
from remat.models.kernels.triton_ops import KERNEL_DTYPES, dispatch, launch, row_block

ChunkFn = Callable[[Tensor, Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor | None]]


def chunk_loss_in_place(
    logits: Tensor, labels: Tensor, valid: Tensor, row_scale: Tensor, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """One chunk's summed token losses and d loss/d logits, built in place in one fp32 buffer."""
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    logits32 = logits.to(compute_dtype)
    lse = torch.logsumexp(logits32, dim=-1)
    target = logits32.gather(1, labels[:, None]).squeeze(1)
    loss = torch.where(valid, lse - target, 0.0).sum()
    if not need_grad:
        return loss, None
    # (softmax - onehot) * row_scale
    d_logits = logits32.sub_(lse[:, None]).exp_()
    d_logits[torch.arange(len(labels), device=d_logits.device), labels] -= 1.0
    return loss, d_logits.mul_(row_scale[:, None]).to(logits.dtype)


def chunk_loss_fusable(
    logits: Tensor, labels: Tensor, valid: Tensor, row_scale: Tensor, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The same, as torch.compile can fuse it: a few passes over the logits, the last writing the
    gradients over them in place (a chunk then holds one buffer of logits, not two)."""
    logits32 = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(logits32, dim=-1)
    onehot = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]
    # the target logit as a masked sum, not a gather: torch 2.11's inductor on CPU ran the gather
    # after the in-place write below (float32 logits alias logits32) and got the loss wrong
    target = torch.where(onehot, logits32, 0.0).sum(-1)
    loss = torch.where(valid, lse - target, 0.0).sum()
    if not need_grad:
        return loss, None
    d_logits = ((logits32 - lse[:, None]).exp() - onehot.to(logits32.dtype)) * row_scale[:, None]
    return loss, logits.copy_(d_logits)


# Vocabulary columns a program holds at once (a 128K row: 16 blocks a pass) and its warps: the
# fastest of the settings swept (benchmarks/investigations/README.md).
_LOSS_BLOCK, _LOSS_WARPS = 8192, 8


def chunk_loss_triton(
    logits: Tensor, labels: Tensor, valid: Tensor, row_scale: Tensor, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The same in one Triton kernel, a program per token: two passes over its logits (the second
    served mostly by L2) where inductor's code made three. Contiguous float32/bf16/fp16 logits,
    finite (a matmul's), labels in [0, vocab): the kernel checks neither."""
    rows, vocab = logits.shape
    losses = logits.new_empty(rows, dtype=torch.float32)
    block = min(_LOSS_BLOCK, row_block(vocab))
    launch(
        "cross_entropy_chunk",
        (rows,),
        logits,
        logits,
        labels,
        row_scale,
        losses,
        vocab,
        NEED_GRAD=need_grad,
        N_BLOCKS=-(-vocab // block),
        BLOCK=block,
        num_warps=_LOSS_WARPS,
    )
    loss = torch.where(valid, losses, 0.0).sum().to(row_scale.dtype)
    return loss, logits if need_grad else None


def chunk_loss_shapes(
    logits: Tensor, labels: Tensor, valid: Tensor, row_scale: Tensor, need_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The compiled loss chunk by shape, for the meta device: inductor's kernels (remat's one on
    CUDA) allocate only the chunk's loss and write the logit gradients over the logits."""
    loss = logits.new_zeros((), dtype=torch.promote_types(logits.dtype, torch.float32))
    return loss, logits if need_grad else None


def on_cuda(fallback: ChunkFn) -> ChunkFn:
    """chunk_loss_triton for contiguous CUDA logits of KERNEL_DTYPES (when Triton is installed);
    `fallback` for anything else."""
    return dispatch(
        chunk_loss_triton,
        fallback,
        lambda logits, *_: logits.is_cuda and logits.dtype in KERNEL_DTYPES and logits.is_contiguous(),
    )


def scale_grad(grad: Tensor, grad_output: Tensor) -> Tensor:
    """A gradient computed for grad_output 1, scaled by backward's grad_output (0-dim)."""
    return grad * grad_output


def add_scaled_grad(acc: Tensor, grad: Tensor, grad_output: Tensor) -> None:
    """acc += grad * grad_output (0-dim), rounded once: a gradient computed for grad_output 1
    added into an existing .grad."""
    acc.addcmul_(grad, grad_output)


@dataclass(frozen=True)
class LossKernels:
    """The loss head's elementwise work, eager or compiled: a chunk's loss and logit gradients,
    and the scaling of the gradients computed in forward by backward's grad_output (into a new
    tensor, or added into the weight's .grad)."""

    chunk: ChunkFn = chunk_loss_in_place
    scale: Callable[[Tensor, Tensor], Tensor] = scale_grad
    add_scaled: Callable[[Tensor, Tensor, Tensor], None] = add_scaled_grad


@functools.cache
def compiled_loss_kernels(backend: str = "inductor") -> LossKernels:
    # Compiled, not eager: eagerly, a multiply by a 0-dim CUDA tensor broadcasts it and takes
    # torch's unvectorized path (benchmarks/README.md has the profile).
    return LossKernels(
        on_cuda(torch.compile(chunk_loss_fusable, backend=backend)),
        torch.compile(scale_grad, backend=backend),
        torch.compile(add_scaled_grad, backend=backend),
    )


# torch >= 2.8 on CUDA: a bf16/fp16 GEMM may write (mm) or add into (addmm) a float32 output.
_MIXED_ADDMM = "dtype_out" in torch.ops.aten.addmm.overloads() and "dtype" in torch.ops.aten.mm.overloads()


def _accumulate_mm(acc: Tensor | None, a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """acc + a @ b in `dtype` (acc None: a @ b, so no zero-filled buffer). With low-precision
    inputs and a float32 result on CUDA (and on meta, which estimates CUDA), one GEMM adds into
    float32: no rounded low-precision product, no second kernel reading and writing acc."""
    if a.dtype == dtype:
        return a @ b if acc is None else acc.addmm_(a, b)
    if a.device.type in ("cuda", "meta") and _MIXED_ADDMM:
        if acc is None:
            return torch.mm(a, b, out_dtype=dtype)
        if a.device.type == "meta":
            # meta holds no values, and torch 2.11's meta addmm(out_dtype=) fails: writing the
            # product into acc books the same allocations and FLOPs as adding into it
            return torch.mm(a, b, out_dtype=dtype, out=acc)
        return torch.addmm(acc, a, b, out_dtype=dtype, out=acc)
    # elsewhere the operands are cast first, so the product is not rounded to their dtype either
    a, b = a.to(dtype), b.to(dtype)
    return a @ b if acc is None else acc.addmm_(a, b)


def _loss_and_grads(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_size: int,
    ignore_index: int,
    need_hidden: bool,
    need_weight: bool,
    chunk_fn: ChunkFn,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Mean cross-entropy of ``hidden @ weight.T`` and, if asked, its gradients (for grad_output 1)."""
    n_tokens = hidden.shape[0]
    # fp32 for low-precision inputs (softmax over 128K entries needs it); float64 stays float64.
    compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
    valid = labels != ignore_index
    n_valid = valid.sum()
    safe_labels = labels.masked_fill(~valid, 0)
    # An all-ignored batch has loss 0/0 = NaN (as F.cross_entropy); its gradients stay zero, not NaN.
    row_scale = valid.to(compute_dtype) / n_valid.clamp(min=1)

    loss_sum = torch.zeros((), dtype=compute_dtype, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight: Tensor | None = None
    need_grad = need_hidden or need_weight
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        h, chunk_labels = hidden[start:end], safe_labels[start:end]
        # Matmul in the input dtype (tensor cores), softmax statistics in compute_dtype.
        logits = h @ weight.t()
        part, d_low = chunk_fn(logits, chunk_labels, valid[start:end], row_scale[start:end], need_grad)
        loss_sum += part
        del logits
        if need_grad:
            assert d_low is not None  # every chunk function returns the gradient it was asked for
            if grad_hidden is not None:
                torch.mm(d_low, weight, out=grad_hidden[start:end])
            if need_weight:
                grad_weight = _accumulate_mm(grad_weight, d_low.t(), h, compute_dtype)
        del d_low  # may be the logits' buffer: free it before the next chunk's logits exist
    if need_weight and grad_weight is None:  # no tokens
        grad_weight = torch.zeros(weight.shape, dtype=compute_dtype, device=weight.device)
    loss = loss_sum / n_valid
    return loss, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        chunk_size: int,
        ignore_index: int,
        kernels: LossKernels,
        fuse_grads: bool,
    ) -> Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        loss, grad_hidden, grad_weight = _loss_and_grads(
            hidden, weight, labels, chunk_size, ignore_index, need_hidden, need_weight, kernels.chunk
        )
        # torch takes None here; its stub says Tensor
        ctx.save_for_backward(grad_hidden, grad_weight)  # type: ignore[arg-type]
        ctx.weight, ctx.kernels, ctx.fuse_grads = kept_for_grad(weight), kernels, fuse_grads  # type: ignore[attr-defined]
        return loss

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        kernels, weight = ctx.kernels, ctx.weight  # type: ignore[attr-defined]
        if grad_hidden is not None:
            grad_hidden = kernels.scale(grad_hidden, grad_output)
        if grad_weight is not None and accumulates_into_grad(weight, ctx.fuse_grads):  # type: ignore[attr-defined]
            kernels.add_scaled(weight.grad, grad_weight, grad_output)
            grad_weight = None
        elif grad_weight is not None:
            grad_weight = kernels.scale(grad_weight, grad_output)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_size: int,
    ignore_index: int = -100,
    *,
    kernels: LossKernels = LossKernels(),
    fuse_grads: bool = False,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=ignore_index)`` (mean), in chunks.

    hidden [N, h], weight [V, h], labels [N] (int64). At most ``chunk_size`` x V logits exist at a
    time; gradients are computed in the forward pass only for inputs that require grad.
    `kernels` compute a chunk's loss and logit gradients and scale the gradients in backward:
    eager, or `compiled_loss_kernels()`, which fuses the chunk into a few passes over the logits
    and writes the gradients over them. With `fuse_grads`, backward adds the weight's gradient
    into weight.grad as it scales it (where remat.models.kernels.grad_accumulation.accumulates_into_grad).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [N, h] and weight [V, h] with the same h; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must have shape [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index, kernels, fuse_grads)
    # Under no_grad the Function would still report needs_input_grad and compute gradients.
    return _loss_and_grads(hidden, weight, labels, chunk_size, ignore_index, False, False, kernels.chunk)[0]
