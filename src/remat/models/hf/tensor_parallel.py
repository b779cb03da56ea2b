"""Tensor parallelism (without sequence parallelism) for Hugging Face causal LMs, by the plan
transformers ships with each model (`config.base_model_tp_plan`: module path patterns under the
base model -> "colwise" / "rowwise"), as torch's ColwiseParallel / RowwiseParallel. Every other
module (the embedding, norms, routed experts of a plan without them, the loss head) stays whole on
every rank.

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
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from remat.models.family import Fork, ParallelSizes
from remat.models.hf.adapter import ADAPTER, attention_modules, hf_model
from remat.problems import Problem

STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# Attention attributes some models reshape by: a head count no plan divides.
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")
FIELD = "tensor_model_parallel_size"


def _plan(hf: Any) -> dict[str, str]:
    return dict(getattr(hf, "base_model_tp_plan", None) or {})


def _splits_mlp(plan: dict[str, str]) -> bool:
    return any(".mlp." in key for key in plan)


def config_problems(hf: Any, sizes: ParallelSizes) -> Iterator[Problem]:
    """Why a transformers config `hf` cannot split over `sizes.tensor` ranks: its plan, and the
    head and FFN counts it splits."""
    tp = sizes.tensor
    if tp == 1:
        return
    model = type(hf).__name__
    if sizes.sequence_parallel:
        yield Problem("sequence_parallel", "Hugging Face models split by tensor parallelism without sequence"
                                           " parallelism for now; drop --sequence_parallel")
    plan = _plan(hf)
    if not plan:
        yield Problem(FIELD, f"is {tp}; {model} ships no tensor-parallel plan (base_model_tp_plan); use 1")
        return
    unmapped = sorted({f"{key}: {style}" for key, style in plan.items() if style not in STYLES})
    if unmapped:
        yield Problem(FIELD, f"is {tp}; {model}'s tensor-parallel plan has entries remat does not map"
                             f" ({', '.join(unmapped)}), only {' and '.join(STYLES)}; use 1")
    counts = [("num_attention_heads", hf.num_attention_heads),
              ("num_key_value_heads", getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)]
    if _splits_mlp(plan):
        counts.append(("intermediate_size", hf.intermediate_size))
    for name, size in counts:
        if size % tp:
            yield Problem(FIELD, f"{name}={size} does not split over {tp} tensor-parallel ranks; use a"
                                 " tensor-parallel size that divides it")


def _matches(pattern: str, names: list[str]) -> list[str]:
    """The module names (relative to the base model) a plan pattern names; `*` is one path part."""
    regex = re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))
    return [name for name in names if regex.fullmatch(name)]


def _planned(model: nn.Module) -> tuple[str, dict[str, nn.Module], dict[str, str]]:
    """The base model's path in `model`, its modules by relative name, and the plan."""
    hf = hf_model(model)
    base: nn.Module = hf.base_model  # type: ignore[assignment]  # transformers' PreTrainedModel property
    prefix = {m: n for n, m in model.named_modules()}[base]
    modules = {name: m for name, m in base.named_modules() if name}
    return prefix, modules, _plan(hf.config)


def model_problems(model: nn.Module, sizes: ParallelSizes) -> Iterator[Problem]:
    """Beyond the config's: plan entries that name no Linear, attention holding a head count, and
    attention dropout that could not draw from the rank's stream."""
    hf = hf_model(model)
    problems = list(config_problems(hf.config, sizes))
    yield from problems
    if problems or sizes.tensor == 1:
        return
    _, modules, plan = _planned(model)
    for pattern in plan:
        found = _matches(pattern, list(modules))
        if not found or not all(isinstance(modules[n], nn.Linear) for n in found):
            yield Problem(FIELD, f"{type(hf).__name__}'s tensor-parallel plan entry {pattern!r} names no Linear"
                                 " modules of this model; use 1")
    for attention in attention_modules(model):
        held = [name for name in _HEAD_COUNTS if isinstance(getattr(attention, name, None), int)]
        if held:
            yield Problem(FIELD, f"{type(attention).__name__} holds head counts ({', '.join(held)}) that its"
                                 " forward may use whole; remat does not split it; use 1")
        dropout = getattr(attention, "attention_dropout", 0.0) or 0.0
        if dropout and attention not in ADAPTER.attention_sites:
            yield Problem("attention_dropout", f"is {dropout}; {type(attention).__name__} has no core_attn Site,"
                                               " through which its dropout draws from this rank's stream; place"
                                               " remat's Sites (remat.adapt) or use 0")


def styles(model: nn.Module, fork: Fork) -> dict[str, ParallelStyle]:
    """Each planned module's style by its path in `model`; attention dropout inside `fork`."""
    prefix, modules, plan = _planned(model)
    for attention in attention_modules(model):
        ADAPTER.fork_attention(attention, fork)  # over this rank's heads
    dot = f"{prefix}." if prefix else ""
    return {f"{dot}{name}": STYLES[style]() for pattern, style in plan.items()
            for name in _matches(pattern, list(modules))}


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
