"""The engine alone, on small functions: exact replay, no-grad inputs, .grad(), discard, groups."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from remat.engine import DiscardScope, Region, checkpoint
from remat.engine.rng import ReplayState

torch.use_deterministic_algorithms(True)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 16, dtype=torch.float64, generator=g).requires_grad_()
    n = torch.rand(16, dtype=torch.float64, generator=g).add_(0.5).requires_grad_()
    return w, n


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # dropout twice, so a wrong RNG restore changes the masks
    return F.dropout(torch.tanh(F.dropout(x, 0.3, True) @ w), 0.5, True)


def _grads(loss: torch.Tensor, *params: torch.Tensor) -> list[torch.Tensor]:
    loss.backward()
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def test_checkpoint_replays_dropout_exactly_and_frees_nothing_needed() -> None:
    w, _ = _weights()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    results = []
    for use in (False, True):
        torch.manual_seed(7)
        y = checkpoint(_block, x, w) if use else _block(x, w)
        after = torch.rand(3)  # the forward's RNG stream continues unchanged
        results.append((y.detach(), after, *_grads((y * y).sum(), x, w)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_checkpoint_gives_parameter_grads_when_no_input_requires_grad() -> None:
    # Frozen embeddings / LoRA: the reentrant design silently loses these gradients.
    w, _ = _weights()
    x = torch.randn(8, 16, dtype=torch.float64)
    torch.manual_seed(3)
    expected = _grads(_block(x, w).sum(), w)
    torch.manual_seed(3)
    y = checkpoint(_block, x, w)
    assert y.requires_grad
    assert torch.equal(_grads(y.sum(), w)[0], expected[0])


def test_checkpoint_supports_autograd_grad() -> None:
    w, _ = _weights()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    ref = torch.autograd.grad(_block(x, w).sum(), (x, w))
    torch.manual_seed(5)
    got = torch.autograd.grad(checkpoint(_block, x, w).sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert w.grad is None


def test_checkpoint_passes_through_without_grad(monkeypatch) -> None:
    """No autograd, nothing to replay: the function runs as is (same dropout masks from the same
    seed) and no replay state is captured."""
    w, _ = _weights()
    x = torch.ones(2, 16, dtype=torch.float64)
    captured = []
    capture = ReplayState.capture.__func__
    monkeypatch.setattr(ReplayState, "capture", classmethod(lambda cls, t: captured.append(1) or capture(cls, t)))
    with torch.no_grad():
        torch.manual_seed(1)
        y = checkpoint(_block, x, w)
        torch.manual_seed(1)
        plain = _block(x, w)
    assert not y.requires_grad and torch.equal(y, plain) and not captured
    checkpoint(_block, x, w)
    assert captured


def _norm_then_consumers(
    x: torch.Tensor, w: torch.Tensor, n: torch.Tensor, discard: bool, calls: list[int]
) -> torch.Tensor:
    def norm(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return F.rms_norm(t, (16,), n)

    with DiscardScope() as scope:
        h = scope.discard(norm, (x,), {}) if discard else norm(x)
        # three consumers save the output, one through a strided view
        return (torch.tanh(h @ w) + torch.sigmoid(h.t()[:4].t() @ w[:4]) + h * h).sum()


def test_discard_rebuilds_the_output_once_for_all_consumers() -> None:
    w, n = _weights()
    x0 = torch.randn(8, 16, dtype=torch.float64)
    results, counts = [], []
    for discard in (False, True):
        calls: list[int] = []
        x = x0.clone().requires_grad_()
        loss = _norm_then_consumers(x, w, n, discard, calls)
        results.append(_grads(loss, x, w, n))
        counts.append(len(calls))
    assert counts == [1, 2]  # forward, plus exactly one replay shared by every consumer
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("discard", [False, True])
def test_discarded_output_storage_is_freed_after_forward(discard: bool) -> None:
    w, n = _weights()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    with DiscardScope() as scope:
        norm = lambda t: F.rms_norm(t, (16,), n)  # noqa: E731
        h = scope.discard(norm, (x,), {}) if discard else norm(x)
        y = torch.tanh(h @ w)
    storage = weakref.ref(h.untyped_storage())
    del h
    gc.collect()
    assert (storage() is None) == discard
    y.sum().backward()  # and the graph still runs


def test_region_links_consecutive_calls_and_replays_them_in_order() -> None:
    w, n = _weights()
    x0 = torch.randn(8, 16, dtype=torch.float64)
    results = []
    for grouped in (False, True):
        torch.manual_seed(11)
        x = x0.clone().requires_grad_()
        region = Region()
        h = x
        for _ in range(3):
            h = region.call(_block, (h, w), {}) if grouped else _block(h, w)
            h = F.rms_norm(h, (16,), n)  # between calls: runs outside the region
        region.close()
        results.append(_grads(h.sum(), x, w, n))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_replay_that_takes_another_path_is_an_error() -> None:
    w, _ = _weights()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    flag = {"on": True}

    def branchy(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t @ w) if flag["on"] else t * 2

    y = checkpoint(branchy, x)
    flag["on"] = False
    with pytest.raises(RuntimeError, match="different path"):
        y.sum().backward()


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))


def test_replay_stops_before_the_last_op_when_no_output_is_needed() -> None:
    w, _ = _weights()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)

    def two_matmuls(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t @ w) @ w

    def backward_matmuls(use: bool) -> int:
        y = checkpoint(two_matmuls, x) if use else two_matmuls(x)
        with _CountMatmuls() as counter:
            y.sum().backward()
        return counter.count

    # the replay recomputes the first matmul and tanh; the second matmul's input is saved
    # before it runs, so the replay ends there
    assert backward_matmuls(True) == backward_matmuls(False) + 1


def test_in_place_change_of_a_checkpoint_input_is_an_error_not_a_wrong_gradient() -> None:
    w, _ = _weights()
    a = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    x = a * 1.0
    y = checkpoint(lambda t: torch.tanh(t @ w), x)
    x.mul_(3)
    with pytest.raises(RuntimeError, match="in-place"):
        y.sum().backward()


def test_in_place_change_of_a_discarded_output_after_a_consumer_saved_it_is_an_error() -> None:
    w, n = _weights()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="in-place"):
        with DiscardScope() as scope:
            h = scope.discard(lambda t: F.rms_norm(t, (16,), n), (x,), {})
            y = h @ w  # saves a reference to h
            h.mul_(3)
    # changed before any consumer saved it: the consumer keeps the real tensor, gradients exact
    results = []
    for discard in (False, True):
        with DiscardScope() as scope:
            norm = lambda t: F.rms_norm(t, (16,), n)  # noqa: E731
            h = scope.discard(norm, (x,), {}) if discard else norm(x)
            h = h * 1.0 if not discard else h
            h.mul_(3)
            y = h @ w
        results.append(_grads(y.sum(), x, w, n))
    for a, b in zip(*results):
        assert torch.allclose(a, b)


def test_in_place_change_between_grouped_calls_is_replayed_from_the_changed_value() -> None:
    w, _ = _weights()
    x0 = torch.randn(8, 16, dtype=torch.float64)
    results = []
    for grouped in (False, True):
        torch.manual_seed(2)
        x = x0.clone().requires_grad_()
        region = Region()
        h = region.call(_block, (x, w), {}) if grouped else _block(x, w)
        h = h * 1.0
        h.add_(1.0)
        h = region.call(_block, (h, w), {}) if grouped else _block(h, w)
        region.close()
        results.append(_grads(h.sum(), x, w))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_forward_without_backward_frees_everything_inside_a_discard_scope() -> None:
    # Saved outputs (tanh saves its result) must not form a reference cycle through the hooks.
    w, n = _weights()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    with DiscardScope() as scope:
        h = scope.discard(lambda t: F.rms_norm(t, (16,), n), (x,), {})
        y = torch.tanh(h @ w)
    storage = weakref.ref(y.untyped_storage())
    del h, y
    assert storage() is None  # freed by reference counting alone, no gc needed


def test_sites_nested_in_a_region_just_run() -> None:
    from remat.sites.site import Site

    inner = Site("moe_act")
    calls: list[str] = []
    inner.action = lambda site, fn, args, kwargs: calls.append("inner action") or fn(*args)
    w, _ = _weights()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    y = checkpoint(lambda t: inner(torch.tanh, t @ w), x)
    y.sum().backward()
    assert calls == []  # the outer region recomputes everything in it
    assert inner(torch.tanh, x).requires_grad and calls == ["inner action"]


def test_replay_stop_is_not_caught_by_user_fallbacks() -> None:
    w, _ = _weights()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)

    def with_fallback(t: torch.Tensor) -> torch.Tensor:
        try:
            return torch.tanh(t @ w) @ w
        except Exception:  # a user's "fused kernel failed, use eager" path
            return (t @ w) @ w

    ref = torch.autograd.grad(with_fallback(x).sum(), x)[0]
    assert torch.equal(torch.autograd.grad(checkpoint(with_fallback, x).sum(), x)[0], ref)


@pytest.mark.parametrize("mechanism", ["checkpoint", "discard"])
def test_double_backward_through_a_region_matches_eager(mechanism: str) -> None:
    w, n = _weights()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)

    def second_order(use: bool) -> tuple[torch.Tensor, ...]:
        with DiscardScope() as scope:
            if mechanism == "discard":
                norm = lambda t: F.rms_norm(t, (16,), n)  # noqa: E731
                h = scope.discard(norm, (x,), {}) if use else norm(x)
                y = torch.tanh(h @ w).pow(2).sum()
            else:
                body = lambda t: torch.tanh(t @ w)  # noqa: E731
                y = (checkpoint(body, x) if use else body(x)).pow(2).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), (x, w))

    for a, b in zip(second_order(False), second_order(True)):
        assert torch.equal(a, b)


class _TanhAsSin(TorchFunctionMode):
    """A torch-function mode that changes what a call computes (as remat estimate's kernels do)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {})) if func is not torch.tanh else torch.sin(*args)


def test_replay_runs_under_the_torch_function_modes_of_the_forward() -> None:
    """Autograd runs backward without function modes; a replay restores them, or it would take
    another path (here: tanh, which saves its output, for sin, which saves its input)."""
    w, _ = _weights()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    with _TanhAsSin():
        checkpoint(lambda t: torch.tanh(t @ w), x).sum().backward()
        expected = torch.autograd.grad(torch.sin(x @ w).sum(), x)[0]
    assert torch.equal(x.grad, expected)
