"""Placing Sites on a model remat did not write, without editing its source (`remat.models.adapt`).

A site map names, for each label, the modules whose forward becomes that Site's call:
``{"layer": "model.layers.*", "mlp": "model.layers.*.mlp"}``. A pattern is a dotted module
path whose parts may hold shell wildcards (``*`` matches one part, never a dot). Known families
bring an `Adapter` (`remat.models.ADAPTERS`): their own map, and a label placed their own way (a Hugging Face
model's `core_attn` wraps its attention function, not a module). The Sites become child modules
named `remat_site`; they hold no tensors, so parameters, state_dict keys, `.to()` and checkpoints
are unchanged, and `unadapt` takes every one of them away again.
"""

from __future__ import annotations

import fnmatch
import functools
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from remat.core.labels import site_labels
from remat.core.problems import ConfigError, Problem, did_you_mean, raise_if_any, read_file, safe_yaml
from remat.sites.site import Site

# The child name a placed Site gets on the module it wraps.
SITE_NAME = "remat_site"

SiteMapLike = Mapping[str, str | Iterable[str]] | str | Path


class Adapter(ABC):
    """A family of models remat did not write (Hugging Face transformers): how to recognise one,
    where its Sites go, and what to set on it first."""

    name: str

    @abstractmethod
    def handles(self, model: nn.Module) -> bool:
        """Whether `model` belongs to this family."""

    @abstractmethod
    def site_map(self, model: nn.Module) -> dict[str, tuple[str, ...]]:
        """label -> module path patterns for this model."""

    def place(self, label: str, module: nn.Module, site: nn.Module) -> Callable[[], None] | None:
        """Route `label`'s computation in `module` through `site` this family's own way; returns
        what undoes it, or None to wrap the module's forward."""
        return None

    def loss_head(self, model: nn.Module) -> Callable[[], None]:
        """Swap the model's loss for remat's chunked linear + cross-entropy; returns the undo."""
        raise ConfigError([Problem("loss_head", f"remat has no chunked loss head for {type(model).__name__}")])

    def prepare(self, model: nn.Module) -> Callable[[], None]:
        """Settings the model needs before Sites act (e.g. its own checkpointing off); returns the undo."""
        return lambda: None


@dataclass(frozen=True)
class _Adaptation:
    site_map: dict[str, tuple[str, ...]]
    loss_head: bool
    undo: tuple[Callable[[], None], ...]


_ADAPTED: weakref.WeakKeyDictionary[nn.Module, _Adaptation] = weakref.WeakKeyDictionary()


def load_site_map(source: SiteMapLike) -> dict[str, tuple[str, ...]]:
    """A site map from a mapping or a YAML file of one, each label's patterns as a tuple; every
    problem (unknown label, a value that is not a pattern or a list of them) at once."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        loaded = read_file(path, safe_yaml, "YAML")
        if not isinstance(loaded, Mapping):
            raise ConfigError([Problem("site_map", f"{path} holds no mapping of label -> module patterns")])
        source = loaded
    problems: list[Problem] = []
    result: dict[str, tuple[str, ...]] = {}
    for label, value in source.items():
        patterns = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
        if label not in site_labels():
            problems.append(
                Problem(
                    "site_map",
                    f"{label!r} is not a site label{did_you_mean(str(label), site_labels())};"
                    f" use one of {', '.join(site_labels())}",
                )
            )
        elif not patterns or not all(isinstance(p, str) and p for p in patterns):
            problems.append(
                Problem(
                    "site_map",
                    f"{label!r} needs a module path pattern or a list of them"
                    f" (e.g. 'model.layers.*.mlp'), not {value!r}",
                )
            )
        else:
            result[label] = patterns
    raise_if_any(problems)
    return result


def matches(pattern: str, name: str) -> bool:
    """Whether module path `name` matches `pattern`, part by part (a `*` never spans a dot)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def _placements(model: nn.Module, site_map: Mapping[str, tuple[str, ...]]) -> Iterator[tuple[str, str, nn.Module]]:
    """(label, module path, module) for every match; ConfigError naming each pattern that matches
    nothing and each module two labels claim."""
    named = [(name, module) for name, module in model.named_modules() if name]
    problems: list[Problem] = []
    claimed: dict[str, str] = {}
    found: list[tuple[str, str, nn.Module]] = []
    for label, patterns in site_map.items():
        for pattern in patterns:
            hits = [(name, module) for name, module in named if matches(pattern, name)]
            if not hits:
                problems.append(
                    Problem(
                        "site_map",
                        f"{label}: pattern {pattern!r} matches no module of "
                        f"{type(model).__name__}; {_near(pattern, named)}",
                    )
                )
            for name, module in hits:
                if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                    problems.append(
                        Problem(
                            "site_map",
                            f"{label}: {name} is a {type(module).__name__}, which runs or lists every child and"
                            " would take a Site for one; place it on the module that calls it",
                        )
                    )
                elif claimed.setdefault(name, label) != label:
                    problems.append(
                        Problem(
                            "site_map",
                            f"{name} is claimed by both {claimed[name]!r} and {label!r}; a module holds one Site",
                        )
                    )
                elif not any(found_name == name for _, found_name, _ in found):
                    found.append((label, name, module))
    raise_if_any(problems)
    return iter(found)


def _near(pattern: str, named: list[tuple[str, nn.Module]]) -> str:
    """The module paths a pattern came closest to, to show what to write instead."""
    depth = pattern.count(".")
    shapes = sorted(
        {
            ".".join("*" if part.isdigit() else part for part in name.split("."))
            for name, _ in named
            if name.count(".") == depth
        }
    )
    return "its modules at that depth: " + (
        ", ".join(shapes[:8]) + (" ..." if len(shapes) > 8 else "") if shapes else "none"
    )


