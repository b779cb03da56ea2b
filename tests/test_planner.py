"""The planner's exact solver against brute force, and what it says when nothing fits."""
from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.planner import Choice, NoPlanFits, PlanningProblem, solve

MiB = 2**20


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
            choices.append(Choice(i, i + 1, {"mlp": "recompute", "k": str(k)},
                                  draw(st.integers(1, 64)) * MiB, draw(st.floats(0.001, 0.05)),
                                  draw(st.integers(0, 8)) * MiB))
    for start, end in itertools.combinations(range(layers + 1), 2):
        if draw(st.booleans()):
            choices.append(Choice(start, end, None, draw(st.integers(1, 128)) * (end - start) * MiB,
                                  draw(st.floats(0.01, 0.1)) * (end - start),
                                  draw(st.integers(1, 32)) * (end - start) * MiB))
    return PlanningProblem(layers, choices, baseline_saved_bytes=512 * MiB, fixed_bytes=100 * MiB)


@settings(max_examples=60, deadline=None)
@given(problem=problems(), budget_mib=st.integers(200, 700))
def test_solver_finds_the_brute_force_optimum(problem: PlanningProblem, budget_mib: int) -> None:
    budget = budget_mib * MiB
    feasible = [c for c in _covers(problem) if problem.peak(c) <= budget]
    if not feasible:
        with pytest.raises(NoPlanFits) as info:
            solve(problem, budget)
        assert info.value.lowest.peak_bytes == min(problem.peak(c) for c in _covers(problem))
        assert info.value.lowest.peak_bytes > budget
        return
    best = min(sum(x.added_time_s for x in c) for c in feasible)
    solution = solve(problem, budget)
    assert solution.peak_bytes <= budget
    assert solution.added_time_s == pytest.approx(best, abs=1e-9)
    assert solution.peak_bytes == problem.peak(solution.choices)


def test_plan_of_the_solution_matches_its_choices() -> None:
    choices = [Choice(0, 2, None, 300 * MiB, 0.2, 40 * MiB), Choice(2, 3, {"mlp": "recompute"}, 50 * MiB, 0.05),
               *(Choice(i, i + 1, {}, 0, 0.0) for i in range(3))]
    problem = PlanningProblem(3, choices, baseline_saved_bytes=600 * MiB)
    solution = solve(problem, 300 * MiB)
    assert solution.plan.full_recompute == [(0, 2)] and solution.plan.layers[2] == {"mlp": "recompute"}
    assert solution.peak_bytes == 600 * MiB - 350 * MiB + 40 * MiB
    assert solve(problem, 10**12).plan.full_recompute == []  # a roomy budget recomputes nothing


def test_no_plan_fits_says_by_how_much_and_what_to_change() -> None:
    problem = PlanningProblem(2, [Choice(i, i + 1, {}, 0, 0.0) for i in range(2)]
                              + [Choice(0, 2, None, 100 * MiB, 0.1, 10 * MiB)],
                              baseline_saved_bytes=400 * MiB, fixed_bytes=1024 * MiB)
    with pytest.raises(NoPlanFits, match="1.30 GiB.*0.30 GiB more.*micro-batch"):
        solve(problem, 1024 * MiB)


def test_128_layers_solve_in_seconds() -> None:
    layers, choices = 128, []
    for i in range(layers):
        for k, (freed, cost) in enumerate([(0, 0.0), (40, 0.004), (90, 0.011), (100, 0.016), (120, 0.02)]):
            choices.append(Choice(i, i + 1, {"variant": str(k)}, freed * MiB, cost, k * MiB))
        for size in (2, 4):
            if i + size <= layers:
                choices.append(Choice(i, i + size, None, (125 * size + 20 * (size - 1)) * MiB,
                                      0.025 * size, 150 * size * MiB))
    problem = PlanningProblem(layers, choices, baseline_saved_bytes=layers * 130 * MiB, fixed_bytes=0)
    start = time.perf_counter()
    solution = solve(problem, layers * 60 * MiB)
    assert time.perf_counter() - start < 30
    assert solution.peak_bytes <= layers * 60 * MiB
