"""The CUDA RMSNorm Function (on CPU in Triton's interpreter, which conftest turns on): values and
gradients against float64 autograd of F.rms_norm, determinism, what it saves, the device
dispatch, the meta device, and the model's norms running it under recompute plans."""

from __future__ import annotations

import pytest
import torch
from conftest import allocations

from remat.models import build
from remat.models.kernels.rmsnorm import RMSNormFunction, on_cuda, rms_norm, triton_rms_norm

pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


EPS = 1e-5


TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = (1 + torch.randn(shape[-1], device=DEVICE, dtype=dtype) / 4).requires_grad_()
    return x, weight


def _reference(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, weight = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    out = rms_norm(x, weight, EPS)
    return (out, *torch.autograd.grad(out, (x, weight), grad.double()))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", [(3, 5, 100), (13, 64), (1, 1), (9, 33), (0, 8)])
def test_matches_float64_autograd_of_torch_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Widths at and off a power of two, 2-D and 3-D, rows that do not fill the last backward
    program, a single element, no rows; every dtype the kernels take."""
    torch.manual_seed(0)
    x, weight = _inputs(shape, dtype)
    out = RMSNormFunction.apply(x, weight, EPS)
    grad = torch.randn_like(out)
    dx, dw = torch.autograd.grad(out, (x, weight), grad)
    assert out.dtype == dx.dtype == dw.dtype == dtype and dx.shape == x.shape and dw.shape == weight.shape
    for got, want in zip((out, dx, dw), _reference(x, weight, grad)):
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("eps", [1e-2, None])
def test_eps_matters_where_rows_are_small(eps: float | None) -> None:
    """A zero row and a row of 1e-3s, where eps sets the scale; None is the dtype's epsilon, as
    torch takes it."""
    x = torch.stack([torch.zeros(48), torch.full((48,), 1e-3), torch.randn(48)]).to(DEVICE).requires_grad_()
    weight = torch.linspace(0.5, 1.5, 48, device=DEVICE, requires_grad=True)
    grad = torch.randn(3, 48, device=DEVICE)
    out = RMSNormFunction.apply(x, weight, eps)
    got = (out, *torch.autograd.grad(out, (x, weight), grad))
    ref_x, ref_w = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = rms_norm(ref_x, ref_w, torch.finfo(torch.float32).eps if eps is None else eps)
    want = (ref, *torch.autograd.grad(ref, (ref_x, ref_w), grad.double()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_backward_is_deterministic() -> None:
    """The weight gradient is summed per program over fixed rows, then over programs in order."""
    torch.manual_seed(0)
    x, weight = _inputs((37, 48), torch.float32)
    grad = torch.randn(37, 48, device=DEVICE)
    first, second = (torch.autograd.grad(RMSNormFunction.apply(x, weight, EPS), (x, weight), grad) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_bad_weight_and_second_derivatives_are_refused() -> None:
    x, weight = _inputs((3, 8), torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        RMSNormFunction.apply(x, weight[:4], EPS)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.autograd.grad(RMSNormFunction.apply(x, weight, EPS).sum(), x, create_graph=True)


def test_non_contiguous_input_and_gradient() -> None:
    torch.manual_seed(0)
    x = torch.randn(40, 6, device=DEVICE).t().requires_grad_()  # [6, 40], column-major
    weight = torch.randn(40, device=DEVICE, requires_grad=True)
    grad = torch.randn(40, 6, device=DEVICE).t()
    out = RMSNormFunction.apply(x, weight, EPS)
    got = (out, *torch.autograd.grad(out, (x, weight), grad))
    for g, want in zip(got, _reference(x, weight, grad)):
        torch.testing.assert_close(g.double(), want, **TOLERANCE[torch.float32])


def test_frozen_weight_gets_no_gradient() -> None:
    x, weight = _inputs((5, 16), torch.float32)
    weight.requires_grad_(False)
    RMSNormFunction.apply(x, weight, EPS).sum().backward()
    assert weight.grad is None and x.grad is not None


def test_saves_the_input_the_weight_and_a_float32_scale_per_row() -> None:
    """What torch's fused CUDA kernel saves: the memory model (and remat estimate, which runs this
    Function on meta tensors) counts exactly this."""
    x, weight = _inputs((2, 7, 32), torch.bfloat16)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        RMSNormFunction.apply(x, weight, EPS)
    assert [t.untyped_storage().data_ptr() for t in saved[:2]] == [t.untyped_storage().data_ptr() for t in (x, weight)]
    assert len(saved) == 3 and saved[2].shape == (2, 7) and saved[2].dtype == torch.float32


def test_on_meta_it_allocates_what_cuda_would() -> None:
    """remat estimate runs the Function on meta: it must leave and allocate what a real device
    does (6 rows of 16, bf16): the output and a float32 scale per row; in backward the output
    gradient, the input gradient, float32 partial weight gradients (3 programs of 2 rows on CPU),
    their float32 sum and its bf16 cast."""

    def inputs(device: str) -> tuple[torch.Tensor, ...]:
        return (
            torch.ones(2, 3, 16, device=device, dtype=torch.bfloat16, requires_grad=True),
            torch.ones(16, device=device, dtype=torch.bfloat16, requires_grad=True),
        )

    def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, weight, EPS)

    measured = allocations(forward, inputs("meta"))
    # on CUDA the partial sums take a row per program, two programs per SM, which meta cannot know
    assert measured == allocations(forward, inputs(DEVICE)) or DEVICE == "cuda"
    saved, peak, grads = measured
    assert saved == 6 * 16 * 2 + 6 * 4 and grads == [((2, 3, 16), torch.bfloat16), ((16,), torch.bfloat16)]
    assert peak == 2 * 6 * 16 * 2 + 3 * 16 * 4 + 16 * 4 + 16 * 2


def test_dispatch_runs_the_fallback_off_cuda_and_for_other_dtypes() -> None:
    calls: list[torch.Tensor] = []

    def fallback(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(x)
        return rms_norm(x, weight, eps)

    x, weight = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(on_cuda(fallback)(x, weight, EPS), rms_norm(x, weight, EPS))
    assert calls == [x]
    if torch.cuda.is_available():
        x = torch.randn(3, 8, device="cuda", requires_grad=True)
        y = on_cuda(fallback)(x, weight.cuda(), EPS)
        assert len(calls) == 1 and type(y.grad_fn).__name__ == "RMSNormFunctionBackward"  # the kernels ran
        on_cuda(fallback)(x, weight.cuda().double(), EPS)  # weight of another dtype
        x64 = torch.randn(3, 8, device="cuda", dtype=torch.float64)  # the kernels compute in float32
        on_cuda(fallback)(x64, weight.cuda().double(), EPS)
        assert len(calls) == 3 and calls[-1] is x64
        with pytest.raises(RuntimeError):  # a weight on another device: torch's own error, not a launch
            on_cuda(fallback)(x, weight, EPS)
        assert len(calls) == 4


@pytest.mark.parametrize("plan", ["layernorm", "mlp", "full"])
def test_in_the_model_plans_stay_bit_identical(plan: str, verified_preset) -> None:
    """The model's norms running the Function (as compile_regions does on CUDA) compose with the
    engine: discard, recompute and full recompute give the gradients of no recompute bit for bit;
    layernorm discard frees exactly each norm's output and its float32 1/rms rows (the input,
    which it keeps to replay, is the norm's own saved input)."""
    torch.manual_seed(0)
    model = build("llama3_tiny", dtype=torch.float32, num_layers=2, seq_length=16, device=DEVICE)
    model.set_norm_kernel(triton_rms_norm)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), device=DEVICE)
    report = verified_preset(model, ids, plan)
    assert report.bit_identical
    norm = model.decoder.layers[0].input_layernorm
    assert (
        type(norm(torch.randn(2, 64, device=DEVICE, requires_grad=True)).grad_fn).__name__ == "RMSNormFunctionBackward"
    )
    if plan == "layernorm":
        tokens, hidden, layers = 2 * 16, model.config.hidden_size, model.config.num_layers
        assert report.baseline.saved.bytes - report.candidate.saved.bytes == layers * 2 * (
            tokens * hidden * 4 + tokens * 4
        )
