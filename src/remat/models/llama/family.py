"""The dense Llama-3 family behind the model seam."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.config.parallel import ParallelLayout
from remat.core.labels import Label
from remat.core.problems import Problem
from remat.models.family import ModelFamily, Target, padded_vocab, unknown
from remat.models.llama.config import RECIPES, LlamaConfig
from remat.models.llama.model import LlamaModel
from remat.models.llama.parallel import LlamaParallelism

# The SwiGLU activation between linear_fc1 and linear_fc2: what `moe_act` is in Megatron's
# experts, for a dense MLP. Its output is all linear_fc2 saves, so it can only be discarded.
MLP_ACT = Label("mlp_act", discard=True, discard_only=True, enclosed_by="mlp")


def _model(model: nn.Module) -> LlamaModel:
    if not isinstance(model, LlamaModel):
        raise TypeError(f"the llama family acts on its own LlamaModel, not {type(model).__name__}")
    return model


class LlamaFamily(ModelFamily):
    name = "llama"
    labels: tuple[Label, ...] = (MLP_ACT,)
    model_type: type[nn.Module] | None = LlamaModel
    kind = "dense Llama models"
    runs = frozenset({"tp", "pp", "cp"})

    def recipes(self) -> Mapping[str, Mapping[str, Any]]:
        return RECIPES

    # the config class a family of Llama-based models builds (the MoE family's extends it)
    config_type: type[LlamaConfig] = LlamaConfig
    # fields of one rank's share, which the family's shard sets from a layout: no overrides
    shard_only: tuple[str, ...] = ("global_layers",)

    def config(self, recipe: str, **overrides: Any) -> LlamaConfig:
        recipes = self.recipes()
        if recipe not in recipes:
            raise unknown("recipe", recipe, list(recipes))
        valid = [name for name in self.config_type.field_names() if name not in self.shard_only]
        for key in overrides:
            if key not in valid:
                raise unknown("override", key, valid)
        return self.config_type(**self.config_fields(recipes[recipe], overrides))

    def config_fields(self, recipe: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The config's fields: the recipe's, with overrides."""
        return {**recipe, **overrides}

    def build(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> LlamaModel:
        return LlamaModel(config, dtype=dtype, device=device, pre_process=pre_process, post_process=post_process)

    def reset_parameters(self, model: nn.Module) -> None:
        _model(model).init_weights()

    def layout_problems(self, config: LlamaConfig, layout: ParallelLayout) -> Iterator[Problem]:
        yield from super().layout_problems(config, layout)
        tp, cp = layout.tp, layout.cp
        for name, size in (
            ("num_attention_heads", config.num_attention_heads),
            ("num_query_groups", config.num_query_groups),
            ("ffn_hidden_size", config.ffn_hidden_size),
        ):
            if tp >= 1 and size % tp:
                yield Problem(
                    "tensor_model_parallel_size",
                    f"{name}={size} does not split over {tp} tensor-parallel"
                    f" ranks; use a tensor-parallel size that divides it",
                )
        # causal load balancing gives each context-parallel rank two chunks of the sequence
        chunks = 2 * cp if cp > 1 else 1
        seq = config.seq_length
        if cp >= 1 and seq % chunks:
            yield Problem(
                "context_parallel_size",
                f"seq_length={seq} does not split into {chunks} chunks"
                f" for {cp} context-parallel ranks; use a sequence length that"
                f" is a multiple of {chunks}",
            )
        elif layout.sp and tp > 1 and cp >= 1 and (seq // cp) % tp:
            yield Problem(
                "sequence_parallel",
                f"each rank's {seq // cp} tokens do not split over {tp}"
                f" tensor-parallel ranks; use a sequence length that is a multiple"
                f" of {tp * cp}, or turn sequence parallelism off",
            )
        if cp > 1:
            yield from self._context_problems(config)

    def _context_problems(self, config: LlamaConfig) -> Iterator[Problem]:
        if config.attention_backend != "sdpa":
            yield Problem(
                "attention_backend",
                f"is {config.attention_backend!r}; torch's context parallelism runs"
                " scaled_dot_product_attention as ring attention, and the eager"
                " backend computes the scores itself; use sdpa",
            )
        if config.attention_dropout:
            yield Problem(
                "attention_dropout",
                f"is {config.attention_dropout}; torch's ring attention draws it per"
                " block of keys, and its backward replays one block's random state"
                " for all of them; use 0 under context parallelism",
            )

    def shard(self, config: LlamaConfig, layout: ParallelLayout, layers: Sequence[int]) -> LlamaConfig:
        return dataclasses.replace(config, **self.shard_fields(config, layout, tuple(layers)))

    def shard_fields(self, config: LlamaConfig, layout: ParallelLayout, layers: tuple[int, ...]) -> dict[str, Any]:
        """The fields a rank's share replaces: its layers, numbered as in the whole model, and
        its heads, FFN, vocabulary and tokens (a family with more fields adds its own)."""
        tp = layout.tp
        return dict(
            num_layers=len(layers),
            global_layers=layers,
            num_attention_heads=config.num_attention_heads // tp,
            num_query_groups=config.num_query_groups // tp,
            ffn_hidden_size=config.ffn_hidden_size // tp,
            vocab_size=padded_vocab(config.vocab_size, tp),
            seq_length=config.seq_length // layout.cp,
            kv_channels=config.head_dim,
        )

    def flops(self, config: LlamaConfig, tokens_per_seq: int, sequences: int) -> float:
        """6 x (layer parameters + output layer) x tokens for the dense part (the embedding lookup
        is not a matmul), plus 6 x layers x 2 x batch x seq^2 x hidden for attention (QK^T and PV,
        without halving for the causal mask, as the torch anchor counts them)."""
        h, f, d = config.hidden_size, config.ffn_hidden_size, config.head_dim
        layer_params = 2 * h * h + 2 * h * config.num_query_groups * d + 3 * h * f
        dense = 6 * (config.num_layers * layer_params + h * config.vocab_size) * sequences * tokens_per_seq
        attention = 6 * config.num_layers * 2 * sequences * tokens_per_seq**2 * h
        return float(dense + attention)

    def use_kernels(self, model: nn.Module, target: Target, *, compiled: bool, shapes_only: bool = False) -> None:
        llama = _model(model)
        if shapes_only:
            llama.use_shape_kernels(target, compiled)
        elif compiled:
            llama.compile_regions()

    def parallelism(self, model: nn.Module, layout: ParallelLayout) -> LlamaParallelism:
        return LlamaParallelism(_model(model), layout, self.name)


FAMILY = LlamaFamily()
