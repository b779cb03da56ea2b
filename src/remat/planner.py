"""The exact solver behind the planner: the fastest cover of the layers by choices under a budget.

A choice runs a range of layers one way: a single layer with some site actions, or a range
recomputed whole. Every layer is covered by exactly one choice. Memory is the bytes the forward
leaves saved (a baseline minus what the chosen actions free) plus the largest transient a choice
adds while its backward recomputes; time is the recompute the choices add. A mixed-integer
program (scipy's HiGHS) finds the optimum in seconds for hundreds of layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from remat.config import ConfigError, Problem
from remat.plans import Plan


@dataclass(frozen=True)
class Choice:
    """Run layers [start, end) one way: `actions` for a single layer, or None to recompute the
    range whole. `freed_bytes` is what it frees against keeping everything."""

    start: int
    end: int
    actions: dict[str, str] | None
    freed_bytes: int
    added_time_s: float
    transient_bytes: int = 0  # alive only while this choice's backward recomputes


@dataclass(frozen=True)
class Solution:
    plan: Plan
    choices: tuple[Choice, ...]
    saved_bytes: int  # left saved after the forward
    peak_bytes: int  # fixed + saved + the largest transient
    added_time_s: float


@dataclass(frozen=True)
class PlanningProblem:
    num_layers: int
    choices: Sequence[Choice]
    baseline_saved_bytes: int  # saved after the forward when everything is kept
    fixed_bytes: int = 0  # weights, gradients, optimizer state, the loss head's peak

    def peak(self, chosen: Sequence[Choice]) -> int:
        saved = self.baseline_saved_bytes - sum(c.freed_bytes for c in chosen)
        return self.fixed_bytes + saved + max((c.transient_bytes for c in chosen), default=0)


class NoPlanFits(ConfigError):
    """The budget is below the smallest peak any plan reaches; `lowest_peak_bytes` says by how much."""

    def __init__(self, budget: int, lowest: Solution) -> None:
        self.lowest = lowest
        short = lowest.peak_bytes - budget
        super().__init__([Problem("memory_budget", (
            f"no plan fits {budget / 2**30:.2f} GiB: the lowest peak any plan reaches is "
            f"{lowest.peak_bytes / 2**30:.2f} GiB ({short / 2**30:.2f} GiB more); raise the budget, "
            "lower the micro-batch size or spread the model over more GPUs"))])


def solve(problem: PlanningProblem, budget_bytes: int) -> Solution:
    """The plan with the least added time whose peak fits the budget; NoPlanFits otherwise."""
    best = _milp(problem, budget_bytes, minimize_memory=False)
    if best is not None:
        return best
    lowest = _milp(problem, None, minimize_memory=True)
    if lowest is None:
        raise ConfigError([Problem("choices", "the choices do not cover every layer exactly once")])
    raise NoPlanFits(budget_bytes, lowest)


_UNIT = 2**20  # the program works in MiB: byte-sized coefficients would sit below HiGHS' tolerances


def _milp(problem: PlanningProblem, budget: int | None, minimize_memory: bool) -> Solution | None:
    choices = list(problem.choices)
    n = len(choices)
    # variables: one binary per choice, then T = the largest transient among the chosen (MiB)
    cover = np.zeros((problem.num_layers, n + 1))
    for j, c in enumerate(choices):
        cover[c.start:c.end, j] = 1
    constraints = [LinearConstraint(cover, 1, 1)]
    transient = np.zeros((n, n + 1))
    for j, c in enumerate(choices):
        transient[j, j], transient[j, n] = c.transient_bytes / _UNIT, -1  # T >= transient_j * x_j
    constraints.append(LinearConstraint(transient, -np.inf, 0))
    memory = np.array([-c.freed_bytes / _UNIT for c in choices] + [1.0])  # saved - baseline + T
    if budget is not None:
        room = (budget - problem.fixed_bytes - problem.baseline_saved_bytes) / _UNIT
        constraints.append(LinearConstraint(memory[None, :], -np.inf, room))
    time = np.array([c.added_time_s for c in choices] + [0.0])
    # the secondary term only breaks ties between equally fast plans, towards less memory
    objective = memory if minimize_memory else time + 1e-9 * memory
    result = milp(objective, constraints=constraints, integrality=np.array([1] * n + [0]),
                  bounds=Bounds(np.zeros(n + 1), np.r_[np.ones(n), np.inf]),
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
        else:
            plan.layers[c.start] = dict(c.actions)
    saved = problem.baseline_saved_bytes - sum(c.freed_bytes for c in chosen)
    return Solution(plan, tuple(chosen), saved, problem.peak(chosen), sum(c.added_time_s for c in chosen))
