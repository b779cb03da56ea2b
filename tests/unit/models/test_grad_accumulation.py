"""Gradient accumulation fused into the weight-gradient GEMM: the sum it leaves in .grad, the
weight-sized temporary it does not allocate, and every case where autograd would not have added
into .grad (where it must return the gradient instead, as torch's linear does)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.config.recompute import RecomputeConfig
from remat.memory.live import peak_during
from remat.models import build
from remat.models.kernels import swiglu
from remat.models.kernels.grad_accumulation import linear
from remat.models.kernels.loss import LossKernels, chunked_linear_cross_entropy, compiled_loss_kernels

OUT, IN, TOKENS = 6, 8, 10


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [2, 5, IN], weight [OUT, IN] holding a gradient already, and a gradient for the output."""
    torch.manual_seed(0)
    x = torch.randn(2, TOKENS // 2, IN, dtype=dtype, requires_grad=True)
    weight = torch.randn(OUT, IN, dtype=dtype, requires_grad=True)
    weight.grad = torch.randn(OUT, IN, dtype=dtype)
    return x, weight, torch.randn(2, TOKENS // 2, OUT, dtype=dtype), weight.grad.clone()


class _Ops(TorchDispatchMode):
    """How many times each aten op (by name, e.g. "addmm_") runs inside."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _fused_sum(old: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return old.addmm(grad.reshape(TOKENS, OUT).t(), x.detach().reshape(TOKENS, IN))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_adds_into_the_gradient_inside_the_gemm(dtype: torch.dtype) -> None:
    """.grad becomes old + g^T x as one GEMM with beta 1 computes it (rounded once), within
    rounding of autograd's two steps; the input gradient is torch's bit for bit."""
    x, weight, grad, old = _inputs(dtype)
    held = weight.grad
    out = linear(x, weight, True)
    with _Ops() as ops:
        out.backward(grad)
    assert ops.counts["addmm_"] == 1 and ops.counts["add_"] == 0  # no separate add
    assert weight.grad is held and torch.equal(weight.grad, _fused_sum(old, x, grad))
    x_ref, weight_ref = x.detach().requires_grad_(), weight.detach().requires_grad_()
    weight_ref.grad = old.clone()
    F.linear(x_ref, weight_ref).backward(grad)
    assert torch.equal(x.grad, x_ref.grad)
    torch.testing.assert_close(
        weight.grad, weight_ref.grad, **({} if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2))
    )


def test_the_weight_sized_temporary_is_not_allocated() -> None:
    """Exactly one weight gradient's bytes less at the backward's peak than autograd's
    compute-then-add (the input gradient is allocated in both)."""

    def backward_peak(fuse: bool) -> int:
        x, weight, grad, _ = _inputs()
        out = linear(x, weight, fuse)
        return peak_during(lambda: out.backward(grad))[1]

    assert backward_peak(False) - backward_peak(True) == OUT * IN * 4


def _unfused(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The weight gradient alone, from torch's linear."""
    x, weight = x.detach(), weight.detach().requires_grad_()
    return torch.autograd.grad(F.linear(x, weight), weight, grad)[0]


def test_autograd_grad_gets_the_gradient_and_grad_is_left_alone() -> None:
    x, weight, grad, old = _inputs()
    (d_weight,) = torch.autograd.grad(linear(x, weight, True), weight, grad)
    torch.testing.assert_close(d_weight, _unfused(x, weight, grad))
    (d_x,) = torch.autograd.grad(linear(x, weight, True), x, grad)  # the weight not asked for
    assert torch.equal(weight.grad, old) and d_x.shape == x.shape


def test_backward_for_other_inputs_leaves_grad_alone() -> None:
    x, weight, grad, old = _inputs()
    linear(x, weight, True).backward(grad, inputs=[x])
    assert torch.equal(weight.grad, old) and x.grad is not None


@pytest.mark.filterwarnings("ignore:grad and param do not obey", "ignore:Using backward.. with create_graph")
@pytest.mark.parametrize(
    "case",
    ["tensor hook", "post-accumulate hook", "no gradient yet", "non-contiguous gradient", "create_graph", "fusion off"],
)
def test_where_autograd_would_not_add_into_grad_it_returns_the_gradient(case: str) -> None:
    """Hooks see the gradient, a first backward gets torch's gradient (stored by autograd), a
    strided .grad and create_graph take autograd's add: .grad ends as old + torch's gradient."""
    x, weight, grad, old = _inputs()
    seen: list[torch.Tensor] = []
    if case == "tensor hook":
        weight.register_hook(seen.append)
    elif case == "post-accumulate hook":
        weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    elif case == "no gradient yet":
        weight.grad, old = None, torch.zeros_like(old)
    elif case == "non-contiguous gradient":
        weight.grad = old.t().contiguous().t()
    out = linear(x, weight, case != "fusion off")
    with _Ops() as ops:
        out.backward(grad, create_graph=case == "create_graph")
    assert ops.counts["addmm_"] == 0  # the gradient computed apart, then stored or added by autograd
    want = _unfused(x, weight, grad)
    assert torch.equal(weight.grad.detach(), want if case == "no gradient yet" else old + want)
    assert len(seen) == (1 if "hook" in case else 0)
    assert (weight.grad.grad_fn is not None) == (case == "create_graph")


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
@pytest.mark.parametrize("fuse", [True, False])
def test_the_loss_head_adds_its_scaled_gradient_in_one_step(fuse: bool, kernels: str) -> None:
    """The loss head's weight gradient, computed in forward for grad_output 1, is scaled by
    backward's grad_output and added into .grad in one step (rounded once), or, unfused,
    scaled and then added by autograd; the compiled kernels within rounding of the product
    (inductor may fuse the multiply-add)."""
    torch.manual_seed(0)
    hidden = torch.randn(TOKENS, IN, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(OUT, IN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, OUT, (TOKENS,))
    (computed,) = torch.autograd.grad(chunked_linear_cross_entropy(hidden, weight, labels, 4), weight)
    weight.grad = torch.randn(OUT, IN, dtype=torch.bfloat16)
    old, grad_output = weight.grad.clone(), torch.tensor(1 / 3)
    loss = chunked_linear_cross_entropy(
        hidden,
        weight,
        labels,
        4,
        fuse_grads=fuse,
        kernels=compiled_loss_kernels() if kernels == "compiled" else LossKernels(),
    )
    loss.backward(grad_output)
    want = old.addcmul(computed, grad_output) if fuse else old + computed * grad_output
    if kernels == "eager":
        assert torch.equal(weight.grad, want)
    else:  # one bf16 rounding step (2**-7 relative) apart at most
        torch.testing.assert_close(weight.grad, want, rtol=2**-7, atol=2**-10)


def _two_steps(
    fuse: bool, plan: Callable[[torch.nn.Module], None] = lambda m: None
) -> tuple[dict[str, torch.Tensor], Counter[str]]:
    """The gradients accumulated over two steps of a 2-layer model, and the ops of the second
    backward."""
    torch.manual_seed(0)
    model = build("llama3_tiny", dtype=torch.float32, num_layers=2, seq_length=16, gradient_accumulation_fusion=fuse)
    plan(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    model(ids[:, :-1], ids[:, 1:]).backward()
    loss = model(ids[:, :-1], ids[:, 1:])
    with _Ops() as ops:
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}, ops.counts


def test_the_model_accumulates_the_same_gradients_fused_or_not() -> None:
    (fused, fused_ops), (plain, plain_ops) = _two_steps(True), _two_steps(False)
    # linear_qkv, linear_proj and linear_fc1 in each layer (the eager linear_fc2 is torch's)
    assert (fused_ops["addmm_"], plain_ops["addmm_"]) == (2 * 3, 0)
    assert (fused_ops["addcmul_"], plain_ops["addcmul_"]) == (1, 0)  # the loss head
    assert fused.keys() == plain.keys()
    for name in fused:
        torch.testing.assert_close(fused[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def _triton_activation(model: torch.nn.Module) -> None:
    """The MLPs' activation through the Triton SwiGLU Function, as compile_regions sets it on CUDA."""
    pytest.importorskip("triton")
    for layer in model.decoder.layers:
        layer.mlp.activation = swiglu.activation


@pytest.mark.parametrize("mlp", ["eager", "triton"])
@pytest.mark.parametrize(
    "config",
    [
        RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp", "layernorm"]),
        RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp_act", "layernorm"]),
        RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ],
)
def test_recompute_accumulates_the_gradients_of_no_recompute_bit_for_bit(config: RecomputeConfig, mlp: str) -> None:
    """The second step adds into .grad inside the GEMMs in the recomputed backward too (whose
    saved weights come back through the engine's hooks), with the gradients of no recompute."""
    kernels = _triton_activation if mlp == "triton" else (lambda model: None)

    def with_plan(model: torch.nn.Module) -> None:
        kernels(model)
        remat.apply(model, config)

    (plain, plain_ops), (recomputed, ops) = _two_steps(True, kernels), _two_steps(True, with_plan)
    assert ops["addmm_"] == plain_ops["addmm_"] == 2 * 3
    for name in plain:
        assert torch.equal(plain[name], recomputed[name]), name


@pytest.mark.filterwarnings("error")
def test_a_weight_that_is_not_a_leaf_is_left_to_autograd_without_a_warning() -> None:
    """A weight computed from a parameter (a cast, say) has no .grad of its own to add into; it is
    not even read (torch warns on reading a non-leaf's .grad)."""
    torch.manual_seed(0)
    hidden = torch.randn(TOKENS, IN, requires_grad=True)
    param = torch.randn(OUT, IN, requires_grad=True)
    x, weight = torch.randn(2, TOKENS // 2, IN), param * 1
    chunked_linear_cross_entropy(hidden, weight, torch.randint(0, OUT, (TOKENS,)), 4, fuse_grads=True).backward()
    linear(x, param * 1, True).sum().backward()
    assert param.grad is not None
