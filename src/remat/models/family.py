"""The model-family seam: what remat needs from a family of models, and nothing else.

A family knows its recipes and how to build a model from a config, with or without the first
stage's embedding and the last stage's loss head (pipeline pre- and post-process); how one
rank's share of a parallel layout looks by shape; the model FLOPs of a step; the fast kernels
a target runs; where sequence parallelism communicates; which of torch's tensor-parallel
styles each module of a built model takes; what context parallelism shards beside the
batch or tells the model (its tokens' positions); what its models share with their
data-parallel replicas; and how its routed experts split over an expert-parallel group. The
model it builds places `Site`s and knows nothing else of recompute. Code outside
`remat.models` reaches a family only through this interface.
"""
from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from remat.labels import Label
from remat.placement import Adapter
from remat.problems import ConfigError, Problem

Target = Literal["cuda", "cpu"]
# Runs what it encloses drawing from a tensor-parallel rank's own random stream (Megatron's
# get_cuda_rng_tracker().fork()): dropout on what only this rank holds.
Fork = Callable[[], AbstractContextManager[None]]
# Megatron pads the vocabulary to a multiple of this times tp (make_vocab_size_divisible_by).
VOCAB_DIVISOR = 128


class ModelConfig(Protocol):
    """What remat reads from any family's config."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def seq_length(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def attention_dropout(self) -> float: ...
    @property
    def hidden_dropout(self) -> float: ...

    def record(self) -> dict[str, Any]:
        """The model's shape as a benchmark result records it (compared with a golden's)."""
        ...

    def megatron_facts(self) -> dict[str, Any]:
        """The Megatron keys the model fixes for the recompute rules (layers, dropout, MoE, MLA)."""
        ...


def one_device_problems(sizes: ParallelSizes, what: str) -> Iterator[Problem]:
    """A family that runs on one device only: every parallel size above 1, named."""
    for field, size in (("tensor_model_parallel_size", sizes.tensor), ("pipeline_model_parallel_size", sizes.pipeline),
                        ("context_parallel_size", sizes.context)):
        if size != 1:
            yield Problem(field, f"is {size}; {what} run on one device for now; use 1")


def dense_facts(config: ModelConfig) -> dict[str, Any]:
    """The recompute rules' keys every model fixes: its layers and dropout."""
    return {"num_layers": config.num_layers, "attention_dropout": config.attention_dropout,
            "hidden_dropout": config.hidden_dropout}


@dataclass(frozen=True)
class ParallelSizes:
    """One rank's place in a parallel layout, in Megatron's sizes."""

    tensor: int = 1
    sequence_parallel: bool = False
    pipeline: int = 1
    context: int = 1
    # The whole model's layers this rank's model holds, in order (a pipeline stage's, or a rank's
    # virtual stages back to back); empty: the first num_layers / pipeline.
    layers: tuple[int, ...] = ()

    @property
    def sequence_split(self) -> int:
        """How many ways sequence parallelism splits the tokens outside attention and MLP."""
        return self.tensor if self.sequence_parallel and self.tensor > 1 else 1


@dataclass(frozen=True)
class SequenceParallelPoints:
    """Where a sequence-parallel model communicates, as torch's parallel styles place it.

    blocks: run on the whole sequence (their tokens all-gathered, their output reduce-scattered).
    split_after: their output is split to this rank's tokens (the embedding).
    gather_after: their output is gathered again (the stack before a vocabulary-parallel loss head).
    split_before, gather_before: the same of their input (a first layer, whose model takes the
    positions from the embedding's whole output; a final norm).
    A module's tokens are its first tensor argument, positional or keyword (`tokens_argument`).
    """

    blocks: list[nn.Module] = field(default_factory=list)
    split_after: list[nn.Module] = field(default_factory=list)
    gather_after: list[nn.Module] = field(default_factory=list)
    split_before: list[nn.Module] = field(default_factory=list)
    gather_before: list[nn.Module] = field(default_factory=list)


TokensHook = Callable[[torch.Tensor], torch.Tensor]


