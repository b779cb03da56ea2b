"""The step's optimizer in Megatron's precision (remat.run.optimizer): main parameters and main
gradients beside the model's, the bytes each holds as estimate and bench count them, the
distributed optimizer's share, and the refusals."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from remat.cli import main
from remat.core.problems import ConfigError
from remat.models import build
from remat.run.optimizer import MainParamsAdamW, OptimizerPrecision, adamw, main_grad_bytes
from remat.run.spec import RunSpec
from remat.run.step import optimizer_state_bytes
from remat.sites.calls import forward_loss

FP32 = OptimizerPrecision(main_params_dtype="fp32")


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return build("llama3_tiny", dtype=dtype, num_layers=2, attention_backend="eager", seq_length=16)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(n)]
    return [(i[:, :-1], i[:, 1:]) for i in ids]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, micro_batches: int) -> None:
    batches = iter(_batches(steps * micro_batches))
    for _ in range(steps):
        for _ in range(micro_batches):
            (forward_loss(model, *next(batches)) / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_fp32_main_parameters_of_an_fp32_model_step_exactly_as_torch_adamw() -> None:
    # the same arithmetic: main gradients summed in the order autograd sums .grad, the same AdamW
    plain, main = _model(), _model()
    _train(plain, adamw(plain.parameters(), fused=False), steps=3, micro_batches=2)
    _train(main, MainParamsAdamW(main.parameters(), FP32), steps=3, micro_batches=2)
    for (name, a), b in zip(plain.named_parameters(), main.parameters()):
        assert torch.equal(a, b), name


def test_bf16_weights_are_the_fp32_main_parameters_rounded_after_each_step() -> None:
    model = _model(torch.bfloat16)
    optimizer = MainParamsAdamW(model.parameters(), FP32)
    _train(model, optimizer, steps=2, micro_batches=1)
    for p in model.parameters():
        main = optimizer.state[p]["main_param"]
        assert main.dtype == torch.float32 and torch.equal(p, main.to(torch.bfloat16))
        assert set(optimizer.state[p]) == {"main_param", "main_grad", "exp_avg", "exp_avg_sq"}


def test_backward_adds_each_gradient_into_its_main_gradient_and_frees_it() -> None:
    model = _model(torch.bfloat16)
    optimizer = MainParamsAdamW(model.parameters(), OptimizerPrecision("fp32", "fp32"))
    reference = _model(torch.bfloat16)
    for inputs, labels in _batches(2):
        forward_loss(model, inputs, labels).backward()
        forward_loss(reference, inputs, labels).backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert p.grad is None
        # fp32 sums of the two bf16 gradients (autograd's .grad sums them in bf16)
        assert torch.allclose(optimizer.state[p]["main_grad"], r.grad.float(), rtol=1e-2, atol=1e-3)
    parameters = sum(p.numel() for p in model.parameters())
    assert main_grad_bytes(optimizer) == 4 * parameters
    assert optimizer_state_bytes(optimizer) == 4 * parameters  # main parameters; moments after a step


def test_a_dropped_optimizer_leaves_gradients_to_autograd() -> None:
    model = _model()
    optimizer = MainParamsAdamW(model.parameters(), FP32)
    del optimizer
    gc.collect()
    forward_loss(model, *_batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def _estimate(tmp_path, *flags: str) -> dict:
    out = tmp_path / "estimate.json"
    assert (
        main(["estimate", "-mr", "llama3_tiny", "--no_progress", "--configs", "none", "--json", str(out), *flags]) == 0
    )
    return json.loads(out.read_text())[0]["stages"][0]


def test_estimate_counts_megatron_s_18_bytes_a_parameter_and_the_distributed_optimizer_s_share(
    tmp_path, capsys
) -> None:
    parameters = sum(p.numel() for p in build("llama3_tiny", device="meta").parameters())
    plain = _estimate(tmp_path)
    mixed = _estimate(tmp_path, "--main_params_dtype", "fp32")
    sharded = _estimate(tmp_path, "--main_params_dtype", "fp32", "-ng", "4", "--use_distributed_optimizer")
    capsys.readouterr()
    assert (plain["weights"], plain["grads"], plain["optimizer_state"]) == (2 * parameters, 0, 4 * parameters)
    # bf16 weights; fp32 main gradients; fp32 main parameters and two moments
    assert (mixed["weights"], mixed["grads"], mixed["optimizer_state"]) == (
        2 * parameters,
        4 * parameters,
        12 * parameters,
    )
    # each of 4 data-parallel ranks keeps a quarter of the main parameters and moments
    assert (sharded["weights"], sharded["grads"]) == (2 * parameters, 4 * parameters)
    assert sharded["optimizer_state"] == pytest.approx(3 * parameters, rel=1e-3)


def test_estimate_under_torch_fsdp2_shards_weights_gradients_and_moments_in_the_main_dtype(tmp_path, capsys) -> None:
    parameters = sum(p.numel() for p in build("llama3_tiny", device="meta").parameters())
    whole = _estimate(tmp_path, "--main_params_dtype", "fp32", "-ng", "2", "-gb", "4")
    fsdp = _estimate(tmp_path, "--main_params_dtype", "fp32", "-ng", "2", "-gb", "4", "--use_torch_fsdp2")
    capsys.readouterr()
    # every llama3_tiny parameter's dim 0 is even, so each rank holds half of each in fp32: 16 bytes a parameter
    # over 2 ranks, gradients held across the 2 micro-batches each rank runs
    assert (fsdp["weights"], fsdp["grads"], fsdp["optimizer_state"]) == (2 * parameters, 2 * parameters, 4 * parameters)
    assert fsdp["activations"] == whole["activations"]
    assert fsdp["peak"] < whole["peak"]


@pytest.mark.parametrize(
    ("precision", "said"),
    [
        (
            OptimizerPrecision(main_grads_dtype="fp32"),
            "main_grads_dtype: needs main parameters to act on; set main_params_dtype (Megatron's bf16 runs use fp32)",
        ),
        (
            OptimizerPrecision(use_distributed_optimizer=True),
            "use_distributed_optimizer: needs main parameters to act on; set main_params_dtype",
        ),
        (
            OptimizerPrecision(main_params_dtype="fp64"),
            "main_params_dtype: 'fp64' is not a dtype remat knows; use one of",
        ),
        (
            OptimizerPrecision("fp32", use_distributed_optimizer=True, use_torch_fsdp2=True),
            "use_distributed_optimizer: FSDP2 shards the main parameters and moments itself, and Megatron refuses the two"
            " together; drop one",
        ),
    ],
)
def test_precision_problems_are_refused_with_what_to_set(precision, said) -> None:
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        RunSpec(device="cpu", optimizer_precision=precision)
