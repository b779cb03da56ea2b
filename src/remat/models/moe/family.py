"""The MoE family (DeepSeek-V3, Qwen3-MoE, Mixtral shapes) behind the model seam."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.config.parallel import ParallelLayout
from remat.core.labels import Label
from remat.core.problems import Problem
from remat.models.llama.config import LlamaConfig
from remat.models.llama.family import LlamaFamily
from remat.models.moe.config import RECIPES, MoEConfig, config_fields
from remat.models.moe.model import MoEModel
from remat.models.moe.parallel import ETP_BESIDE_TP, MoEParallelism


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
    shard_only = (*LlamaFamily.shard_only, "expert_model_parallel_size", "expert_tensor_parallel_size")
    kind = "MoE models"
    runs = LlamaFamily.runs | {"ep", "etp"}

    def config_fields(self, recipe: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        return config_fields(recipe, overrides)

    def build(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> MoEModel:
        return MoEModel(_moe(config), dtype=dtype, device=device, pre_process=pre_process, post_process=post_process)

    def layout_problems(self, config: LlamaConfig, layout: ParallelLayout) -> Iterator[Problem]:
        """The Llama's (heads, FFN and sequence over tp and cp), the experts over ep ranks and,
        beside tp, their FFN over the tp ranks (Megatron's default expert tensor-parallel size)."""
        yield from super().layout_problems(config, layout)
        c, tp, ep, etp = _moe(config), layout.tp, layout.ep, layout.etp
        if ep >= 1 and c.num_moe_experts % ep:
            yield Problem("expert_model_parallel_size", f"({ep}) must divide num_moe_experts ({c.num_moe_experts})")
        if etp is not None and etp >= 1 and c.expert_ffn % etp:
            yield Problem("expert_tensor_parallel_size", f"({etp}) must divide moe_ffn_hidden_size ({c.expert_ffn})")
        if tp <= 1:
            return
        for name, size in (
            ("moe_ffn_hidden_size", c.expert_ffn),
            ("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size or 0),
        ):
            if size % tp:
                yield Problem(
                    "tensor_model_parallel_size",
                    f"{name}={size} does not split over {tp} tensor-parallel"
                    " ranks; use a tensor-parallel size that divides it",
                )
        if etp == 1:
            yield Problem(
                "expert_tensor_parallel_size",
                "is 1, experts whole on every tensor-parallel rank, which"
                " does not run yet; beside -tp remat splits each expert over"
                " the tensor-parallel ranks as Megatron's default (etp ="
                " tp) does: drop -etp",
            )
        elif etp is not None and etp != tp:
            yield Problem("expert_tensor_parallel_size", ETP_BESIDE_TP.format(etp))

    def shard(self, config: LlamaConfig, layout: ParallelLayout, layers: Sequence[int]) -> MoEConfig:
        return _moe(super().shard(config, layout, layers))

    def shard_fields(self, config: LlamaConfig, layout: ParallelLayout, layers: tuple[int, ...]) -> dict[str, Any]:
        """The Llama's (MLA: the up projections' heads), the kind of each of the share's layers
        (dense or MoE) as in the whole model, its share of the experts, and each expert's FFN over
        tp (Megatron's default expert tensor-parallel size) or else over etp."""
        c, tp = _moe(config), layout.tp
        fields = super().shard_fields(config, layout, layers)
        shared = c.moe_shared_expert_intermediate_size
        return dict(
            fields,
            moe_layer_freq=[int(c.is_moe_layer(i)) for i in fields["global_layers"]],
            moe_ffn_hidden_size=c.expert_ffn // tp,
            moe_shared_expert_intermediate_size=shared // tp if shared else shared,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=(layout.etp or 1) if tp == 1 else 1,
        )

    def parallelism(self, model: nn.Module, layout: ParallelLayout) -> MoEParallelism:
        return MoEParallelism(_moe_model(model), layout, self.name)

    def flops(self, config: LlamaConfig, tokens_per_seq: int, sequences: int) -> float:
        """6 x active matmul parameters x tokens (routed experts at top-k, the router, shared
        experts, MLA's projections), plus attention's two matmuls at their head dims (causal mask
        not halved), as for the Llama."""
        c = _moe(config)
        h, heads = c.hidden_size, c.num_attention_heads
        if c.multi_latent_attention:
            qk, v = c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
            q = h * heads * qk if c.q_lora_rank is None else h * c.q_lora_rank + c.q_lora_rank * heads * qk
            attention = (
                q
                + h * (c.kv_lora_rank + c.qk_pos_emb_head_dim)
                + c.kv_lora_rank * heads * (c.qk_head_dim + v)
                + heads * v * h
            )
        else:
            qk = v = c.head_dim
            attention = 2 * h * heads * qk + 2 * h * c.num_query_groups * qk
        moe = (
            h * c.num_moe_experts
            + c.moe_router_topk * 3 * h * c.expert_ffn
            + 3 * h * (c.moe_shared_expert_intermediate_size or 0)
        )
        mlps = sum(moe if c.is_moe_layer(i) else 3 * h * c.ffn_hidden_size for i in c.layers)
        active = c.num_layers * attention + mlps + h * c.vocab_size
        scores = 6 * c.num_layers * sequences * tokens_per_seq**2 * heads * (qk + v)
        return float(6 * active * sequences * tokens_per_seq + scores)


FAMILY = MoEFamily()
