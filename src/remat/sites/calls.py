"""How remat calls a model in a training step: `model(input_ids, labels=labels)`.

remat's models return the loss (or a pipeline stage's hidden states); a Hugging Face-style model
returns an output holding `.loss`. Every step remat runs (trace, verify, bench) calls through here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


def forward_loss(model: nn.Module, input_ids: Tensor, labels: Tensor) -> Tensor:
    """The loss (or hidden states) of one forward; TypeError if the model returns neither."""
    out: Any = model(input_ids, labels=labels)
    if isinstance(out, Tensor):
        return out
    loss = getattr(out, "loss", None)
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"{type(model).__name__}(input_ids, labels=labels) returned {type(out).__name__} without a"
            " loss tensor; remat steps a model that returns its loss, or an output with .loss"
        )
    return loss


def after_optimizer_step(model: nn.Module) -> None:
    """The model's own work after each optimizer step, if it has any (an MoE model moves its
    routers' balancing bias, as Megatron does after every step)."""
    hook = getattr(model, "after_optimizer_step", None)
    if callable(hook):
        hook()


def set_loss_scale(model: nn.Module, scale: float) -> None:
    """Tell the model the factor its loss is scaled by before backward (1 / micro-batches), if it
    takes it: a model that adds losses of its own inside backward (an MoE model's auxiliary
    load-balancing loss) scales their gradients alike."""
    hook = getattr(model, "set_loss_scale", None)
    if callable(hook):
        hook(scale)
