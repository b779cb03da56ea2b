"""Precision: the dtype a run computes in, as Megatron Bridge names it (`-c/--compute_dtype`), and
Megatron's FP8 settings (`fp8`, `fp8_recipe`) that its recompute rules read."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from remat.config.fields import from_public, optional, parse_str, setting, to_public
from remat.core.problems import Problem, did_you_mean, not_an_option, one_of

# What remat computes in, and Megatron Bridge's names of the rest (refused by name).
COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp32", "fp64")
BRIDGE_COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp8_cs", "fp8_mx", "fp8_sc", "nvfp4")
FP8_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")


@dataclass(frozen=True)
class Precision:
    """A run's compute dtype and Megatron's FP8 settings."""

    compute_dtype: str = setting(
        "bf16",
        parse=parse_str,
        flag=True,
        short="-c",
        metavar="DTYPE",
        help=f"{', '.join(COMPUTE_DTYPES)} (Megatron Bridge's fp8 variants are not supported yet)",
    )
    fp8: str | None = setting(None, parse=optional(parse_str))
    fp8_recipe: str = setting("delayed", parse=parse_str)

    def problems(self) -> Iterator[Problem]:
        """Values that are not a format or recipe (Megatron's rules), and compute dtypes remat does
        not run."""
        yield from self.compute_problems()
        yield from self.fp8_problems()

    def fp8_problems(self) -> Iterator[Problem]:
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            yield not_an_option("fp8", self.fp8, FP8_FORMATS)
        if self.fp8_recipe not in FP8_RECIPES:
            yield not_an_option("fp8_recipe", self.fp8_recipe, FP8_RECIPES)

    def compute_problems(self) -> Iterator[Problem]:
        dtype = self.compute_dtype
        if dtype not in COMPUTE_DTYPES:
            known = dtype in BRIDGE_COMPUTE_DTYPES
            # a typo is pointed at what runs, not at a Bridge dtype that would be refused next
            yield Problem(
                "compute_dtype",
                f"{dtype!r} is "
                + (
                    "not supported yet"
                    if known
                    else f"not a compute dtype{did_you_mean(dtype, COMPUTE_DTYPES)}; Megatron Bridge's "
                    f"are {one_of(BRIDGE_COMPUTE_DTYPES)}"
                )
                + "; use -c bf16",
            )

    @property
    def dtype(self) -> Any:
        """The torch dtype of compute_dtype."""
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[self.compute_dtype]

    @classmethod
    def from_megatron(cls, keys: Mapping[str, Any]) -> Precision:
        return cls(**from_public(cls, keys))

    def to_megatron(self) -> dict[str, Any]:
        """Megatron's keys (the compute dtype is Bridge's flag, not a config key)."""
        return {k: v for k, v in to_public(self).items() if k != "compute_dtype"}
