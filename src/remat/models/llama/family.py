"""The dense Llama-3 family behind the model seam."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel)

from remat.labels import Label
from remat.models.family import (Fork, ModelFamily, ParallelSizes, SequenceParallelPoints, Target, padded_vocab,
                                 unknown)
from remat.models.llama.config import RECIPES, LlamaConfig
from remat.models.llama.model import MLP, LlamaModel, SelfAttention
from remat.problems import Problem

# The SwiGLU activation between linear_fc1 and linear_fc2: what `moe_act` is in Megatron's
# experts, for a dense MLP. Its output is all linear_fc2 saves, so it can only be discarded.
MLP_ACT = Label("mlp_act", discard=True, discard_only=True, enclosed_by="mlp")


def _model(model: nn.Module) -> LlamaModel:
    if not isinstance(model, LlamaModel):
        raise TypeError(f"the llama family acts on its own LlamaModel, not {type(model).__name__}")
    return model


P = ParamSpec("P")
R = TypeVar("R")


def forked(fork: Fork, fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, drawing its randoms from the stream `fork` swaps in."""
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with fork():
            return fn(*args, **kwargs)
    return run


@torch.no_grad()
def gate_up_by_rank(weight: Tensor, tp: int) -> None:
    """linear_fc1's rows [gate; up] reordered [gate_0; up_0; gate_1; up_1; ...], so that a column
    split gives each rank the gate and up rows of its own FFN share, as Megatron stores them."""
    weight.copy_(weight.unflatten(0, (2, tp, -1)).transpose(0, 1).reshape(weight.shape).clone())


