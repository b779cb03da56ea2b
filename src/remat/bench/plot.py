"""Plots: memory versus throughput of benchmark runs with their Pareto frontier; one step's memory timeline.

Uses a bare Figure on an Agg canvas rather than pyplot, so plotting never touches a user's interactive backend.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from remat.bench.result import BenchResult
from remat.memory.timeline import Timeline

_GIB = 1 << 30
Point = tuple[float, float]  # (peak memory GiB, TFLOP/s)
Anchor = tuple[str, float, float]  # (label, peak memory GiB, TFLOP/s)


def pareto_frontier(points: Iterable[Point]) -> list[Point]:
    """The points that no other point beats on throughput with at most as much memory, by memory ascending."""
    frontier: list[Point] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not frontier or y > frontier[-1][1]:
            frontier.append((x, y))
    return frontier


def _ok_points(ok_runs: Sequence[BenchResult]) -> list[tuple[str, float, float]]:
    # the results table's headline, whole-step TFLOP/s/GPU (forward+backward under --no_optimizer)
    return [(run.name, run.peak_allocated_bytes / _GIB, run.tflops_per_gpu) for run in ok_runs
            if run.peak_allocated_bytes is not None and run.tflops_per_gpu is not None]


def _oom_points(results: Sequence[BenchResult]) -> list[tuple[str, float]]:
    return [(r.name, r.oom.allocated_bytes / _GIB) for r in results
            if r.status == "oom" and r.oom is not None and r.oom.allocated_bytes is not None]


def _label(ax: Axes, text: str, x: float, y: float) -> None:
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)


def _draw_frontier(ax: Axes, frontier: list[Point]) -> None:
    if frontier:
        xs, ys = zip(*frontier)
        ax.step(xs, ys, where="post", color="tab:blue", alpha=0.5, linewidth=1.5, label="Pareto frontier")


def pareto_figure(results: Sequence[BenchResult], *, anchors: Sequence[Anchor] = (), title: str = "") -> Figure:
    """Peak allocated memory against whole-step TFLOP/s per GPU (the results table's figure), the
    Pareto frontier, OOM runs marked at y = 0 where they failed, and `anchors` on the same axes."""
    ok_points = _ok_points([r for r in results if r.status == "ok"])
    oom_points = _oom_points(results)

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    _draw_frontier(ax, pareto_frontier((x, y) for _, x, y in ok_points))
    if ok_points:
        ax.scatter([p[1] for p in ok_points], [p[2] for p in ok_points], color="tab:blue", zorder=3, label="runs")
    for name, x, y in ok_points:
        _label(ax, name, x, y)
    if oom_points:
        ax.scatter([x for _, x in oom_points], [0.0] * len(oom_points), color="red", marker="x", s=60, zorder=3,
                   clip_on=False, label="OOM (allocated at failure)")
    for name, x in oom_points:
        _label(ax, f"{name} (OOM)", x, 0.0)
    if anchors:
        ax.scatter([a[1] for a in anchors], [a[2] for a in anchors], color="grey", marker="D", zorder=3,
                   label="reference")
    for label, x, y in anchors:
        _label(ax, label, x, y)

    ax.set_xlabel("peak allocated memory (GiB)")
    ax.set_ylabel("TFLOP/s/GPU (whole step, as in the table)")
    # from zero (OOM markers sit at y = 0), with room past the furthest run for its label
    drawn = ax.dataLim if ax.dataLim.width >= 0 else None  # nothing drawn: limits left to matplotlib
    ax.set_xlim(0, 1.1 * drawn.x1 if drawn else None)
    ax.set_ylim(0, 1.1 * drawn.y1 if drawn else None)
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    return fig


def pareto_plot(
    results: Sequence[BenchResult],
    path: str | os.PathLike[str],
    *,
    anchors: Sequence[Anchor] = (),
    title: str = "",
) -> Path:
    """Write pareto_figure as a PNG and return its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pareto_figure(results, anchors=anchors, title=title).savefig(out, format="png", dpi=150)
    return out


_PHASES = (("fwd", "forward", "tab:green"), ("head", "loss head", "tab:purple"), ("bwd", "backward", "tab:orange"),
           ("tail", "backward", "tab:orange"), ("optimizer", "optimizer", "tab:red"))


def _phase(window: str) -> tuple[str, str] | None:
    return next(((label, color) for prefix, label, color in _PHASES if window.startswith(prefix)), None)


def timeline_plot(timeline: Timeline, path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Write a PNG of allocated (and reserved) memory over one step's ops, phases shaded, each
    layer's forward and backward marked; return its path."""
    fig = Figure(figsize=(11, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ops = range(len(timeline.allocated))
    ax.plot(ops, [b / _GIB for b in timeline.allocated], color="tab:blue", linewidth=1, label="allocated")
    if timeline.reserved is not None:
        ax.plot(ops, [b / _GIB for b in timeline.reserved], color="grey", linewidth=1, label="reserved")
    ends = [start for start, _ in timeline.marks[1:]] + [len(timeline.allocated)]
    shaded: set[str] = set()
    for (start, window), end in zip(timeline.marks, ends):
        phase = _phase(window)
        if phase is None:
            continue
        label, color = phase
        ax.axvspan(start, end, color=color, alpha=0.08, label=None if label in shaded else label)
        shaded.add(label)
        if window[:3] in ("fwd", "bwd"):
            ax.axvline(start, color=color, alpha=0.4, linewidth=0.6)
            ax.annotate(window, (start, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                        va="top", ha="right", color=color)
    ax.set_xlabel("op of the training step")
    ax.set_ylabel("GiB")
    ax.set_xlim(0, max(len(timeline.allocated) - 1, 1))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    ax.legend(loc="lower left", fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=150)
    return out
