"""The planner's exact solver against brute force, and what it says when nothing fits."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.memory.windows import Choice, PlanningProblem, Window
from remat.planner import solver as planner
from remat.planner.solver import NoPlanFits, _milp, solve

MiB = 2**20


def _windows(layers: int, base: list[int]) -> list[Window]:
    """The windows of a step: each layer's forward, the loss head, each layer's backward."""
    names = (
        [(f"fwd{i}", i, i) for i in range(layers)]
        + [("head", None, layers)]
        + [(f"bwd{i}", i, i) for i in reversed(range(layers))]
    )
    return [Window(name, layer, holds, b * MiB) for (name, layer, holds), b in zip(names, base)]


def _own(start: int, end: int, draw, low: int, high: int) -> dict[str, int]:
    return {f"{phase}{i}": draw(st.integers(low, high)) * MiB for i in range(start, end) for phase in ("fwd", "bwd")}


def _covers(problem: PlanningProblem) -> list[tuple[Choice, ...]]:
    """Every way to cover the layers exactly once (brute force)."""
    by_start: dict[int, list[Choice]] = {}
    for c in problem.choices:
        by_start.setdefault(c.start, []).append(c)

    def extend(layer: int) -> list[tuple[Choice, ...]]:
        if layer == problem.num_layers:
            return [()]
        return [(c, *rest) for c in by_start.get(layer, []) for rest in extend(c.end)]

    return extend(0)


@st.composite
def problems(draw) -> PlanningProblem:
    layers = draw(st.integers(1, 4))
    choices = []
    for i in range(layers):
        choices.append(Choice(i, i + 1, {}, 0, 0.0))  # keep: always possible
        for k in range(draw(st.integers(0, 3))):
            choices.append(
                Choice(
                    i,
                    i + 1,
                    {"mlp": "recompute", "k": str(k)},
                    draw(st.integers(1, 64)) * MiB,
                    draw(st.floats(0.001, 0.05)),
                    _own(i, i + 1, draw, -64, 8),
                )
            )
        if draw(st.booleans()):  # offload: reaches the next layer's windows, uses host memory
            choices.append(
                Choice(
                    i,
                    i + 1,
                    {"layer": "offload"},
                    draw(st.integers(1, 64)) * MiB,
                    draw(st.floats(0.0, 0.01)),
                    _own(i, min(i + 2, layers), draw, -64, 8),
                    host_bytes=draw(st.integers(1, 64)) * MiB,
                )
            )
    for start, end in itertools.combinations(range(layers + 1), 2):
        if draw(st.booleans()):
            choices.append(
                Choice(
                    start,
                    end,
                    None,
                    draw(st.integers(1, 128)) * (end - start) * MiB,
                    draw(st.floats(0.01, 0.1)) * (end - start),
                    _own(start, end, draw, -128, 32),
                )
            )
    base = draw(st.lists(st.integers(100, 700), min_size=2 * layers + 1, max_size=2 * layers + 1))
    # a pipeline rank: other micro-batches in flight (1F1B; interleaved counts chunks, so halves too)
    others = draw(st.sampled_from([0.0, 0.0, 1.0, 2.5]))
    held = draw(st.integers(0, 200)) * MiB if others else 0
    return PlanningProblem(layers, choices, _windows(layers, base), held_bytes=held, others_in_flight=others)


def test_a_choice_changes_its_own_windows_and_the_windows_that_hold_it() -> None:
    windows = {w.name: w for w in _windows(3, [0] * 7)}
    choice = Choice(1, 2, {"mlp": "recompute"}, 10, 0.0, {"fwd1": -4, "bwd1": 3})
    assert [choice.delta(windows[n]) for n in ("fwd0", "fwd1", "fwd2", "head", "bwd2", "bwd1", "bwd0")] == [
        0,
        -4,
        -10,
        -10,
        -10,
        3,
        0,
    ]


def test_a_choice_measured_in_a_later_layers_window_uses_the_measurement_there() -> None:
    windows = {w.name: w for w in _windows(3, [0] * 7)}
    # offload of layer 0: copies out still run in fwd1, copies back are in place for bwd1
    choice = Choice(0, 1, {"layer": "offload"}, 10, 0.0, {"fwd0": 0, "bwd0": 2, "fwd1": -6, "bwd1": 0})
    assert [choice.delta(windows[n]) for n in ("fwd0", "fwd1", "fwd2", "head", "bwd2", "bwd1", "bwd0")] == [
        0,
        -6,
        -10,
        -10,
        -10,
        0,
        2,
    ]


@settings(max_examples=60, deadline=None)
@given(problem=problems(), budget_mib=st.integers(50, 800), host_mib=st.one_of(st.none(), st.integers(0, 128)))
def test_solver_finds_the_brute_force_optimum(problem: PlanningProblem, budget_mib: int, host_mib: int | None) -> None:
    budget, host = budget_mib * MiB, None if host_mib is None else host_mib * MiB

    in_flight = 1 + problem.others_in_flight  # each micro-batch in flight holds what it offloaded

    def host_ok(cover: tuple[Choice, ...]) -> bool:
        return host is None or in_flight * sum(c.host_bytes for c in cover) <= host

    covers = [c for c in _covers(problem) if host_ok(c)]
    feasible = [c for c in covers if problem.peak(c) <= budget]
    if not feasible:
        with pytest.raises(NoPlanFits) as info:
            solve(problem, budget, host)
        assert info.value.lowest.peak_bytes == min(problem.peak(c) for c in covers)
        assert info.value.lowest.peak_bytes > budget
        return
    best = min(sum(x.added_time_s for x in c) for c in feasible)
    solution = solve(problem, budget, host)
    assert solution.peak_bytes <= budget
    assert host is None or in_flight * solution.host_bytes <= host
    assert solution.added_time_s == pytest.approx(best, abs=1e-9)
    assert solution.peak_bytes == problem.peak(solution.choices)


def test_other_micro_batches_in_flight_hold_every_choices_savings_in_every_window() -> None:
    windows = _windows(2, [100, 100, 300, 100, 100])  # fwd0 fwd1 head bwd1 bwd0
    keep, recompute = Choice(0, 1, {}, 0, 0.0), Choice(0, 1, {"mlp": "recompute"}, 10 * MiB, 0.01, {"fwd0": 0})
    others = [Choice(1, 2, {}, 0, 0.0)]
    alone = PlanningProblem(2, [keep, recompute, *others], windows)
    piped = PlanningProblem(2, [keep, recompute, *others], windows, held_bytes=50 * MiB, others_in_flight=2.0)
    assert alone.peak([keep, *others]) == 300 * MiB and alone.peak([recompute, *others]) == 290 * MiB
    assert piped.peak([keep, *others]) == 350 * MiB
    assert piped.peak([recompute, *others]) == 350 * MiB - 3 * 10 * MiB  # its own micro-batch and two more
    # fwd0, the layer's own window, holds only the other micro-batches' savings
    assert piped.delta(recompute, windows[0]) == -20 * MiB


def test_plan_of_the_solution_matches_its_choices() -> None:
    windows = _windows(3, [100, 200, 300, 600, 550, 250, 200])
    choices = [
        Choice(0, 2, None, 300 * MiB, 0.2, {"bwd1": 10 * MiB}),
        Choice(2, 3, {"mlp": "recompute"}, 50 * MiB, 0.05),
        *(Choice(i, i + 1, {}, 0, 0.0) for i in range(3)),
    ]
    problem = PlanningProblem(3, choices, windows)
    solution = solve(problem, 280 * MiB)
    assert solution.plan.full_recompute == [(0, 2)] and solution.plan.layers[2] == {"mlp": "recompute"}
    assert (solution.peak_bytes, solution.peak_window) == (260 * MiB, "bwd1")
    roomy = solve(problem, 10**12)
    assert roomy.plan.full_recompute == [] and roomy.peak_bytes == 600 * MiB  # recomputes nothing


def test_no_plan_fits_says_by_how_much_and_what_to_change() -> None:
    choices = [Choice(i, i + 1, {}, 0, 0.0) for i in range(2)] + [Choice(0, 2, None, 100 * MiB, 0.1)]
    windows = _windows(2, [900, 1000, 1432, 1200, 900])
    with pytest.raises(NoPlanFits, match=r"1\.30 GiB.*0\.30 GiB more, in window head.*micro-batch"):
        solve(PlanningProblem(2, choices, windows), 1024 * MiB)
    # with what the micro-batch does not scale known: 1332 MiB = 800 fixed + 532 that scale with the micro-batch,
    # which must come down to 224 MiB: 0.42x
    with pytest.raises(
        NoPlanFits,
        match=r"0\.78 GiB is weights, gradients and optimizer state and 0\.52 GiB is activations .* "
        r"0\.42x of them or fewer would fit",
    ):
        solve(PlanningProblem(2, choices, windows, fixed_bytes=800 * MiB), 1024 * MiB)
    with pytest.raises(NoPlanFits, match=r"optimizer state take 1\.07 GiB alone: no recompute plan helps"):
        solve(PlanningProblem(2, choices, windows, fixed_bytes=1100 * MiB), 1024 * MiB)


def test_equal_times_go_to_the_plan_with_fewer_actions() -> None:
    """Times measured as zero (a tiny model): one action that fits beats three that free a little
    more, and a site action beats recomputing the layer whole."""
    one = Choice(0, 1, {"mlp": "recompute"}, 10 * MiB, 0.0)
    three = Choice(0, 1, {"mlp": "recompute", "core_attn": "recompute", "layernorm": "discard"}, 11 * MiB, 0.0)
    whole = Choice(0, 1, None, 12 * MiB, 0.0)
    problem = PlanningProblem(1, [Choice(0, 1, {}, 0, 0.0), three, whole, one], _windows(1, [50, 100, 60]))
    assert solve(problem, 95 * MiB).choices == (one,)


# One Llama-3-8B layer at sequence 4096 as `remat estimate` traces it on meta (bytes, seconds at
# 600 TFLOP/s): what each site combination frees, adds and costs, and a recompute group's
# cost. Identical layers and times computed from FLOPs make ties a MILP proves slowly: HiGHS
# took over a minute at some budgets for 128 of them.
_COMBOS_8B = [  # (actions, freed, seconds, own forward window, own backward window)
    ({}, 0, 0.0, 0, 0),
    ({"mlp": "recompute"}, 469762048, 0.0016034544571733329, -67108864, 0),
    ({"layernorm": "recompute"}, 32768, 0.0, -32768, -32768),
    ({"mlp": "recompute", "layernorm": "recompute"}, 469794816, 0.0016034544571733329, -67141632, -32768),
    ({"layernorm": "discard"}, 67141632, 0.0, -32768, -67141632),
    ({"mlp": "recompute", "layernorm": "discard"}, 536903680, 0.0016034544571733329, -67141632, -33570816),
    ({"core_attn": "recompute"}, 524304, 0.00045812984490666703, -524304, -524304),
    ({"mlp": "recompute", "core_attn": "recompute"}, 470286352, 0.00206158430208, -67633168, -524304),
    ({"layernorm": "recompute", "core_attn": "recompute"}, 557072, 0.00045812984490666703, -557072, -557072),
    (
        {"mlp": "recompute", "core_attn": "recompute", "layernorm": "recompute"},
        470319120,
        0.00206158430208,
        -67665936,
        -557072,
    ),
    ({"core_attn": "recompute", "layernorm": "discard"}, 67665936, 0.00045812984490666703, -557072, -67665936),
    (
        {"mlp": "recompute", "core_attn": "recompute", "layernorm": "discard"},
        537427984,
        0.00206158430208,
        -67665936,
        -34095120,
    ),
]


_LAYER_8B, _GROUP_FIRST_8B, _GROUP_SECONDS_8B = 688422928, 185106448, 0.0026342466082133337


def _traced_8b(layers: int = 128, max_group: int = 16) -> PlanningProblem:
    choices = []
    for i in range(layers):
        choices += [
            Choice(i, i + 1, actions, freed, seconds, {f"fwd{i}": fwd, f"bwd{i}": bwd})
            for actions, freed, seconds, fwd, bwd in _COMBOS_8B
        ]
        for size in range(1, min(max_group, layers - i) + 1):  # the group keeps only its input
            own = {f"fwd{i + j}": -_GROUP_FIRST_8B - j * _LAYER_8B + (j > 0) * 33554432 for j in range(size)}
            choices.append(
                Choice(
                    i,
                    i + size,
                    None,
                    size * _LAYER_8B - 33554432,
                    size * _GROUP_SECONDS_8B,
                    {**own, **{f"bwd{i + j}": 0 for j in range(size)}},
                )
            )
    names = (
        [("pre", None, 0, 115909607424)]
        + [(f"fwd{i}", i, i, 116631584784 + i * _LAYER_8B) for i in range(layers)]
        + [("head", None, layers, 120179511312 + layers * _LAYER_8B)]
        + [(f"bwd{i}", i, i, 116832911384 + i * _LAYER_8B) for i in reversed(range(layers))]
        + [("tail", None, 0, 116960280584), ("optimizer", None, 0, 115876052992)]
    )
    return PlanningProblem(layers, choices, [Window(*w) for w in names])


def test_128_traced_layers_solve_in_seconds() -> None:
    problem = _traced_8b()
    highest = problem.peak([c for c in problem.choices if c.actions == {}])
    with pytest.raises(NoPlanFits) as info:
        start = time.perf_counter()
        solve(problem, 1)
    assert time.perf_counter() - start < 20
    lowest = info.value.lowest.peak_bytes
    for fraction in (0.0, 0.05, 0.3, 0.6, 0.9):
        budget = int(lowest + fraction * (highest - lowest))
        start = time.perf_counter()
        solution = solve(problem, budget)
        assert time.perf_counter() - start < 20
        assert solution.peak_bytes == problem.peak(solution.choices) <= budget


def test_a_choice_measured_beyond_the_next_layer_is_solved_by_the_milp(monkeypatch) -> None:
    """The dynamic program assumes choices reach their own and the next layer's windows only;
    anything else goes to the mixed-integer program, with the same answer as brute force. Here
    offloading layer 0 frees 50 MiB at the head but its copies back raise bwd2, which the head
    barely tops, by 40 MiB: a solver that took bwd2 for a window merely holding the layer would
    pick it (the cheapest action) and overshoot every budget."""
    windows = _windows(3, [300, 320, 340, 500, 480, 330, 310])
    far = Choice(0, 1, {"layer": "offload"}, 50 * MiB, 0.001, {"fwd0": 0, "bwd0": 0, "bwd2": 40 * MiB})
    choices = [
        far,
        *(Choice(i, i + 1, {}, 0, 0.0) for i in range(3)),
        *(Choice(i, i + 1, {"mlp": "recompute"}, 30 * MiB, 0.01 * (1 + i)) for i in range(3)),
    ]
    problem = PlanningProblem(3, choices, windows)
    milp_calls = []
    monkeypatch.setattr(planner, "_milp", lambda *a, **k: milp_calls.append(a) or _milp(*a, **k))
    for budget, recomputed in ((470 * MiB, [0]), (455 * MiB, [0, 1]), (440 * MiB, [0, 1])):
        best = min(
            (c for c in _covers(problem) if problem.peak(c) <= budget), key=lambda c: sum(x.added_time_s for x in c)
        )
        solution = solve(problem, budget)
        assert solution.added_time_s == pytest.approx(sum(x.added_time_s for x in best))
        assert solution.peak_bytes == problem.peak(solution.choices) <= budget
        assert [c.start for c in solution.choices if c.actions] == recomputed
    assert milp_calls
