"""Pipeline parallelism through `torch.distributed.pipelining`: each rank runs its model chunks
(stages) under torch's 1F1B schedule, or interleaved 1F1B with virtual stages.

A chunk is a model a family builds with a share of the layers: the first stage's with the
embedding (pre-process), the last stage's with the final norm and loss head (post-process), so
the last stage's output is already the micro-batch's loss. With `vp` virtual stages, rank r runs
stages r, r + pp, r + 2 pp, ... as Megatron and torch order them. Recompute acts inside each
chunk (its Sites) and knows nothing of the schedule; the schedule decides how many micro-batches
each stage holds at once (pp - r of them under 1F1B on rank r).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from remat.config.parallel import ParallelLayout
from remat.parallel.tied import TiedEnds
from remat.sites.calls import after_optimizer_step, set_loss_scale


class Pipeline(nn.Module):
    """This rank's model chunks and the schedule that trains them; `forward_backward` is one
    step's micro-batches."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        layout: ParallelLayout,
        *,
        pipeline_rank: int,
        hidden: Tensor,
        micro_batches: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """`hidden`: a meta tensor shaped as one micro-batch's hidden states between stages (its
        dtype the model's); `group`: the ranks of this pipeline, first stage to last (default: all)."""
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.layout, self.micro_batches, self.group = layout, micro_batches, group
        self.stage_indices = indices = layout.stage_indices(pipeline_rank)
        self.is_first, self.is_last = indices[0] == 0, indices[-1] == layout.chunks - 1
        device = next(self.chunks.parameters()).device
        tokens = torch.empty(hidden.shape[:2], dtype=torch.long, device="meta")
        # the loss head reduces in float32 at least (bf16 hidden states, float32 loss)
        loss = torch.empty((), dtype=torch.promote_types(hidden.dtype, torch.float32), device="meta")
        # hidden states carry gradients back: torch sets up their receives from requires_grad
        hidden = hidden.detach().requires_grad_()
        stages = [
            PipelineStage(
                chunk,
                index,
                layout.chunks,
                device,
                input_args=tokens if index == 0 else hidden,
                output_args=loss if index == layout.chunks - 1 else hidden,
                group=group,
            )
            for chunk, index in zip(self.chunks, indices)
        ]
        self.schedule = _schedule(stages, micro_batches, layout)
        self.tied = TiedEnds(chunks, first=self.is_first, last=self.is_last, group=group)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The last stage's copies of weights tied to the first stage's (a tied embedding) set to
        them; again whenever the weights are initialized or loaded anew."""
        self.tied.copy_first()

    def forward_backward(
        self, batches: Sequence[tuple[Tensor, Tensor]], weights: Sequence[Tensor | float] | None = None
    ) -> Tensor:
        """Forward and backward of the micro-batches `batches` (inputs, labels), each loss times
        its weight (under context parallelism, the rank's share of its labelled tokens; default 1);
        gradients accumulate in the chunks. Returns the mean loss, on every rank of the pipeline."""
        inputs = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        for chunk in self.chunks:  # the scale `_schedule`'s loss function applies
            set_loss_scale(chunk, 1 / self.micro_batches)
        losses: list[Tensor] = []
        self.tied.start_step()
        args = (inputs,) if self.is_first else ()
        # the last stage's output is its loss already: torch splits the weights as its targets
        target = torch.tensor([float(w) for w in weights or [1.0] * len(batches)], device=labels.device)
        self.schedule.step(
            *args,
            target=target if self.is_last else None,
            labels=labels,
            losses=losses if self.is_last else None,
            **_NO_OUTPUTS,
        )
        self.tied.sum_gradients()
        # float64 on every stage: the ranks must agree on the size of what they reduce
        total = torch.zeros((), dtype=torch.float64, device=labels.device)
        if self.is_last:
            total += torch.stack([loss.detach() for loss in losses]).sum()
        dist.all_reduce(total, group=self.group)  # the last stage's, to every stage
        return total

    def after_optimizer_step(self) -> None:
        """Each chunk's own work after the optimizer's step (an MoE stage's balancing)."""
        for chunk in self.chunks:
            after_optimizer_step(chunk)


# the last stage's outputs (scalar losses) are not merged into a batch where torch can skip it
_NO_OUTPUTS: dict[str, Any] = (
    {"return_outputs": False} if "return_outputs" in inspect.signature(Schedule1F1B.step).parameters else {}
)


# torch's class that runs each of ParallelLayout's SCHEDULES (a PipelineScheduleMulti takes a
# rank's stages as a list, a PipelineScheduleSingle its one stage)
TORCH_SCHEDULES: dict[str, type[PipelineScheduleSingle] | type[PipelineScheduleMulti]] = {
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


def _schedule(
    stages: list[PipelineStage], micro_batches: int, layout: ParallelLayout
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """torch's schedule of the layout. The last stage's output is the micro-batch's mean loss,
    its target the loss's weight [1]; the step's loss is their mean, so each is scaled here and
    torch scales nothing."""

    def scaled(output: Tensor, weight: Tensor) -> Tensor:
        return output * weight[0] / micro_batches

    schedule = TORCH_SCHEDULES[layout.pipeline_schedule]
    options = {"scale_grads": False} if "scale_grads" in inspect.signature(schedule.__init__).parameters else {}
    chunks = stages if issubclass(schedule, PipelineScheduleMulti) else stages[0]
    return schedule(chunks, micro_batches, loss_fn=scaled, **options)  # type: ignore[arg-type]


def model_chunks(model: nn.Module) -> list[nn.Module]:
    """The models whose Sites a plan acts on: a pipeline's chunks, or the model itself."""
    return list(model.chunks) if isinstance(model, Pipeline) else [model]
