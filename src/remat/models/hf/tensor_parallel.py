"""Tensor parallelism for Hugging Face causal LMs, by the plan transformers ships with each model
(`config.base_model_tp_plan`: module path patterns under the base model -> "colwise" /
"rowwise"), as torch's ColwiseParallel / RowwiseParallel. Every other module (the embedding,
norms, routed experts of a plan without them, the loss head) stays whole on every rank.

Sequence parallelism (torchtitan's layout on the same plan): between the planned blocks each rank
holds its share of the tokens. The first layer's input is split (the model takes positions and
the causal mask from the embedding's whole output first) and the last layer's output gathered
again for the final norm and the loss head; the layers' norms run on this rank's tokens as torch's
SequenceParallel (weights replicated, their gradients summed); a planned block (attention, a split
MLP) gathers its tokens first and its row-parallel projection reduce-scatters. Layers holding other
weights outside the plan (Mixtral's experts) or hidden dropout are refused.

The column-parallel projections hand attention and the MLP this rank's share as local tensors:
HF attention reshapes by `-1` heads and repeats keys by `num_key_value_groups` (heads / kv heads,
the same on every rank), so it runs on this rank's heads unchanged. Attention dropout over them
draws from the rank's own stream: the adapter's attention router calls the attention function
inside the family's `fork`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError, Problem
from remat.models.family import Fork, SequenceParallelPoints, TokensHook, on_tokens_argument, on_tokens_output
from remat.models.hf.adapter import ADAPTER, attention_modules, hf_model
from remat.models.hf.configs import layer_configs

STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# Attention attributes some models reshape by: a head count no plan divides.
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")
FIELD = "tensor_model_parallel_size"


def _plan(hf: Any) -> dict[str, str]:
    return dict(getattr(hf, "base_model_tp_plan", None) or {})


def _splits_mlp(plan: dict[str, str]) -> bool:
    return any(".mlp." in key for key in plan)


def config_problems(hf: Any, tp: int) -> Iterator[Problem]:
    """Why a transformers config `hf` cannot split over `tp` ranks: its plan, and the head and FFN
    counts it splits."""
    if tp == 1:
        return
    model = type(hf).__name__
    plan = _plan(hf)
    if not plan:
        yield Problem(FIELD, f"is {tp}; {model} ships no tensor-parallel plan (base_model_tp_plan); use 1")
        return
    unmapped = sorted({f"{key}: {style}" for key, style in plan.items() if style not in STYLES})
    if unmapped:
        yield Problem(
            FIELD,
            f"is {tp}; {model}'s tensor-parallel plan has entries remat does not map"
            f" ({', '.join(unmapped)}), only {' and '.join(STYLES)}; use 1",
        )
    names = ["num_attention_heads", "num_key_value_heads"]
    if _splits_mlp(plan):  # MoE-only configs have no dense intermediate_size
        names.append("intermediate_size")
    # a heterogeneous config holds these per layer (and refuses to read them globally); some
    # configs hold a list of one per layer instead (Gemma 3n's intermediate_size)
    counts = {
        (name, size) for layer in layer_configs(hf) for name in names for size in _each(getattr(layer, name, None))
    }
    for name, size in sorted(counts, key=str):
        if isinstance(size, int) and size % tp:
            yield Problem(
                FIELD,
                f"{name}={size} does not split over {tp} tensor-parallel ranks; use a"
                " tensor-parallel size that divides it",
            )


def _each(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _matches(pattern: str, names: list[str]) -> list[str]:
    """The module names (relative to the base model) a plan pattern names; `*` is one path part."""
    regex = re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
    return [name for name in names if regex.fullmatch(name)]


def _planned(model: nn.Module) -> tuple[str, dict[str, nn.Module], dict[str, str]]:
    """The base model's path in `model`, its modules by relative name, and each planned module's
    style by relative name."""
    hf = hf_model(model)
    base: nn.Module = hf.base_model  # type: ignore[assignment]  # transformers' PreTrainedModel property
    prefix = {m: n for n, m in model.named_modules()}[base]
    modules = {name: m for name, m in base.named_modules() if name}
    return (
        prefix,
        modules,
        {name: style for pattern, style in _plan(hf.config).items() for name in _matches(pattern, list(modules))},
    )


@dataclass(frozen=True)
class _SequenceSplit:
    """A planned model under sequence parallelism: the blocks its plan splits (their parents are
    the decoder layers), the layers, and each layer's other modules holding weights."""

    blocks: list[str]
    layers: list[str]
    others: list[str]

    @classmethod
    def of(cls, modules: dict[str, nn.Module], planned: dict[str, str]) -> _SequenceSplit:
        blocks = sorted({name.rpartition(".")[0] for name in planned}, key=list(modules).index)
        layers = sorted({block.rpartition(".")[0] for block in blocks}, key=list(modules).index)
        others = [
            f"{layer}.{child}"
            for layer in layers
            for child, module in modules[layer].named_children()
            if f"{layer}.{child}" not in blocks and any(True for _ in module.parameters())
        ]
        return cls(blocks, layers, others)

    def norms(self, modules: dict[str, nn.Module]) -> list[str]:
        """The layers' norms: modules whose weights are all vectors, run on this rank's tokens."""
        return [name for name in self.others if all(p.dim() == 1 for p in modules[name].parameters())]


Move = tuple[Placement, Placement]
GATHER: Move = (Shard(1), Replicate())  # all-gathers this rank's tokens; backward keeps its own part
SPLIT: Move = (Replicate(), Shard(1))  # keeps this rank's tokens; backward all-gathers


def _moved(mesh: DeviceMesh, move: Move) -> TokensHook:
    source, target = move
    return lambda x: DTensor.from_local(x, mesh, [source], run_check=False).redistribute(mesh, [target]).to_local()


