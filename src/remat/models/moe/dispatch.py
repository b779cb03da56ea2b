"""Token slots to their experts and back: Megatron Core's dropless permutation, and under expert
parallelism its all-to-all dispatcher on torch's autograd-aware all-to-all (torchtitan's
ExpertParallel). Every op is deterministic, so a recompute replays the same routing and the same
sums (a scatter-add's atomics would not)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

# The routed experts: (rows grouped by local expert, their routing probabilities, where each
# expert's rows end) -> their outputs.
Experts = Callable[[Tensor, Tensor, Tensor], Tensor]


class _Permute(torch.autograd.Function):
    """Rows of x in expert order: row j of the result is token order[j] // k. Backward sums each
    token's k gradient rows in a fixed order (index_put's atomics would not be reproducible)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, topk: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return x[order // topk]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        return grad[inverse].view(-1, ctx.topk, grad.shape[-1]).sum(1), None, None, None


class _Unpermute(torch.autograd.Function):
    """Back to token order, summing each token's k expert outputs in a fixed order."""

    @staticmethod
    def forward(ctx, y: Tensor, order: Tensor, inverse: Tensor, topk: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(order)
        ctx.topk = topk
        return y[inverse].view(-1, topk, y.shape[-1]).sum(1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return grad[order // ctx.topk], None, None, None


def sorting(keys: Tensor) -> tuple[Tensor, Tensor]:
    """(order, inverse): the stable sort of `keys` and the permutation that undoes it."""
    order = torch.argsort(keys, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inverse


def permute(x: Tensor, keys: Tensor, topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rows of x sorted by `keys`, one per token slot; order; inverse); `unpermute` undoes it."""
    order, inverse = sorting(keys)
    return _Permute.apply(x, order, inverse, topk), order, inverse


def unpermute(y: Tensor, order: Tensor, inverse: Tensor, topk: int) -> Tensor:
    return _Unpermute.apply(y, order, inverse, topk)


def expert_offsets(counts: Tensor) -> Tensor:
    """Where each expert's rows end, as the grouped matmuls take it."""
    return torch.cumsum(counts, 0).to(torch.int32)


class AllToAll:
    """Token slots, sorted by global expert, to the ranks of `group` that hold their experts
    (rank r the experts [r x local, (r + 1) x local)), and the experts' outputs back to the ranks
    their tokens came from, both by torch's autograd-aware all-to-all; the backward of each is the
    opposite exchange. How many rows go where is exchanged first (Megatron's preprocess, a
    device-to-host sync)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, experts: Experts, x: Tensor, probs: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """x [slots, hidden] and probs [slots] sorted by global expert, tokens_per_expert [experts]
        this rank's; returns the experts' outputs for these slots, in the same order."""
        with torch.no_grad():
            received = torch.empty_like(tokens_per_expert)
            dist.all_to_all_single(received, tokens_per_expert, group=self.group)
        received = received.view(self.size, -1)  # [source rank, local expert]
        sent_rows = tokens_per_expert.view(self.size, -1).sum(1).tolist()
        received_rows = received.sum(1).tolist()
        x = all_to_all_single_autograd(x, received_rows, sent_rows, self.group)
        probs = all_to_all_single_autograd(probs, received_rows, sent_rows, self.group)
        # rows arrive by source rank, then local expert; the grouped matmuls take them by local expert
        local_expert = torch.arange(received.shape[1], device=x.device).repeat(self.size)
        grouped, order, inverse = permute(x, local_expert.repeat_interleave(received.flatten()), 1)
        y = experts(grouped, probs[order], expert_offsets(received.sum(0)))
        return all_to_all_single_autograd(unpermute(y, order, inverse, 1), sent_rows, received_rows, self.group)
