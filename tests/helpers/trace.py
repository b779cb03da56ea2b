"""Shared by the unit and integration tests of trace."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from hypothesis import strategies as st
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import remat
from remat.config.plan import Plan

LAYERS = 4


LABELS = ("core_attn", "layernorm", "mlp")


OPTIONS = {
    "core_attn": ["keep", "recompute"],
    "layernorm": ["keep", "recompute", "discard"],
    "mlp": ["keep", "recompute"],
    "mlp_act": ["keep", "discard"],
}


@pytest.fixture(scope="module", params=[pytest.param("sdpa", marks=pytest.mark.slow), "eager"])
def backend_trace(request):
    torch.manual_seed(0)
    model = remat.models.build(
        "llama3_tiny",
        dtype=torch.float64,
        num_layers=LAYERS,
        seq_length=16,
        attention_backend=request.param,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = ids[:, :-1], ids[:, 1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        return model, batch, remat.trace(model, batch, timing_repeats=1)


def _events(nodes):
    for node in nodes:
        yield node
        yield from _events(node.children)


def _held_by_ops(fn) -> tuple[object, int]:
    """Bytes that ops allocated during `fn()` and still hold when it returns, from the CPU
    allocator's own events (torch.profiler), not remat's meter. Allocations outside ops are left
    out: Python numbers wrapped as 0-dim tensors (MulBackward saves the 0.125 of `x * 0.125`) and
    the engine's CPU RNG state per recomputed region, which beside an accelerator stay on the host."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        gc.collect()
    held: dict[int, int] = {}
    events = prof.profiler.kineto_results.experimental_event_tree()
    for event in sorted(_events(events), key=lambda e: e.start_time_ns):
        if event.tag == _EventType.Allocation:
            ptr, size = event.extra_fields.ptr, event.extra_fields.alloc_size
            if size > 0:
                held[ptr] = size if event.parent is not None else 0
            else:
                held.pop(ptr, None)
    return result, sum(held.values())


def _measured(model, batch, plan) -> int:
    """The independent count: what the forward of `plan` leaves allocated, by the allocator."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(model, plan)
    for p in model.parameters():
        p.grad = None
    loss, held = _held_by_ops(lambda: model(*batch))
    loss.backward()  # the step's gradients, which other measurements count as held
    return held


@st.composite
def plans(draw) -> Plan:
    layers = [
        {label: draw(st.sampled_from(OPTIONS[label])) for label in draw(st.sets(st.sampled_from(list(OPTIONS))))}
        for _ in range(LAYERS)
    ]
    groups, i = [], 0
    while i < LAYERS:
        if draw(st.booleans()):
            end = draw(st.integers(i + 1, LAYERS))
            groups.append((i, end))
            for j in range(i, end):
                layers[j] = {}
            i = end
        else:
            i += 1
    return Plan(layers, groups)


@pytest.fixture(scope="module")
def offload_traced():
    torch.manual_seed(0)
    model = remat.models.build(
        "llama3_tiny",
        dtype=torch.float64,
        num_layers=LAYERS,
        seq_length=16,
        attention_backend="eager",
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = ids[:, :-1], ids[:, 1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        return model, batch, remat.trace(model, batch, timing_repeats=1, offload=True, min_offloaded_tensor_size=256)
