"""FP8 training with current scaling (`-c fp8_cs`), through torchao's float8 training: each linear
of the decoder layers becomes torchao's `Float8Linear`, which casts its input, weight and output
gradient to FP8 on every call with a scale from that tensor's own amax (tensorwise: one per
tensor; rowwise: one per row). The embedding, the output head, norms and attention stay in bf16,
as Megatron keeps them, and so do the first and last layers under `first_last_layers_bf16`.

Current scaling keeps no state across calls: a recompute replay casts the same tensor with the
same scale, so FP8 with recompute is bit-identical to FP8 without. Tensor parallelism splits the
swapped linears by torch's styles: a split weight or input is a DTensor, whose amax (and so its
scale) torchao reduces over the ranks, as one process's would be. `Float8Linear` subclasses
`nn.Linear` and keeps its parameters, so `state_dict` keys, `.to()`, saving and loading are a
linear's. torchao is an optional extra (`remat[fp8]`).

Under tensorwise scaling the weight-gradient GEMM casts the input exactly as the forward did (one
scale from the same tensor, the same dtype), so a linear may keep the FP8 input its forward cast,
1 byte an element, instead of torchao's bf16 copy: under `fp8_keep_inputs` (on by default) it
does, with gradients bit-identical to torchao's. Its input then is no longer kept in bf16 by it,
so discarding the norm or activation that feeds it (`layernorm`, `mlp_act`) frees less than in
bf16 (what the trace measures, and the planner weighs)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from remat.config.precision import Precision
from remat.core.labels import LAYER
from remat.core.problems import ConfigError, Problem, warn
from remat.sites.site import Site

INSTALL = "FP8 training needs torchao: pip install 'remat[fp8]' (or pip install torchao)"
# torch's FP8 GEMM (_scaled_mm) takes inner and outer sizes in multiples of 16
GEMM_MULTIPLE = 16
FORMATS = {"e4m3": torch.float8_e4m3fn, "hybrid": torch.float8_e5m2}  # the output gradient's dtype


def torchao_float8() -> Any:
    """torchao.float8, or a ConfigError with the line that installs it."""
    # torchao logs a warning for each compiled extension it cannot load (CUDA kernels on a CPU
    # machine, another torch's ABI); float8 training is Python and needs none of them
    # (and torch a deprecation of how torchao registers an enum with the compiler)
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
        import torchao.float8.float8_linear  # noqa: F401  (the submodules, by attribute below)
        import torchao.float8.float8_linear_utils
        import torchao.float8.float8_scaling_utils
        import torchao.float8.float8_training_tensor  # noqa: F401
    except ImportError:
        raise ConfigError([Problem("compute_dtype", f"'fp8_cs': {INSTALL}")]) from None
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return float8


def float8_config(precision: Precision) -> Any:
    """torchao's Float8LinearConfig for the precision's recipe and format (Megatron's hybrid: the
    output gradient in e5m2; e4m3: everything in e4m3)."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(precision.recipe)
    if precision.fp8 is None:  # the recipe's own: tensorwise is hybrid, rowwise e4m3
        return config
    grads = ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")  # torchao: both alike
    dtype = FORMATS[precision.fp8]
    return dataclasses.replace(
        config, **{name: dataclasses.replace(getattr(config, name), target_dtype=dtype) for name in grads}
    )


def fp8_run_problems(precision: Precision, device: str) -> Iterator[Problem]:
    """Why an FP8 run cannot run here: torchao missing, a GPU without FP8."""
    if not precision.is_fp8:
        return
    try:
        torchao_float8()
    except ConfigError as err:
        yield from err.problems
    if device.startswith("cuda") and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(torch.device(device))
        if capability < (8, 9):
            yield Problem(
                "compute_dtype",
                f"fp8_cs needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper,"
                f" Blackwell); {torch.cuda.get_device_name(torch.device(device))} has"
                f" {capability[0]}.{capability[1]}; use -c bf16",
            )


