"""torch.compile over a model under a plan: compiled whole or block by block (as torchtitan does),
a Site's recompute or discard lowers to torch's compile-aware checkpoint, so the gradients are
the uncompiled run's, bit for bit under aot_eager (dropout included: its masks are replayed, not
drawn anew); an offloading plan is refused with what to do instead."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.engine import Region
from remat.models import build

LAYERS, BATCH, SEQ = 2, 2, 16

pytestmark = pytest.mark.usefixtures("deterministic")


def _selective(*modules: str) -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="selective", recompute_modules=list(modules))


def _full(method: str, k: int) -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="full", recompute_method=method, recompute_num_layers=k)


def _model(dropout: float = 0.2) -> nn.Module:
    torch.manual_seed(0)
    return build(
        "llama3_tiny",
        dtype=torch.float64,
        num_layers=LAYERS,
        seq_length=SEQ,
        attention_backend="eager",  # core_attn recomputes the scores (SDPA's kernel already does)
        attention_dropout=dropout,
        hidden_dropout=dropout,
    )


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.decoder.layers)  # type: ignore[union-attr, arg-type]


Compile = Callable[[nn.Module], Callable[..., torch.Tensor]]


def _whole(model: nn.Module, backend: str = "aot_eager") -> Callable[..., torch.Tensor]:
    return torch.compile(model, backend=backend)


def _per_layer(model: nn.Module, backend: str = "aot_eager") -> Callable[..., torch.Tensor]:
    for layer in _layers(model):
        layer.compile(backend=backend)
    return model


def _grads(model: nn.Module, plan: RecomputeConfig | Plan | None, compile: Compile | None) -> list[torch.Tensor]:
    """The loss and every parameter's gradient of one step of `model` under `plan`."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(model, plan)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=g)
    step = compile(model) if compile is not None else model
    torch.manual_seed(5)
    loss = step(ids[:, :-1], ids[:, 1:].contiguous())
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]


def _assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


CASES = [
    ("mlp", _selective("mlp"), _whole),
    ("core_attn", _selective("core_attn"), _whole),
    ("layernorm", _selective("layernorm"), _whole),  # discard: consumers keep no copy either
    ("mlp+mlp_act", Plan([{"mlp": "recompute", "mlp_act": "discard"}] * LAYERS), _whole),  # nested
    ("selective_per_layer", _selective("core_attn", "layernorm", "mlp"), _per_layer),
    ("full_uniform1", _full("uniform", 1), _whole),
    ("full_uniform2_per_layer", _full("uniform", 2), _per_layer),
]


@pytest.mark.parametrize(("plan", "compile"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_compiled_model_gets_the_uncompiled_gradients_bit_for_bit(plan, compile) -> None:
    expected = _grads(_model(), plan, None)
    _assert_equal(_grads(_model(), plan, compile), expected)
    _assert_equal(expected, _grads(_model(), None, None))


@pytest.mark.slow
def test_an_adapted_torchtitan_model_compiled_block_by_block_gets_the_uncompiled_gradients() -> None:
    from helpers.adapt import SITE_MAP, _batch
    from helpers.adapt import _model as titan

    def grads(plan: RecomputeConfig | None, compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = remat.adapt(titan(dropout=0.1), SITE_MAP)
        remat.apply(model, plan)
        if compiled:
            for block in model.layers.values():
                block.compile(backend="aot_eager")
        torch.manual_seed(5)
        model(*_batch()).backward()
        return [p.grad for p in model.parameters()]

    expected = grads(None, False)
    for plan in (_selective("core_attn", "layernorm", "mlp"), _full("uniform", 1)):
        _assert_equal(grads(plan, True), expected)


@pytest.mark.slow
def test_an_adapted_hugging_face_model_compiled_whole_gets_the_uncompiled_gradients() -> None:
    from helpers.hf import batch, build

    def grads(plan: RecomputeConfig | None, compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = remat.adapt(build("llama"))
        remat.apply(model, plan)
        step = torch.compile(model, backend="aot_eager") if compiled else model
        ids, labels = batch(model)
        torch.manual_seed(5)
        step(input_ids=ids, labels=labels).loss.backward()
        return [p.grad for p in model.parameters()]

    _assert_equal(grads(_selective("core_attn", "layernorm", "mlp"), True), grads(None, False))


def test_remat_checkpoint_inside_compiled_code_lowers_to_torchs_checkpoint() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.float64)

    def step(x: torch.Tensor) -> torch.Tensor:
        inner = lambda h: torch.nn.functional.dropout(torch.tanh(h @ w), 0.3, True)  # noqa: E731
        return remat.checkpoint(inner, x).square().sum()

    torch.manual_seed(1)
    step(x).backward()
    expected, w.grad = w.grad, None
    torch.manual_seed(1)
    torch.compile(step, backend="aot_eager")(x).backward()
    assert torch.equal(w.grad, expected)


def test_an_offloading_plan_is_refused_under_compile_with_what_to_do() -> None:
    model = _model()
    plan = Plan([{"layer": "offload"}, {"mlp": "recompute"}], min_offloaded_tensor_size=0)
    with pytest.raises(
        RuntimeError, match=r"site 'layer' offloads, which cannot run inside torch.compile.*compile_sites"
    ):
        _grads(model, plan, _whole)


def test_a_region_run_by_hand_inside_compiled_code_is_refused() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return Region().call(torch.sin, (x,), {})

    with pytest.raises(RuntimeError, match="recompute region cannot run inside torch.compile"):
        torch.compile(step, backend="aot_eager")(torch.ones(3, requires_grad=True))


def test_an_action_that_cannot_be_traced_is_refused_naming_its_site() -> None:
    site = remat.Site("mlp")
    site.action = lambda site, fn, args, kwargs: fn(*args, **kwargs)  # no `traced` lowering

    with pytest.raises(RuntimeError, match="site 'mlp': function cannot run inside torch.compile"):
        torch.compile(site, backend="aot_eager")(torch.sin, torch.ones(3, requires_grad=True))


@pytest.mark.slow
def test_inductor_gradients_match_the_uncompiled_ones_within_rounding() -> None:
    for plan in (_selective("core_attn", "layernorm", "mlp"), _full("uniform", 1)):
        expected = _grads(_model(dropout=0.0), plan, None)
        got = _grads(_model(dropout=0.0), plan, lambda m: _whole(m, "inductor"))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
