"""Tensor parallelism (remat.parallel.tensor_parallel) on CPU: two processes under torchrun with gloo.

Split over two tensor-parallel ranks, with and without sequence parallelism, every recompute,
discard and offload plan gives each rank the loss and the gradients of the same split run without
recompute, bit for bit, dropout on: the arithmetic is the same, and each replay restores this
rank's own dropout stream as well as torch's default generators. gradient_accumulation_fusion
is on (the recipe's default): the fusing linear runs on the DTensor weights. The same holds with
FSDP2 over two replicas of such a split (four processes). Without sequence parallelism, full
recompute's kept inputs split over the ranks (distribute_saved_activations) change no bit either,
and each rank keeps half of each.

The quick tests of the same code: tests/unit/parallel/test_tensor_parallel.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_under_torchrun

from remat.parallel.tensor_parallel import RANK_SEED_OFFSET
from remat.sites.calls import forward_loss

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import fsdp_worker  # noqa: E402
import tp_worker  # noqa: E402

TP = tp_worker.TP


SPLIT = [False, True]  # sequence parallelism off, on


REPLICAS = 2  # data-parallel, by FSDP2


def _run(tmp_path_factory, nproc: int) -> dict:
    out = tmp_path_factory.mktemp("tp") / "results.pt"
    run_under_torchrun(Path(tp_worker.__file__), out, nproc)
    return torch.load(out)


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict:
    return _run(tmp_path_factory, TP)


@pytest.fixture(scope="module")
def sharded_split(tmp_path_factory) -> dict:
    return _run(tmp_path_factory, REPLICAS * TP)


def _assert_bit_identical(result: tuple, plain: tuple) -> None:
    (losses, grads), (plain_losses, plain_grads) = result, plain
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("sp", SPLIT)
@pytest.mark.parametrize("plan", [p for p in tp_worker.PLANS if p != "none"])
def test_every_plan_under_tensor_parallelism_is_bit_identical_to_it_without_recompute(split, plan, sp, dropout) -> None:
    _assert_bit_identical(split[f"{plan}@sp={sp}@{dropout}"], split[f"none@sp={sp}@{dropout}"])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("plan", [p for p in tp_worker.DP_TP_PLANS if p != "none"])
def test_every_plan_under_fsdp2_over_tensor_parallelism_is_bit_identical_to_it_without_recompute(
    sharded_split, plan, dropout
) -> None:
    _assert_bit_identical(sharded_split[f"{plan}@{dropout}"], sharded_split[f"none@{dropout}"])


# What a full-recompute range keeps whole: its input, [micro-batch, seq, hidden] in float64.
LAYER_INPUT = fsdp_worker.PER_RANK * fsdp_worker.SEQ * 64 * 8


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name", list(tp_worker.FULL))
def test_split_saved_inputs_are_bit_identical_to_tp_without_recompute_and_with_plain_full_recompute(
    split, name, dropout
) -> None:
    distributed = split["distributed"]
    _assert_bit_identical(distributed[f"{name}@True@{dropout}"], split[f"none@sp=False@{dropout}"])
    _assert_bit_identical(distributed[f"{name}@True@{dropout}"], distributed[f"{name}@False@{dropout}"])


@pytest.mark.parametrize("name, ranges", [("uniform_1", 4), ("uniform_2", 2), ("block_1", 1), ("block_2", 2)])
def test_each_rank_keeps_one_tp_th_of_each_ranges_input(split, name, ranges) -> None:
    distributed = split["distributed"]
    assert distributed[f"saved:{name}@False"] - distributed[f"saved:{name}@True"] == ranges * LAYER_INPUT // TP


def test_a_plan_without_the_split_takes_it_off(split) -> None:
    assert split["distributed"]["taken off"] == [None] * fsdp_worker.LAYERS


def test_offloading_split_inputs_offloads_each_ranks_shard(split) -> None:
    distributed = split["distributed"]
    _assert_bit_identical(distributed["offloaded@True"], split["none@sp=False@0.1"])
    _assert_bit_identical(distributed["offloaded@False"], split["none@sp=False@0.1"])
    # the first two ranges' inputs, whole or halved
    assert (distributed["offloaded bytes@False"], distributed["offloaded bytes@True"]) == (
        2 * LAYER_INPUT,
        2 * LAYER_INPUT // TP,
    )


def test_split_inputs_under_fsdp2_gather_the_layer_then_the_input_before_a_replay(sharded_split) -> None:
    _assert_bit_identical(sharded_split["distributed_uniform_2@sp=False"], sharded_split["none@sp=False"])


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("sp", SPLIT)
def test_tensor_parallelism_without_recompute_matches_one_process(split, sp, micro_batches) -> None:
    losses, grads = split[f"none@sp={sp}@0.0" if micro_batches == 1 else f"accumulated@sp={sp}"]
    model = fsdp_worker.model(0.0)
    for _ in range(micro_batches):  # the second adds into .grad (fused into the GEMM under TP too)
        loss = forward_loss(model, *tp_worker.batch())
        loss.backward()
    # Not bit for bit: the row-parallel linears (linear_proj, linear_fc2) sum the ranks' partial
    # products by an all-reduce (a reduce-scatter under sequence parallelism) where one process
    # sums the whole inner dimension in one GEMM, and the norms' weight gradients under sequence
    # parallelism are sums of the ranks' token halves: the additions run in another order.
    assert losses[0] == losses[1]  # the loss head is whole on each rank, on every token
    assert losses[0] == pytest.approx(loss.item(), rel=1e-13)
    for name, p in model.named_parameters():
        torch.testing.assert_close(tp_worker.gate_then_up(name, grads[name]), p.grad, rtol=1e-10, atol=1e-13, msg=name)


def test_fsdp2_over_tensor_parallelism_without_recompute_matches_one_process_on_the_global_batch(sharded_split) -> None:
    losses, grads = sharded_split["none@0.0"]
    model = fsdp_worker.model(0.0)
    loss = forward_loss(model, *fsdp_worker.global_batch(REPLICAS))
    loss.backward()
    # ranks are replica-major: each replica's tensor-parallel ranks hold its loss whole; FSDP2
    # averages the replicas' gradients (rounding as in the tests above and in test_parallel_runs.py)
    per_replica = losses[::TP]
    assert all(losses[i] == per_replica[i // TP] for i in range(len(losses)))
    assert sum(per_replica) / REPLICAS == pytest.approx(loss.item(), rel=1e-13)
    for name, p in model.named_parameters():
        torch.testing.assert_close(tp_worker.gate_then_up(name, grads[name]), p.grad, rtol=1e-10, atol=1e-13, msg=name)


def _masks(split: dict, sp: bool, dim: int) -> list[list[torch.Tensor]]:
    """Each rank's dropped positions, one per dropout call on `dim`-D tensors (4: attention
    probabilities, 3: hidden states), in call order."""
    return [[dropped for dropped, _ in rank if dropped.dim() == dim] for rank in split[f"masks@sp={sp}"]]


@pytest.mark.parametrize("sp", SPLIT)
def test_dropout_on_a_ranks_own_share_draws_its_own_masks_and_on_what_all_hold_the_same(split, sp) -> None:
    attention, hidden = _masks(split, sp, 4), _masks(split, sp, 3)
    layers = fsdp_worker.LAYERS
    assert [len(a) for a in attention] == [layers] * TP and [len(h) for h in hidden] == [2 * layers + 1] * TP
    # each rank's own heads (rank 0 would draw rank 1's masks from one shared default stream)
    assert all(not torch.equal(a, b) for a, b in zip(*attention))
    # the embedding's and the layers' hidden dropout: on each rank's own tokens under sequence
    # parallelism, else on the whole sequence every rank holds, where masks must agree (and do
    # after each attention's forked draws, which leave the default stream as it was)
    assert all(torch.equal(a, b) != sp for a, b in zip(*hidden))


def test_each_stream_is_seeded_as_megatron_seeds_it(split) -> None:
    # the worker built its models from seed 0, then seeded the step STEP_SEED on both ranks
    p = fsdp_worker.model(0.1).config.attention_dropout
    for rank, recorded in enumerate(split["masks@sp=False"]):
        first_attention = next((dropped, nonzero) for dropped, nonzero in recorded if dropped.dim() == 4)
        first_hidden = next((dropped, nonzero) for dropped, nonzero in recorded if dropped.dim() == 3)
        for seed, (dropped, nonzero) in (
            (RANK_SEED_OFFSET + rank, first_attention),
            (tp_worker.STEP_SEED, first_hidden),
        ):
            torch.manual_seed(seed)
            drawn = F.dropout(torch.ones(dropped.shape, dtype=torch.float64), p) == 0
            assert torch.equal(drawn & nonzero, dropped), (rank, seed)


def test_parallelize_tensor_names_every_problem_of_the_model(split) -> None:
    assert split["refusals"]["shape"].splitlines() == [
        "tensor_model_parallel_size: num_attention_heads=3 does not split over 2 tensor-parallel ranks; use a"
        " tensor-parallel size that divides it",
        "tensor_model_parallel_size: num_query_groups=1 does not split over 2 tensor-parallel ranks; use a"
        " tensor-parallel size that divides it",
        "tensor_model_parallel_size: ffn_hidden_size=81 does not split over 2 tensor-parallel ranks; use a"
        " tensor-parallel size that divides it",
        "sequence_parallel: each rank's 15 tokens do not split over 2 tensor-parallel ranks; use a sequence length"
        " that is a multiple of 2, or turn sequence parallelism off",
    ]


def test_megatron_s_main_gradients_of_split_parameters_count_this_rank_s_share(split) -> None:
    counted, local_fp32 = split["main grads"]
    assert counted == local_fp32


def test_parallelize_tensor_refuses_experts_split_otherwise_a_two_dimensional_mesh_and_unlike_seeds(split) -> None:
    refusals = split["refusals"]
    assert refusals["moe"].splitlines() == [
        "expert_tensor_parallel_size: is 2; beside tensor parallelism remat splits each expert over the"
        " tensor-parallel ranks, as Megatron's default (etp = tp) does; other expert tensor-parallel sizes do not run"
        " yet: drop -etp"
    ]
    assert refusals["mesh"] == "mesh: has 2 dimensions ('dp', 'tp'); pass its tensor-parallel one, e.g. mesh['tp']"
    assert refusals["seed"] == (
        "seed: torch's default generators were seeded [0, 1] on the tensor-parallel ranks, so dropout on the tensors"
        " they all hold would differ; call torch.manual_seed() with one seed on every tensor-parallel rank first"
    )
