"""FSDP2 data parallelism (remat.parallel) on CPU: two processes under torchrun with gloo.

Under FSDP2, every recompute and offload plan gives each rank the loss and the gradients of the
same sharded run without recompute, bit for bit, dropout on (the arithmetic is the same and each
rank's dropout masks are replayed). The sharded run without recompute matches one process on
the whole global batch only to float64 rounding: FSDP2 sums the two ranks' gradients (a
reduce-scatter) where one process sums over all sequences in one GEMM, so the order of the
additions differs.

The quick tests of the same code: tests/unit/parallel/test_parallel.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remat.config.parallel import ParallelLayout
from remat.estimate.stages import EstimateSpec, estimate
from remat.models import build
from remat.run.optimizer import OptimizerPrecision
from remat.sites.calls import forward_loss

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import fsdp_worker  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    out = tmp_path_factory.mktemp("fsdp") / "results.pt"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(WORLD),
            str(Path(fsdp_worker.__file__)),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("plan", [p for p in fsdp_worker.PLANS if p != "none"])
def test_every_plan_under_fsdp2_is_bit_identical_to_fsdp2_without_recompute(sharded, plan, dropout) -> None:
    losses, grads = sharded[f"{plan}@{dropout}"]
    plain_losses, plain_grads = sharded[f"none@{dropout}"]
    assert losses == plain_losses
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_bf16_compute_over_fp32_shards_recomputes_bit_identically(sharded) -> None:
    losses, grads = sharded["full_uniform_2@bf16"]
    plain_losses, plain_grads = sharded["none@bf16"]
    assert losses == plain_losses
    assert all(g.dtype == torch.float32 for g in grads.values())  # fp32 main gradients
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_reducing_gradients_once_a_step_as_the_distributed_optimizer_does_matches_reducing_each_micro_batch(
    sharded,
) -> None:
    """Layers kept gathered through the step and gradients reduced once sum the micro-batches
    before the reduce-scatter, FSDP2's default after it: float64 rounding apart. A full-recompute
    group replaying layers kept gathered gives the very same gradients."""
    every, once = sharded["reduced"]["every"], sharded["reduced"]["once"]
    assert every.keys() == once.keys() and len(once) > 0
    for name, grad in once.items():
        torch.testing.assert_close(grad, every[name], rtol=1e-12, atol=1e-15, msg=name)
        assert torch.equal(grad, sharded["reduced"]["once_full_uniform_2"][name]), name


def test_fsdp2_without_recompute_matches_one_process_on_the_global_batch(sharded) -> None:
    losses, grads = sharded["none@0.0"]
    model = fsdp_worker.model(0.0)
    loss = forward_loss(model, *fsdp_worker.global_batch(WORLD))
    loss.backward()
    # equal tokens per rank: the global mean loss is the mean of the ranks', and FSDP2 averages
    # the ranks' gradients
    assert sum(losses) / WORLD == pytest.approx(loss.item(), rel=1e-13)
    assert losses[0] != losses[1]  # the ranks saw different sequences
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-13)


def test_saved_for_backward_under_fsdp2_leaves_out_the_parameters_it_gathers(sharded) -> None:
    # the root's gathered parameters stay from its forward to its backward, and each layer's
    # are freed by resizing their storage: weights, not activations
    plain, under_fsdp2 = sharded["saved"]
    assert under_fsdp2 == plain


def test_a_layer_holding_weights_of_two_dtypes_shards_each_as_its_own_unit(sharded) -> None:
    """FSDP2 flattens one dtype per unit; transformers' DeepSeek-V3 router keeps float32 in a bf16
    layer, so it is a unit of its own, gathered with its layer before a replay: full recompute of
    both layers (the first replayed from the second's backward) is bit-identical to none."""
    (dtypes, loss, grads), (_, full_loss, full_grads) = (sharded["mixed dtypes"][n] for n in ("none", "full_uniform_2"))
    assert dtypes == ["torch.bfloat16", "torch.float32"]
    assert full_loss == loss and full_grads.keys() == grads.keys()
    assert all(torch.equal(g, grads[n]) for n, g in full_grads.items())


def _bench_json(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "remat",
            "bench",
            "-mr",
            "llama3_tiny",
            "--device",
            "cpu",
            "-ms",
            "3",
            "--warmup_steps",
            "1",
            "--no_history",
            "--no_progress",
            "--json",
            str(out),
            *flags,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("remat bench: llama3_tiny") == 1  # rank 0 alone reports
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_ng_2_starts_torchrun_and_each_rank_holds_half_the_weights_and_optimizer_state(tmp_path) -> None:
    full = ["--recompute_granularity", "full", "--recompute_method", "uniform", "-rl", "2"]
    one, two = _bench_json(tmp_path, *full), _bench_json(tmp_path, "-ng", "2", *full)
    assert two["status"] == "ok" and len(two["losses"]) == 3
    assert two["shape"]["data_parallel"] == 2 and "data_parallel" not in one["shape"]
    assert two["memory"]["weights"] * 2 == one["memory"]["weights"]
    assert two["memory"]["optimizer"] * 2 == one["memory"]["optimizer"]


def test_bench_ng_2_with_main_params_keeps_fp32_shards_as_its_estimate_under_fsdp2_says(tmp_path) -> None:
    """FSDP2 in Megatron's precision: fp32 shards of the parameters, their gradients and moments,
    layers gathered in bf16 (losses in bf16 arithmetic). The estimate's components equal the run's
    to the byte; its peak models FSDP2's gathered parameters as the root's and one layer's, which
    on these tiny shapes reads within 3% of the peak counted."""
    run = _bench_json(tmp_path, "-ng", "2", "-gb", "4", "--main_params_dtype", "fp32")
    parameters = sum(p.numel() for p in build("llama3_tiny", device="meta").parameters())
    memory = run["memory"]
    assert (memory["weights"], memory["grads"], memory["optimizer"]) == (2 * parameters, 2 * parameters, 4 * parameters)
    spec = EstimateSpec(
        recipe="llama3_tiny",
        layout=ParallelLayout(num_gpus=2),
        global_batch_size=4,
        device="cpu",
        optimizer_precision=OptimizerPrecision("fp32", use_torch_fsdp2=True),
    )
    predicted = estimate(spec)[0].stages[0]
    assert (predicted.weights, predicted.grads, predicted.optimizer_state) == (
        memory["weights"],
        memory["grads"],
        memory["optimizer"],
    )
    assert predicted.peak == pytest.approx(run["peak_allocated_bytes"], rel=0.03)


def test_bench_ng_2_with_the_distributed_optimizer_holds_megatron_s_bytes_at_most(tmp_path) -> None:
    """Megatron's distributed optimizer on FSDP2: fp32 shards of the parameters and moments,
    the layers gathered in bf16 and fp32 gradients accumulated whole through the step: 6 + 12/dp
    bytes a parameter, as the estimate counts Megatron's. Its peak stays within the estimate
    (which also counts Megatron's main-gradient hooks' working memory), by at most 15% here."""
    run = _bench_json(tmp_path, "-ng", "2", "-gb", "4", "--main_params_dtype", "fp32", "--use_distributed_optimizer")
    parameters = sum(p.numel() for p in build("llama3_tiny", device="meta").parameters())
    assert (run["memory"]["weights"], run["memory"]["optimizer"]) == (2 * parameters, 4 * parameters)
    spec = EstimateSpec(
        recipe="llama3_tiny",
        layout=ParallelLayout(num_gpus=2),
        global_batch_size=4,
        device="cpu",
        optimizer_precision=OptimizerPrecision("fp32", use_distributed_optimizer=True),
    )
    predicted = estimate(spec)[0].stages[0]
    assert predicted.weights + predicted.grads + predicted.optimizer_state == (6 + 12 // 2) * parameters
    assert 0.85 * predicted.peak <= run["peak_allocated_bytes"] <= predicted.peak
