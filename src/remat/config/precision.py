"""Precision: the dtype a run computes in, as Megatron Bridge names it (`-c/--compute_dtype`), and
Megatron's FP8 settings (`fp8`, `fp8_recipe`) that its recompute rules read."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from remat.config.fields import from_public, optional, parse_bool, parse_int, parse_str, setting, to_public
from remat.core.problems import Problem, did_you_mean, not_an_option, one_of

# What remat computes in, and Megatron Bridge's names of the rest (refused by name).
COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp8_cs", "fp32", "fp64")
BRIDGE_COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp8_cs", "fp8_mx", "fp8_sc", "nvfp4")
FP8_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")
# Megatron's recipes, and torchao's rowwise (current scaling per row) beside its tensorwise
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "rowwise", "mxfp8", "blockwise", "custom")
# what fp8_cs (current scaling) runs through torchao; the reason each other recipe does not run
CURRENT_SCALING_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
NOT_RUN: dict[str, str] = {
    "delayed": "delayed scaling keeps an amax history across steps, which torchao's float8 training"
    " no longer has; fp8_cs scales each tensor from its own amax: use --fp8_recipe tensorwise",
    "mxfp8": "MXFP8 is Bridge's fp8_mx, which needs Blackwell tensor cores (compute capability 10.0)",
    "blockwise": "blockwise scaling (Bridge's fp8_sc) is a torchao prototype remat does not run yet;"
    " use tensorwise or rowwise",
    "custom": "a custom recipe is Megatron's own Python class; use tensorwise or rowwise",
}
REFUSED_DTYPES: dict[str, str] = {
    "fp8_mx": "MXFP8 needs Blackwell tensor cores (compute capability 10.0), and remat has no MX path"
    " yet; on Hopper and Ada use -c fp8_cs",
    "nvfp4": "NVFP4 needs Blackwell tensor cores (compute capability 10.0), and remat has no FP4 path"
    " yet; on Hopper and Ada use -c fp8_cs",
    "fp8_sc": "subchannel (blockwise) scaling is a torchao prototype remat does not run yet; use -c fp8_cs",
}


@dataclass(frozen=True)
class Precision:
    """A run's compute dtype and Megatron's FP8 settings. `-c fp8_cs` trains the decoder layers'
    linears in FP8 with current scaling (torchao's float8 training), the embedding, output head,
    norms and attention in bf16, as Megatron keeps them."""

    compute_dtype: str = setting(
        "bf16",
        parse=parse_str,
        flag=True,
        short="-c",
        metavar="DTYPE",
        help=f"{', '.join(COMPUTE_DTYPES)}; fp8_cs: the layers' linears in FP8, current scaling (needs torchao)",
    )
    fp8: str | None = setting(
        None,
        parse=optional(parse_str),
        flag=True,
        metavar="FORMAT",
        help="with -c fp8_cs: e4m3 everywhere, or hybrid (gradients in e5m2; the default for tensorwise)",
    )
    fp8_recipe: str | None = setting(
        None,
        parse=optional(parse_str),
        flag=True,
        metavar="RECIPE",
        help="with -c fp8_cs: tensorwise (default) or rowwise scales",
    )
    first_last_layers_bf16: bool = setting(
        False, parse=parse_bool, flag=True, help="keep the first and last layers' linears in bf16 under FP8"
    )
    num_layers_at_start_in_bf16: int = setting(
        1, parse=parse_int, flag=True, metavar="N", help="with --first_last_layers_bf16: layers at the start"
    )
    num_layers_at_end_in_bf16: int = setting(
        1, parse=parse_int, flag=True, metavar="N", help="with --first_last_layers_bf16: layers at the end"
    )

    fp8_keep_inputs: bool = setting(
        True,
        parse=parse_bool,
        flag=True,
        negatable=True,
        help="with -c fp8_cs tensorwise: each FP8 linear keeps the FP8 input it cast (1 byte an element)"
        " for its weight gradient instead of a bf16 copy; the same gradients",
    )

    @property
    def keeps_fp8_inputs(self) -> bool:
        """Whether the run's FP8 linears keep their FP8 inputs (tensorwise: cast alike both ways)."""
        return self.is_fp8 and self.fp8_keep_inputs and self.recipe == "tensorwise"

    @property
    def label(self) -> str:
        """What a table calls the run's dtype: fp8_cs, or the torch dtype's name."""
        return self.compute_dtype if self.is_fp8 else str(self.dtype).removeprefix("torch.")

    @property
    def is_fp8(self) -> bool:
        return self.compute_dtype == "fp8_cs"

    @property
    def fp8_format(self) -> str | None:
        """The FP8 format the run uses (Megatron's `fp8`): hybrid by default under fp8_cs."""
        return self.fp8 or ("hybrid" if self.is_fp8 else None)

    @property
    def recipe(self) -> str:
        """The scaling recipe: tensorwise by default under fp8_cs, Megatron's delayed otherwise."""
        return self.fp8_recipe or ("tensorwise" if self.is_fp8 else "delayed")

    def bf16_layers(self, num_layers: int) -> frozenset[int]:
        """The layers (of `num_layers`) whose linears stay in bf16."""
        if not self.first_last_layers_bf16:
            return frozenset()
        start, end = self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16
        return frozenset(range(min(start, num_layers))) | frozenset(range(max(num_layers - end, 0), num_layers))

    def problems(self) -> Iterator[Problem]:
        """Values that are not a format or recipe (Megatron's rules), and compute dtypes and recipes
        remat does not run."""
        yield from self.compute_problems()
        yield from self.fp8_problems()
        if self.is_fp8:
            yield from self.fp8_run_problems()

    def fp8_problems(self) -> Iterator[Problem]:
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            yield not_an_option("fp8", self.fp8, FP8_FORMATS)
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            yield not_an_option("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) < 0:
                yield Problem(name, f"is {getattr(self, name)}; give a count of layers >= 0")

    def fp8_run_problems(self) -> Iterator[Problem]:
        """What an FP8 run cannot be: a recipe other than current scaling."""
        if self.recipe in NOT_RUN:
            yield Problem("fp8_recipe", f"is {self.recipe!r}: {NOT_RUN[self.recipe]}")

    def compute_problems(self) -> Iterator[Problem]:
        dtype = self.compute_dtype
        if dtype in REFUSED_DTYPES:
            yield Problem("compute_dtype", f"{dtype!r}: {REFUSED_DTYPES[dtype]}")
        elif dtype not in COMPUTE_DTYPES:
            yield Problem(
                "compute_dtype",
                f"{dtype!r} is not a compute dtype{did_you_mean(dtype, COMPUTE_DTYPES)}; remat runs"
                f" {one_of(COMPUTE_DTYPES)}",
            )
        elif not self.is_fp8:
            fp8_only = [n for n in ("fp8", "fp8_recipe") if getattr(self, n) is not None]
            fp8_only += ["first_last_layers_bf16"] if self.first_last_layers_bf16 else []
            if fp8_only and dtype != "bf16":  # bf16 runs carry Megatron's fp8 keys for its rules
                yield Problem(fp8_only[0], f"applies to FP8 training, not {dtype}; add -c fp8_cs or drop it")

    @property
    def dtype(self) -> Any:
        """The torch dtype of compute_dtype (FP8 runs hold and compute the rest in bf16)."""
        import torch

        return {"bf16": torch.bfloat16, "fp8_cs": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[
            self.compute_dtype
        ]

    @classmethod
    def from_megatron(cls, keys: Mapping[str, Any]) -> Precision:
        return cls(**from_public(cls, keys))

    def to_megatron(self) -> dict[str, Any]:
        """Megatron's keys (the compute dtype is Bridge's flag, not a config key)."""
        return {k: v for k, v in to_public(self).items() if k != "compute_dtype"}
