"""adapt(model, site_map): Sites on a model remat did not write (`remat.sites.placement` places them).

A model of a family remat knows (Hugging Face transformers) brings its own site map; any other
takes one, label -> module path patterns, in Python or YAML.
"""

from __future__ import annotations

from torch import nn

from remat import models
from remat.sites.placement import SiteMapLike, place_sites, remove_sites


def adapt(model: nn.Module, site_map: SiteMapLike | None = None, *, loss_head: bool = False) -> nn.Module:
    """Place Sites on `model` in place (and return it), so `remat.sites.apply`, `trace` and `plan` act on it.

    `site_map`: label -> module path pattern(s) (``*`` matches one part of a path), as a mapping or
    a YAML file; None uses the map of the model's family where remat knows it. Idempotent; another
    map replaces the first. `loss_head`: the training loss from remat's chunked linear +
    cross-entropy instead of full-vocabulary logits (same loss; the output carries no logits).
    Raises ConfigError naming every unknown label and every pattern that matches nothing.
    """
    return place_sites(model, site_map, models.adapter_for(model), loss_head=loss_head)


def unadapt(model: nn.Module) -> nn.Module:
    """Take away every Site `adapt` placed on `model` and what it changed; a no-op if it placed none."""
    return remove_sites(model)
