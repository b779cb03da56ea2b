"""trace() in one process: the predicted peak of random plans equal to the measured one, with an
optimizer step too; Megatron configs and the baseline; plans that do not fit the model refused;
offload's predictions and the trace they need; what each site saves against what recomputing it
frees; the cost of combined actions; a traced model left clean; the timeline; timing repeats.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_trace_runs.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.trace import LABELS, LAYERS, _measured, plans
from hypothesis import HealthCheck, given, settings

import remat
from remat.config.plan import Plan
from remat.memory.measure import MAX_TIMING_REPEATS, _summed_times, timing_repeats
from remat.memory.prediction import Effect
from remat.memory.prediction import combo_of as _combo
from remat.memory.prediction import combos as _combos


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans())
def test_predicted_peak_equals_the_measured_peak_for_random_plans(backend_trace, measured_peak, plan) -> None:
    model, batch, trace = backend_trace
    prediction = trace.predict(plan)
    assert prediction.peak_bytes == measured_peak(model, batch, plan)


def test_peak_with_an_optimizer_step_is_predicted_exactly(measured_peak) -> None:
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float64, num_layers=3, seq_length=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    batch = ids[:, :-1], ids[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*batch).backward()
    optimizer.step()  # a run under way: moments, step counts and gradients the trace must give back
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    trace = remat.trace(model, batch, optimizer=optimizer, timing_repeats=1)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # lr held at 0
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert [set(s) for s in states] == [set(optimizer.state[p]) for p in model.parameters()]
    assert all(torch.equal(v, optimizer.state[p][k]) for s, p in zip(states, model.parameters()) for k, v in s.items())
    optimizer.zero_grad(set_to_none=True)  # a steady step starts without gradients (the optimizer dropped them)
    # weights, AdamW's two moments (and step counts), and the gradients backward creates (the optimizer
    # drops them after each step): what the micro-batch does not scale
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    assert trace.fixed_bytes == 2 * weights + state
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert [w.name for w in trace.windows] == [
        "pre",
        "fwd0",
        "fwd1",
        "fwd2",
        "head",
        "bwd2",
        "bwd1",
        "bwd0",
        "tail",
        "optimizer",
    ]
    for plan in (None, Plan([{"mlp": "recompute"}, {"layernorm": "discard"}, {}]), Plan([{}, {}, {}], [(0, 3)])):
        assert trace.predict(plan).peak_bytes == measured_peak(model, batch, plan, optimizer)


def test_megatron_configs_predict_exactly_and_none_is_the_baseline(backend_trace) -> None:
    model, batch, trace = backend_trace
    assert trace.predict(None).saved_bytes == trace.baseline_saved_bytes == _measured(model, batch, None)
    for config in (
        remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]),
        remat.RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            assert trace.predict(config).saved_bytes == _measured(model, batch, config)


def test_predict_rejects_plans_that_do_not_fit_the_model(backend_trace) -> None:
    _, _, trace = backend_trace
    with pytest.raises(remat.ConfigError, match="moe"):
        trace.predict(Plan([{"moe": "recompute"}] + [{}] * (LAYERS - 1)))
    with pytest.raises(remat.ConfigError, match="full_recompute"):
        trace.predict(Plan([{}] * LAYERS, [(2, 9)]))


def test_offload_frees_what_it_moves_to_host(offload_traced) -> None:
    _, _, trace = offload_traced
    everything = trace.layers[0].combos[frozenset({("layer", "offload")})]
    assert everything.freed_bytes == everything.host_bytes > 0  # host buffers are not device memory
    assert {q for _, q in everything.window_bytes} == {0, 1}  # its own windows and the next layer's
    assert trace.layers[0].offloaded_groups[1].host_bytes == trace.layers[0].input_bytes > 0


def test_offload_is_predicted_only_from_a_trace_that_measured_it(backend_trace, offload_traced) -> None:
    _, _, plain = backend_trace
    with pytest.raises(remat.ConfigError, match=r"offload=True \(remat plan --offload\)"):
        plain.predict(Plan([{"layer": "offload"}] + [{}] * (LAYERS - 1)))
    _, _, trace = offload_traced
    with pytest.raises(remat.ConfigError, match="did not measure core_attn=offload, mlp=offload"):
        trace.predict(
            Plan([{"core_attn": "offload", "mlp": "offload"}] + [{}] * (LAYERS - 1), min_offloaded_tensor_size=256)
        )
    with pytest.raises(remat.ConfigError, match="the trace measured 256"):
        trace.predict(Plan([{"core_attn": "offload"}] + [{}] * (LAYERS - 1)))
    last = Plan([{}] * (LAYERS - 1) + [{"mlp": "offload"}], min_offloaded_tensor_size=256)
    with pytest.raises(remat.ConfigError, match=r"layers\[3\]: offloads in the last layer"):
        trace.predict(last)
    with pytest.raises(remat.ConfigError, match="offloads in the last layer"):
        trace.predict(Plan([{}, {"layer": "offload"}, {}, {}], [(1, 4)], min_offloaded_tensor_size=256))
    trace.predict(Plan([{}, {"layer": "offload"}, {}, {}], [(1, 3)], min_offloaded_tensor_size=256))


def test_longer_offloaded_groups_free_their_extra_layers_in_the_next_layers_windows() -> None:
    from remat.memory.prediction import Effect, LayerEffects

    def measured(size: int, freed: int, host: int = 0) -> Effect:
        windows = {(phase, q): -q for q in range(size) for phase in ("fwd", "bwd")}
        windows.update({("fwd", size): -freed // 2, ("bwd", size): 0} if host else {})
        return Effect(freed, windows, 0.0, host)

    effects = LayerEffects(
        {},
        {s: measured(s, 100 * s + 10 * (s - 1)) for s in (1, 2, 3)},
        10,
        0.001,
        {s: measured(s, 100 * s + 10 * (s - 1) + 10, host=10) for s in (1, 2, 3)},
    )
    five = effects.group(5, offload_input=True)
    extra = five.freed_bytes - effects.offloaded_groups[3].freed_bytes
    assert extra == 2 * (100 + 10)
    assert five.window_bytes[("fwd", 5)] == effects.offloaded_groups[3].window_bytes[("fwd", 3)] - extra
    assert five.window_bytes[("bwd", 5)] == -extra
    model = remat.models.build("llama3_tiny", num_layers=2, seq_length=8, device="meta")
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with pytest.raises(remat.ConfigError, match="shapes-only trace"):
        remat.trace(model, (ids, ids), offload=True, flops_per_s=1e12)


def test_trace_of_a_fresh_run_leaves_no_gradients_or_optimizer_state() -> None:
    model = remat.models.build("llama3_tiny", dtype=torch.float64, num_layers=2, seq_length=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    for optimizer in (torch.optim.AdamW(model.parameters(), lr=1e-3), None):  # None: gradients accumulate
        remat.trace(model, (ids[:, :-1], ids[:, 1:]), optimizer=optimizer, timing_repeats=1)
        assert all(p.grad is None for p in model.parameters())
        assert optimizer is None or len(optimizer.state) == 0


def test_trace_leaves_the_model_without_a_plan() -> None:
    model = remat.models.build("llama3_tiny", dtype=torch.float64, num_layers=1, seq_length=8)
    remat.apply(model, remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]))
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    trace = remat.trace(model, (ids[:, :-1], ids[:, 1:]))
    assert all(s.action is None for group in remat.find_sites(model).inner for s in group)
    assert trace.layers[0].input_bytes == 0  # one layer: no multi-layer group to measure it with


def test_timeline_marks_every_window_in_step_order_and_peaks_where_the_trace_does(tmp_path) -> None:
    from remat.bench.plot import timeline_plot
    from remat.memory.timeline import timeline

    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float32, num_layers=3, seq_length=16)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    recorded = timeline(
        model,
        (ids[:, :-1], ids[:, 1:].contiguous()),
        optimizer=optimizer,
        plan=remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]),
    )
    assert [name for _, name in recorded.marks] == [
        "fwd0",
        "fwd1",
        "fwd2",
        "head",
        "bwd2",
        "bwd1",
        "bwd0",
        "tail",
        "optimizer",
    ]
    positions = [i for i, _ in recorded.marks]
    assert positions == sorted(positions) and positions[-1] < len(recorded.allocated)
    assert max(recorded.allocated) == max(recorded.peaks.values())  # sampled after every op: the peak
    assert recorded.reserved is None  # CPU
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # learning rate held at 0
    path = timeline_plot(recorded, tmp_path / "step.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # per window (for compiled regions, which a per-op dispatch mode would run eagerly)
    coarse = timeline(model, (ids[:, :-1], ids[:, 1:].contiguous()), optimizer=optimizer, plan=None, per_op=False)
    assert [name for _, name in coarse.marks] == [name for _, name in recorded.marks]
    assert len(coarse.allocated) == 2 * (len(coarse.marks) + 1)  # each window's peak, each start
    assert max(coarse.allocated) == max(coarse.peaks.values())


def test_a_combination_costs_the_sum_of_its_actions_timed_alone() -> None:
    """Whatever a combination's own timing would have said: its actions add separate work."""
    mlp, ln, attn = ("mlp", "recompute"), ("layernorm", "discard"), ("core_attn", "recompute")
    measured = {
        frozenset(): Effect(0, {}),
        frozenset({mlp}): Effect(8, {}, 0.036),
        frozenset({ln}): Effect(2, {}, 0.001),
        frozenset({attn}): Effect(1, {}, 0.004),
        frozenset({ln, mlp}): Effect(10, {}),
        frozenset({attn, ln, mlp}): Effect(11, {}),
    }
    summed = _summed_times(measured)
    assert {combo: e.added_time_s for combo, e in summed.items()} == {
        frozenset(): 0.0,
        frozenset({mlp}): 0.036,
        frozenset({ln}): 0.001,
        frozenset({attn}): 0.004,
        frozenset({ln, mlp}): 0.036 + 0.001,
        frozenset({attn, ln, mlp}): 0.036 + 0.001 + 0.004,
    }
    assert [e.freed_bytes for e in summed.values()] == [e.freed_bytes for e in measured.values()]


