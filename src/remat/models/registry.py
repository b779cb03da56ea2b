"""The families remat knows and the adapters of families of models it did not write, by name.

`remat.models` registers its families here; a family's own modules (a factory adapting the model a
function returns) look adapters up here, below the package that imports them all.
"""

from __future__ import annotations

from torch import nn

from remat.core import labels
from remat.models.family import ModelFamily, unknown
from remat.sites.placement import Adapter

FAMILIES: dict[str, ModelFamily] = {}
# Families of models remat did not write, for `remat.adapt`.
ADAPTERS: list[Adapter] = []


def register(family: ModelFamily) -> ModelFamily:
    """Make a family's recipes and site labels known."""
    for label in family.labels:
        labels.register(label)
    FAMILIES[family.name] = family
    return family


def adapter_for(model: nn.Module) -> Adapter | None:
    """The adapter of the family `model` belongs to, or None."""
    return next((adapter for adapter in ADAPTERS if adapter.handles(model)), None)


def recipes() -> list[str]:
    """Every recipe name, of every family."""
    return [name for family in FAMILIES.values() for name in family.recipes()]


def family_of(recipe: str) -> ModelFamily:
    """The family a recipe belongs to; ValueError naming the closest recipe if none."""
    for family in FAMILIES.values():
        if family.owns(recipe):
            return family
    raise unknown("recipe", recipe, recipes())
