"""Site: the one wrapper every model uses to mark where remat may act."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from remat.core.labels import site_labels
from remat.engine import inside_region, refuse_compiled


class SiteAction(Protocol):
    """What apply() installs on a Site: runs the wrapped call with recompute/discard machinery.
    Under torch.compile the Site calls the action's `traced` method (same arguments) instead."""

    def __call__(self, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...


def traced(action: SiteAction, site: Site, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """What `action` does while torch.compile traces the Site: its own `traced` method (torch's
    compile-aware checkpoint where it recomputes or discards, a refusal where it offloads); one without it
    is refused in the compiled forward, rather than compiled into a wrong backward."""
    lower = getattr(action, "traced", None)
    if lower is not None:
        return lower(site, fn, args, kwargs)
    return refuse_compiled(
        f"site {site.label!r}: {type(action).__name__} cannot run inside torch.compile; compile what runs"
        " between Sites instead (the CLI's --compile, remat.sites.placement.compile_sites), or drop"
        " that action from the plan"
    )


class Site(nn.Module):
    """A named place in a model where remat may act (`core_attn`, `mlp`, `layer`, ...).

    Call it with the function to run and its arguments: ``y = self.mlp_site(self.mlp, x)``.
    It holds no parameters, so placing Sites leaves a model's state_dict unchanged; with no
    plan applied it calls the function directly.
    """

    def __init__(self, label: str, *, fused: bool = False) -> None:
        super().__init__()
        if label not in site_labels():
            raise ValueError(f"unknown site label {label!r}; use one of {', '.join(site_labels())}")
        self.label = label
        # The wrapped kernel already recomputes its own internals (flash/cuDNN attention),
        # so recomputing this site frees almost nothing.
        self.fused = fused
        self.action: SiteAction | None = None
        # Runs before a full-recompute group replays this layer from a later layer's backward:
        # a layer whose parameters are sharded (FSDP2) gathers them (set by remat.parallel).
        self.before_replay: Callable[[], None] | None = None

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.action is None or not torch.is_grad_enabled() or inside_region():
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            return traced(self.action, self, fn, args, kwargs)
        return self.action(self, fn, args, kwargs)

    def extra_repr(self) -> str:
        return f"{self.label!r}" + (", fused=True" if self.fused else "")
