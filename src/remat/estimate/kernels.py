"""What the target device runs, on meta tensors: its fused attention kernels (cuDNN on CUDA, flash
on CPU) where torch would take its unfused path, and fused AdamW's state without its kernel."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from remat.core.problems import ConfigError, Problem


class TargetKernels(TorchFunctionMode):
    """On meta tensors torch takes its unfused paths; run what the `target` device would run:
    fused attention (cuDNN on CUDA, flash on CPU)."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not args or not isinstance(args[0], Tensor) or args[0].device.type != "meta":
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention and self._fused(args, kwargs):
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _fused(self, args: tuple, kwargs: dict) -> bool:
        """Whether the target runs SDPA fused: flash and cuDNN take one head dim for q, k and v
        (MLA's v is narrower), CPU flash no dropout, and only the unfused path gives a learned mask
        (Inkling's position bias) its gradient with grouped key heads; meta runs unfused."""
        if len(args) < 3 or args[0].shape[-1] != args[2].shape[-1]:
            return False
        if _learned(kwargs.get("attn_mask", args[3] if len(args) > 3 else None)):
            return False
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return self.target == "cuda" or not dropout

    def _attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if self.target == "cuda":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, attn_mask, True, dropout_p, is_causal, False, scale=scale
            )[0]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]


@contextmanager
def target_kernels(target: str, model: nn.Module) -> Iterator[None]:
    """TargetKernels over a step of `model`; a model whose step reads tensor values (a mask's
    `.item()`, routing counts `.tolist()`, `torch.unique`), which meta tensors lack, refused by name."""
    try:
        with TargetKernels(target):
            yield
    except (RuntimeError, NotImplementedError) as err:
        if "meta" not in str(err).lower():
            raise
        reason = str(err).splitlines()[0][:120]
        raise ConfigError(
            [
                Problem(
                    "model",
                    f"{type(model).__name__}'s step reads tensor values, which a shapes-only run on the meta"
                    f" device does not have ({reason}); measure it on its device instead (`remat bench`,"
                    " `remat plan`)",
                )
            ]
        ) from err


def _learned(mask: Any) -> bool:
    return isinstance(mask, Tensor) and mask.requires_grad


class AdamWState(torch.optim.Optimizer):
    """What fused AdamW (the bench's on CUDA) holds: two moments per parameter, updated in place
    (no temporaries). Meta tensors cannot run the fused kernel; memory is all the estimate needs."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def begin_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The state a steady step's optimizer holds, made by one step on zero gradients (meta: no data);
    the trace puts back the state it finds, which the stage's estimate then counts."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