class LlamaFamily(ModelFamily):
    name = "llama"
    labels: tuple[Label, ...] = (MLP_ACT,)
    model_type: type[nn.Module] | None = LlamaModel

    def recipes(self) -> Mapping[str, Mapping[str, Any]]:
        return RECIPES

    # the config class a family of Llama-based models builds (the MoE family's extends it)
    config_type: type[LlamaConfig] = LlamaConfig

    def config(self, recipe: str, **overrides: Any) -> LlamaConfig:
        recipes = self.recipes()
        if recipe not in recipes:
            raise unknown("recipe", recipe, list(recipes))
        # global_layers numbers a shard's layers: the family's shard sets it
        valid = [name for name in self.config_type.field_names() if name != "global_layers"]
        for key in overrides:
            if key not in valid:
                raise unknown("override", key, valid)
        return self.config_type(**self.config_fields(recipes[recipe], overrides))

    def config_fields(self, recipe: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The config's fields: the recipe's, with overrides."""
        return {**recipe, **overrides}

    def build(self, config: LlamaConfig, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None, pre_process: bool = True,
              post_process: bool = True) -> LlamaModel:
        return LlamaModel(config, dtype=dtype, device=device, pre_process=pre_process, post_process=post_process)

    def reset_parameters(self, model: nn.Module) -> None:
        _model(model).init_weights()

    def shard_problems(self, config: LlamaConfig, sizes: ParallelSizes) -> Iterator[Problem]:
        tp, cp = sizes.tensor, sizes.context
        for name, size in (("num_attention_heads", config.num_attention_heads),
                           ("num_query_groups", config.num_query_groups), ("ffn_hidden_size", config.ffn_hidden_size)):
            if tp >= 1 and size % tp:
                yield Problem("tensor_model_parallel_size", f"{name}={size} does not split over {tp} tensor-parallel"
                                                            f" ranks; use a tensor-parallel size that divides it")
        # causal load balancing gives each context-parallel rank two chunks of the sequence
        chunks = 2 * cp if cp > 1 else 1
        seq = config.seq_length
        if cp >= 1 and seq % chunks:
            yield Problem("context_parallel_size", f"seq_length={seq} does not split into {chunks} chunks"
                                                   f" for {cp} context-parallel ranks; use a sequence length that"
                                                   f" is a multiple of {chunks}")
        elif sizes.sequence_parallel and tp > 1 and cp >= 1 and (seq // cp) % tp:
            yield Problem("sequence_parallel", f"each rank's {seq // cp} tokens do not split over {tp}"
                                               f" tensor-parallel ranks; use a sequence length that is a multiple"
                                               f" of {tp * cp}, or turn sequence parallelism off")

    def context_parallel_problems(self, config: LlamaConfig, sizes: ParallelSizes) -> Iterator[Problem]:
        if config.attention_backend != "sdpa":
            yield Problem("attention_backend", f"is {config.attention_backend!r}; torch's context parallelism runs"
                                               " scaled_dot_product_attention as ring attention, and the eager"
                                               " backend computes the scores itself; use sdpa")
        if config.attention_dropout:
            yield Problem("attention_dropout", f"is {config.attention_dropout}; torch's ring attention draws it per"
                                               " block of keys, and its backward replays one block's random state"
                                               " for all of them; use 0 under context parallelism")

    def context_parallel(self, model: nn.Module, group: dist.ProcessGroup) -> list[tuple[Tensor, int]]:
        rotary = _model(model).rotary_pos_emb
        return [(rotary.cos, 0), (rotary.sin, 0)]

    def shard(self, config: LlamaConfig, sizes: ParallelSizes) -> LlamaConfig:
        return dataclasses.replace(config, **self.shard_fields(config, sizes))

    def shard_fields(self, config: LlamaConfig, sizes: ParallelSizes) -> dict[str, Any]:
        """The fields a rank's share replaces: its layers, numbered as in the whole model, and
        its heads, FFN, vocabulary and tokens (a family with more fields adds its own)."""
        tp = sizes.tensor
        layers = sizes.layers or tuple(range(config.num_layers // sizes.pipeline))
        return dict(
            num_layers=len(layers), global_layers=layers,
            num_attention_heads=config.num_attention_heads // tp, num_query_groups=config.num_query_groups // tp,
            ffn_hidden_size=config.ffn_hidden_size // tp, vocab_size=padded_vocab(config.vocab_size, tp),
            seq_length=config.seq_length // sizes.context, kv_channels=config.head_dim)

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

    def sequence_parallel(self, model: nn.Module, tensor_parallel: int) -> SequenceParallelPoints:
        llama = _model(model)
        llama.sequence_parallel_size = tensor_parallel
        blocks: list[nn.Module] = [block for layer in llama.decoder.transformer_layers()
                                   for block in (layer.self_attention, layer.mlp)]
        return SequenceParallelPoints(
            blocks=blocks, split_after=[llama.embedding] if llama.embedding is not None else [],
            gather_after=[llama.decoder] if llama.output_layer is not None else [])

    # the attention and MLP classes whose tensor-parallel plan this family knows (tensor_parallel_part)
    tensor_parallel_parts: tuple[type[nn.Module], ...] = (SelfAttention, MLP)

    def tensor_parallel_problems(self, model: nn.Module, sizes: ParallelSizes) -> Iterator[Problem]:
        llama = _model(model)
        yield from self.shard_problems(llama.config, sizes)
        known = self.tensor_parallel_parts
        others = sorted({type(part).__name__ for layer in llama.decoder.transformer_layers()
                         for part in (layer.self_attention, layer.mlp) if not isinstance(part, known)})
        if others:
            yield Problem("model", f"layers with {', '.join(others)} have no tensor-parallel plan; only"
                                   f" {', '.join(part.__name__ for part in known)} split")

    def tensor_parallel(self, model: nn.Module, sizes: ParallelSizes, fork: Fork) -> dict[str, ParallelStyle]:
        """Megatron's split, in torchtitan's styles: each layer's attention and MLP by
        `tensor_parallel_part`. With sequence parallelism the norms run on this rank's tokens,
        the embedding's output is split and the decoder's gathered again for the loss head."""
        llama = _model(model)
        tokens = Shard(1) if sizes.sequence_parallel else Replicate()
        names = {module: name for name, module in llama.named_modules()}
        plan: dict[str, ParallelStyle] = {}
        for layer in llama.decoder.transformer_layers():
            name = names[layer]
            for part, path in ((layer.self_attention, "self_attention"), (layer.mlp, "mlp")):
                plan |= {f"{name}.{path}{sub}": style for sub, style in
                         self.tensor_parallel_part(part, sizes.tensor, tokens, fork).items()}
            if sizes.sequence_parallel:
                layer.dropout = forked(fork, layer.dropout)  # over this rank's tokens
                plan |= {f"{name}.{norm}": SequenceParallel(use_local_output=True)
                         for norm in ("input_layernorm", "pre_mlp_layernorm")}
        if sizes.sequence_parallel:
            points = self.sequence_parallel(llama, sizes.tensor)
            llama.embedding_dropout = forked(fork, llama.embedding_dropout)
            plan |= {names[m]: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
                     for m in points.split_after}
            plan |= {names[m]: PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
                     for m in points.gather_after}
            if llama.decoder.final_layernorm is not None:
                plan[names[llama.decoder.final_layernorm]] = SequenceParallel(use_local_output=True)
        return plan

    def tensor_parallel_part(self, part: nn.Module, tp: int, tokens: Placement, fork: Fork) -> dict[str, ParallelStyle]:
        """Prepare a layer's attention or MLP `part` (of `tensor_parallel_parts`) to run as one of
        `tp` ranks, its input and output the layer's `tokens` (Shard(1) under sequence
        parallelism); the styles of its modules by path below it ("" the part itself). The dense
        Llama's: linear_qkv and linear_fc1 by columns (whole query groups; each rank's gate and up
        rows), linear_proj and linear_fc2 by rows, attention and the MLP on local tensors; Qwen3's
        q and k norms (one weight for all heads) as torch's SequenceParallel along the heads: the
        weight replicated, its gradient parts summed over the ranks."""
        if isinstance(part, MLP):
            gate_up_by_rank(part.linear_fc1.weight, tp)
            return {".linear_fc1": ColwiseParallel(input_layouts=tokens),
                    ".linear_fc2": RowwiseParallel(output_layouts=tokens)}
        assert isinstance(part, SelfAttention)  # tensor_parallel_problems
        part.num_heads, part.num_groups = part.num_heads // tp, part.num_groups // tp
        part.attention = forked(fork, part.attention)  # over this rank's heads
        plan: dict[str, ParallelStyle] = {".linear_qkv": ColwiseParallel(input_layouts=tokens),
                                          ".linear_proj": RowwiseParallel(output_layouts=tokens)}
        if part.q_layernorm is not None:  # q, k [b, s, heads, d]: this rank's heads
            plan |= {f".{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for norm in ("q_layernorm", "k_layernorm")}
        return plan


FAMILY = LlamaFamily()
