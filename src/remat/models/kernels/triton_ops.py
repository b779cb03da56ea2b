"""What remat's Triton-backed Functions share: whether Triton is there, the dtypes the kernels
take, and a launch that does nothing on the meta device.

Triton is imported when a kernel is first launched, so CPU-only installs never need it; with
TRITON_INTERPRET=1 the same kernels run on CPU tensors (that is how the tests check them). On the
meta device nothing is launched: a Function then only allocates, which is what remat's estimate
needs of it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

# The kernels compute in float32: float64 would lose precision, so it takes the fallbacks.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Fn = TypeVar("Fn", bound=Callable[..., Any])


def row_block(width: int) -> int:
    """A kernel block holding `width` columns: the next power of two (Triton blocks are)."""
    return 1 << max(width - 1, 0).bit_length()


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels() -> Any:
    from remat.models.kernels import triton_kernels

    return triton_kernels


def dispatch(kernel: Fn, fallback: Fn, takes: Callable[..., bool]) -> Fn:
    """`kernel` for the calls whose arguments it `takes` (and CUDA tensors of KERNEL_DTYPES, which
    `takes` checks), `fallback` for the rest and everywhere when Triton is not installed."""
    if not triton_available():
        return fallback

    def call(*args: Any) -> Any:
        return (kernel if takes(*args) else fallback)(*args)

    return call  # type: ignore[return-value]


def launch(name: str, grid: tuple[int, ...], on: Tensor, *args: Any, **meta: Any) -> None:
    """Run kernel `name` over `grid` on the device of `on` (Triton launches on the current device
    otherwise); nothing when `on` is empty or on meta."""
    if on.numel() and on.device.type != "meta":
        guard = torch.cuda.device(on.device) if on.is_cuda else contextlib.nullcontext()
        with guard:
            getattr(_kernels(), name)[grid](*args, **meta)


def refuse_double_backward(what: str) -> None:
    """A kernel's result has no graph: refuse create_graph=True instead of returning wrong
    second derivatives."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"remat's Triton {what} is not twice differentiable; for second derivatives "
            "run the model without compile_regions()"
        )
