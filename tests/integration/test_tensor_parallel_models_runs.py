"""Tensor parallelism on the layers beyond the dense Llama's
(tests/integration/workers/tp_models_worker.py, two processes under torchrun with gloo): Qwen3's q/k
norms, DeepSeek-V3's multi-latent attention (with and without the queries' low rank), MoE layers
(routed and shared experts split over the ranks, the router replicated).

Each is split over two ranks, with and without sequence parallelism. Without recompute and
dropout, each rank's loss and every gradient match one process's: not bit for bit, since the
row-parallel projections sum the ranks' partial products by an all-reduce or reduce-scatter, and
a weight every rank holds whole (a norm over each rank's own heads or tokens) has its gradient
summed over the ranks' parts, where one process adds in another order; float64, so within
rtol 1e-10. MLA's replicated down projections and norms get the whole gradient on every rank,
bit-identical between ranks (the up projections and the shared rotary key sum their input's
gradient over the ranks before it reaches them); so do the routers, whose gradient comes whole
from the experts' summed input gradients. Every plan (selective, full) with dropout on is bit-identical to the split run
without recompute: the same arithmetic, each replay restoring this rank's dropout stream.

The quick tests of the same code: tests/unit/parallel/test_tensor_parallel_models.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import run_under_torchrun

from remat.sites.calls import forward_loss

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import tp_models_worker as worker  # noqa: E402
import tp_worker  # noqa: E402

SPLIT = [False, True]  # sequence parallelism off, on


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp_models") / "results.pt"
    run_under_torchrun(Path(worker.__file__), out, tp_worker.TP)
    return torch.load(out)


@pytest.mark.parametrize("sp", SPLIT)
@pytest.mark.parametrize("name", list(worker.MODELS))
def test_split_without_recompute_matches_one_process(split, name, sp) -> None:
    losses, grads = split[f"{name}@sp={sp}@none@0.0"]
    model = worker.model(name, 0.0)
    loss = forward_loss(model, *tp_worker.batch())
    loss.backward()
    assert losses[0] == losses[1] == pytest.approx(loss.item(), rel=1e-13)
    assert grads.keys() == dict(model.named_parameters()).keys()
    for param, p in model.named_parameters():
        torch.testing.assert_close(
            worker.one_process_order(param, grads[param]), p.grad, rtol=1e-10, atol=1e-13, msg=param
        )


@pytest.mark.parametrize("sp", SPLIT)
@pytest.mark.parametrize("plan", ["selective", "full"])
@pytest.mark.parametrize("name", list(worker.MODELS))
def test_every_plan_is_bit_identical_to_the_split_without_recompute(split, name, sp, plan) -> None:
    (losses, grads), (plain_losses, plain_grads) = (
        split[f"{name}@sp={sp}@{p}@{worker.DROPOUT}"] for p in (plan, "none")
    )
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys()
    for param, grad in grads.items():
        assert torch.equal(grad, plain_grads[param]), param


@pytest.mark.parametrize("name", list(worker.MODELS))
def test_weights_every_rank_holds_whole_get_the_same_gradient_on_every_rank(split, name) -> None:
    assert all(unlike == [] for key, unlike in split.items() if key.startswith(f"unlike:{name}@"))
