"""MoEModel: remat's decoder with mixture-of-experts layers (after any dense first layers) and,
optionally, multi-latent attention; the rest (embedding, norms, RoPE, loss head) is the Llama's."""
from __future__ import annotations

import torch

from remat.models.llama.model import LlamaModel, TransformerLayer
from remat.models.moe.config import MoEConfig
from remat.models.moe.mla import MLASelfAttention
from remat.models.moe.moe_layer import GroupedExperts, MoELayer, TopKRouter, swiglu_with_probs


class MoEModel(LlamaModel):
    config: MoEConfig

    def build_layer(self, index: int, dtype: torch.dtype | None, device: torch.device) -> TransformerLayer:
        c = self.config
        attention = MLASelfAttention(c, dtype=dtype, device=device) if c.multi_latent_attention else None
        if not c.is_moe_layer(index):
            return TransformerLayer(c, dtype=dtype, device=device, self_attention=attention)
        return TransformerLayer(c, dtype=dtype, device=device, self_attention=attention,
                                mlp=MoELayer(c, layer=index, dtype=dtype, device=device), mlp_label="moe")

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

    def update_expert_bias(self) -> None:
        """Every router's balancing step (DeepSeek-V3), after the optimizer's."""
        for router in self.routers():
            router.update_expert_bias()
