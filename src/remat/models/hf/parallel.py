"""Hugging Face causal LMs under a parallel layout: tensor (and sequence) parallelism by each
model's own plan (`tensor_parallel.py`), context parallelism by its rotary embedding taking the
rank's positions (`context_parallel.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ParallelStyle

from remat.core.problems import Problem
from remat.models.family import Fork, ModelParallelism, SequenceParallelPoints
from remat.models.hf import context_parallel, tensor_parallel


class HfParallelism(ModelParallelism):
    shifts_labels = True  # HF's causal-LM loss

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        yield from tensor_parallel.model_problems(self.model, self.layout)

    def tensor_parallel(self, fork: Fork) -> dict[str, ParallelStyle]:
        return tensor_parallel.styles(self.model, fork, self.layout.sp)

    def sequence_points(self) -> SequenceParallelPoints:
        return tensor_parallel.sequence_points(self.model)

    def context_buffers(self, group: dist.ProcessGroup) -> list[tuple[torch.Tensor, int]]:
        context_parallel.prepare(self.model, self.layout)
        return []  # the rotary embedding takes its tokens' positions instead (set_positions)

    def set_positions(self, positions: torch.Tensor | None) -> None:
        context_parallel.set_positions(self.model, positions)
