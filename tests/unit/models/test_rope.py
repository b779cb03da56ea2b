"""The CUDA QKV split with RoPE (on CPU in Triton's interpreter, which conftest turns on): values
and gradients against float64 autograd of the eager formula, what it saves, the refusals, the
device dispatch, the meta device and the model's plans."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import allocations

from remat.models import build
from remat.models.kernels import rope
from remat.models.kernels.rope import RotaryQKV, on_cuda, split_qkv
from remat.models.llama.model import split_qkv as eager_split_qkv
from remat.run.verify import run_step

pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def eager_project_qkv(x: torch.Tensor, weight: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """The model's projection then its eager split."""
    return eager_split_qkv(F.linear(x, weight), *args)


def project_qkv(x: torch.Tensor, weight: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    """The model's projection then the Function."""
    return split_qkv(F.linear(x, weight), *args)


def _inputs(
    heads: int, groups: int, head_dim: int, dtype: torch.dtype = torch.float32, b: int = 2, s: int = 5, hidden: int = 24
) -> tuple[torch.Tensor, ...]:
    """x, the fused weight, and cos/sin as the model slices them from longer tables (whose two
    halves differ here, so a kernel that mixed them up would show)."""
    x = torch.randn(b, s, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    weight = (torch.randn((heads + 2 * groups) * head_dim, hidden, device=DEVICE, dtype=dtype) / 5).requires_grad_()
    angles = torch.randn(s + 3, head_dim, device=DEVICE)
    return x, weight, angles.cos().to(dtype)[:s], angles.sin().to(dtype)[:s]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, groups, head_dim", [(4, 2, 16), (6, 3, 12), (8, 8, 16), (3, 1, 8)])
def test_matches_float64_autograd_of_the_eager_formula(
    heads: int, groups: int, head_dim: int, dtype: torch.dtype
) -> None:
    """The kernels alone (the eager formula's projection an identity, exact in float64): query
    heads per group and groups a power of two or not, one group or as many as heads, a head dim
    whose half is not a power of two; every dtype the kernels take, each value computed in float32
    and rounded once (within one unit in the last place of the float64 result)."""
    torch.manual_seed(0)
    _, _, cos, sin = _inputs(heads, groups, head_dim, dtype)
    width = (heads + 2 * groups) * head_dim
    qkv = torch.randn(2, 5, width, device=DEVICE, dtype=dtype, requires_grad=True)
    out = RotaryQKV.apply(qkv, cos, sin, heads, groups)
    grads = [torch.randn_like(t) for t in out]
    (got,) = torch.autograd.grad(out, qkv, grads)
    qkv64 = qkv.detach().double().requires_grad_()
    identity = torch.eye(width, device=DEVICE, dtype=torch.float64)
    want_out = eager_split_qkv(qkv64 @ identity, cos.double(), sin.double(), heads, groups)
    (want,) = torch.autograd.grad(want_out, qkv64, [g.double() for g in grads])
    for a, b in zip((*out, got), (*want_out, want)):
        assert a.dtype == dtype and a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a.double(), b, rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_with_the_projection_matches_the_eager_formula() -> None:
    torch.manual_seed(0)
    x, weight, cos, sin = _inputs(6, 2, 12)
    out = project_qkv(x, weight, cos, sin, 6, 2)
    grads = [torch.randn_like(t) for t in out]
    want_out = eager_project_qkv(x, weight, cos, sin, 6, 2)
    for a, b in zip(
        (*out, *torch.autograd.grad(out, (x, weight), grads)),
        (*want_out, *torch.autograd.grad(want_out, (x, weight), grads)),
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_any_strides_and_unused_outputs() -> None:
    """A strided projection output, gradients in other strides, tables a saved-tensor hook hands
    back transposed, and outputs that get no gradient (materialized as zeros)."""
    torch.manual_seed(0)
    x, weight, cos, sin = _inputs(4, 2, 16)
    grads = [torch.randn(16, n, 5, 2, device=DEVICE).permute(3, 2, 1, 0) for n in (4, 2, 2)]  # [2, 5, n, 16]
    want = torch.autograd.grad(eager_project_qkv(x, weight, cos, sin, 4, 2), (x, weight), grads)
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.t().contiguous() if t.dim() == 2 else t, lambda t: t.t() if t.dim() == 2 else t
    ):
        out = project_qkv(x, weight, cos, sin, 4, 2)
    for a, b in zip(torch.autograd.grad(out, (x, weight), grads), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    qkv = torch.randn(128, 2, 5, device=DEVICE).permute(1, 2, 0).requires_grad_()  # [2, 5, 128], strided
    q, _, _ = RotaryQKV.apply(qkv, cos, sin, 4, 2)
    q_want, _, _ = eager_project_qkv(qkv, torch.eye(128, device=DEVICE), cos, sin, 4, 2)
    torch.testing.assert_close(q, q_want, rtol=1e-5, atol=1e-5)
    (got,) = torch.autograd.grad(q.sum(), qkv)
    (expected,) = torch.autograd.grad(q_want.sum(), qkv)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_saves_the_tables_only_and_with_the_projection_what_the_formula_saves() -> None:
    """RoPE is linear: its backward needs cos and sin, nothing of q or k. With the projection the
    Function saves what the eager formula and inductor's partition of it save (remat's estimate
    counts the Function's bytes for CUDA)."""

    def saved_storages(fn, *args) -> set[int]:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(*args)
        return {t.untyped_storage().data_ptr() for t in saved}

    x, weight, cos, sin = _inputs(4, 2, 16)
    qkv = torch.randn(2, 5, 8 * 16, device=DEVICE, requires_grad=True)
    assert saved_storages(RotaryQKV.apply, qkv, cos, sin, 4, 2) == {t.untyped_storage().data_ptr() for t in (cos, sin)}
    compiled = torch.compile(eager_project_qkv, backend="aot_eager_decomp_partition")
    assert (
        saved_storages(project_qkv, x, weight, cos, sin, 4, 2)
        == saved_storages(compiled, x, weight, cos, sin, 4, 2)
        == saved_storages(eager_project_qkv, x, weight, cos, sin, 4, 2)
        == {t.untyped_storage().data_ptr() for t in (x, weight, cos, sin)}
    )


def test_bad_layouts_and_second_derivatives_are_refused() -> None:
    x, weight, cos, sin = _inputs(4, 2, 16)
    qkv = torch.randn(2, 5, 8 * 16, device=DEVICE, requires_grad=True)
    cases = [
        ((torch.randn(2, 5, 40), cos[:, :4], sin[:, :4], 4, 3), "4 query heads do not split into 3 groups"),
        ((torch.randn(2, 5, 45), cos[:, :5], sin[:, :5], 3, 3), "needs an even head dim, got 5"),
        ((qkv, cos, sin, 6, 2), "of dim 16 has 160 columns, got 128"),
        ((qkv, cos[:4], sin[:4], 4, 2), r"cos and sin must be \[5, 16\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            RotaryQKV.apply(*args)
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        q, _, _ = project_qkv(x, weight, cos, sin, 4, 2)
        torch.autograd.grad(q.sum(), x, create_graph=True)


def test_on_meta_it_allocates_what_cuda_would() -> None:
    """remat estimate runs the Function on meta: it must leave and allocate what a real device
    does (10 tokens, 4 query heads and 2 groups of dim 16, hidden 24, bf16): q, k, v; in backward
    their gradients, the fused projection's gradient, the weight's and the input's."""

    def inputs(device: str) -> tuple[torch.Tensor, ...]:
        return (
            torch.ones(2, 5, 24, device=device, dtype=torch.bfloat16, requires_grad=True),
            torch.ones(8 * 16, 24, device=device, dtype=torch.bfloat16, requires_grad=True),
            torch.ones(5, 16, device=device, dtype=torch.bfloat16),
            torch.ones(5, 16, device=device, dtype=torch.bfloat16),
        )

    def forward(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return project_qkv(*args, 4, 2)

    saved, peak, grads = measured = allocations(forward, inputs("meta"))
    assert measured == allocations(forward, inputs(DEVICE))
    assert saved == 10 * 8 * 16 * 2 and grads == [((2, 5, 24), torch.bfloat16), ((128, 24), torch.bfloat16)]
    assert peak == (10 * 8 * 16 * 2 + 128 * 24 + 10 * 24) * 2


def test_dispatch_runs_the_fallback_where_the_kernel_would_differ_from_the_formula() -> None:
    """Off CUDA; on CUDA for float64, tables of another dtype or that require grad, tables on
    another device, and under autocast (where the formula would give q and k another dtype than
    the kernel writes)."""
    calls: list[torch.Tensor] = []

    def fallback(qkv: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
        calls.append(qkv)
        return eager_split_qkv(qkv, *args)

    x, weight, cos, sin = (t.detach().cpu() for t in _inputs(4, 2, 16))
    qkv = F.linear(x, weight)
    for got, want in zip(on_cuda(fallback)(qkv, cos, sin, 4, 2), eager_split_qkv(qkv, cos, sin, 4, 2)):
        torch.testing.assert_close(got, want)
    assert calls == [qkv]
    if torch.cuda.is_available():
        qkv, cos, sin = (t.cuda().bfloat16() for t in (qkv, cos, sin))
        q, _, _ = on_cuda(fallback)(qkv.requires_grad_(), cos, sin, 4, 2)
        assert len(calls) == 1 and type(q.grad_fn).__name__ == "RotaryQKVBackward"  # the kernel ran
        on_cuda(fallback)(qkv.double(), cos.double(), sin.double(), 4, 2)
        on_cuda(fallback)(qkv, cos.float(), sin.float(), 4, 2)
        on_cuda(fallback)(qkv, cos.detach().requires_grad_(), sin, 4, 2)
        with torch.autocast("cuda", dtype=torch.float16):
            on_cuda(fallback)(qkv, cos, sin, 4, 2)
        assert len(calls) == 5
        with pytest.raises(RuntimeError):  # tables on another device: torch's own error, not a launch
            on_cuda(fallback)(qkv, cos.cpu(), sin.cpu(), 4, 2)
        assert len(calls) == 6


@pytest.mark.parametrize("plan", ["layernorm", "core_attn", "full"])
def test_in_the_model_plans_stay_bit_identical_and_save_what_the_formula_saves(plan: str, verified_preset) -> None:
    """The model's attention running the Function (as compile_regions does on CUDA) composes with
    the engine: discard, recompute and full recompute give the gradients of no recompute bit for
    bit, and no recompute saves the bytes of the eager formula."""
    torch.manual_seed(0)
    model = build("llama3_tiny", dtype=torch.float32, num_layers=2, seq_length=16, device=DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), device=DEVICE)
    eager_saved = run_step(model, ids[:, :-1], ids[:, 1:], seed=0).saved
    for layer in model.decoder.layers:
        layer.self_attention.split_qkv = rope.split_qkv
    report = verified_preset(model, ids, plan)
    assert report.bit_identical
    assert report.baseline.saved == eager_saved
