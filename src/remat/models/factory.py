"""Any model, from a factory: recipe `module:package.module:function`, imported from the current
folder too (as `python -m` would). The function takes no arguments and returns the model, or
(model, site map) for `remat.models.adapt`; a transformers model is adapted as it is. The step feeds
it `model(input_ids, labels=labels)` with token ids below the vocabulary of its first embedding; a
model that returns logits takes a loss function, `module:package.module:function+package.module:loss`
(`WithLoss`). Runs on one device; FLOPs count its matmul weights only."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.config.parallel import ParallelLayout
from remat.core.labels import LAYER
from remat.core.problems import ConfigError, Problem
from remat.models.family import ModelFamily, Target, dense_facts
from remat.models.registry import adapter_for
from remat.sites.calls import with_loss
from remat.sites.placement import compile_sites, place_sites
from remat.sites.site import Site

PREFIX = "module:"
LOSS_SEPARATOR = "+"  # module:MODEL+LOSS
DEFAULT_SEQ = 64


def module_recipe(model: str, loss_fn: str | None = None) -> str:
    """The recipe of the model `model` (package.module:function) returns, with its loss function."""
    return f"{PREFIX}{model}" + (f"{LOSS_SEPARATOR}{loss_fn}" if loss_fn else "")


def _factory(path: str, what: str = "the model") -> Any:
    module_name, _, attribute = path.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `remat` script's path has no cwd
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            [
                Problem(
                    "model",
                    f"cannot load {path!r} ({err}); give package.module:function, a function that returns {what}",
                )
            ]
        ) from err
    if not callable(factory):
        raise ConfigError([Problem("model", f"{path!r} is not a function; give one that returns {what}")])
    return factory


def _made(recipe_path: str) -> nn.Module:
    """The factory's model, adapted (its own Sites, a transformers family, or the map it returned),
    inside WithLoss where the recipe names a loss function."""
    path, _, loss = recipe_path.partition(LOSS_SEPARATOR)
    made = _factory(path)()
    model, site_map = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, nn.Module):
        raise ConfigError([Problem("model", f"{path} returned {type(model).__name__}, not an nn.Module")])
    placed = place_sites(model, site_map, adapter_for(model))
    return with_loss(placed, _factory(loss, "the loss (output, labels) -> loss") if loss else None)


@dataclasses.dataclass(frozen=True)
class FactoryConfig:
    path: str
    seq_length: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0

    def megatron_facts(self) -> dict[str, Any]:
        return dense_facts(self)

    def record(self) -> dict[str, Any]:
        return {
            "model": self.path,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "seq_length": self.seq_length,
            "vocab_size": self.vocab_size,
        }


@functools.lru_cache(maxsize=8)
def _shape(path: str) -> tuple[int, int, int, int]:
    """(layers, hidden size, vocabulary, matmul weights: parameters of two or more dimensions but
    embeddings) of the factory's model, built on meta."""
    with torch.device("meta"):
        model = _made(path)
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ConfigError([Problem("model", f"{path}'s model has no nn.Embedding to tell its vocabulary by")])
    layers = sum(isinstance(m, Site) and m.label == LAYER for m in model.modules())
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings)
    return layers, embedding.embedding_dim, embedding.num_embeddings, weights


class FactoryFamily(ModelFamily):
    name = "module"
    kind = "models from a factory"  # one device, or data parallelism over several

    def recipes(self) -> Mapping[str, Mapping[str, Any]]:
        return {}  # any importable factory: `owns` recognises them

    def owns(self, recipe: str) -> bool:
        return recipe.startswith(PREFIX)

    def config(self, recipe: str, **overrides: Any) -> FactoryConfig:
        path = recipe.removeprefix(PREFIX)
        unknown = sorted(set(overrides) - {"seq_length"})
        if unknown:
            raise ConfigError(
                [
                    Problem(key, "a factory's model takes only -sl/--seq_length; change the factory for other shapes")
                    for key in unknown
                ]
            )
        layers, hidden, vocab, _ = _shape(path)
        return FactoryConfig(path, overrides.get("seq_length") or DEFAULT_SEQ, layers, hidden, vocab)

    def build(
        self,
        config: FactoryConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> nn.Module:
        if not (pre_process and post_process):
            raise ConfigError(
                [Problem("pipeline_model_parallel_size", "a factory's model runs as one pipeline stage; use -pp 1")]
            )
        with torch.device(device or "cpu"):
            model = _made(config.path)
        return model.to(dtype=dtype) if dtype is not None else model

    def reset_parameters(self, model: nn.Module) -> None:
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset) and module is not model:
                reset()

    def shard(self, config: FactoryConfig, layout: ParallelLayout, layers: Sequence[int]) -> FactoryConfig:
        return config

    def flops(self, config: FactoryConfig, tokens_per_seq: int, sequences: int) -> float:
        """6 x matmul weights (every parameter of two or more dimensions but embeddings) x tokens;
        attention's own matmuls are not counted (their shapes are the factory's)."""
        return float(6 * _shape(config.path)[3] * tokens_per_seq * sequences)

    def use_kernels(self, model: nn.Module, target: Target, *, compiled: bool, shapes_only: bool = False) -> None:
        if compiled and not shapes_only:
            compile_sites(model)


FAMILY = FactoryFamily()