def test_an_action_inside_a_recomputed_enclosing_site_is_dropped() -> None:
    """mlp recompute replays the activation plainly: mlp_act's action there does nothing, so a
    Llama layer has 2 x 3 x 3 distinct combinations (mlp_act is discard-only), not 2 x 3 x 2 x 2."""
    assert _combo({"mlp": "recompute", "mlp_act": "discard", "layernorm": "keep"}) == {("mlp", "recompute")}
    assert _combo({"mlp": "keep", "mlp_act": "discard"}) == {("mlp_act", "discard")}
    combos = _combos(frozenset({*LABELS, "mlp_act"}))
    assert len(combos) == len(set(combos)) == 18
    assert not any(("mlp_act", "recompute") in c or {("mlp", "recompute"), ("mlp_act", "discard")} <= c for c in combos)


def _freed_alone_from_what_sites_save(trace, layer: int, label: str) -> int:
    """The independent count (saved-tensor hooks, not the meter): a recompute keeps the site's
    inputs and what other sites save, and frees the rest of what it saved."""
    s = trace.storages[(layer, label)]
    return s.saved_bytes - s.input_bytes - s.shared_bytes


def test_what_each_site_saves_accounts_for_what_recomputing_it_frees(backend_trace) -> None:
    _, _, trace = backend_trace
    for i in range(LAYERS):
        for label in LABELS:
            freed = trace.layers[i].combos[frozenset({(label, "recompute")})].freed_bytes
            assert freed == _freed_alone_from_what_sites_save(trace, i, label) > 0
    assert trace.storages[(None, "loss head")].saved_bytes > 0
    # discarding the activation frees what recomputing it would, and the output linear_fc2 saves
    model, (ids, _), _ = backend_trace
    activation = ids.numel() * model.config.ffn_hidden_size * 8  # [tokens, ffn] in float64
    for i in range(LAYERS):
        freed = trace.layers[i].combos[frozenset({("mlp_act", "discard")})].freed_bytes
        assert freed == _freed_alone_from_what_sites_save(trace, i, "mlp_act") + activation


