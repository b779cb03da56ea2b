"""Offload on CPU in one process (host copies are plain copies, same logic as CUDA): every layer
offloaded moving exactly the bytes it frees, the size threshold (bit-identical) and its warning,
host buffers reused across steps and given back when a graph is freed, retain_graph, views, dedup
and in-place changes after save, when an offloaded group loads and is prefetched, Megatron's offload
configs lowered to per-layer plans, plan round trips.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_offload_runs.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.offload import ALL_LAYERS, FULL1, LAYERS, PLANS, SEQ, _batch, _config, _model, _verify
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat.config.plan import Plan
from remat.engine import Offloader, offloading
from remat.engine.offload import _HostCopy
from remat.run.verify import verify
from remat.sites.apply import find_sites, offloader_of

pytestmark = pytest.mark.usefixtures("deterministic")


@pytest.mark.parametrize(("threshold", "warns"), [(2**20, True), (0, False)])
def test_a_plan_whose_tensors_all_stay_under_the_threshold_says_so(threshold: int, warns: bool) -> None:
    model = _model()
    plan = Plan([{"layer": "offload"}, {}, {}, {}], min_offloaded_tensor_size=threshold)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", remat.RematWarning)
        verify(model, plan, *_batch(model))
    said = [str(w.message) for w in caught if "nothing moved to host" in str(w.message)]
    assert (offloader_of(model).stats().offloaded_bytes == 0) == warns
    assert said == (
        [
            f"min_offloaded_tensor_size: the plan offloads, but no saved tensor had {threshold} elements or"
            " more, so nothing moved to host; lower it (--min_offloaded_tensor_size) to offload this model's"
            " tensors"
        ]
        if warns
        else []
    )


def test_offloading_every_layer_moves_exactly_the_bytes_it_frees() -> None:
    # Everything a layer saves is created by the layers or the model (cos/sin, the embedding
    # output) and held by nothing else, so each offloaded storage is freed on the device.
    model = _model()
    report = _verify(model, ALL_LAYERS)
    stats = offloader_of(model).stats()
    assert report.freed_bytes == stats.offloaded_bytes == stats.peak_host_bytes


def test_threshold_keeps_small_tensors_on_the_device() -> None:
    model = _model()
    everything = _verify(model, ALL_LAYERS)
    moved_all = offloader_of(model).stats().offloaded_bytes
    report = _verify(model, Plan(ALL_LAYERS.layers, min_offloaded_tensor_size=SEQ * model.config.hidden_size))
    moved_large = offloader_of(model).stats().offloaded_bytes
    assert report.bit_identical
    assert 0 < moved_large < moved_all
    assert report.freed_bytes == moved_large < everything.freed_bytes
    report = _verify(model, Plan(ALL_LAYERS.layers, min_offloaded_tensor_size=10**9))
    assert offloader_of(model).stats().offloaded_bytes == 0 and report.freed_bytes == 0


def test_second_step_allocates_no_host_buffers() -> None:
    model = _model()
    remat.apply(model, ALL_LAYERS)
    offloader = offloader_of(model)
    ids, labels = _batch(model)
    model(ids, labels).backward()
    first = offloader.stats()
    for _ in range(2):
        loss = model(ids, labels)
        assert offloader.stats().host_bytes == first.peak_host_bytes  # all held between forward and backward
        loss.backward()
    after = offloader.stats()
    assert first.allocations > 0 and first.pool_bytes == first.peak_host_bytes
    assert (after.allocations, after.pool_bytes, after.host_bytes) == (first.allocations, first.pool_bytes, 0)


def test_graph_freed_without_backward_returns_buffers() -> None:
    model = _model()
    remat.apply(model, ALL_LAYERS)
    offloader = offloader_of(model)
    loss = model(*_batch(model))
    assert offloader.stats().host_bytes > 0
    del loss
    assert offloader.stats().host_bytes == 0


def test_retain_graph_backward_twice() -> None:
    """Offloaded tensors unpack again for a second backward: both give no offload's gradients (the
    second adds into the first, in the weight-gradient GEMMs)."""

    def twice(offload: bool) -> dict[str, torch.Tensor]:
        model = _model(dropout=0.0)
        if offload:
            remat.apply(model, ALL_LAYERS)
        loss = model(*_batch(model))
        loss.backward(retain_graph=True)
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, offloaded = twice(False), twice(True)
    assert all(torch.equal(offloaded[n], plain[n]) for n in plain)


class _SaveAll(torch.autograd.Function):
    """Saves the given tensors; its backward hands what it unpacked to `seen`."""

    @staticmethod
    def forward(ctx, x, seen, *tensors):
        ctx.seen = seen
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors  # each access unpacks again
        ctx.seen.extend(saved)
        return (grad, None, *[None] * len(saved))


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32]


VIEWS = ["whole", "transpose", "slice", "strided", "twice", "narrow_twice"]


def _views(base: torch.Tensor, kind: str) -> list[torch.Tensor]:
    if kind == "whole":
        return [base]
    if kind == "transpose":
        return [base.t()]
    if kind == "slice":
        return [base[1:]]
    if kind == "strided":
        return [base[:, ::2]]
    if kind == "twice":
        return [base, base]
    return [base[:1], base[1:].t()]  # two views of one storage


@st.composite
def _saved_sets(draw):
    bases = []
    for _ in range(draw(st.integers(1, 6))):
        shape = (draw(st.integers(2, 9)), draw(st.integers(2, 9)))
        dtype = draw(st.sampled_from(DTYPES))
        bases.append((torch.randn(shape).mul(100).to(dtype), draw(st.sampled_from(VIEWS))))
    return bases, draw(st.integers(0, 60)), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(case=_saved_sets())
def test_views_dedup_thresholds_and_bytes(case) -> None:
    bases, min_numel, with_parameter = case
    offloader = Offloader(min_numel, device_type="cpu")
    weight = nn.Parameter(torch.randn(8, 8))
    for step in range(2):  # the second step reuses every host buffer
        allocations = offloader.stats().allocations
        x = torch.randn(3, requires_grad=True)
        saved = [v for base, kind in bases for v in _views(base, kind)] + ([weight.t()] if with_parameter else [])
        expected = [(v.clone(), v.size(), v.stride(), v.storage_offset()) for v in saved]
        large = {
            v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
            for v, _ in bases
            if v.untyped_storage().nbytes() >= min_numel * v.element_size()
        }
        seen: list[torch.Tensor] = []
        with offloading(offloader, key=0):
            y = _SaveAll.apply(x, seen, *saved)
        stats = offloader.stats()
        assert stats.host_bytes == sum(large.values())  # each storage once, parameters never
        if step == 1:
            assert stats.allocations == allocations
        y.sum().backward()
        for got, (value, size, stride, offset) in zip(seen, expected):
            assert torch.equal(got, value)
            assert (got.size(), got.stride(), got.storage_offset()) == (size, stride, offset)
        by_storage: dict[int, int] = {}
        for original, got in zip(saved, seen):  # views of one offloaded storage come back sharing one
            key = original.untyped_storage().data_ptr()
            if key in large:
                assert by_storage.setdefault(key, got.untyped_storage().data_ptr()) == got.untyped_storage().data_ptr()
            else:
                assert got.untyped_storage().data_ptr() == key  # kept: the very same storage
        del y, seen
        assert offloader.stats().host_bytes == 0


def test_in_place_change_after_save_gets_a_fresh_copy() -> None:
    offloader = Offloader(0, device_type="cpu")
    base, seen = torch.randn(4, 4), []
    x = torch.randn(3, requires_grad=True)
    with offloading(offloader, key=0):
        y = _SaveAll.apply(x, seen, base)
        first = base.clone()
        base.add_(1)  # a new version: the second save must not reuse the first copy
        y = _SaveAll.apply(y, seen, base)
    assert offloader.stats().offloaded_bytes == 2 * base.untyped_storage().nbytes()
    y.sum().backward()
    assert torch.equal(seen[0], base) and torch.equal(seen[1], first)  # backward runs last-saved first


class _Marked(torch.autograd.Function):
    """Identity whose backward logs ("next", key): the backward of the layer after group `key`."""

    @staticmethod
    def forward(ctx, x, events, key):
        ctx.events, ctx.key = events, key
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append(("next", ctx.key))
        return grad, None, None


def test_a_group_loads_when_backward_reaches_the_layer_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, int]] = []
    load, take = _HostCopy.load, _HostCopy.take

    def logged_load(self):
        if self.loaded is None:
            events.append(("load", self.group.key))
        load(self)

    def logged_take(self):
        events.append(("use", self.group.key))
        return take(self)

    monkeypatch.setattr(_HostCopy, "load", logged_load)
    monkeypatch.setattr(_HostCopy, "take", logged_take)
    offloader, seen = Offloader(0, device_type="cpu"), []
    y = torch.randn(3, requires_grad=True)
    for key in range(3):
        with offloading(offloader, key):
            y = _SaveAll.apply(y, seen, torch.randn(5, 5), torch.randn(6))
        y = _Marked.apply(y, events, key)  # the layer after, which offloads nothing
        offloader.prefetch_on_grad(y, key)
    with offloading(offloader, 3):  # a group nobody prefetches loads at its first unpack
        y = _SaveAll.apply(y, seen, torch.randn(4))
    y.sum().backward()
    expected = [("load", 3), ("use", 3)]
    for key in (2, 1, 0):
        expected += [("load", key)] * 2 + [("next", key)] + [("use", key)] * 2
    assert events == expected


def test_the_layers_after_an_offload_group_prefetch_it_and_then_wait_for_its_copies(monkeypatch) -> None:
    events: list[tuple[str, int]] = []
    prefetch = Offloader.prefetch_on_grad
    monkeypatch.setattr(Offloader, "await_copies", lambda self, key: events.append(("wait", key)))
    monkeypatch.setattr(
        Offloader, "prefetch_on_grad", lambda self, t, key: (events.append(("prefetch", key)), prefetch(self, t, key))
    )
    model = _model()
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: events.append(("layer", i)))
    remat.apply(model, Plan([{"layer": "offload"}, {"mlp": "offload"}, {}, {}], min_offloaded_tensor_size=0))
    model(*_batch(model)).backward()
    assert events == [
        ("layer", 0),
        ("layer", 1),
        ("prefetch", 0),
        ("layer", 2),
        ("wait", 0),
        ("prefetch", 1),
        ("layer", 3),
        ("wait", 1),
    ]


def test_megatron_offload_configs_lower_to_per_layer_offload() -> None:
    model_sites = find_sites(_model()).model_sites
    plan = Plan.from_config(_config(cpu_offloading=True, cpu_offloading_num_layers=2), model_sites)
    assert [a.get("layer") for a in plan.layers] == ["offload", "offload", None, None]
    plan = Plan.from_config(
        _config(**{**FULL1, "recompute_num_layers": 2}, cpu_offloading=True, cpu_offloading_num_layers=3), model_sites
    )
    assert [a.get("layer") for a in plan.layers] == ["offload", None, "offload", None]
    assert "full recompute, groups of 2, inputs offloaded" in plan.describe()
    plan = Plan.from_config(
        _config(fine_grained_activation_offloading=True, offload_modules=["core_attn"]), model_sites
    )
    assert plan.layers == [{"core_attn": "offload"}] * (LAYERS - 1) + [{}]  # the last layer's backward comes at once


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_offload_plan_round_trips(tmp_path, suffix: str) -> None:
    plan = PLANS["mixed_plan"]
    plan.save(tmp_path / f"plan{suffix}")
    assert Plan.load(tmp_path / f"plan{suffix}") == plan
    assert "min_offloaded_tensor_size" not in Plan.none(2).to_dict()
    with pytest.raises(remat.ConfigError, match="min_offloaded_tensor_size"):
        Plan.from_dict({**plan.to_dict(), "min_offloaded_tensor_size": -1})
