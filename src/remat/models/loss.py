"""Chunked linear + cross-entropy: the loss head without the full [tokens, vocab] fp32 logits.

With a 128K vocabulary the fp32 logits of 16K tokens take 8 GiB, more than several layers of
kept activations. Here the logits exist one token chunk at a time, and the gradients w.r.t. the
hidden states and the output weight are computed in the forward pass, chunk by chunk, so the
backward pass only scales them.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _loss_and_grads(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_size: int,
    ignore_index: int,
    need_hidden: bool,
    need_weight: bool,
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
    grad_weight = (
        torch.zeros(weight.shape, dtype=compute_dtype, device=weight.device) if need_weight else None
    )
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        h, chunk_labels = hidden[start:end], safe_labels[start:end]
        # Matmul in the input dtype (tensor cores), softmax statistics in compute_dtype.
        logits = (h @ weight.t()).to(compute_dtype)
        lse = torch.logsumexp(logits, dim=-1)
        target = logits.gather(1, chunk_labels[:, None]).squeeze(1)
        loss_sum += torch.where(valid[start:end], lse - target, 0.0).sum()
        if not (need_hidden or need_weight):
            continue
        # d loss / d logits = (softmax - onehot) / n_valid, built in place in the logits buffer.
        d_logits = logits.sub_(lse[:, None]).exp_()
        d_logits[torch.arange(end - start, device=d_logits.device), chunk_labels] -= 1.0
        d_logits.mul_(row_scale[start:end, None])
        d_low = d_logits.to(weight.dtype)
        del logits, d_logits  # free the fp32 chunk before the two matmuls allocate
        if grad_hidden is not None:
            grad_hidden[start:end] = d_low @ weight
        if grad_weight is not None:
            grad_weight.add_(d_low.t() @ h)
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
    ) -> Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        loss, grad_hidden, grad_weight = _loss_and_grads(
            hidden, weight, labels, chunk_size, ignore_index, need_hidden, need_weight
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        return _scaled(grad_hidden, grad_output), _scaled(grad_weight, grad_output), None, None, None


def _scaled(grad: Tensor | None, grad_output: Tensor) -> Tensor | None:
    return None if grad is None else grad * grad_output


def chunked_linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, ignore_index: int = -100
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, labels, ignore_index=ignore_index)`` (mean), in chunks.

    hidden [N, h], weight [V, h], labels [N] (int64). At most ``chunk_size`` x V logits exist at a
    time; gradients are computed in the forward pass only for inputs that require grad.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [N, h] and weight [V, h] with the same h; got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must have shape [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, ignore_index)
    # Under no_grad the Function would still report needs_input_grad and compute gradients.
    return _loss_and_grads(hidden, weight, labels, chunk_size, ignore_index, False, False)[0]
