"""Tensor parallelism on the layers beyond the dense Llama's (tests/workers/tp_models_worker.py,
two processes under torchrun with gloo): Qwen3's q/k norms, DeepSeek-V3's multi-latent
attention (with and without the queries' low rank), MoE layers (routed and shared experts split
over the ranks, the router replicated).

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
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_under_torchrun
from remat import models
from remat.sites.calls import forward_loss
from remat.cli.tables import _expert_parallel
from remat.estimate.stages import EstimateSpec
from remat.core.problems import ConfigError
from remat.config.megatron import TrainingFacts
from remat.run.spec import RunSpec
from remat.config.parallel import ParallelLayout

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
        torch.testing.assert_close(worker.one_process_order(param, grads[param]), p.grad, rtol=1e-10, atol=1e-13, msg=param)


@pytest.mark.parametrize("sp", SPLIT)
@pytest.mark.parametrize("plan", ["selective", "full"])
@pytest.mark.parametrize("name", list(worker.MODELS))
def test_every_plan_is_bit_identical_to_the_split_without_recompute(split, name, sp, plan) -> None:
    (losses, grads), (plain_losses, plain_grads) = (split[f"{name}@sp={sp}@{p}@{worker.DROPOUT}"]
                                                    for p in (plan, "none"))
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys()
    for param, grad in grads.items():
        assert torch.equal(grad, plain_grads[param]), param


@pytest.mark.parametrize("name", list(worker.MODELS))
def test_weights_every_rank_holds_whole_get_the_same_gradient_on_every_rank(split, name) -> None:
    assert all(unlike == [] for key, unlike in split.items() if key.startswith(f"unlike:{name}@"))


def test_one_ranks_shard_holds_its_heads_and_its_share_of_every_experts_ffn() -> None:
    family = models.family_of("deepseek_tiny")
    config = family.config("deepseek_tiny")
    shard = family.shard(config, ParallelLayout(tp=2, sp=True), range(config.num_layers))
    assert (shard.num_attention_heads, shard.expert_ffn, shard.moe_shared_expert_intermediate_size) == (2, 16, 16)
    # the down projections' ranks stay whole (replicated), as do the experts and the router
    assert (shard.q_lora_rank, shard.kv_lora_rank, shard.num_moe_experts) == (48, 32, 8)
    assert [str(p) for p in family.layout_problems(family.config("moe_tiny"), ParallelLayout(tp=3))] == [
        f"tensor_model_parallel_size: {name}={size} does not split over 3 tensor-parallel ranks; use a"
        " tensor-parallel size that divides it"
        for name, size in (("num_attention_heads", 4), ("num_query_groups", 2), ("ffn_hidden_size", 160),
                           ("moe_shared_expert_intermediate_size", 64))]


def test_experts_split_over_tp_as_megatron_s_default_and_an_explicit_etp_1_is_refused() -> None:
    tp2 = TrainingFacts(layout=ParallelLayout(tp=2))
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size: is 1, experts whole on every tensor-parallel"
                                          " rank, which does not run yet; beside -tp remat splits each expert"):
        RunSpec("moe_tiny", device="cpu", layout=dataclasses.replace(tp2.layout, etp=1), capture=tp2.capture)
    assert _expert_parallel(EstimateSpec("moe_tiny", device="cpu", layout=tp2.layout, capture=tp2.capture)) == "ep 1, etp 2, "
    assert _expert_parallel(EstimateSpec("moe_tiny", device="cpu")) == "ep 1, etp 1, "
