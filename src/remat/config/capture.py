"""Capture: which CUDA graphs a run captures, in Megatron's names (`cuda_graph_impl`,
`cuda_graph_scope`). remat checks Megatron's rules tying graphs to recompute and offload; a run
captures nothing yet (`unrun_problems`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from remat.config.fields import from_public, parse_label_tuple, parse_str, setting, to_public
from remat.core.problems import Problem, not_an_option

CUDA_GRAPH_IMPLS: tuple[str, ...] = ("none", "local", "transformer_engine", "full_iteration")
CUDA_GRAPH_SCOPES: tuple[str, ...] = (
    "full_iteration",
    "attn",
    "mlp",
    "moe",
    "moe_router",
    "moe_preprocess",
    "mamba",
)


@dataclass(frozen=True)
class Capture:
    """CUDA graphs: none, per layer (`local`, `transformer_engine`: the scopes of each layer, all of
    it when none are given) or the whole iteration."""

    cuda_graph_impl: str = setting(
        "none",
        parse=parse_str,
        flag=True,
        choices=CUDA_GRAPH_IMPLS,
        help="CUDA graphs: none, per layer (local, transformer_engine) or the whole iteration (full_iteration)",
    )
    cuda_graph_scope: tuple[str, ...] = setting(
        (),
        parse=parse_label_tuple,
        flag=True,
        text=parse_label_tuple,
        metavar="A,B",
        help=f"comma separated: {', '.join(CUDA_GRAPH_SCOPES)}",
    )

    @property
    def full_iteration(self) -> bool:
        """Megatron migrates the deprecated scope value "full_iteration" to the full-iteration implementation."""
        return self.cuda_graph_impl == "full_iteration" or "full_iteration" in self.cuda_graph_scope

    @property
    def per_layer(self) -> bool:
        return self.cuda_graph_impl in ("local", "transformer_engine") and not self.full_iteration

    @property
    def captures(self) -> bool:
        """Whether any graph is asked for."""
        return self.cuda_graph_impl != "none" or bool(self.cuda_graph_scope)

    def graphed(self, scope: str) -> bool:
        """Whether a CUDA graph captures the `scope` part of each layer (a per-layer graph with no
        scope captures the whole layer, Megatron's default)."""
        in_scope = not self.cuda_graph_scope or scope in self.cuda_graph_scope
        return self.full_iteration or (self.per_layer and in_scope)

    def problems(self) -> Iterator[Problem]:
        if self.cuda_graph_impl not in CUDA_GRAPH_IMPLS:
            yield not_an_option("cuda_graph_impl", self.cuda_graph_impl, CUDA_GRAPH_IMPLS)
        for scope in self.cuda_graph_scope:
            if scope not in CUDA_GRAPH_SCOPES:
                yield not_an_option("cuda_graph_scope", scope, CUDA_GRAPH_SCOPES)

    @classmethod
    def from_megatron(cls, keys: Mapping[str, Any]) -> Capture:
        return cls(**from_public(cls, keys))

    def to_megatron(self) -> dict[str, Any]:
        scope = self.cuda_graph_scope  # a config file's text stays as given, for from_megatron to parse
        return {**to_public(self), "cuda_graph_scope": list(scope) if isinstance(scope, (list, tuple)) else scope}

    def describe(self) -> str:
        if self.full_iteration:
            return "cuda graphs: full iteration"
        if self.cuda_graph_impl == "none":
            return "cuda graphs: off"
        return f"cuda graphs: {self.cuda_graph_impl}, capturing {', '.join(self.cuda_graph_scope) or 'whole layers'}"
