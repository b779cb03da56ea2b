"""trace()'s exact predictions over random plans (hypothesis): the saved bytes of any plan equal what
the CPU allocator counts (eager attention, and sdpa slow), and an offload plan's peak, saved and
host bytes equal what it measures.

The quick tests of the same code: tests/unit/memory/test_trace.py."""

from __future__ import annotations

from helpers.trace import LABELS, LAYERS, _measured, plans
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat.config.plan import Plan
from remat.sites.apply import offloader_of


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans())
def test_predicted_saved_bytes_equal_the_counted_ones_for_random_plans(backend_trace, plan) -> None:
    model, batch, trace = backend_trace
    assert trace.predict(plan).saved_bytes == _measured(model, batch, plan)


@st.composite
def offload_plans(draw) -> Plan:
    """Plans the offload trace measured: per layer a recompute/discard combination with the rest of
    the layer offloaded or kept, or one site offloaded alone; recompute groups, inputs offloaded or not."""
    plan = draw(plans())
    plan.min_offloaded_tensor_size = 256  # the tiny model's activations are a few thousand elements
    in_group = {i for s, e in plan.full_recompute for i in range(s, e)}
    for i, actions in enumerate(plan.layers[:-1]):  # the last layer's backward follows at once: kept
        if i in in_group:
            continue
        how = draw(st.sampled_from(["as drawn", "layer", "site"]))
        if how == "layer":
            actions["layer"] = "offload"
        elif how == "site":
            plan.layers[i] = {draw(st.sampled_from(LABELS)): "offload"}
    for start, end in plan.full_recompute:
        if end < LAYERS and draw(st.booleans()):
            plan.layers[start] = {"layer": "offload"}
    return plan


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=offload_plans())
def test_offload_plans_predict_peak_saved_and_host_bytes_exactly(offload_traced, measured_peak, plan) -> None:
    model, batch, trace = offload_traced
    prediction = trace.predict(plan)
    assert prediction.peak_bytes == measured_peak(model, batch, plan)
    # on CPU the host buffers come from the same allocator as the device's tensors
    assert prediction.saved_bytes + prediction.host_bytes == _measured(model, batch, plan)
    offloader = offloader_of(model) if plan.offloads() else None
    assert prediction.host_bytes == (offloader.stats().offloaded_bytes if offloader else 0)
