"""The loss head's CUDA chunk kernel (on CPU in Triton's interpreter, which conftest turns on):
loss and logit gradients against float64, written over the logits, and the device dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat.models.kernels.loss import (
    LossKernels,
    chunk_loss_in_place,
    chunk_loss_triton,
    chunked_linear_cross_entropy,
    on_cuda,
)

pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=4e-3),
    torch.float16: dict(rtol=2e-3, atol=1e-4),
}


def _chunk(rows: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(DEVICE, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    valid = (torch.arange(rows) % 4 != 1).to(DEVICE)
    scale = valid.float() / valid.sum().clamp(min=1)
    return logits, labels, valid, scale


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows,vocab", [(6, 100), (3, 8192 + 37), (4, 7), (0, 9)])
def test_matches_the_float64_chunk(rows: int, vocab: int, dtype: torch.dtype) -> None:
    """One vocabulary block and several (an 8192-column block and a partial one), ignored rows
    (row scale 0), no rows; the gradients land in the logits' buffer."""
    logits, labels, valid, scale = _chunk(rows, vocab, dtype)
    want_loss, want_grad = chunk_loss_in_place(logits.double(), labels, valid, scale.double(), True)
    buffer = logits.clone()
    loss, grad = chunk_loss_triton(buffer, labels, valid, scale, True)
    assert grad is buffer and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, **TOLERANCE[dtype])


def test_a_maximum_in_a_later_block_rescales_the_running_sum() -> None:
    """Logits rising along the vocabulary and every row's maximum in the last, partial block: the
    online logsumexp must rescale what it summed over the earlier blocks."""
    logits, labels, valid, scale = _chunk(3, 2 * 8192 + 37, torch.float32)
    logits += torch.linspace(0, 30, logits.shape[1], device=DEVICE)
    logits[:, -1] = logits.amax(1) + 2
    want_loss, want_grad = chunk_loss_in_place(logits.double(), labels, valid, scale.double(), True)
    loss, grad = chunk_loss_triton(logits.clone(), labels, valid, scale, True)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad.double(), want_grad, **TOLERANCE[torch.float32])


def test_without_gradients_the_logits_stay() -> None:
    logits, labels, valid, scale = _chunk(5, 300, torch.float32)
    buffer = logits.clone()
    loss, grad = chunk_loss_triton(buffer, labels, valid, scale, False)
    assert grad is None and torch.equal(buffer, logits)
    torch.testing.assert_close(
        loss.double(), chunk_loss_in_place(logits.double(), labels, valid, scale.double(), False)[0]
    )


def test_the_loss_head_on_the_kernel_matches_cross_entropy() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(19, 8, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(50, 8, generator=g).to(DEVICE).requires_grad_()
    labels = torch.randint(0, 50, (19,), generator=g).to(DEVICE)
    labels[[2, 3]] = -100
    loss = chunked_linear_cross_entropy(h, w, labels, 7, kernels=LossKernels(chunk=chunk_loss_triton))
    got = (loss, *torch.autograd.grad(3 * loss, (h, w)))
    ref = F.cross_entropy(h.double() @ w.double().T, labels)
    want = (ref, *torch.autograd.grad(3 * ref, (h, w)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6)


def test_dispatch_runs_the_fallback_off_cuda_and_for_strided_logits() -> None:
    calls: list[torch.Tensor] = []

    def fallback(logits, labels, valid, scale, need_grad):
        calls.append(logits)
        return chunk_loss_in_place(logits, labels, valid, scale, need_grad)

    logits, labels, valid, scale = (t.cpu() for t in _chunk(4, 10, torch.float32))
    on_cuda(fallback)(logits, labels, valid, scale, True)
    assert calls == [logits]
    if torch.cuda.is_available():
        logits, labels, valid, scale = _chunk(4, 10, torch.float32)
        on_cuda(fallback)(logits, labels, valid, scale, True)
        assert len(calls) == 1  # the kernel ran
        strided = logits.t().contiguous().t()
        on_cuda(fallback)(strided, labels, valid, scale, True)
        assert len(calls) == 2 and calls[-1] is strided
