"""remat's MoE models under a parallel layout: the Llama's plan, with MLA and MoE layers split by
tensor parallelism as Megatron splits them (models/moe/tensor_parallel.py), the routers' load over
the context-parallel group and the replicas, and the routed experts split over expert-parallel
ranks."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Placement
from torch.distributed.tensor.parallel import ParallelStyle

from remat.core.problems import Problem
from remat.models.family import Fork
from remat.models.llama.parallel import LlamaParallelism
from remat.models.moe.mla import MLASelfAttention
from remat.models.moe.model import MoEModel
from remat.models.moe.moe_layer import MoELayer
from remat.models.moe.tensor_parallel import mla_styles, moe_styles

# beside tp, each expert's FFN splits over the tp ranks: Megatron's default expert_tensor_parallel_size
ETP_BESIDE_TP = (
    "is {}; beside tensor parallelism remat splits each expert over the tensor-parallel ranks, as"
    " Megatron's default (etp = tp) does; other expert tensor-parallel sizes do not run yet: drop -etp"
)


class MoEParallelism(LlamaParallelism):
    parts = (*LlamaParallelism.parts, MLASelfAttention, MoELayer)

    @property
    def moe(self) -> MoEModel:
        assert isinstance(self.model, MoEModel)  # the family builds it
        return self.model

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        config, layout = self.moe.config, self.layout
        if layout.ep > 1 and config.expert_model_parallel_size != layout.ep:
            yield Problem(
                "expert_model_parallel_size",
                f"the model was built for {config.expert_model_parallel_size}"
                f" expert-parallel rank(s), not {layout.ep}; build it with"
                f" expert_model_parallel_size={layout.ep}",
            )
        built = config.expert_tensor_parallel_size  # 1 unless built for expert tensor parallelism without tp
        if layout.tp == 1 and (etp := built if built != 1 else layout.etp or 1) != 1:
            yield Problem(
                "expert_tensor_parallel_size",
                f"is {etp}; each expert runs whole on its rank (no expert"
                " tensor parallelism yet; remat estimate predicts it); use 1",
            )
        elif layout.tp > 1 and built != 1:
            yield Problem("expert_tensor_parallel_size", ETP_BESIDE_TP.format(built))

    def tensor_parallel_part(self, part: nn.Module, tokens: Placement, fork: Fork) -> dict[str, ParallelStyle]:
        """MLA and MoE layers as Megatron splits them; the Llama's parts as it does."""
        if isinstance(part, MLASelfAttention):
            return mla_styles(part, self.layout.tp, tokens, fork)
        if isinstance(part, MoELayer):
            return moe_styles(part, self.layout.tp, tokens)
        return super().tensor_parallel_part(part, tokens, fork)

    def replicas(self, group: dist.ProcessGroup) -> None:
        """The routers' token counts are summed over `group` before each balancing step, as
        Megatron does, so every replica moves the expert bias alike."""
        self.moe.balancing_group = group

    def context_buffers(self, group: dist.ProcessGroup) -> list[tuple[torch.Tensor, int]]:
        """The Llama's RoPE tables (MLA's rotated parts read them too); each router's load-balancing
        loss over the group's tokens (TopKRouter.context_group). The expert bias's token counts are
        summed over dp x cp already (`replicas`)."""
        for router in self.moe.routers():
            router.context_group = group
        return super().context_buffers(group)

    def routed_experts(self) -> list[nn.Module]:
        return [module.experts for module in self.model.modules() if isinstance(module, MoELayer)]

    def split_experts(self, group: dist.ProcessGroup) -> list[nn.Module]:
        """Megatron's and torchtitan's split: rank r of the group holds experts [r x local,
        (r + 1) x local) of each MoE layer, and the layer exchanges token slots with the others
        by all-to-all; the router, the shared experts and the rest stay whole on every rank.
        Its callers have run `problems()`."""
        for layer in self.model.modules():
            if isinstance(layer, MoELayer):
                layer.split_experts(group)
        return self.routed_experts()
