"""The CUDA SwiGLU kernels (on CPU in Triton's interpreter, which conftest turns on): values and
gradients against float64 autograd of the eager formula, what they save, and the device dispatch."""
from __future__ import annotations

import pytest
import torch

from remat.models.llama import silu_mul
from remat.models.swiglu import SiluMul, on_cuda

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
             torch.float16: dict(rtol=2e-3, atol=1e-3)}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", [(3, 5, 2 * 1100), (7, 2 * 64), (2, 1, 2 * 1024), (0, 2 * 8)])
def test_kernels_match_float64_autograd_of_the_eager_formula(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """ffn below, at and not a multiple of the kernels' block; 2-D, 3-D and empty inputs; every
    dtype the kernels take (one rounding of a float32 result)."""
    torch.manual_seed(0)
    gate_up = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape[:-1] + (shape[-1] // 2,), device=DEVICE, dtype=dtype)
    out = SiluMul.apply(gate_up)
    (d_gate_up,) = torch.autograd.grad(out, gate_up, grad)
    ref_in = gate_up.detach().double().requires_grad_()
    ref_out = silu_mul(ref_in)
    (ref_grad,) = torch.autograd.grad(ref_out, ref_in, grad.double())
    assert out.shape == ref_out.shape and out.dtype == dtype and d_gate_up.shape == gate_up.shape
    torch.testing.assert_close(out.double(), ref_out, **TOLERANCE[dtype])
    torch.testing.assert_close(d_gate_up.double(), ref_grad, **TOLERANCE[dtype])


def test_odd_width_and_second_derivatives_are_refused() -> None:
    with pytest.raises(ValueError, match="even last dimension"):
        SiluMul.apply(torch.randn(2, 7, device=DEVICE))
    gate_up = torch.randn(3, 2 * 8, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(SiluMul.apply(gate_up).sum(), gate_up, create_graph=True)


def test_non_contiguous_input_and_gradient() -> None:
    torch.manual_seed(0)
    base = torch.randn(2 * 96, 4, device=DEVICE)
    gate_up = base.t().requires_grad_()  # [4, 192], column-major
    grad = torch.randn(96, 4, device=DEVICE).t()
    (d_gate_up,) = torch.autograd.grad(SiluMul.apply(gate_up), gate_up, grad)
    ref_in = gate_up.detach().double().requires_grad_()
    (ref_grad,) = torch.autograd.grad(silu_mul(ref_in), ref_in, grad.double())
    torch.testing.assert_close(d_gate_up.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_saves_only_the_gate_up_input() -> None:
    """What the memory model (and remat estimate's stand-in for CUDA) assumes it saves."""
    gate_up = torch.randn(4, 2 * 32, device=DEVICE, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        SiluMul.apply(gate_up)
    assert len(saved) == 1 and saved[0].untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()


def test_dispatch_runs_the_fallback_off_cuda() -> None:
    calls: list[torch.Tensor] = []

    def fallback(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return silu_mul(x)

    x = torch.randn(3, 8)
    torch.testing.assert_close(on_cuda(fallback)(x), silu_mul(x))
    assert calls == [x]
    if torch.cuda.is_available():
        y = on_cuda(fallback)(torch.randn(3, 8, device="cuda", requires_grad=True))
        assert len(calls) == 1 and type(y.grad_fn).__name__ == "SiluMulBackward"  # the kernels ran
        x64 = torch.randn(3, 8, device="cuda", dtype=torch.float64)  # the kernels compute in float32
        on_cuda(fallback)(x64)
        assert calls[-1] is x64
