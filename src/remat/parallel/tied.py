"""Weights tied across a pipeline, as Megatron's embedding group keeps them: a model whose input
embedding and output layer share one weight holds a copy on each end of the pipeline (the first
stage's embedding, the last stage's output layer). The last stage's copy starts as the first's,
and after a step's backward each end adds the other's gradient, so the optimizer moves both
copies alike.

A chunk names what it shares with the other end by its `tied_parameters()` method, in the same
order on both ends; a chunk without one ties nothing. Megatron all-reduces over a group of the
first and last pipeline ranks; here the two ends exchange over the pipeline's own group (one send
and one receive each: the bytes of a two-rank all-reduce, and no further communicator), receiving
into a buffer the size of the gradient for the exchange."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def tied_parameters(chunk: nn.Module) -> list[nn.Parameter]:
    """What `chunk` shares with the chunk at the other end of its pipeline (read when used: FSDP2
    replaces a module's parameters with its shards)."""
    found = getattr(chunk, "tied_parameters", None)
    return list(found()) if callable(found) else []


def _local(tensor: Tensor) -> Tensor:
    """This rank's part (an FSDP2 shard: the same shape on both ends, sharded alike over dp)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TiedEnds:
    """The tied parameters of a pipeline rank's first chunk (if it runs the pipeline's first
    stage) and last chunk (if it runs the last); `group`: the pipeline's ranks, first to last."""

    def __init__(
        self, chunks: Sequence[nn.Module], *, first: bool, last: bool, group: dist.ProcessGroup | None
    ) -> None:
        self.chunks, self.first, self.last, self.group = chunks, first, last, group

    def _ends(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return (
            tied_parameters(self.chunks[0]) if self.first else [],
            tied_parameters(self.chunks[-1]) if self.last else [],
        )

    @torch.no_grad()
    def copy_first(self) -> None:
        """The last stage's copies set to the first's (after the weights are initialized)."""
        first, last = self._ends()
        if first and last:  # one rank runs both ends (one stage of virtual chunks)
            for a, b in zip(first, last):
                _local(b).copy_(_local(a))
        elif first:
            for p in first:
                dist.send(_local(p), group=self.group, group_dst=dist.get_world_size(self.group) - 1)
        else:
            for p in last:
                dist.recv(_local(p), group=self.group, group_src=0)

    @torch.no_grad()
    def start_step(self) -> None:
        """Before a step: the last stage's gradients, equal to the first's since the last sum,
        start from zero, so the step's sum counts gradients accumulated before it once."""
        for p in self._ends()[1]:
            if (grad := _gradient(p)) is not None:
                grad.zero_()

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """After a step's backward: each copy's gradient is the sum of both (a + b on one end,
        b + a on the other: the same sum)."""
        first, last = self._ends()
        mine = [_local(_summed(p)) for p in first + last]
        if first and last:
            for a, b in zip(mine[: len(first)], mine[len(first) :]):
                b.add_(a)
                a.copy_(b)
            return
        if not mine:
            return
        peer = dist.get_world_size(self.group) - 1 if first else 0
        theirs = [torch.empty_like(g) for g in mine]
        ops = [dist.P2POp(dist.isend, g, group=self.group, group_peer=peer) for g in mine]
        ops += [dist.P2POp(dist.irecv, g, group=self.group, group_peer=peer) for g in theirs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for g, other in zip(mine, theirs):
            g.add_(other)


def _gradient(p: nn.Parameter) -> Tensor | None:
    """Where `p`'s gradient accumulates: `.grad`, or Megatron's main gradient that an optimizer
    keeping main parameters moves it into during backward (`MainParamsAdamW`)."""
    return p.grad if p.grad is not None else getattr(p, "main_grad", None)


def _summed(p: nn.Parameter) -> Tensor:
    grad = _gradient(p)
    if grad is None:  # alike on both ends: neither waits for the other's exchange
        raise RuntimeError("a weight tied across pipeline stages has no gradient after the step's backward")
    return grad
