"""The CUDA SwiGLU activation Function (on CPU in Triton's interpreter, which conftest turns on):
values and gradients against float64 autograd of the eager formula, what it saves, the device
dispatch, the meta device, and the model's `mlp_act` site kept or discarded around it."""

from __future__ import annotations

import pytest
import torch
from conftest import allocations

from remat.config.plan import Plan
from remat.models import build
from remat.models.kernels import swiglu
from remat.models.kernels.swiglu import SwiGLU, on_cuda
from remat.models.llama.model import silu_mul
from remat.run.verify import verify

pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", [(3, 5, 2 * 1100), (7, 2 * 64), (2, 1, 2 * 1024), (0, 2 * 8)])
def test_matches_float64_autograd_of_the_eager_formula(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """ffn below, at and not a multiple of the kernels' block; 2-D, 3-D and empty inputs; every
    dtype the kernels take."""
    torch.manual_seed(0)
    gate_up = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    out = SwiGLU.apply(gate_up)
    grad = torch.randn_like(out)
    (d_gate_up,) = torch.autograd.grad(out, gate_up, grad)
    x = gate_up.detach().double().requires_grad_()
    ref_out = silu_mul(x)
    (ref_grad,) = torch.autograd.grad(ref_out, x, grad.double())
    assert out.dtype == dtype and d_gate_up.shape == gate_up.shape
    for got, want in ((out, ref_out), (d_gate_up, ref_grad)):
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


def test_odd_width_and_second_derivatives_are_refused() -> None:
    with pytest.raises(ValueError, match="even last dimension"):
        SwiGLU.apply(torch.randn(2, 7, device=DEVICE))
    gate_up = torch.randn(3, 2 * 4, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(SwiGLU.apply(gate_up).sum(), gate_up, create_graph=True)


def test_non_contiguous_input_and_gradient() -> None:
    torch.manual_seed(0)
    gate_up = torch.randn(2 * 96, 4, device=DEVICE).t().requires_grad_()  # [4, 192], column-major
    grad = torch.randn(96, 4, device=DEVICE).t()
    (got,) = torch.autograd.grad(SwiGLU.apply(gate_up), gate_up, grad)
    (want,) = torch.autograd.grad(silu_mul(gate_up), gate_up, grad)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_saves_the_gate_up_input_only() -> None:
    """Not the activation (linear_fc2 saves that): what the memory model, and remat estimate,
    which runs this Function on meta tensors, count."""
    gate_up = torch.randn(4, 2 * 32, device=DEVICE, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        SwiGLU.apply(gate_up)
    assert [t.untyped_storage().data_ptr() for t in saved] == [gate_up.untyped_storage().data_ptr()]


def test_on_meta_it_allocates_what_cuda_would() -> None:
    """remat estimate runs the Function on meta: it must leave and allocate what a real device
    does. On CPU Triton's interpreter copies tensors for the kernels, so the backward's peak is
    counted by hand: the output gradient and gate/up's gradient (bf16, ffn 16, 6 tokens)."""

    def inputs(device: str) -> tuple[torch.Tensor, ...]:
        return (torch.ones(2, 3, 2 * 16, device=device, dtype=torch.bfloat16, requires_grad=True),)

    saved, peak, grads = allocations(SwiGLU.apply, inputs("meta"))
    real_saved, _, real_grads = allocations(SwiGLU.apply, inputs(DEVICE))
    assert (saved, grads) == (real_saved, real_grads) and saved == 6 * 16 * 2  # the output alone
    assert peak == (6 * 16 + 6 * 32) * 2


def test_dispatch_runs_the_fallback_off_cuda_and_for_float64() -> None:
    calls: list[torch.Tensor] = []

    def fallback(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return silu_mul(x)

    x = torch.randn(3, 8)
    torch.testing.assert_close(on_cuda(fallback)(x), silu_mul(x))
    assert calls == [x]
    if torch.cuda.is_available():
        x = torch.randn(3, 8, device="cuda", requires_grad=True)
        y = on_cuda(fallback)(x)
        assert len(calls) == 1 and type(y.grad_fn).__name__ == "SwiGLUBackward"  # the kernels ran
        x64 = torch.randn(3, 8, device="cuda", dtype=torch.float64)  # the kernels compute in float32
        on_cuda(fallback)(x64)
        assert len(calls) == 2 and calls[-1] is x64


@pytest.mark.parametrize("plan", ["mlp_act", "mlp", "full"])
def test_in_the_model_plans_stay_bit_identical(plan: str, verified_preset) -> None:
    """The model's MLP running the Function (as compile_regions does on CUDA) composes with the
    engine: discarding the activation, recomputing the MLP and full recompute give the gradients
    of no recompute bit for bit, and the activation rebuilt in backward has the forward's bits."""
    torch.manual_seed(0)
    model = build("llama3_tiny", dtype=torch.float32, num_layers=2, seq_length=16, device=DEVICE)
    for layer in model.decoder.layers:
        layer.mlp.activation = swiglu.activation
    ids = torch.randint(0, model.config.vocab_size, (2, 17), device=DEVICE)
    assert verified_preset(model, ids, plan).bit_identical


def test_discarding_the_activation_frees_exactly_its_bytes() -> None:
    """mlp_act=discard in one layer: linear_fc2 then saves a reference, not the activation
    [tokens, ffn]; everything else stays saved."""
    torch.manual_seed(0)
    model = build("llama3_tiny", dtype=torch.float32, num_layers=2, seq_length=16, device=DEVICE)
    for layer in model.decoder.layers:
        layer.mlp.activation = swiglu.activation
    ids = torch.randint(0, model.config.vocab_size, (2, 17), device=DEVICE)
    report = verify(model, Plan([{"mlp_act": "discard"}, {}]), ids[:, :-1], ids[:, 1:])
    assert report.bit_identical
    assert report.freed_bytes == 2 * 16 * model.config.ffn_hidden_size * 4
