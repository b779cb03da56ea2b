"""The MoE family (DeepSeek-V3, Qwen3-MoE, Mixtral shapes) behind the model seam."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Placement
from torch.distributed.tensor.parallel import ParallelStyle

from remat.labels import Label
from remat.models.family import Fork, ParallelSizes
from remat.models.llama.config import LlamaConfig
from remat.models.llama.family import LlamaFamily
from remat.models.moe.config import RECIPES, MoEConfig, config_fields
from remat.models.moe.mla import MLASelfAttention
from remat.models.moe.model import MoEModel
from remat.models.moe.moe_layer import MoELayer
from remat.models.moe.tensor_parallel import mla_plan, moe_plan
from remat.problems import ConfigError, Problem


# beside tp, each expert's FFN splits over the tp ranks: Megatron's default expert_tensor_parallel_size
ETP_BESIDE_TP = ("is {}; beside tensor parallelism remat splits each expert over the tensor-parallel ranks, as"
                 " Megatron's default (etp = tp) does; other expert tensor-parallel sizes do not run yet: drop -etp")


def _moe(config: LlamaConfig) -> MoEConfig:
    if not isinstance(config, MoEConfig):
        raise TypeError(f"the moe family takes an MoEConfig, not {type(config).__name__}")
    return config


def _moe_model(model: nn.Module) -> MoEModel:
    if not isinstance(model, MoEModel):
        raise TypeError(f"the moe family acts on its own MoEModel, not {type(model).__name__}")
    return model


class MoEFamily(LlamaFamily):
    """remat's decoder with MoE layers and MLA; the Llama's kernels, pieces and seams otherwise."""

    name = "moe"
    labels: tuple[Label, ...] = ()  # mlp_act is the Llama family's, registered with it

    def recipes(self) -> Mapping[str, Mapping[str, Any]]:
        return RECIPES

    config_type = MoEConfig
    model_type = MoEModel

    def config_fields(self, recipe: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        return config_fields(recipe, overrides)

    def build(self, config: LlamaConfig, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None, pre_process: bool = True,
              post_process: bool = True) -> MoEModel:
        return MoEModel(_moe(config), dtype=dtype, device=device, pre_process=pre_process, post_process=post_process)

    def shard_problems(self, config: LlamaConfig, sizes: ParallelSizes) -> Iterator[Problem]:
        """The Llama's (heads, FFN and sequence over tp and cp; pipeline stages split the layers as
        the Llama's, each keeping the whole model's kinds) and the experts' FFN, which split over tp."""
        yield from super().shard_problems(config, sizes)
        if sizes.tensor > 1:
            yield from self._tensor_problems(_moe(config), sizes)

    def _tensor_problems(self, c: MoEConfig, sizes: ParallelSizes) -> Iterator[Problem]:
        tp = sizes.tensor
        for name, size in (("moe_ffn_hidden_size", c.expert_ffn),
                           ("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size or 0)):
            if size % tp:
                yield Problem("tensor_model_parallel_size", f"{name}={size} does not split over {tp} tensor-parallel"
                                                            " ranks; use a tensor-parallel size that divides it")
        if c.expert_tensor_parallel_size != 1:
            yield Problem("expert_tensor_parallel_size", ETP_BESIDE_TP.format(c.expert_tensor_parallel_size))

    def shard(self, config: LlamaConfig, sizes: ParallelSizes) -> MoEConfig:
        return _moe(super().shard(config, sizes))

    def shard_fields(self, config: LlamaConfig, sizes: ParallelSizes) -> dict[str, Any]:
        """The Llama's (MLA: the up projections' heads), the kind of each of the share's layers
        (dense or MoE) as in the whole model, and each expert's FFN over tp (Megatron's default
        expert_tensor_parallel_size)."""
        c, tp = _moe(config), sizes.tensor
        fields = super().shard_fields(config, sizes)
        shared = c.moe_shared_expert_intermediate_size
        return dict(fields, moe_layer_freq=[int(c.is_moe_layer(i)) for i in fields["global_layers"]],
                    moe_ffn_hidden_size=c.expert_ffn // tp,
                    moe_shared_expert_intermediate_size=shared // tp if shared else shared)

    def data_parallel(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        """The routers' token counts are summed over `group` before each balancing step, as
        Megatron does, so every replica moves the expert bias alike."""
        _moe_model(model).balancing_group = group

    def context_parallel(self, model: nn.Module, group: dist.ProcessGroup) -> list[tuple[torch.Tensor, int]]:
        """The Llama's RoPE tables (MLA's rotated parts read them too); each router's load-balancing
        loss over the group's tokens (TopKRouter.context_group). The expert bias's token counts are
        summed over dp x cp already (`data_parallel`)."""
        for router in _moe_model(model).routers():
            router.context_group = group
        return super().context_parallel(model, group)

    tensor_parallel_parts = (*LlamaFamily.tensor_parallel_parts, MLASelfAttention, MoELayer)

    def tensor_parallel_part(self, part: nn.Module, tp: int, tokens: Placement, fork: Fork) -> dict[str, ParallelStyle]:
        """MLA and MoE layers as Megatron splits them (models/moe/tensor_parallel.py); the Llama's
        parts as it does."""
        if isinstance(part, MLASelfAttention):
            return mla_plan(part, tp, tokens, fork)
        if isinstance(part, MoELayer):
            return moe_plan(part, tp, tokens)
        return super().tensor_parallel_part(part, tp, tokens, fork)

    def expert_parallel_problems(self, model: nn.Module, size: int) -> Iterator[Problem]:
        config = _moe_model(model).config
        if config.expert_model_parallel_size != size:
            yield Problem("expert_model_parallel_size", f"the model was built for {config.expert_model_parallel_size}"
                                                        f" expert-parallel rank(s), not {size}; build it with"
                                                        f" expert_model_parallel_size={size}")
        if config.expert_tensor_parallel_size != 1:
            yield Problem("expert_tensor_parallel_size", f"is {config.expert_tensor_parallel_size}; each expert runs"
                                                         " whole on its rank (no expert tensor parallelism yet;"
                                                         " remat estimate predicts it); use 1")

    def expert_parallel(self, model: nn.Module, group: dist.ProcessGroup) -> list[nn.Module]:
        """Megatron's and torchtitan's split: rank r of the group holds experts [r x local,
        (r + 1) x local) of each MoE layer, and the layer exchanges token slots with the others
        by all-to-all; the router, the shared experts and the rest stay whole on every rank."""
        problems = list(self.expert_parallel_problems(model, dist.get_world_size(group)))
        if problems:
            raise ConfigError(problems)
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.split_experts(group)
        return self.routed_experts(model)

    def routed_experts(self, model: nn.Module) -> list[nn.Module]:
        return [module.experts for module in model.modules() if isinstance(module, MoELayer)]

    def flops(self, config: LlamaConfig, tokens_per_seq: int, sequences: int) -> float:
        """6 x active matmul parameters x tokens (routed experts at top-k, the router, shared
        experts, MLA's projections), plus attention's two matmuls at their head dims (causal mask
        not halved), as for the Llama."""
        c = _moe(config)
        h, heads = c.hidden_size, c.num_attention_heads
        if c.multi_latent_attention:
            qk, v = c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
            q = h * heads * qk if c.q_lora_rank is None else h * c.q_lora_rank + c.q_lora_rank * heads * qk
            attention = q + h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank * heads * (
                c.qk_head_dim + v) + heads * v * h
        else:
            qk = v = c.head_dim
            attention = 2 * h * heads * qk + 2 * h * c.num_query_groups * qk
        moe = h * c.num_moe_experts + c.moe_router_topk * 3 * h * c.expert_ffn + 3 * h * (
            c.moe_shared_expert_intermediate_size or 0)
        mlps = sum(moe if c.is_moe_layer(i) else 3 * h * c.ffn_hidden_size for i in c.layers)
        active = c.num_layers * attention + mlps + h * c.vocab_size
        scores = 6 * c.num_layers * sequences * tokens_per_seq**2 * heads * (qk + v)
        return float(6 * active * sequences * tokens_per_seq + scores)


FAMILY = MoEFamily()