def _fp8_linear(input: Tensor, weight: Tensor, mm_config: Any, config: Any, keep_input: bool) -> Tensor:
    """torchao's FP8 matmul of `input` by `weight`; with `keep_input`, the input cast here first,
    so that torchao's matmul saves the FP8 tensor for backward and uses it as cast there (the
    cast's backward passes the gradient through). A step's hot path: torchao is imported already
    (to_fp8), so these imports are lookups."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    if keep_input:
        c = config.cast_config_input
        input = hp_tensor_to_float8_dynamic(
            input,
            c.target_dtype,
            mm_config,
            gemm_input_role=GemmInputRole.INPUT,
            scaling_granularity=c.scaling_granularity,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )
    return matmul_with_hp_or_float8_args.apply(input, weight.t(), mm_config, config)


@functools.cache
def _compiled(backend: str) -> Callable[..., Tensor]:
    # one compiled function for every layer's linears: the weights are its inputs, so the layers
    # share its graphs (one a shape), and inductor fuses each cast with its amax as torchao intends
    return torch.compile(_fp8_linear, backend=backend)


@functools.cache
def _linear_class(float8: Any) -> Any:
    """torchao's Float8Linear running `_fp8_linear`, eager or compiled (the class attributes
    `keep_input` and `backend`, set per instance by to_fp8)."""

    class Fp8Linear(float8.float8_linear.Float8Linear):  # type: ignore[misc,name-defined]
        keep_input = False
        backend: str | None = None

        def forward(self, input: Tensor) -> Tensor:
            run = _compiled(self.backend) if self.backend else _fp8_linear
            output = run(input, self.weight, self.linear_mm_config, self.config, self.keep_input)
            return output if self.bias is None else output + self.bias.to(output.dtype)

    return Fp8Linear


def keeps_fp8_input(config: Any) -> bool:
    """Whether the weight-gradient GEMM casts the input as the forward does (tensorwise, alike)."""
    c = config.cast_config_input
    return c == config.cast_config_input_for_grad_weight and c.scaling_granularity.value == "tensorwise"


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of `model`: the modules holding its `layer` Sites, in order."""
    return [
        model.get_submodule(name.rpartition(".")[0])
        for name, module in model.named_modules()
        if isinstance(module, Site) and module.label == LAYER and "." in name
    ]


# routers stay in high precision (Megatron keeps them so): their scores pick the experts
ROUTERS = frozenset({"router", "gate"})


def _fits(module: nn.Module, path: str) -> bool:
    return (
        isinstance(module, nn.Linear)
        and path.rpartition(".")[2] not in ROUTERS
        and module.in_features % GEMM_MULTIPLE == 0
        and module.out_features % GEMM_MULTIPLE == 0
    )


def to_fp8(
    model: nn.Module,
    precision: Precision,
    layers: Sequence[int] | None = None,
    num_layers: int = 0,
    compile_backend: str | None = None,
) -> int:
    """Swap the linears of `model`'s decoder layers for torchao's Float8Linear; the number swapped.
    `layers`: the whole model's index of each layer `model` holds (a pipeline stage's), and
    `num_layers` the whole model's count, for the layers kept in bf16; by default `model`'s own.
    Under `precision.keeps_fp8_inputs` each linear keeps its FP8 input for backward.
    `compile_backend`: torch.compile's backend for the linears' casts and matmuls (None: eager)."""
    if not precision.is_fp8:
        return 0
    float8, config = torchao_float8(), float8_config(precision)
    kind, keep = _linear_class(float8), precision.keeps_fp8_inputs and keeps_fp8_input(config)

    swapped: list[nn.Linear] = []

    def swapped_in(linear: nn.Linear) -> nn.Linear:
        fp8 = kind.from_float(linear, config=config)
        fp8.keep_input, fp8.backend = keep, compile_backend
        swapped.append(fp8)
        return fp8

    found = layer_modules(model)
    if not found:
        raise ConfigError(
            [
                Problem(
                    "compute_dtype",
                    f"fp8_cs swaps the linears of a model's decoder layers, and"
                    f" {type(model).__name__} marks none with a 'layer' Site; adapt it or place Sites",
                )
            ]
        )
    indices = list(layers) if layers is not None else list(range(len(found)))
    in_bf16 = precision.bf16_layers(num_layers or len(found))
    grouped = 0
    for index, layer in zip(indices, found, strict=True):
        if index in in_bf16:
            continue
        float8.float8_linear_utils.swap_linear_layers(layer, swapped_in, module_filter_fn=_fits)
        grouped += sum(p.dim() > 2 for p in layer.parameters())
    if grouped:
        warn(
            "fp8_cs: the routed experts' grouped GEMMs run in bf16 (an FP8 grouped GEMM is not wired"
            " in yet); their layers' other linears run in FP8"
        )
    return len(swapped)
