"""verify(): run one step with and without a plan; compare loss and gradients, count saved bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.memory import SavedMemory, measure_saved
from remat.sites.apply import apply, offloader_of, warn_if_nothing_offloaded
from remat.sites.calls import LossFn, forward_loss, with_loss


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    saved: SavedMemory


@dataclass(frozen=True)
class VerifyReport:
    """A plan's step against the no-recompute step on the same batch and RNG seed."""

    plan: Plan
    baseline: StepResult
    candidate: StepResult

    @property
    def freed_bytes(self) -> int:
        return self.baseline.saved.bytes - self.candidate.saved.bytes

    @property
    def same_parameters_have_grads(self) -> bool:
        return self.baseline.grads.keys() == self.candidate.grads.keys()

    @property
    def max_grad_diff(self) -> float:
        """Largest |difference| over the loss and every gradient; inf if a gradient is missing."""
        if not self.same_parameters_have_grads:
            return float("inf")
        diffs = [(self.baseline.grads[n] - g).abs().max() for n, g in self.candidate.grads.items()]
        return float(max([(self.baseline.loss - self.candidate.loss).abs(), *diffs]))

    @property
    def bit_identical(self) -> bool:
        return (
            self.same_parameters_have_grads
            and torch.equal(self.baseline.loss, self.candidate.loss)
            and all(torch.equal(self.baseline.grads[n], g) for n, g in self.candidate.grads.items())
        )


def run_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, seed: int) -> StepResult:
    """Forward (counting what it leaves alive for backward) and backward from a fixed RNG seed."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss, saved = measure_saved(
        lambda: forward_loss(model, input_ids, labels), input_ids.device, resident=model.parameters
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return StepResult(loss.detach(), grads, saved)


def verify(
    model: nn.Module,
    plan: RecomputeConfig | Plan,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    seed: int = 0,
    *,
    loss_fn: LossFn | None = None,
) -> VerifyReport:
    """Run the batch without recompute, then with `plan` (left applied to `model`); a model that
    returns logits takes `loss_fn(output, labels)` (e.g. `remat.cross_entropy`)."""
    model = with_loss(model, loss_fn)
    model.train()
    apply(model, None)
    baseline = run_step(model, input_ids, labels, seed)
    resolved = apply(model, plan)
    offloader = offloader_of(model)
    if offloader is not None:
        # fill the host pool first: the counted step then creates no host buffers, and what its
        # forward leaves alive is what stays on the device
        run_step(model, input_ids, labels, seed)
        offloader.reset_stats()
    candidate = run_step(model, input_ids, labels, seed)
    warn_if_nothing_offloaded(model)
    return VerifyReport(resolved, baseline, candidate)
