"""Model families behind one seam (`remat.models.family.ModelFamily`), and their recipes by name.

Code outside `remat.models` builds and inspects models only through these functions and the
family a recipe belongs to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.models import factory, llama
from remat.models.factory import module_recipe
from remat.models.family import ModelConfig, ModelFamily, ModelParallelism, SequenceParallelPoints, Target
from remat.models.hf import family as hf_family
from remat.models.hf.adapter import ADAPTER as HF_ADAPTER
from remat.models.moe import family as moe_family
from remat.models.registry import ADAPTERS, FAMILIES, adapter_for, family_of, recipes, register
from remat.sites.placement import Adapter

for family in (llama.FAMILY, moe_family.FAMILY, hf_family.FAMILY, factory.FAMILY):
    register(family)
ADAPTERS.append(HF_ADAPTER)


def family_of_model(model: nn.Module) -> ModelFamily | None:
    """The family whose model class `model` is (the closest one, for a subclass), else the family
    that handles it (Hugging Face models), or None."""
    by_type = {family.model_type: family for family in FAMILIES.values() if family.model_type is not None}
    return next(
        (by_type[cls] for cls in type(model).__mro__ if cls in by_type),
        next((family for family in FAMILIES.values() if family.handles(model)), None),
    )


def recipe_config(recipe: str, **overrides: Any) -> Any:
    """The recipe's config with fields replaced by overrides (Megatron names)."""
    return family_of(recipe).config(recipe, **overrides)


def build(
    recipe: str, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None, **overrides: Any
) -> nn.Module:
    """A freshly initialized model of the recipe; device="meta" allocates nothing."""
    family = family_of(recipe)
    return family.build(family.config(recipe, **overrides), dtype=dtype, device=device)


def parameter_count(recipe: str, **overrides: Any) -> int:
    """The recipe's parameters, counted on a model built on the meta device (nothing allocated)."""
    return sum(p.numel() for p in build(recipe, device="meta", **overrides).parameters())


__all__ = [
    "module_recipe",
    "ADAPTERS",
    "Adapter",
    "FAMILIES",
    "adapter_for",
    "ModelConfig",
    "ModelFamily",
    "ModelParallelism",
    "SequenceParallelPoints",
    "Target",
    "build",
    "family_of",
    "family_of_model",
    "parameter_count",
    "recipe_config",
    "recipes",
    "register",
]