class _SitedForward:
    """A module's forward called through its Site."""

    def __init__(self, site: Site, inner: Callable[..., Any]) -> None:
        self.site, self.inner = site, inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.site(self.inner, *args, **kwargs)


def replace_forward(module: nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Set `module`'s forward to `wrap(its forward)` on the instance; returns what puts back the
    forward it had (its class's, or one installed on the instance before)."""
    own = module.__dict__.get("forward")
    inner = module.forward
    wrapped = wrap(inner)
    # inspect.signature follows __wrapped__: the forward keeps its parameters' names (HF's
    # Trainer keeps only the dataset columns the forward's signature names)
    wrapped.__wrapped__ = inner  # type: ignore[attr-defined]
    module.forward = wrapped  # type: ignore[method-assign]

    def undo() -> None:
        if own is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = own  # type: ignore[method-assign]

    return undo


def _place(adapter: Adapter | None, label: str, module: nn.Module) -> Callable[[], None]:
    site = Site(label)
    special = adapter.place(label, module, site) if adapter is not None else None
    unwrap = special if special is not None else replace_forward(module, functools.partial(_SitedForward, site))
    module.add_module(SITE_NAME, site)

    def undo() -> None:
        unwrap()
        delattr(module, SITE_NAME)

    return undo


def place_sites(
    model: nn.Module, site_map: SiteMapLike | None, adapter: Adapter | None, *, loss_head: bool = False
) -> nn.Module:
    """Place Sites on `model` in place (and return it), so `remat.sites.apply`, `trace` and `plan` act on it.

    `site_map`: label -> module path pattern(s), as a mapping or a YAML file; None uses the map of
    `adapter`, the model's family where remat knows it (Hugging Face transformers). Idempotent:
    adapting again with the same map changes nothing, with another map replaces the first.
    `loss_head`: compute the training loss with remat's chunked linear + cross-entropy instead of
    the model's full-vocabulary logits (same loss; the output then carries no logits).
    Raises ConfigError naming every unknown label and every pattern that matches nothing.
    """
    if site_map is None and adapter is None and any(isinstance(m, Site) for m in model.modules()):
        return model  # a model that places its own Sites
    wanted = _wanted(model, site_map, adapter)
    previous = _ADAPTED.get(model)
    if previous is not None:
        if previous.site_map == wanted and previous.loss_head == loss_head:
            return model
        remove_sites(model)
    own = [name for name, m in model.named_modules() if isinstance(m, Site)]
    if own:
        raise ConfigError(
            [
                Problem(
                    "site_map",
                    f"{type(model).__name__} already places its own Sites ({own[0]},"
                    " ...); apply plans to it directly, without adapt",
                )
            ]
        )
    if loss_head and adapter is None:
        raise ConfigError(
            [Problem("loss_head", f"remat has no chunked loss head for {type(model).__name__}; leave loss_head off")]
        )
    _ADAPTED[model] = _Adaptation(wanted, loss_head, _placed(model, wanted, adapter, loss_head))
    return model


def _wanted(model: nn.Module, site_map: SiteMapLike | None, adapter: Adapter | None) -> dict[str, tuple[str, ...]]:
    """The site map to place: the one given, else the adapter's."""
    if site_map is not None:
        return load_site_map(site_map)
    if adapter is None:
        raise ConfigError(
            [
                Problem(
                    "site_map",
                    f"remat does not know {type(model).__name__}'s family; give a site"
                    " map: label -> module path patterns, e.g. {'layer': 'layers.*',"
                    " 'mlp': 'layers.*.mlp'}",
                )
            ]
        )
    return adapter.site_map(model)


def _placed(
    model: nn.Module, wanted: dict[str, tuple[str, ...]], adapter: Adapter | None, loss_head: bool
) -> tuple[Callable[[], None], ...]:
    """Prepare the model, swap in the loss head and place each Site; what undoes each step, or
    every step undone when one fails."""
    placements = list(_placements(model, wanted))
    undo: list[Callable[[], None]] = []
    try:
        if adapter is not None:
            undo.append(adapter.prepare(model))
        if loss_head and adapter is not None:
            undo.append(adapter.loss_head(model))
        for label, _, module in placements:
            undo.append(_place(adapter, label, module))
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    return tuple(undo)


def compile_sites(model: nn.Module, **compile_kwargs: Any) -> int:
    """torch.compile the call of every placed Site that holds no other Site (norms, MLPs, experts):
    one compiled function per module class, shared by its layers. The Sites stay outside compiled
    code, so every plan composes with it. Returns how many calls were compiled."""
    import torch

    by_class: dict[type, Callable[..., Any]] = {}
    count = 0
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if not isinstance(forward, _SitedForward) or any(
            isinstance(m, Site) and m is not forward.site for m in module.modules()
        ):
            continue
        cls = type(module)
        compiled = by_class.setdefault(cls, torch.compile(cls.forward, **compile_kwargs))
        forward.inner = functools.partial(compiled, module)
        count += 1
    return count


def remove_sites(model: nn.Module) -> nn.Module:
    """Take away every Site `place_sites` put on `model` and what it changed; a no-op if it put none."""
    adaptation = _ADAPTED.pop(model, None)
    if adaptation is not None:
        for step in reversed(adaptation.undo):
            step()
    return model


def site_map_of(model: nn.Module) -> dict[str, tuple[str, ...]] | None:
    """The site map `adapt` placed on `model`, or None."""
    adaptation = _ADAPTED.get(model)
    return None if adaptation is None else dict(adaptation.site_map)
