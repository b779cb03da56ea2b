"""The exact solver behind the planner: the fastest cover of the layers by choices under a budget.

The problem is `remat.memory.windows`': choices covering the layers, windows with peaks.

Choices only reach their own layers' windows, the next layer's (offload) and, through the bytes
they free, the windows that hold them; so a dynamic program over the layers finds the fastest
plan, and the lowest peak when none fits, exactly: its states are the Pareto front of (bytes
freed so far, time added or highest peak so far) after each prefix of layers, per previous choice
still measured in the next layer. The mixed-integer program (scipy's HiGHS) answers what the
dynamic program does not carry: a cap on host bytes, a choice measured further away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.config.plan import Plan
from remat.core.labels import LAYER, recompute_labels
from remat.core.problems import ConfigError, Problem
from remat.core.sizes import format_bytes
from remat.memory.windows import Choice, PlanningProblem, Window


@dataclass(frozen=True)
class Solution:
    plan: Plan
    choices: tuple[Choice, ...]
    peak_bytes: int
    peak_window: str
    added_time_s: float
    host_bytes: int = 0


class NoPlanFits(ConfigError):
    """The budget is below the smallest peak any plan reaches; `lowest` is that plan."""

    def __init__(
        self, budget: int, lowest: Solution, activations_in_peak: bool = True, fixed_bytes: int | None = None
    ) -> None:
        self.lowest = lowest
        short = lowest.peak_bytes - budget
        super().__init__(
            [
                Problem(
                    "memory_budget",
                    (
                        f"no plan fits {format_bytes(budget)}: the lowest peak any plan reaches is "
                        f"{format_bytes(lowest.peak_bytes)} ({format_bytes(short)} more, in window "
                        f"{lowest.peak_window}). {_what_would_fit(budget, lowest.peak_bytes, activations_in_peak, fixed_bytes)}"
                    ),
                )
            ]
        )


_MORE_GPUS = "spread the model over more GPUs (tensor+sequence parallel splits weights and activations, pipeline parallel the layers)"


def _what_would_fit(budget: int, lowest: int, activations_in_peak: bool, fixed: int | None) -> str:
    """Advice sized by what the lowest peak is made of: weights, gradients and optimizer state,
    which only sharding or more GPUs reduce, and the rest, which scales with the micro-batch
    where activations are alive."""
    if fixed is None:
        return (
            "Raise the budget, lower the micro-batch size, or " + _MORE_GPUS
            if activations_in_peak
            else "No activation is alive there: shard weights, gradients and optimizer state (FSDP2), or " + _MORE_GPUS
        )
    if fixed >= budget:
        return (
            f"Weights, gradients and optimizer state take {format_bytes(fixed)} alone: no recompute plan "
            f"helps; shard them (FSDP2) or " + _MORE_GPUS
        )
    rest = lowest - fixed
    if not activations_in_peak:
        return (
            f"No activation is alive there: {format_bytes(fixed)} of weights, gradients and optimizer state "
            f"and {format_bytes(rest)} of working memory; shard them (FSDP2) or " + _MORE_GPUS
        )
    return (
        f"Of that peak, {format_bytes(fixed)} is weights, gradients and optimizer state and "
        f"{format_bytes(rest)} is activations and working memory, which scale with the tokens of a "
        f"micro-batch: {(budget - fixed) / rest:.2f}x of them or fewer would fit (a smaller micro-batch with "
        f"more gradient accumulation, or context parallel over the sequence); or raise the budget, or " + _MORE_GPUS
    )


def solve(problem: PlanningProblem, budget_bytes: int, host_budget_bytes: int | None = None) -> Solution:
    """The plan with the least added time whose peak fits the budget (and whose offloaded bytes
    fit `host_budget_bytes`); NoPlanFits otherwise."""
    dynamic = host_budget_bytes is None and _layer_local(problem)

    def optimum(budget: int | None) -> Solution | None:  # budget None: the lowest peak
        if not dynamic:
            found = _milp(problem, budget, host_budget_bytes, minimize_memory=budget is None)
            if found is not None and budget is not None and found.peak_bytes > budget:  # over by HiGHS' tolerance
                tighter = budget - (found.peak_bytes - budget) - _MARGIN
                found = _milp(problem, tighter, host_budget_bytes, minimize_memory=False)
            return found
        chosen = _cover_dp(problem, budget)
        return None if chosen is None else _solution(problem, chosen)

    best = optimum(budget_bytes)
    if best is not None:
        return best
    lowest = optimum(None)
    if lowest is None:
        raise ConfigError([Problem("choices", "the choices do not cover every layer exactly once")])
    window = next(w for w in problem.windows if w.name == lowest.peak_window)
    activations = window.layer is not None or window.holds > 0 or problem.held_bytes > 0
    raise NoPlanFits(budget_bytes, lowest, activations, problem.fixed_bytes)


def _cost(c: Choice) -> float:
    # ties (times measured as zero) go to the plan with the fewest actions, 2 us each: above HiGHS'
    # absolute gap (1e-6, which scipy does not expose), far below any action's time on a GPU; a layer
    # recomputed whole counts as every site acted on, and one more
    actions = len(c.actions) if c.actions is not None else (c.end - c.start) * (len(recompute_labels()) + 1)
    return c.added_time_s + 2e-6 * actions


def _layer_local(problem: PlanningProblem) -> bool:
    """Whether every choice is measured only in windows of its own layers and the next one (what
    the dynamic program assumes), every layer window holds the layers before it, and every other
    window none or all of them."""
    if problem.held_bytes or problem.others_in_flight:  # every choice reaches every window
        return False
    by_name = {w.name: w for w in problem.windows}
    return all(
        w.holds == w.layer if w.layer is not None else w.holds in (0, problem.num_layers) for w in problem.windows
    ) and all(
        name in by_name and (layer := by_name[name].layer) is not None and c.start <= layer <= c.end
        for c in problem.choices
        for name in c.window_bytes
    )


def _cover_dp(problem: PlanningProblem, budget: int | None) -> list[Choice] | None:
    """The dynamic program: with a budget, the fastest cover that fits it (None if none does);
    without, the cover with the lowest peak. A layer's windows peak at what its choice measured
    there minus the bytes freed before it (later choices do not reach them), so a state is the
    bytes freed so far and a value: the time added so far, or the highest peak so far."""
    n = problem.num_layers
    by_layer: dict[int, list[Window]] = {}
    for w in problem.windows:
        if w.layer is not None:
            by_layer.setdefault(w.layer, []).append(w)
    choices = list(problem.choices)
    starting: dict[int, list[int]] = {}
    for j, c in enumerate(choices):
        starting.setdefault(c.start, []).append(j)
    # fronts[s][index of the previous choice if it is measured in layer s's windows, else None] =
    # (freed, value, back): freed descending, value strictly descending with it; back[k] = (s',
    # key', k', choice index), or None at the start
    fronts: list[dict[int | None, tuple[np.ndarray, np.ndarray, list]]] = [{} for _ in range(n + 1)]
    arrivals: list[dict[int | None, list]] = [{} for _ in range(n + 1)]
    arrivals[0][None] = [(np.zeros(1, dtype=np.int64), np.full(1, 0.0 if budget is not None else -np.inf), [None])]
    for s in range(n + 1):
        fronts[s] = {key: _pareto(parts) for key, parts in arrivals[s].items()}
        for j in starting.get(s, []):
            c = choices[j]
            nxt = j if any(w.name in c.window_bytes for w in by_layer.get(c.end, [])) else None
            for key, (freed, value, _) in fronts[s].items():
                prev = None if key is None else choices[key]
                # each window of the choice's layers peaks at: base + own - freed before s (the
                # previous choice's bytes there as measured, if it was)
                high = max(
                    (
                        w.base_bytes
                        + c.window_bytes.get(w.name, 0)
                        + (
                            prev.freed_bytes + prev.window_bytes[w.name]
                            if prev is not None and w.layer == s and w.name in prev.window_bytes
                            else 0
                        )
                        for layer in range(s, c.end)
                        for w in by_layer.get(layer, [])
                    ),
                    default=-np.inf,
                )
                if budget is None:
                    ok = np.arange(len(freed))
                    new_value = np.maximum(value, high - freed)
                else:
                    ok = np.flatnonzero(freed >= high - budget)
                    new_value = value[ok] + _cost(c)
                if len(ok):
                    arrivals[c.end].setdefault(nxt, []).append(
                        (freed[ok] + c.freed_bytes, new_value, [(s, key, int(k), j) for k in ok])
                    )
    return _best_cover(problem, fronts, budget, choices)


def _best_cover(
    problem: PlanningProblem,
    fronts: list[dict[int | None, tuple[np.ndarray, np.ndarray, list]]],
    budget: int | None,
    choices: list[Choice],
) -> list[Choice] | None:
    """Of the covers reaching the last layer, the best once the windows outside the layers are
    counted (they hold every layer's freed bytes or none), followed back to its choices."""
    n = problem.num_layers
    best: tuple[float, int | None, int] | None = None
    for key, (freed, value, _) in fronts[n].items():
        rest = np.full(len(freed), -np.inf)  # the windows outside the layers: none or all held
        for w in problem.windows:
            if w.layer is None:
                rest = np.maximum(rest, w.base_bytes - (freed if w.holds >= n else 0))
        if budget is None:
            score = np.maximum(value, rest)
        else:
            score = np.where(rest <= budget, value, np.inf)
        k = int(np.argmin(score))
        if np.isfinite(score[k]) and (best is None or score[k] < best[0]):
            best = (float(score[k]), key, k)
    if best is None:
        return None
    chosen, step = [], fronts[n][best[1]][2][best[2]]
    while step is not None:
        s, key, k, j = step
        chosen.append(choices[j])
        step = fronts[s][key][2][k]
    return chosen


def _pareto(parts: list) -> tuple[np.ndarray, np.ndarray, list]:
    """The states no other state beats (at least as many bytes freed at no higher value)."""
    freed = np.concatenate([p[0] for p in parts])
    value = np.concatenate([p[1] for p in parts])
    back = [b for p in parts for b in p[2]]
    order = np.lexsort((value, -freed))  # most freed first, lowest value first among equals
    keep = order[value[order] < np.minimum.accumulate(np.r_[np.inf, value[order]])[:-1]]
    return freed[keep], value[keep], [back[k] for k in keep]


_UNIT = 2**20  # the program works in MiB: byte-sized coefficients would sit below HiGHS' tolerances
_MARGIN = 16  # bytes: HiGHS accepts a constraint broken by its feasibility tolerance (1e-6 MiB, a byte)


def _milp(
    problem: PlanningProblem, budget: int | None, host_budget: int | None, minimize_memory: bool
) -> Solution | None:
    from scipy.optimize import Bounds, LinearConstraint, milp  # scipy loads when a MILP is solved

    choices, windows = list(problem.choices), list(problem.windows)
    n = len(choices)
    # variables: one binary per choice, then P = the step's peak (MiB)
    cover = np.zeros((problem.num_layers, n + 1))
    for j, c in enumerate(choices):
        cover[c.start : c.end, j] = 1
    # every window: base + sum_j delta_j x_j <= P
    peaks = np.array([[problem.delta(c, w) / _UNIT for c in choices] + [-1.0] for w in windows])
    base = np.array([(w.base_bytes + problem.held_bytes) / _UNIT for w in windows])
    constraints = [LinearConstraint(cover, 1, 1), LinearConstraint(peaks, -np.inf, -base)]
    if host_budget is not None:
        in_flight = 1 + problem.others_in_flight  # each micro-batch in flight holds its own copies on the host
        host = np.array([in_flight * c.host_bytes / _UNIT for c in choices] + [0.0])
        constraints.append(LinearConstraint(host[None, :], -np.inf, host_budget / _UNIT))
    upper = np.inf if budget is None else budget / _UNIT
    objective = np.r_[np.zeros(n), 1.0] if minimize_memory else np.array([_cost(c) for c in choices] + [0.0])
    result = milp(
        objective,
        constraints=constraints,
        integrality=np.r_[np.ones(n), 0],
        bounds=Bounds(np.zeros(n + 1), np.r_[np.ones(n), upper]),
        options={"mip_rel_gap": 0.0},
    )  # exact: the default stops within 0.01%
    if result.x is None:
        return None
    chosen = tuple(c for c, x in zip(choices, result.x[:n]) if x > 0.5)
    return _solution(problem, chosen)


def _solution(problem: PlanningProblem, chosen: Sequence[Choice]) -> Solution:
    plan = Plan.none(problem.num_layers)
    for c in sorted(chosen, key=lambda c: c.start):
        if c.actions is None:
            plan.full_recompute.append((c.start, c.end))
            if c.input_offloaded:
                plan.layers[c.start][LAYER] = "offload"
        else:
            plan.layers[c.start] = dict(c.actions)
    peak, window = problem.peak_and_window(chosen)
    return Solution(
        plan,
        tuple(sorted(chosen, key=lambda c: c.start)),
        peak,
        window,
        sum(c.added_time_s for c in chosen),
        sum(c.host_bytes for c in chosen),
    )
