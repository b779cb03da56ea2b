"""Hugging Face transformers models: where their Sites go (placeholder, filled next)."""
from __future__ import annotations

from torch import nn

from remat.models.family import Adapter


class HfAdapter(Adapter):
    name = "hf"

    def handles(self, model: nn.Module) -> bool:
        return any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__)

    def site_map(self, model: nn.Module) -> dict[str, tuple[str, ...]]:
        raise NotImplementedError


ADAPTER = HfAdapter()
