"""The dense Llama under a parallel layout: Megatron's tensor-parallel split in torchtitan's styles,
where sequence parallelism communicates, and the RoPE tables context parallelism shards."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from remat.core.problems import Problem
from remat.models.family import Fork, ModelParallelism, SequenceParallelPoints
from remat.models.llama.model import MLP, LlamaModel, SelfAttention

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


class LlamaParallelism(ModelParallelism):
    """A LlamaModel under tensor, sequence and context parallelism."""

    # the attention and MLP classes whose tensor-parallel split it knows (tensor_parallel_part)
    parts: tuple[type[nn.Module], ...] = (SelfAttention, MLP)

    @property
    def llama(self) -> LlamaModel:
        assert isinstance(self.model, LlamaModel)  # the family builds it
        return self.model

    def problems(self) -> Iterator[Problem]:
        yield from super().problems()
        if self.layout.tp == 1:
            return
        others = sorted(
            {
                type(part).__name__
                for layer in self.llama.decoder.transformer_layers()
                for part in (layer.self_attention, layer.mlp)
                if not isinstance(part, self.parts)
            }
        )
        if others:
            yield Problem(
                "model",
                f"layers with {', '.join(others)} have no tensor-parallel split; only"
                f" {', '.join(part.__name__ for part in self.parts)} split",
            )

    def tensor_parallel(self, fork: Fork) -> dict[str, ParallelStyle]:
        """Megatron's split, in torchtitan's styles: each layer's attention and MLP by
        `tensor_parallel_part`. With sequence parallelism the norms run on this rank's tokens,
        the embedding's output is split and the decoder's gathered again for the loss head."""
        llama, sp = self.llama, self.layout.sp
        tokens = Shard(1) if sp else Replicate()
        names = {module: name for name, module in llama.named_modules()}
        plan: dict[str, ParallelStyle] = {}
        for layer in llama.decoder.transformer_layers():
            name = names[layer]
            for part, path in ((layer.self_attention, "self_attention"), (layer.mlp, "mlp")):
                plan |= {
                    f"{name}.{path}{sub}": style for sub, style in self.tensor_parallel_part(part, tokens, fork).items()
                }
            if sp:
                layer.dropout = forked(fork, layer.dropout)  # over this rank's tokens
                plan |= {
                    f"{name}.{norm}": SequenceParallel(use_local_output=True)
                    for norm in ("input_layernorm", "pre_mlp_layernorm")
                }
        if sp:
            points = self.sequence_points()
            llama.embedding_dropout = forked(fork, llama.embedding_dropout)
            plan |= {
                names[m]: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
                for m in points.split_after
            }
            plan |= {
                names[m]: PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
                for m in points.gather_after
            }
            if llama.decoder.final_layernorm is not None:
                plan[names[llama.decoder.final_layernorm]] = SequenceParallel(use_local_output=True)
        return plan

    def tensor_parallel_part(self, part: nn.Module, tokens: Placement, fork: Fork) -> dict[str, ParallelStyle]:
        """Prepare a layer's attention or MLP `part` (of `parts`) to run as one of tp ranks, its
        input and output the layer's `tokens` (Shard(1) under sequence parallelism); the styles of
        its modules by path below it ("" the part itself). The dense Llama's: linear_qkv and
        linear_fc1 by columns (whole query groups; each rank's gate and up rows), linear_proj and
        linear_fc2 by rows, attention and the MLP on local tensors; Qwen3's q and k norms (one
        weight for all heads) as torch's SequenceParallel along the heads: the weight replicated,
        its gradient parts summed over the ranks."""
        tp = self.layout.tp
        if isinstance(part, MLP):
            gate_up_by_rank(part.linear_fc1.weight, tp)
            # the whole model's rows as the split stores them: weights drawn again whole
            # (remat.parallel.seeding) are reordered so before each rank's rows are cut
            vars(part.linear_fc1)["whole_to_split"] = {"weight": functools.partial(gate_up_by_rank, tp=tp)}
            return {
                ".linear_fc1": ColwiseParallel(input_layouts=tokens),
                ".linear_fc2": RowwiseParallel(output_layouts=tokens),
            }
        assert isinstance(part, SelfAttention)  # problems()
        part.num_heads, part.num_groups = part.num_heads // tp, part.num_groups // tp
        part.attention = forked(fork, part.attention)  # over this rank's heads
        plan: dict[str, ParallelStyle] = {
            ".linear_qkv": ColwiseParallel(input_layouts=tokens),
            ".linear_proj": RowwiseParallel(output_layouts=tokens),
        }
        if part.q_layernorm is not None:  # q, k [b, s, heads, d]: this rank's heads
            plan |= {
                f".{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
                for norm in ("q_layernorm", "k_layernorm")
            }
        return plan

    def sequence_points(self) -> SequenceParallelPoints:
        llama = self.llama
        llama.sequence_parallel_size = self.layout.tp
        blocks: list[nn.Module] = [
            block for layer in llama.decoder.transformer_layers() for block in (layer.self_attention, layer.mlp)
        ]
        return SequenceParallelPoints(
            blocks=blocks,
            split_after=[llama.embedding] if llama.embedding is not None else [],
            gather_after=[llama.decoder] if llama.output_layer is not None else [],
        )

    def context_buffers(self, group: dist.ProcessGroup) -> list[tuple[Tensor, int]]:
        rotary = self.llama.rotary_pos_emb
        return [(rotary.cos, 0), (rotary.sin, 0)]
