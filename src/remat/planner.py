"""The exact solver behind the planner: the fastest cover of the layers by choices under a budget.

A choice runs a range of layers one way: a single layer with some site actions, or a range
recomputed whole. Every layer is covered by exactly one choice. Memory is tracked per window of
the step (each layer's forward and backward, the loss head, the optimizer step): a window's peak
is its no-recompute peak, plus what the choices covering its layer add in it, minus what every
choice whose saved tensors it still holds frees. The step's peak is the largest window; time is
the recompute the choices add. A mixed-integer program (scipy's HiGHS) finds the optimum.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from remat.config import LAYER, ConfigError, Problem, format_bytes
from remat.plans import Plan


@dataclass(frozen=True)
class Window:
    """A stretch of the step with its own peak: `layer`'s forward or backward (None for the loss
    head, the tail of backward, the optimizer step), in which layers [0, holds) keep their saved
    tensors; `base_bytes` is its peak allocated when every layer keeps everything."""

    name: str
    layer: int | None
    holds: int
    base_bytes: int


@dataclass(frozen=True)
class Choice:
    """Run layers [start, end) one way: `actions` for a single layer, or None to recompute the
    range whole (with `input_offloaded`, the input it keeps goes to host). `freed_bytes` is what
    it leaves unsaved after the forward against keeping everything; `window_bytes` what it adds
    to the peaks of the windows it was measured in, by name (its own layers', and for offload the
    next layer's, while copies run); `host_bytes` what it moves to host memory."""

    start: int
    end: int
    actions: dict[str, str] | None
    freed_bytes: int
    added_time_s: float
    window_bytes: Mapping[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    input_offloaded: bool = False

    def delta(self, window: Window) -> int:
        """Bytes this choice adds to (or, negative, removes from) the window's peak: as measured
        in its own windows; elsewhere, what it frees wherever its layers' saved tensors are held."""
        if window.name in self.window_bytes:
            return self.window_bytes[window.name]
        if window.layer is not None and self.start <= window.layer < self.end:
            return 0
        return -self.freed_bytes if self.end <= window.holds else 0


@dataclass(frozen=True)
class Solution:
    plan: Plan
    choices: tuple[Choice, ...]
    peak_bytes: int
    peak_window: str
    added_time_s: float
    host_bytes: int = 0


@dataclass(frozen=True)
class PlanningProblem:
    num_layers: int
    choices: Sequence[Choice]
    windows: Sequence[Window]

    def peak_and_window(self, chosen: Sequence[Choice]) -> tuple[int, str]:
        peaks = [(w.base_bytes + sum(c.delta(w) for c in chosen), w.name) for w in self.windows]
        return max(peaks)

    def peak(self, chosen: Sequence[Choice]) -> int:
        return self.peak_and_window(chosen)[0]


class NoPlanFits(ConfigError):
    """The budget is below the smallest peak any plan reaches; `lowest` is that plan."""

    def __init__(self, budget: int, lowest: Solution, activations_in_peak: bool = True) -> None:
        self.lowest = lowest
        short = lowest.peak_bytes - budget
        advice = ("lower the micro-batch size, or spread the model over more GPUs (tensor, sequence "
                  "or pipeline parallel)" if activations_in_peak else
                  "no activation is alive there: weights, gradients and optimizer state alone exceed "
                  "it; shard them (FSDP2) or spread the model over more GPUs")
        super().__init__([Problem("memory_budget", (
            f"no plan fits {format_bytes(budget)}: the lowest peak any plan reaches is "
            f"{format_bytes(lowest.peak_bytes)} ({format_bytes(short)} more, in window "
            f"{lowest.peak_window}); raise the budget, or {advice}"))])



def solve(problem: PlanningProblem, budget_bytes: int, host_budget_bytes: int | None = None) -> Solution:
    """The plan with the least added time whose peak fits the budget (and whose offloaded bytes
    fit `host_budget_bytes`); NoPlanFits otherwise."""
    best = _milp(problem, budget_bytes, host_budget_bytes, minimize_memory=False)
    if best is not None:
        return best
    lowest = _milp(problem, None, host_budget_bytes, minimize_memory=True)
    if lowest is None:
        raise ConfigError([Problem("choices", "the choices do not cover every layer exactly once")])
    window = next(w for w in problem.windows if w.name == lowest.peak_window)
    raise NoPlanFits(budget_bytes, lowest, window.layer is not None or window.holds > 0)


_UNIT = 2**20  # the program works in MiB: byte-sized coefficients would sit below HiGHS' tolerances


def _milp(problem: PlanningProblem, budget: int | None, host_budget: int | None,
          minimize_memory: bool) -> Solution | None:
    choices, windows = list(problem.choices), list(problem.windows)
    n = len(choices)
    # variables: one binary per choice, then P = the step's peak (MiB)
    cover = np.zeros((problem.num_layers, n + 1))
    for j, c in enumerate(choices):
        cover[c.start:c.end, j] = 1
    # every window: base + sum_j delta_j x_j <= P
    peaks = np.array([[c.delta(w) / _UNIT for c in choices] + [-1.0] for w in windows])
    base = np.array([w.base_bytes / _UNIT for w in windows])
    constraints = [LinearConstraint(cover, 1, 1), LinearConstraint(peaks, -np.inf, -base)]
    if host_budget is not None:
        host = np.array([c.host_bytes / _UNIT for c in choices] + [0.0])
        constraints.append(LinearConstraint(host[None, :], -np.inf, host_budget / _UNIT))
    upper = np.inf if budget is None else budget / _UNIT
    time = np.array([c.added_time_s for c in choices] + [0.0])
    # ties (times measured as zero) go to the plan that changes the fewest layers: 1 us each, above
    # HiGHS' absolute gap (1e-6) and below any real recompute
    changed = np.array([0.0 if c.actions == {} else c.end - c.start for c in choices] + [0.0])
    objective = np.r_[np.zeros(n), 1.0] if minimize_memory else time + 1e-6 * changed
    result = milp(objective, constraints=constraints, integrality=np.r_[np.ones(n), 0],
                  bounds=Bounds(np.zeros(n + 1), np.r_[np.ones(n), upper]),
                  options={"mip_rel_gap": 0.0})  # exact: the default stops within 0.01%
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
    return Solution(plan, tuple(sorted(chosen, key=lambda c: c.start)), peak, window,
                    sum(c.added_time_s for c in chosen), sum(c.host_bytes for c in chosen))
