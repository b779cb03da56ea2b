"""The chunked loss head for a Hugging Face causal LM: the loss from the last hidden states and
the output embedding, chunk by chunk (remat's chunked linear + cross-entropy), instead of the
full-vocabulary logits that HF's `ForCausalLMLoss` upcasts to float32 (4 GiB per sequence of 8192
tokens at a 128k vocabulary). Same loss as HF's: labels shifted by one, -100 ignored, a mean, or a
sum over `num_items_in_batch` where the Trainer passes it. The output then has no logits. A
micro-batch of fewer tokens than half the hidden size keeps HF's head, which then holds less.

Some heads scale their logits (Granite divides by `logits_scaling`, HyperCLOVAX multiplies by a
field of the same name, Cohere by `logit_scale`): the first call reads the scale off the logits
the model returns for its last position, and refuses a head whose logits no scale explains."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from remat.core.problems import ConfigError, Problem
from remat.models.kernels.loss import LossKernels, chunked_linear_cross_entropy, compiled_loss_kernels
from remat.sites.placement import replace_forward

IGNORE = -100
CHUNK_TOKENS = 4096


# the loss's eager kernels (a compiled model swaps in compiled_loss_kernels)
EAGER = LossKernels()


def causal_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    num_items_in_batch: Any = None,
    kernels: LossKernels = EAGER,
    shift_labels: Tensor | None = None,
) -> Tensor:
    """HF's causal-LM loss of `hidden` [b, s, h] through `weight` [V, h], without all the logits at
    once; as HF's, `shift_labels` are the labels shifted already (by context parallelism)."""
    shifted = nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:] if shift_labels is None else shift_labels
    flat = shifted.reshape(-1).to(hidden.device)
    mean = chunked_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, flat, CHUNK_TOKENS, IGNORE, kernels=kernels
    )
    if num_items_in_batch is None:
        return mean
    valid = (flat != IGNORE).sum()
    return mean * valid / torch.as_tensor(num_items_in_batch, device=mean.device)


def _whole(t: Tensor) -> Tensor:
    """A plain tensor of `t`'s whole value (a DTensor's gathered)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def logit_scale(logits: Tensor, hidden: Tensor, weight: Tensor, model: str) -> float:
    """The scalar by which `model`'s head multiplies `hidden @ weight.T` into the `logits` it
    returned for the last position; ConfigError if no scalar gives them to the dtype's rounding."""
    if hidden.is_meta:  # shapes only: no values to read a scale from
        return 1.0
    base = nn.functional.linear(_whole(hidden)[:, -1:].to(weight.dtype), _whole(weight)).double()
    got = _whole(logits)[:, -1:].double()  # a model may return every position's logits
    tolerance = 4 * max(torch.finfo(t.dtype).eps for t in (hidden, weight, logits))
    scale = float((got * base).sum() / (base * base).sum().clamp_min(torch.finfo(torch.float64).tiny))
    if abs(scale - 1) <= tolerance:
        scale = 1.0
    error = float((got - scale * base).abs().max())
    if error > tolerance * abs(scale) * float(base.abs().max()):
        raise ConfigError(
            [
                Problem(
                    "loss_head",
                    f"{model}'s head computes logits that no scale of its output layer's gives (off by"
                    f" up to {error:.3g}), which the chunked loss head cannot reproduce; leave loss_head off",
                )
            ]
        )
    return scale


def _decoder(model: nn.Module) -> nn.Module:
    """The module whose output the head takes: the one holding the decoder layers' list
    (`model` in Llama's layout, `model.decoder` in OPT's; a model's base_model may be itself)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layer = next((n for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)), "")
    if layer.count(".") >= 2:
        return model.get_submodule(layer.rsplit(".", 2)[0])
    base = model.base_model
    assert isinstance(base, nn.Module)
    return base


def loss_head_problems(model: Any) -> Iterator[Problem]:
    """Why the chunked loss head cannot stand in for `model`'s (a causal LM of transformers)."""
    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(model.config, "final_logit_softcapping", None):
        yield Problem(
            "loss_head", f"{name} soft-caps its logits, which the chunked loss head does not; leave loss_head off"
        )
    forward = getattr(inspect.unwrap(type(model).forward), "__code__", None)
    loss = getattr(getattr(model, "loss_function", None), "__name__", None)
    if forward is None or "loss_function" not in forward.co_names or loss != "ForCausalLMLoss":
        yield Problem(
            "loss_head",
            f"{name} computes its own loss, not transformers' causal LM loss (labels shifted by one),"
            " which the chunked loss head computes; leave loss_head off",
        )
    if not isinstance(head, nn.Linear) or head.bias is not None:
        yield Problem("loss_head", f"{name}'s output layer is not a Linear without bias; leave loss_head off")


def swap_loss_head(model: Any) -> Callable[[], None]:
    """Compute `model`'s training loss with the chunked head whenever labels are given; returns the undo."""
    problems = list(loss_head_problems(model))
    if problems:
        raise ConfigError(problems)
    head = model.get_output_embeddings()
    base = _decoder(model)
    state: dict[str, Any] = {}

    def capture(module: nn.Module, args: tuple, out: Any) -> None:
        state["hidden"] = (
            out if isinstance(out, Tensor) else out[0] if isinstance(out, tuple) else out.last_hidden_state
        )

    def chunked(inner: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(_forward, inner)

    def _forward(inner: Callable[..., Any], *args: Any, labels: Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None or labels.numel() * 2 <= head.in_features:
            # the chunked head keeps the output layer's gradient (vocab x hidden) from forward to
            # backward, HF's keeps float32 logits (tokens x vocab): fewer tokens than half the
            # hidden size keep less HF's way
            return inner(*args, labels=labels, **kwargs)
        shift_labels = kwargs.pop("shift_labels", None)  # the loss's, not the model's
        first = "scale" not in state
        handle = base.register_forward_hook(capture)
        try:  # no logits at all (the first call: the last position's, to read the head's scale)
            out = inner(*args, logits_to_keep=1 if first else torch.empty(0, dtype=torch.long), **kwargs)
        finally:
            handle.remove()
        hidden = state.pop("hidden")
        if first:
            with torch.no_grad():
                state["scale"] = logit_scale(out.logits, hidden, head.weight, type(model).__name__)
        hidden = hidden.to(head.weight.dtype)  # as heads that cast their input do
        if state["scale"] != 1.0:
            hidden = hidden * state["scale"]
        # compiled on CUDA (remat's Triton chunk kernel); eager elsewhere, where compiling costs more than it saves
        kernels = compiled_loss_kernels() if hidden.is_cuda else LossKernels()
        loss = causal_lm_loss(hidden, head.weight, labels, kwargs.get("num_items_in_batch"), kernels, shift_labels)
        aux = getattr(out, "aux_loss", None)
        if aux is not None:  # MoE load balancing, as HF adds it when labels are given
            loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
        out.loss, out.logits = loss, None
        return out

    return replace_forward(model, chunked)
