"""Expert parallelism (remat.parallel.expert_parallel) on CPU: two processes under torchrun with gloo.

remat's tiny MoE, built as `remat bench -ep 2 -ng 2` builds it (step.build_model): each rank holds
2 of the 4 experts of each MoE layer, token slots go to the rank holding their expert and back by
all-to-all, FSDP2 over the 2 data-parallel ranks. Every plan (`moe`, which replays the exchange,
`moe_act`, `shared_experts`, full recompute, offload) gives each rank the loss and the gradients of
the same run without recompute, bit for bit, dropout on; the run matches one process; every
layout problem is named before any process starts.

The quick tests of the same code: tests/unit/parallel/test_expert_parallel.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import run_under_torchrun

from remat.estimate.spec import EstimateSpec
from remat.parallel.parallelize import sharded_state_bytes
from remat.sites.calls import forward_loss

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import ep_worker  # noqa: E402

EP = ep_worker.EP


MOE_LAYERS = 3


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep") / "results.pt"
    run_under_torchrun(Path(ep_worker.__file__), out, EP)
    return torch.load(out)


@pytest.mark.parametrize("plan", [p for p in ep_worker.PLANS if p != "none"])
def test_every_plan_under_expert_parallelism_is_bit_identical_to_it_without_recompute(split, plan) -> None:
    (losses, grads, _), (plain_losses, plain_grads, _) = split[plan], split["none"]
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys() and any(".experts.weight" in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize(
    "plan, exchanges",
    [
        ("none", MOE_LAYERS),
        ("moe_act", MOE_LAYERS),
        ("shared_experts", MOE_LAYERS),
        ("moe", 2 * MOE_LAYERS),  # Megatron's moe recompute checkpoints the layer with its dispatch and combine
        ("full_uniform_1", 2 * MOE_LAYERS),
        ("full_block_3", MOE_LAYERS + 2),
    ],
)  # layers 1 and 2 of 0-2 are MoE
def test_a_replay_of_an_moe_layer_exchanges_its_tokens_again(split, plan, exchanges) -> None:
    assert split[plan][2] == exchanges


def test_expert_parallelism_matches_one_process_over_the_ranks_micro_batches(split) -> None:
    losses, grads, _ = split["none"]
    model = ep_worker.model()  # all 4 experts, drawn as the split ranks draw their 2
    for rank in range(EP):  # each rank's sequences as a micro-batch, with its dropout masks
        torch.manual_seed(ep_worker.STEP_SEED + rank)
        loss = forward_loss(model, *ep_worker.share(rank))
        loss.backward()  # each rank's whole backward, the router's auxiliary loss at its full weight
        # Not bit for bit (nor the gradients): an expert's GEMMs take the rows of both ranks at
        # once where one process runs each micro-batch's rows apart (another blocking of the
        # sums), and its weight gradient sums both micro-batches in one GEMM; FSDP2 sums the
        # ranks' gradients then divides where one process adds the halves.
        assert losses[rank] == pytest.approx(loss.item(), rel=1e-13)
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():  # FSDP2's mean over the data-parallel ranks
        torch.testing.assert_close(grads[name], p.grad / EP, rtol=1e-10, atol=1e-13, msg=name)


def test_parallelize_experts_names_every_problem_and_changes_nothing(split) -> None:
    refusals = split["refusals"]
    assert refusals["built_for_another_size"].splitlines() == [
        "expert_model_parallel_size: the model was built for 1 expert-parallel rank(s), not 2; build it with"
        " expert_model_parallel_size=2",
        "expert_tensor_parallel_size: is 2; each expert runs whole on its rank (no expert tensor parallelism yet;"
        " remat estimate predicts it); use 1",
    ]
    assert refusals["not_dividing"].splitlines()[0] == (
        "expert_model_parallel_size: (4) does not divide the 2 data-parallel rank(s) (2 GPUs / tp x pp x cp 1);"
        " expert-parallel ranks are data-parallel ranks that split the experts: use a multiple of 4 GPUs"
    )
    assert refusals["dense"] == (
        "expert_model_parallel_size: is 2, but dense Llama models have no routed experts"
        " that remat splits; use an MoE recipe (remat recipes lists them) or drop it"
    )
    assert refusals["mesh"] == "mesh: has 2 dimensions ('pp', 'dp'); pass its data-parallel one, e.g. mesh['dp']"
    assert refusals["unnamed"] == (
        "mesh: has no dimension names; make it with init_device_mesh(..., mesh_dim_names=('dp',))"
    )


def test_the_estimate_holds_fsdp2_s_expert_shards_to_the_byte(split) -> None:
    """FSDP2 shards the experts over the ranks holding the same ones (here 1: 2 ranks, ep 2) and
    the rest over both; the estimate's weights are rank 0's shards (FSDP2 pads the last rank's)."""
    spec = EstimateSpec.of_run(ep_worker.spec(EP))
    shard = spec.family.shard(
        spec.model_config,
        spec.layout,  # one expert-parallel rank's experts
        range(spec.model_config.num_layers),
    )
    assert (
        sharded_state_bytes(
            spec.family.build(shard, dtype=spec.state_dtype, device="meta"), spec.family, spec.layout, spec.state_dtype
        )
        == split["held_bytes"][0]
    )
