"""MoE models under pipeline and data parallelism (gloo, CPU): stages built with the whole model's
layer numbers; a pipeline step bit-identical to one process's (float64, no dropout); the aux
loss's gradient scaled as the main loss per micro-batch; the expert bias balanced over the
data-parallel replicas; each stage's experts split over the expert-parallel ranks of its own
data-parallel group (pp 2 x dp 2, ep 2), every plan equal to one process's step; experts split
over expert- and tensor-parallel ranks at once (dp 2 x tp 2, ep 2); validation and estimates of
MoE stages.

The quick tests of the same code: tests/unit/parallel/test_moe_parallel.py."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_under_torchrun

import remat
from remat.cli import main
from remat.models import build
from remat.run import step as steps
from remat.sites.calls import after_optimizer_step

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import ep_pp_worker  # noqa: E402
import moe_worker  # noqa: E402

RECIPES = ("moe_tiny", "deepseek_tiny")


CASES = [(recipe, layout, name) for (recipe, layout), names in moe_worker.CASES.items() for name in names]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe") / "results.pt"
    run_under_torchrun(Path(moe_worker.__file__), out)
    return torch.load(out)


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep_pp") / "results.pt"
    run_under_torchrun(Path(ep_pp_worker.__file__), out, ep_pp_worker.GPUS)
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict]:
    found = {}
    for recipe in RECIPES:
        model = moe_worker.whole(recipe)
        loss = steps.forward_backward(model, moe_worker.Data(moe_worker.batches(4)), 4)  # type: ignore[arg-type]
        grads = {name: p.grad for name, p in model.named_parameters()}
        after_optimizer_step(model)
        found[recipe] = {
            "loss": loss.item(),
            "grads": grads,
            "bias": {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")},
            "kinds": {i: type(layer.mlp).__name__ for i, layer in enumerate(model.decoder.layers)},
        }
    return found


@pytest.mark.parametrize("recipe,layout,plan", CASES)
def test_a_pipelined_moe_step_is_the_whole_models_step_bit_for_bit(launched, one_process, recipe, layout, plan) -> None:
    """Same ops per micro-batch, gradients accumulated in micro-batch order, the aux loss's
    gradient scaled by 1/4 on both: gradients equal bit for bit. The loss to float32's precision:
    one process's forward_backward sums the step's loss in a float32 tensor."""
    piped, whole = launched[f"{recipe}:{layout}:{plan}"], one_process[recipe]
    assert piped["kinds"] == whole["kinds"]  # each stage's layers of the whole model's kind
    assert piped["loss"] == pytest.approx(whole["loss"], rel=1e-7)
    assert piped["grads"].keys() == whole["grads"].keys()
    for name, grad in piped["grads"].items():
        assert torch.equal(grad, whole["grads"][name]), name
    # each stage balances its own layers' routers on the counts of all 4 micro-batches
    assert piped["bias"].keys() == whole["bias"].keys()
    assert all(torch.equal(b, whole["bias"][n]) for n, b in piped["bias"].items())
    if recipe == "deepseek_tiny":
        assert len(piped["bias"]) == 3


def test_the_expert_bias_stays_the_same_on_every_data_parallel_rank_and_as_one_process(launched) -> None:
    dp = launched["data_parallel"]
    per_rank, (rank0, rank1) = dp["per_rank"], dp["biases"]
    given = moe_worker.batches(2 * per_rank * 2, seed=3)
    model = moe_worker.whole("deepseek_tiny")
    for k in range(2):  # one process runs both ranks' micro-batches of each step
        steps.forward_backward(model, moe_worker.Data(given[4 * k : 4 * k + 4]), 4)  # type: ignore[arg-type]
        after_optimizer_step(model)
        whole = {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
        assert rank0[k].keys() == rank1[k].keys() == whole.keys()
        for name, bias in whole.items():
            assert torch.equal(rank0[k][name], rank1[k][name]) and torch.equal(rank0[k][name], bias), (k, name)
        assert any(b.any() for b in whole.values())


def test_the_aux_loss_gradient_is_scaled_as_the_main_loss_per_micro_batch() -> None:
    """seq_aux_loss averages per sequence, so 1 micro-batch of 4 sequences and 4 of 1 give the same
    aux gradient; the batch-wide aux_loss gives the mean of its micro-batches' own. The aux part is
    the router gradient with the aux loss less that without (float64: equal to 1e-9 of it)."""
    given = moe_worker.batches(4)
    whole_batch = [(torch.cat([b[0] for b in given]), torch.cat([b[1] for b in given]))]

    def aux_part(recipe: str, batches: list, micro_batches: int) -> torch.Tensor:
        grads = []
        for coeff in (0.1, 0.0):
            torch.manual_seed(0)
            model = build(recipe, dtype=torch.float64, moe_aux_loss_coeff=coeff, **moe_worker.OVERRIDES)
            steps.forward_backward(model, moe_worker.Data(batches), micro_batches)  # type: ignore[arg-type]
            grads.append(torch.cat([r.weight.grad.flatten() for r in model.routers()]))  # type: ignore[operator]
        return grads[0] - grads[1]

    one, four = aux_part("deepseek_tiny", whole_batch, 1), aux_part("deepseek_tiny", given, 4)
    assert (one - four).abs().max() <= 1e-9 * one.abs().max()
    mean = sum(aux_part("moe_tiny", [b], 1) for b in given) / 4
    accumulated = aux_part("moe_tiny", given, 4)
    assert (mean - accumulated).abs().max() <= 1e-9 * mean.abs().max()


@pytest.mark.slow
def test_validate_and_estimate_accept_an_moe_recipe_over_pipeline_stages(capsys, tmp_path) -> None:
    assert main(["validate", "-mr", "moe_tiny", "--num_layers", "4", "-pp", "2"]) == 0
    assert main(["validate", "-mr", "moe_tiny", "-pp", "2"]) != 0  # 3 layers over 2 stages
    assert "do not split evenly into 2" in capsys.readouterr().err
    out = tmp_path / "estimate.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)  # moe on the dense first layer
        assert (
            main(
                [
                    "estimate",
                    "-mr",
                    "moe_tiny",
                    "--num_layers",
                    "4",
                    "-pp",
                    "2",
                    "-gb",
                    "4",
                    "-sl",
                    "16",
                    "--no_progress",
                    "--configs",
                    "none",
                    "moe",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
    capsys.readouterr()
    none, moe = json.loads(out.read_text())
    assert [s["layers"] for s in none["stages"]] == [2, 2]
    # stage 0 holds the dense layer 0 and MoE layer 1, stage 1 two MoE layers: moe saves on both
    assert all(m["activations"] < n["activations"] for n, m in zip(none["stages"], moe["stages"]))


@pytest.mark.parametrize("recipe,layout,plan", CASES)
def test_expert_parallelism_beside_pipeline_stages_is_the_whole_models_step(
    expert_parallel, one_process, recipe, layout, plan
) -> None:
    """pp 2 x dp 2, each stage's experts over its 2 data-parallel ranks. Every plan is the same
    run as no recompute, bit for bit (the replays of `moe` exchange again, in the same order on
    both ranks of a group). Against one process on the same 4 micro-batches, to float64 rounding:
    FSDP2 sums the two replicas' gradients and halves them where one process adds the 4
    micro-batches in turn, and an expert's GEMMs take the rows of both ranks of its group at once
    (other associations of the same sums). The expert bias moves on counts, exact."""
    piped, plain, whole = (
        expert_parallel[f"{recipe}:{layout}:{plan}"],
        expert_parallel[f"{recipe}:{layout}:none"],
        one_process[recipe],
    )
    assert piped["kinds"] == whole["kinds"]
    assert piped["loss"] == pytest.approx(whole["loss"], rel=1e-7)  # one process sums it in float32
    assert piped["grads"].keys() == whole["grads"].keys() and any(".experts." in name for name in piped["grads"])
    for name, grad in piped["grads"].items():
        assert torch.equal(grad, plain["grads"][name]), name
        expected = whole["grads"][name]
        assert (grad - expected).abs().max() <= 1e-13 * expected.abs().max(), name
    assert piped["bias"].keys() == whole["bias"].keys()
    assert all(torch.equal(b, whole["bias"][n]) for n, b in piped["bias"].items())
    # an MoE layer of pipeline rank p: global rank 2 p + d (dp rank d) holds its d-th half of the
    # experts, exchanging with the other dp rank of the same stage
    config, pipe = moe_worker.spec(recipe).model_config, moe_worker.spec(recipe, layout).layout
    held, half = {layer: layer // (4 // pipe.chunks) % pipe.pp for layer in range(4)}, config.num_moe_experts // 2
    assert piped["experts"] == {
        (layer, 2 * held[layer] + d): (half * d, [2 * held[layer], 2 * held[layer] + 1])
        for layer, kind in whole["kinds"].items()
        if kind == "MoELayer"
        for d in (0, 1)
    }


@pytest.fixture(scope="module")
def one_process_two_micro_batches() -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """One process's step on the 2 micro-batches that dp 2 x tp 2 trains on, from build_model's
    weights (no expert bias yet)."""
    found = {}
    for recipe in RECIPES:
        s = ep_pp_worker.tensor_parallel_spec(recipe, False, 0.0)
        torch.manual_seed(s.seed)
        model = s.family.build(dataclasses.replace(s.model_config, expert_model_parallel_size=1), dtype=s.dtype)
        loss = steps.forward_backward(model, moe_worker.Data(moe_worker.batches(2)), 2)  # type: ignore[arg-type]
        found[recipe] = (loss.item(), {name: p.grad for name, p in model.named_parameters()})
    return found


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recipe", RECIPES)
def test_experts_split_over_expert_and_tensor_parallel_ranks_train_as_one_process(
    expert_parallel, one_process_two_micro_batches, recipe, sp
) -> None:
    """dp 2 x tp 2, experts over ep 2 and each expert's FFN over tp 2 (Megatron's default etp =
    tp), with and without sequence parallelism, from build_model's own weights. Against one
    process, float64 within rtol 1e-10: the row-parallel sums and the experts' partial outputs
    are summed over the tp ranks, FSDP2 halves the sum of two replicas' gradients, an expert's
    GEMMs take both ranks' rows at once; one process adds in another order. Under sequence
    parallelism every plan with dropout on is bit-identical to the split run without recompute
    (each replay exchanges the token slots again and restores this rank's dropout stream)."""
    loss, grads = one_process_two_micro_batches[recipe]
    split = expert_parallel[f"tp:{recipe}:sp={sp}:none@0.0"]
    assert split["loss"] == pytest.approx(loss, rel=1e-7)  # one process sums it in float32
    assert split["grads"].keys() == grads.keys() and any(".experts." in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(split["grads"][name], grad, rtol=1e-10, atol=1e-13, msg=name)
    if not sp:  # the plans run under sequence parallelism, whose dropout draws from both kinds of stream
        return
    plain = expert_parallel[f"tp:{recipe}:sp={sp}:none@{ep_pp_worker.DROPOUT}"]
    for plan in ep_pp_worker.TP_PLANS[1:]:
        run = expert_parallel[f"tp:{recipe}:sp={sp}:{plan}@{ep_pp_worker.DROPOUT}"]
        assert run["loss"] == plain["loss"]
        assert all(torch.equal(g, plain["grads"][name]) for name, g in run["grads"].items()), plan