def on_tokens_argument(module: nn.Module, change: TokensHook) -> None:
    """Before each call of `module`, its tokens (its first tensor argument, positional or keyword:
    transformers' layers take hidden states either way) replaced by `change(tokens)`."""
    def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                return (*args[:i], change(arg), *args[i + 1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return args, {**kwargs, key: change(kwargs[key])}
    module.register_forward_pre_hook(hook, with_kwargs=True)


def on_tokens_output(module: nn.Module, change: TokensHook) -> None:
    """After each call of `module`, its output tokens (the output, or its first element:
    transformers' attention returns its weights beside) replaced by `change(tokens)`."""
    def hook(_: nn.Module, args: tuple, out: Any) -> Any:
        return (change(out[0]), *out[1:]) if isinstance(out, tuple) else change(out)
    module.register_forward_hook(hook)


def unknown(kind: str, name: str, valid: list[str]) -> ValueError:
    """An unknown recipe or config field, with the closest valid name."""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ValueError(f"unknown {kind} {name!r}; {hint}valid: {', '.join(valid)}")


def padded_vocab(vocab_size: int, tensor_parallel: int) -> int:
    """One tensor-parallel rank's share of the vocabulary, padded as Megatron pads it."""
    if tensor_parallel == 1:
        return vocab_size
    return -(-vocab_size // (VOCAB_DIVISOR * tensor_parallel)) * VOCAB_DIVISOR


class ModelFamily(ABC):
    """One family of models behind the seam (remat's Llama; MoE and adapted models next)."""

    name: str
    # Site labels the family's models use beyond Megatron's; registered with the family.
    labels: tuple[Label, ...] = ()
    # The class of the models `build` returns (None: models of many classes), for family_of_model.
    model_type: type[nn.Module] | None = None
    # Whether the models' loss pairs each token with the next one's label (Hugging Face's shifts its
    # labels itself): context parallelism then shifts them over the whole sequence before sharding
    # it, and `context_parallel_positions` tells the models so.
    shifts_labels = False

    @abstractmethod
    def recipes(self) -> Mapping[str, Mapping[str, Any]]:
        """Recipe name -> config fields."""

    def handles(self, model: nn.Module) -> bool:
        """Whether `model` is one of this family's though of no `model_type` (models of many classes)."""
        return False

    def owns(self, recipe: str) -> bool:
        """Whether `recipe` names one of this family's models."""
        return recipe in self.recipes()

    @abstractmethod
    def config(self, recipe: str, **overrides: Any) -> ModelConfig:
        """The recipe's config with fields replaced; ConfigError naming every bad field, ValueError
        for an unknown field."""

    @abstractmethod
    def build(self, config: Any, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
              pre_process: bool = True, post_process: bool = True) -> nn.Module:
        """A freshly initialized model; device "meta" allocates nothing. Without `pre_process` the
        model takes the previous stage's hidden states, without `post_process` it returns hidden
        states instead of the loss."""

    @abstractmethod
    def reset_parameters(self, model: nn.Module) -> None:
        """Initialize the weights again from the global torch seed."""

    @abstractmethod
    def shard_problems(self, config: Any, sizes: ParallelSizes) -> Iterator[Problem]:
        """Why the config cannot split this way (heads over tp, the sequence over cp, ...)."""

    @abstractmethod
    def shard(self, config: Any, sizes: ParallelSizes) -> ModelConfig:
        """The config of one rank's model: its share of heads, FFN and vocabulary, of the sequence,
        and of the layers (one pipeline stage's)."""

    @abstractmethod
    def flops(self, config: Any, tokens_per_seq: int, sequences: int) -> float:
        """Model FLOPs of forward and backward over `sequences` x `tokens_per_seq`, recompute not counted."""

    @abstractmethod
    def use_kernels(self, model: nn.Module, target: Target, *, compiled: bool, shapes_only: bool = False) -> None:
        """Run the fast kernels `target` runs: with `compiled`, the code between Sites compiled and
        (on CUDA) remat's Triton kernels. With `shapes_only` the model runs on meta tensors and each
        piece allocates and saves what the target's kernel would."""

    @abstractmethod
    def sequence_parallel(self, model: nn.Module, tensor_parallel: int) -> SequenceParallelPoints:
        """Prepare `model` to run on a sequence-parallel rank's tokens; where it communicates."""

    def tensor_parallel_problems(self, model: nn.Module, sizes: ParallelSizes) -> Iterator[Problem]:
        """Why `model` (built by this family) cannot run split over `sizes.tensor` ranks this way."""
        yield Problem("tensor_model_parallel_size", f"is {sizes.tensor}; {self.name} models have no tensor-parallel"
                                                    " plan; use 1")

    def tensor_parallel(self, model: nn.Module, sizes: ParallelSizes, fork: Fork) -> dict[str, ParallelStyle]:
        """Prepare `model` to run as one of `sizes.tensor` ranks (its local head counts, dropout on
        what only this rank holds inside `fork`) and return torch's parallel style for each module
        path, as `parallelize_module` takes them. Call when tensor_parallel_problems finds none."""
        raise ConfigError(list(self.tensor_parallel_problems(model, sizes)))

    def context_parallel_problems(self, config: Any, sizes: ParallelSizes) -> Iterator[Problem]:
        """Why a model of `config` cannot run over `sizes.context` ranks by torch's context
        parallelism (ring attention in place of scaled_dot_product_attention), beyond what
        shard_problems finds. A family whose shard_problems accepts context parallelism says here
        what its models run otherwise."""
        return iter(())

    def context_parallel(self, model: nn.Module, group: dist.ProcessGroup) -> list[tuple[torch.Tensor, int]]:
        """Have `model` run as one of `group`'s context-parallel ranks, each holding a share of every
        sequence (what it computes over whole sequences, an MoE router's load, summed over the
        group), and return its tensors indexed by sequence position (RoPE tables), each with its
        sequence dimension: context parallelism shards them with each batch, as torch's
        context_parallel does. Call when context_parallel_problems finds none."""
        raise ConfigError([Problem("context_parallel_size", f"{self.name} models have no context-parallel plan;"
                                                            " use 1")])

    def context_parallel_positions(self, model: nn.Module, positions: torch.Tensor | None) -> None:
        """Before the forwards of sharded batches, where each token this rank holds sits in the whole
        sequence ([1, seq / cp], in the rank's order); None after them. For models that count
        positions from the tokens they are given (Hugging Face's); remat's shard their tables."""

    def data_parallel(self, model: nn.Module, group: dist.ProcessGroup) -> None:
        """`model` is one of `group`'s replicas (data- and context-parallel ranks), each training
        on tokens of its own: a model that keeps statistics of its tokens across steps (an MoE
        router's load) sums them over the group. Nothing to do for most models."""

    def expert_parallel_problems(self, model: nn.Module, size: int) -> Iterator[Problem]:
        """Why `model` (built by this family) cannot split its routed experts over `size` ranks."""
        yield Problem("expert_model_parallel_size", f"is {size}; {self.name} models have no routed experts that"
                                                    " remat splits; use an MoE recipe (remat recipes lists them)")

    def routed_experts(self, model: nn.Module) -> list[nn.Module]:
        """The modules holding `model`'s routed experts' weights (none for most models): FSDP2
        shards them over the ranks holding the same experts, not over every data-parallel rank."""
        return []

    def expert_parallel(self, model: nn.Module, group: dist.ProcessGroup) -> list[nn.Module]:
        """Have each rank of `group` hold its share of `model`'s routed experts, and the MoE layers
        send each token slot to the rank holding its expert and its output back; returns the
        modules holding the experts' weights, whose gradients are then those of this rank's share
        of the group's tokens (to be averaged over the ranks holding the same experts, as every
        other gradient over the data-parallel ranks). Call when expert_parallel_problems finds none."""
        raise ConfigError(list(self.expert_parallel_problems(model, dist.get_world_size(group))))
