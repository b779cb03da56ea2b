"""MoEModel: remat's decoder with mixture-of-experts layers (after any dense first layers) and,
optionally, multi-latent attention; the rest (embedding, norms, RoPE, loss head) is the Llama's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from remat.models.llama.model import LlamaModel, TransformerLayer
from remat.models.moe.config import MoEConfig
from remat.models.moe.mla import MLASelfAttention
from remat.models.moe.moe_layer import GroupedExperts, MoELayer, TopKRouter, swiglu_with_probs


class MoEModel(LlamaModel):
    config: MoEConfig
    # the data-parallel replicas whose token counts the balancing step sums (MoEFamily.data_parallel)
    balancing_group: dist.ProcessGroup | None = None

    def build_layer(self, index: int, dtype: torch.dtype | None, device: torch.device) -> TransformerLayer:
        c = self.config
        attention = MLASelfAttention(c, dtype=dtype, device=device) if c.multi_latent_attention else None
        if not c.is_moe_layer(index):
            return TransformerLayer(c, dtype=dtype, device=device, self_attention=attention)
        return TransformerLayer(
            c,
            dtype=dtype,
            device=device,
            self_attention=attention,
            mlp=MoELayer(c, layer=index, dtype=dtype, device=device),
            mlp_label="moe",
        )

    def compile_regions(self, backend: str = "inductor") -> None:
        """The Llama's regions, and the experts' activation with its routing probabilities."""
        super().compile_regions(backend)
        activation = torch.compile(swiglu_with_probs, backend=backend)
        for module in self.modules():
            if isinstance(module, GroupedExperts):
                module.activation = activation

    def routers(self) -> list[TopKRouter]:
        return [module for module in self.modules() if isinstance(module, TopKRouter)]

    def after_optimizer_step(self) -> None:
        """What a training step runs after the optimizer's: the routers' balancing step."""
        self.update_expert_bias()

    def set_loss_scale(self, scale: float) -> None:
        """The factor the step scales each micro-batch's loss by (1 / micro-batches): the
        auxiliary losses' gradients are scaled alike (Megatron's MoEAuxLossAutoScaler.set_loss_scale)."""
        for router in self.routers():
            router.loss_scale = scale

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Every router's balancing step (DeepSeek-V3), after the optimizer's: on the token counts
        of all data-parallel replicas where there are several (one all-reduce for all routers, as
        Megatron's), so that every replica keeps the same bias."""
        routers = [router for router in self.routers() if router.config.moe_router_enable_expert_bias]
        if routers and self.balancing_group is not None:
            counts = torch.stack([router.local_tokens_per_expert for router in routers])
            dist.all_reduce(counts, group=self.balancing_group)
            for router, summed in zip(routers, counts):
                router.local_tokens_per_expert.copy_(summed)
        for router in routers:
            router.update_expert_bias()
