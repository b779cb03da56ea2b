"""FLOP formulas torch's FlopCounterMode lacks or gets wrong, for timing steps on the meta device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


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
