"""The model-family seam: what remat needs from a family of models, and nothing else.

A family knows its recipes and how to build a model from a config, with or without the first
stage's embedding and the last stage's loss head (pipeline pre- and post-process); what a parallel
layout cannot do with a config, and one rank's share of it by shape; the model FLOPs of a step;
and the fast kernels a target runs. For a built model under a layout it gives a `ModelParallelism`:
what each parallelism of `remat.parallel` needs of that model (torch's tensor-parallel styles,
where sequence parallelism communicates, what context parallelism shards or tells the model, what
replicas share, how routed experts split). The model it builds places `Site`s and knows nothing
else of recompute. Code outside `remat.models` reaches a family only through this interface.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from remat.config.parallel import ParallelLayout
from remat.core.labels import Label
from remat.core.problems import ConfigError, Problem

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


def dense_facts(config: ModelConfig) -> dict[str, Any]:
    """The recompute rules' keys every model fixes: its layers and dropout; a dense model has
    neither grouped-GEMM experts nor multi-latent attention."""
    return {
        "num_layers": config.num_layers,
        "attention_dropout": config.attention_dropout,
        "hidden_dropout": config.hidden_dropout,
        "moe_grouped_gemm": False,
        "multi_latent_attention": False,
    }


@dataclass(frozen=True)
class SequenceParallelPoints:
    """Where a sequence-parallel model communicates, as torch's parallel styles place it.

    blocks: run on the whole sequence (their tokens all-gathered, their output reduce-scattered).
    split_after: their output is split to this rank's tokens (the embedding).
    gather_after: their output is gathered again (the stack before a vocabulary-parallel loss head).
    split_before, gather_before: the same of their input (a first layer, whose model takes the
    positions from the embedding's whole output; a final norm).
    A module's tokens are its first tensor argument, positional or keyword (`on_tokens_argument`).
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
                return (*args[:i], change(arg), *args[i + 1 :]), kwargs
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


# What a family says of a model-parallel size its models do not run: ParallelLayout's field ->
# (Megatron's name, the refusal, given the size and how the family names its models).
REFUSED: dict[str, tuple[str, str]] = {
    "tp": ("tensor_model_parallel_size", "is {size}; {kind} have no tensor-parallel split; use 1"),
    "pp": ("pipeline_model_parallel_size", "is {size}; {kind} run as one pipeline stage; use 1"),
    "cp": ("context_parallel_size", "is {size}; {kind} have no context-parallel split; use 1"),
    "ep": (
        "expert_model_parallel_size",
        "is {size}, but {kind} have no routed experts that remat splits; use an MoE"
        " recipe (remat recipes lists them) or drop it",
    ),
    "etp": (
        "expert_tensor_parallel_size",
        "is {size}, but {kind} have no routed experts that remat splits; use an"
        " MoE recipe (remat recipes lists them) or drop it",
    ),
}


class ModelParallelism:
    """What one built model does under one parallel layout: the seam through which the
    parallelisms of `remat.parallel` reach a model. The base runs nothing but one process (data
    parallelism aside); a family subclasses it for the parallelisms its models run."""

    # Whether the model's loss pairs each token with the next one's label itself (Hugging Face's):
    # context parallelism then shifts the labels over the whole sequence before sharding it, and
    # `set_positions` tells the model so.
    shifts_labels = False

    def __init__(self, model: nn.Module, layout: ParallelLayout, family: str) -> None:
        self.model, self.layout, self.family = model, layout, family

    def problems(self) -> Iterator[Problem]:
        """Why the built model cannot run under the layout, beyond what its family's
        `layout_problems` finds on its config; checked before anything changes."""
        return iter(())

    def tensor_parallel(self, fork: Fork) -> dict[str, ParallelStyle]:
        """Prepare the model to run as one of `layout.tp` ranks (its local head counts, dropout on
        what only this rank holds inside `fork`) and return torch's parallel style for each module
        path, as `parallelize_module` takes them."""
        raise ConfigError([self._refused("tp")])

    def sequence_points(self) -> SequenceParallelPoints:
        """Prepare the model to run on a sequence-parallel rank's tokens; where it communicates."""
        raise ConfigError(
            [Problem("sequence_parallel", f"{self.family} models run on one device; drop --sequence_parallel")]
        )

    def context_buffers(self, group: dist.ProcessGroup) -> list[tuple[torch.Tensor, int]]:
        """Have the model run as one of `group`'s context-parallel ranks, each holding a share of
        every sequence (what it computes over whole sequences, an MoE router's load, summed over
        the group), and return its tensors indexed by sequence position (RoPE tables), each with
        its sequence dimension: context parallelism shards them with each batch, as torch's
        context_parallel does."""
        raise ConfigError([self._refused("cp")])

    def set_positions(self, positions: torch.Tensor | None) -> None:
        """Before the forwards of sharded batches, where each token this rank holds sits in the
        whole sequence ([1, seq / cp], in the rank's order); None after them. For models that count
        positions from the tokens they are given (Hugging Face's); remat's shard their tables."""

    def replicas(self, group: dist.ProcessGroup) -> None:
        """The model is one of `group`'s replicas (data- and context-parallel ranks), each training
        on tokens of its own: a model that keeps statistics of its tokens across steps (an MoE
        router's load) sums them over the group. Nothing to do for most models."""

    def routed_experts(self) -> list[nn.Module]:
        """The modules holding the model's routed experts' weights (none for most models): FSDP2
        shards them over the ranks holding the same experts, not over every data-parallel rank."""
        return []

    def split_experts(self, group: dist.ProcessGroup) -> list[nn.Module]:
        """Have each rank of `group` hold its share of the routed experts, and the MoE layers send
        each token slot to the rank holding its expert and its output back; returns the modules
        holding the experts' weights, whose gradients are then those of this rank's share of the
        group's tokens (to be averaged over the ranks holding the same experts)."""
        raise ConfigError([self._refused("ep")])

    def _refused(self, size: str) -> Problem:
        """A parallelism the family's models do not run, asked of the model anyway."""
        name, refusal = REFUSED[size]
        return Problem(name, refusal.format(size=getattr(self.layout, size), kind=f"{self.family} models"))


class ModelFamily(ABC):
    """One family of models behind the seam (remat's Llama, its MoE, Hugging Face's, a factory's)."""

    name: str
    # Site labels the family's models use beyond Megatron's; registered with the family.
    labels: tuple[Label, ...] = ()
    # The class of the models `build` returns (None: models of many classes), for family_of_model.
    model_type: type[nn.Module] | None = None
    # How problems name the family's models ("dense Llama models").
    kind: str = "these models"
    # The model-parallel sizes (ParallelLayout's fields) its models run above 1; `layout_problems`
    # refuses the others by name (REFUSED).
    runs: frozenset[str] = frozenset()

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
    def build(
        self,
        config: Any,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> nn.Module:
        """A freshly initialized model; device "meta" allocates nothing. Without `pre_process` the
        model takes the previous stage's hidden states, without `post_process` it returns hidden
        states instead of the loss."""

    @abstractmethod
    def reset_parameters(self, model: nn.Module) -> None:
        """Initialize the weights again from the global torch seed."""

    def layout_problems(self, config: Any, layout: ParallelLayout) -> Iterator[Problem]:
        """Why a model of `config` cannot run under `layout`: each size above 1 the family does not
        run; a family adds what its config cannot split (heads over tp, the sequence over cp,
        experts over ep)."""
        for size, (name, refusal) in REFUSED.items():
            value = getattr(layout, size)
            if value is not None and value > 1 and size not in self.runs:
                yield Problem(name, refusal.format(size=value, kind=self.kind))

    @abstractmethod
    def shard(self, config: Any, layout: ParallelLayout, layers: Sequence[int]) -> ModelConfig:
        """The config of one rank's model: its share of heads, FFN, experts and vocabulary, of the
        sequence, and the whole model's `layers` it holds (a pipeline rank's), which keep their
        numbers."""

    @abstractmethod
    def flops(self, config: Any, tokens_per_seq: int, sequences: int) -> float:
        """Model FLOPs of forward and backward over `sequences` x `tokens_per_seq`, recompute not counted."""

    @abstractmethod
    def use_kernels(self, model: nn.Module, target: Target, *, compiled: bool, shapes_only: bool = False) -> None:
        """Run the fast kernels `target` runs: with `compiled`, the code between Sites compiled and
        (on CUDA) remat's Triton kernels. With `shapes_only` the model runs on meta tensors and each
        piece allocates and saves what the target's kernel would."""

    def parallelism(self, model: nn.Module, layout: ParallelLayout) -> ModelParallelism:
        """What `model` (built by this family) does under `layout`."""
        return ModelParallelism(model, layout, self.name)


# Tensor-parallel shares kept as plain local tensors: a module records which slice of a whole
# tensor its parameter holds, so that weights drawn after the split are drawn whole and cut
# (remat.parallel.seeding, the MoE family's experts) and equal one process's.
class Share(NamedTuple):
    """A plain parameter's place in its whole tensor: slice `rank` of `size` equal ones along `dim`."""

    dim: int
    rank: int
    size: int

    def whole_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(n * self.size if d == self.dim else n for d, n in enumerate(shape))

    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.chunk(self.size, self.dim)[self.rank]


def split_share(module: nn.Module, name: str) -> Share | None:
    """The share of a whole tensor `module`'s parameter `name` holds, if a slice of one."""
    shares: dict[str, Share] = getattr(module, "split_shares", {})
    return shares.get(name)


def record_share(module: nn.Module, name: str, share: Share) -> None:
    vars(module).setdefault("split_shares", {})[name] = share
