"""How remat calls a model in a training step: `model(input_ids, labels=labels)`.

remat's models return the loss (or a pipeline stage's hidden states); a Hugging Face-style model
returns an output holding `.loss`; a model that returns logits (torchtitan's `forward(tokens)`)
runs inside `WithLoss` with a loss function. Every step remat runs (trace, verify, bench) calls
through here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from remat.core.problems import ConfigError, Problem

IGNORE_INDEX = -100  # labels that take no part in the loss (Megatron's and transformers')
LossFn = Callable[[Any, Tensor], Tensor]


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross-entropy of logits [..., vocab] against labels [...] already aligned
    with them (label i is the token after input i), ignoring IGNORE_INDEX: a `loss_fn`."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


class WithLoss(nn.Module):
    """`model`, which returns logits, stepped as remat steps a model: `loss_fn(model(input_ids), labels)`."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.loss_fn(self.model(input_ids), labels)


def with_loss(model: nn.Module, loss_fn: LossFn | None) -> nn.Module:
    """`model` as remat steps it: itself without a loss function, inside WithLoss with one."""
    if loss_fn is None:
        return model
    if not callable(loss_fn):
        raise ConfigError(
            [Problem("loss_fn", f"is {type(loss_fn).__name__}; give a function (output, labels) -> loss")]
        )
    return WithLoss(model, loss_fn)


def forward_loss(model: nn.Module, input_ids: Tensor, labels: Tensor) -> Tensor:
    """The loss (or hidden states) of one forward; ConfigError if the model takes no labels or
    returns neither."""
    try:
        out: Any = model(input_ids, labels=labels)
    except TypeError as err:
        if "labels" not in str(err):
            raise
        raise ConfigError([_no_loss(model, f"takes no labels= ({err})")]) from None
    if isinstance(out, Tensor):
        return out
    loss = getattr(out, "loss", None)
    if not isinstance(loss, Tensor):
        raise ConfigError([_no_loss(model, f"returned {type(out).__name__} without a loss tensor")])
    return loss


def _no_loss(model: nn.Module, what: str) -> Problem:
    return Problem(
        "model",
        f"{type(model).__name__}(input_ids, labels=labels) {what}; remat steps a model that takes labels="
        " and returns its loss (or an output with .loss); for one that returns logits, give the loss"
        " function (output, labels) -> loss: `--loss_fn remat:cross_entropy` beside --model, or"
        " remat.cross_entropy as `loss_fn` to remat.verify, trace and plan",
    )


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