class _Tokens(ParallelStyle):
    """A module's tokens moved along the sequence (dim 1) by DTensor: `before` its call (its
    first tensor argument), `after` it (its output tokens)."""

    def __init__(self, before: Move | None = None, after: Move | None = None) -> None:
        super().__init__()
        self.before, self.after = before, after

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.before is not None:
            on_tokens_argument(module, _moved(device_mesh, self.before))
        if self.after is not None:
            on_tokens_output(module, _moved(device_mesh, self.after))
        return module


def sequence_points(model: nn.Module) -> SequenceParallelPoints:
    """Where a planned model communicates under sequence parallelism: its planned blocks (attention,
    a split MLP) on the whole sequence, its first layer's input split (the model takes positions
    and the mask from the embedding's whole output), its last layer's output gathered again."""
    _, modules, planned = _planned(model)
    problems = list(_sequence_problems(modules, planned))
    if problems:
        raise ConfigError(problems)
    split = _SequenceSplit.of(modules, planned)
    return SequenceParallelPoints(
        blocks=[modules[b] for b in split.blocks],
        split_before=[modules[split.layers[0]]],
        gather_after=[modules[split.layers[-1]]],
    )


def model_problems(model: nn.Module, layout: ParallelLayout) -> Iterator[Problem]:
    """Beyond the config's (`config_problems`): plan entries that name no Linear, attention holding
    a head count, and attention dropout that could not draw from the rank's stream."""
    hf = hf_model(model)
    if layout.tp == 1:
        return
    _, modules, planned = _planned(model)
    for pattern in _plan(hf.config):
        found = _matches(pattern, list(modules))
        if not found or not all(isinstance(modules[n], nn.Linear) for n in found):
            yield Problem(
                FIELD,
                f"{type(hf).__name__}'s tensor-parallel plan entry {pattern!r} names no Linear"
                " modules of this model; use 1",
            )
    if layout.sp:
        yield from _sequence_problems(modules, planned)
    for attention in attention_modules(model):
        held = [name for name in _HEAD_COUNTS if isinstance(getattr(attention, name, None), int)]
        if held:
            yield Problem(
                FIELD,
                f"{type(attention).__name__} holds head counts ({', '.join(held)}) that its"
                " forward may use whole; remat does not split it; use 1",
            )
        dropout = getattr(attention, "attention_dropout", 0.0) or 0.0
        if dropout and attention not in ADAPTER.attention_sites:
            yield Problem(
                "attention_dropout",
                f"is {dropout}; {type(attention).__name__} has no core_attn Site,"
                " through which its dropout draws from this rank's stream; place"
                " remat's Sites (remat.models.adapt) or use 0",
            )


def _sequence_problems(modules: dict[str, nn.Module], planned: dict[str, str]) -> Iterator[Problem]:
    """What cannot run on this rank's tokens between the planned blocks: weights other than norms
    (their gradients would be this rank's tokens' only) and hidden dropout (the same masks on
    every rank's different tokens)."""
    split = _SequenceSplit.of(modules, planned)
    norms = split.norms(modules)
    unsplit = sorted({type(modules[name]).__name__ for name in split.others if name not in norms})
    if unsplit:
        yield Problem(
            "sequence_parallel",
            f"the layers' {', '.join(unsplit)} hold weights the tensor-parallel"
            " plan does not split, which would run on this rank's tokens only;"
            " drop --sequence_parallel",
        )
    dropout = sorted(
        {
            name.rpartition(".")[2]
            for layer in split.layers
            for name, m in modules[layer].named_modules()
            if isinstance(m, nn.Dropout)
            and m.p > 0
            and not any(f"{layer}.{name}".startswith(f"{b}.") for b in split.blocks)
        }
    )
    if dropout:
        yield Problem(
            "sequence_parallel",
            f"the layers' dropout ({', '.join(dropout)}) outside attention would draw"
            " the same masks on every rank's tokens; set it to 0 or drop"
            " --sequence_parallel",
        )


def styles(model: nn.Module, fork: Fork, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Each planned module's style by its path in `model`; attention dropout inside `fork`. Under
    sequence parallelism the layers' norms run on this rank's tokens (torch's SequenceParallel), a
    planned block gathers its tokens first and its row-parallel output is reduce-scattered."""
    prefix, modules, planned = _planned(model)
    for attention in attention_modules(model):
        ADAPTER.fork_attention(attention, fork)  # over this rank's heads
    found: dict[str, ParallelStyle] = {name: STYLES[style]() for name, style in planned.items()}
    if sequence_parallel:
        split = _SequenceSplit.of(modules, planned)
        found |= {
            name: RowwiseParallel(output_layouts=Shard(1)) for name, style in planned.items() if style == "rowwise"
        }
        found |= {block: _Tokens(before=GATHER) for block in split.blocks}
        found |= {norm: SequenceParallel(use_local_output=True) for norm in split.norms(modules)}
        first, last = split.layers[0], split.layers[-1]
        found |= {first: _Tokens(before=SPLIT), last: _Tokens(before=SPLIT if first == last else None, after=GATHER)}
    dot = f"{prefix}." if prefix else ""
    return {f"{dot}{name}": style for name, style in found.items()}


def shard_config(hf: Any, tp: int) -> Any:
    """One rank's transformers config by shape: its heads, kv heads and (where the plan splits the
    MLP) intermediate size; head_dim stays as it was."""
    if tp == 1:
        return hf
    shard = copy.deepcopy(hf)
    shard.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    shard.num_attention_heads = hf.num_attention_heads // tp
    shard.num_key_value_heads = (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads) // tp
    if _splits_mlp(_plan(hf)):
        shard.intermediate_size = hf.intermediate_size // tp
    return shard