def test_a_site_whose_saved_output_another_site_saves_too_frees_almost_nothing() -> None:
    """SDPA without dropout: core_attn saves q, k, v (its inputs), the output (which linear_proj,
    outside the sites, saves too) and the logsumexp: recomputing it frees the logsumexp only."""
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float64, num_layers=2, seq_length=16)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        trace = remat.trace(model, (ids[:, :-1], ids[:, 1:]), timing_repeats=1)
    config, float64 = model.config, 8
    core = trace.storages[(1, "core_attn")]
    assert core.shared_with == {(1, "layer")}
    assert core.shared_bytes == 2 * 16 * config.hidden_size * float64  # the attention output
    lse = 2 * config.num_attention_heads * 16 * float64  # one per head and token, in the model's dtype on CPU
    assert trace.layers[1].combos[frozenset({("core_attn", "recompute")})].freed_bytes == lse
    assert _freed_alone_from_what_sites_save(trace, 1, "core_attn") == lse


@pytest.mark.parametrize(
    "step_s, repeats",
    [(0.42, 3), (1.5, 3), (0.2, 5), (0.05, 20), (0.001, MAX_TIMING_REPEATS), (0.0, MAX_TIMING_REPEATS)],
)
def test_short_gpu_steps_are_timed_more_often_up_to_a_cap(step_s, repeats) -> None:
    assert timing_repeats(3, step_s) == repeats
    assert timing_repeats(30, step_s) == 30  # never fewer than asked
