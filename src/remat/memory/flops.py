"""FLOP formulas torch's FlopCounterMode lacks or gets wrong, for timing steps on the meta device,
and a counter that counts a matmul of FP8 operands (torchao's float8 tensors) at the time it takes
at the bf16 rate a step is timed by: half, as Hopper's and Ada's FP8 tensor cores run twice as
fast as their bf16 ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from remat.engine.storage import FP8_DTYPES, memory_tensors


def _attention_flops(bmms: int) -> Callable[..., int]:
    """`bmms` matmuls of attention's [s_q, d] x [d, s_k] size per query head; key/value heads may
    be fewer (GQA), which torch < 2.13's own formula rejects."""

    def flops(*shapes: Any, out_shape: Any = None, **kwargs: Any) -> int:
        query, key = (shapes[1], shapes[2]) if bmms > 2 else (shapes[0], shapes[1])
        b, h, s_q, d = query
        return bmms * 2 * b * h * s_q * key[2] * d

    return flops


def _addmm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *rest: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """A matmul that adds into its input (the loss head's weight gradient). torch's own formula
    takes addmm's out_dtype for its out_shape and fails, and counts nothing for addmm_."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


# Hopper's and Ada's dense FP8 tensor-core peak over their bf16 one
FP8_SPEEDUP = 2.0


def _is_fp8(x: Any) -> bool:
    """An FP8 operand: an FP8 tensor, or a wrapper subclass holding FP8 data (torchao's)."""
    return isinstance(x, torch.Tensor) and any(t.dtype in FP8_DTYPES for t in memory_tensors(x))


class TimedFlopCounter(FlopCounterMode):
    """FlopCounterMode with `time_flops`: the FLOPs as bf16-rate time, FP8 matmuls at 1/FP8_SPEEDUP.
    It reads each op through FlopCounterMode's private `_count_flops`: a torch that renames it
    counts FP8 matmuls at the bf16 rate, as before."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fp8_flops = 0

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        if func_packet in self.flop_registry and any(_is_fp8(a) for a in args[:2]):
            self.fp8_flops += self.flop_registry[func_packet](*args, **kwargs, out_val=out)
        return super()._count_flops(func_packet, out, args, kwargs)

    @property
    def time_flops(self) -> float:
        return self.get_total_flops() - self.fp8_flops * (1 - 1 / FP8_SPEEDUP)


_aten = torch.ops.aten
FLOP_FORMULAS = {
    _aten.addmm: _addmm_flops,
    _aten.addmm_: _addmm_flops,
    **{
        op: _attention_flops(2)
        for op in (_aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention)
    },
    **{
        op: _attention_flops(5)
        for op in (
            _aten._scaled_dot_product_cudnn_attention_backward,
            _aten._scaled_dot_product_flash_attention_backward,
        )
    },
}
