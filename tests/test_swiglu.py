"""The CUDA SwiGLU + linear_fc2 Function (on CPU in Triton's interpreter, which conftest turns
on): values and gradients against float64 autograd of the eager formula, what it saves, the
activation its backward rebuilds, the device dispatch and the meta device."""
from __future__ import annotations

import pytest
import torch
from conftest import allocations
from torch.utils.flop_counter import FlopCounterMode

from remat.models import build, swiglu
from remat.models.llama import swiglu_down
from remat.models.swiglu import SwiGLUDown, on_cuda
from remat.verify import run_step

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2),
             torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _reference(gate_up: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Output and gradients in float64 autograd of the eager formula."""
    x, w = gate_up.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    out = swiglu_down(x, w, False)
    return (out, *torch.autograd.grad(out, (x, w), grad.double()))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", [(3, 5, 2 * 1100), (7, 2 * 64), (2, 1, 2 * 1024), (0, 2 * 8)])
def test_matches_float64_autograd_of_the_eager_formula(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """ffn below, at and not a multiple of the kernels' block; 2-D, 3-D and empty inputs; every
    dtype the kernels take."""
    torch.manual_seed(0)
    gate_up = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = (torch.randn(6, shape[-1] // 2, device=DEVICE, dtype=dtype) / 8).requires_grad_()
    out = SwiGLUDown.apply(gate_up, weight, False)
    grad = torch.randn_like(out)
    d_gate_up, d_weight = torch.autograd.grad(out, (gate_up, weight), grad)
    ref_out, ref_gate_up, ref_weight = _reference(gate_up, weight, grad)
    assert out.dtype == dtype and d_gate_up.shape == gate_up.shape and d_weight.shape == weight.shape
    for got, want in ((out, ref_out), (d_gate_up, ref_gate_up), (d_weight, ref_weight)):
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


def test_backward_rebuilds_the_forward_activation_bit_for_bit() -> None:
    """The weight gradient uses the activation written again in backward: the same bits as the
    forward's (read back through an identity down projection, which is exact)."""
    torch.manual_seed(0)
    gate_up = torch.randn(5, 2 * 96, device=DEVICE, dtype=torch.bfloat16)
    activation = SwiGLUDown.apply(gate_up, torch.eye(96, device=DEVICE, dtype=torch.bfloat16), False)
    weight = torch.randn(4, 96, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(5, 4, device=DEVICE, dtype=torch.bfloat16)
    (d_weight,) = torch.autograd.grad(SwiGLUDown.apply(gate_up, weight, False), weight, grad)
    assert torch.equal(d_weight, grad.t().mm(activation))


def test_odd_width_and_second_derivatives_are_refused() -> None:
    weight = torch.randn(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="even last dimension"):
        SwiGLUDown.apply(torch.randn(2, 7, device=DEVICE), weight, False)
    gate_up = torch.randn(3, 2 * 4, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(SwiGLUDown.apply(gate_up, weight, False).sum(), gate_up, create_graph=True)


def test_non_contiguous_input_and_gradient() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(2 * 96, 4, device=DEVICE).t().requires_grad_()  # [4, 192], column-major
    weight = torch.randn(8, 96, device=DEVICE, requires_grad=True)
    grad = torch.randn(8, 4, device=DEVICE).t()
    got = torch.autograd.grad(SwiGLUDown.apply(gate_up, weight, False), (gate_up, weight), grad)
    for g, want in zip(got, _reference(gate_up, weight, grad)[1:]):
        torch.testing.assert_close(g.double(), want, **TOLERANCE[torch.float32])


def test_frozen_weight_skips_its_gradient_matmul() -> None:
    def backward_flops(weight_grad: bool) -> int:
        gate_up = torch.randn(3, 2 * 8, device=DEVICE, requires_grad=True)
        out = SwiGLUDown.apply(gate_up, torch.randn(4, 8, device=DEVICE, requires_grad=weight_grad), False)
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        return counter.get_total_flops()

    assert backward_flops(False) * 2 == backward_flops(True) > 0


def test_saves_the_gate_up_input_and_the_weight_only() -> None:
    """Not the activation: what the memory model (and remat estimate, which runs this Function on
    meta tensors) counts."""
    gate_up = torch.randn(4, 2 * 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        SwiGLUDown.apply(gate_up, weight, False)
    assert sorted(t.untyped_storage().data_ptr() for t in saved) == sorted(
        t.untyped_storage().data_ptr() for t in (gate_up, weight))


def test_on_meta_it_allocates_what_cuda_would() -> None:
    """remat estimate runs the Function on meta: it must leave and allocate what a real device
    does. On CPU Triton's interpreter copies tensors for the kernels, so the backward's peak is
    counted by hand: the output gradient, gate/up's gradient, the activation written again and the
    weight gradient (bf16, ffn 16, 6 tokens), linear_fc2's input gradient freed before the last."""
    def inputs(device: str) -> tuple[torch.Tensor, ...]:
        return (torch.ones(2, 3, 2 * 16, device=device, dtype=torch.bfloat16, requires_grad=True),
                torch.ones(8, 16, device=device, dtype=torch.bfloat16, requires_grad=True))

    def forward(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return SwiGLUDown.apply(gate_up, weight, False)

    saved, peak, grads = allocations(forward, inputs("meta"))
    real_saved, _, real_grads = allocations(forward, inputs(DEVICE))
    assert (saved, grads) == (real_saved, real_grads) and saved == 6 * 8 * 2  # the output alone
    assert peak == (6 * 8 + 6 * 32 + 6 * 16 + 8 * 16) * 2


def test_dispatch_runs_the_fallback_off_cuda_and_for_float64() -> None:
    calls: list[torch.Tensor] = []

    def fallback(x: torch.Tensor, weight: torch.Tensor, fuse_grads: bool) -> torch.Tensor:
        calls.append(x)
        return swiglu_down(x, weight, fuse_grads)

    x, weight = torch.randn(3, 8), torch.randn(2, 4)
    torch.testing.assert_close(on_cuda(fallback)(x, weight, False), swiglu_down(x, weight, False))
    assert calls == [x]
    if torch.cuda.is_available():
        x = torch.randn(3, 8, device="cuda", requires_grad=True)
        y = on_cuda(fallback)(x, weight.cuda(), False)
        assert len(calls) == 1 and type(y.grad_fn).__name__ == "SwiGLUDownBackward"  # the kernels ran
        x64 = torch.randn(3, 8, device="cuda", dtype=torch.float64)  # the kernels compute in float32
        on_cuda(fallback)(x64, weight.cuda().double(), False)
        assert len(calls) == 2 and calls[-1] is x64


@pytest.mark.parametrize("plan", ["layernorm", "mlp", "full"])
def test_in_the_model_plans_stay_bit_identical_and_the_activation_is_not_saved(plan: str, verified_preset) -> None:
    """The model's MLP running the Function (as compile_regions does on CUDA) composes with the
    engine: recompute, discard and full recompute give the gradients of no recompute bit for bit,
    and against the eager MLP each layer saves the activation and silu(gate) less."""
    torch.manual_seed(0)
    model = build("llama3_tiny", dtype=torch.float32, num_layers=2, seq_length=16, device=DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), device=DEVICE)
    eager_saved = run_step(model, ids[:, :-1], ids[:, 1:], seed=0).saved.bytes
    for layer in model.decoder.layers:
        layer.mlp.activation_down = swiglu.activation_down
    report = verified_preset(model, ids, plan)
    assert report.bit_identical
    tokens, ffn = 2 * 16, model.config.ffn_hidden_size
    assert eager_saved - report.baseline.saved.bytes == 2 * 2 * tokens * ffn * 4
