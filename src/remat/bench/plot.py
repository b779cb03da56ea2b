"""Plots: memory versus throughput of benchmark runs with their Pareto frontier; one step's memory timeline.

Uses a bare Figure on an Agg canvas rather than pyplot, so plotting never touches a user's interactive backend.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from remat.bench.result import BenchResult
from remat.memory.timeline import Timeline

_GIB = 1 << 30


def _memory_unit(largest_gib: float) -> tuple[str, float]:
    """(unit, factor from GiB): MiB where everything is under a tenth of a GiB (tiny CPU recipes)."""
    return ("MiB", 1024.0) if largest_gib < 0.1 else ("GiB", 1.0)


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
    return [
        (run.name, run.peak_allocated_bytes / _GIB, run.tflops_per_gpu)
        for run in ok_runs
        if run.peak_allocated_bytes is not None and run.tflops_per_gpu is not None
    ]


def _oom_points(results: Sequence[BenchResult]) -> list[tuple[str, float]]:
    return [
        (r.name, r.oom.allocated_bytes / _GIB)
        for r in results
        if r.status == "oom" and r.oom is not None and r.oom.allocated_bytes is not None
    ]


# Where a label may sit beside its point, in points: right, above, left, below, then further out.
_OFFSETS = [(dx * r, dy * r) for r in (1, 2, 3) for dx, dy in ((6, 4), (6, -12), (-6, 4), (-6, -12), (0, 10), (0, -16))]


Label = tuple[str, float, float, bool]  # (text, x, y, y in axes coordinates rather than data)


def _annotate(ax: Axes, label: Label, dx: float, dy: float) -> Any:
    text, x, y, bottom = label
    return ax.annotate(
        text,
        (x, y),
        xycoords=("data", "axes fraction") if bottom else "data",
        textcoords="offset points",
        xytext=(dx, dy),
        fontsize=8,
        ha="left" if dx >= 0 else "right",
    )


def _place_labels(ax: Axes, labels: Sequence[Label]) -> None:
    """Annotate each point with its name at the first offset of _OFFSETS where the text stays in
    the figure and overlaps no label placed before it (the first offset when none is free)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    placed: list[Any] = []
    for label in labels:
        for dx, dy in _OFFSETS:
            note = _annotate(ax, label, dx, dy)
            box = note.get_window_extent(renderer)
            inside = fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
            if inside and not any(box.overlaps(other) for other in placed):
                break
            note.remove()
        else:  # no free place: the first, overlapping
            box = _annotate(ax, label, *_OFFSETS[0]).get_window_extent(renderer)
        placed.append(box)


def _draw_frontier(ax: Axes, frontier: list[Point]) -> None:
    if frontier:
        xs, ys = zip(*frontier)
        ax.step(xs, ys, where="post", color="tab:blue", alpha=0.5, linewidth=1.5, label="Pareto frontier")


# An OOM run has no throughput: its marker sits at the bottom of the axes (its y is this, in axes
# coordinates), at the memory it held when it failed.
_BOTTOM = 0.03


def pareto_figure(results: Sequence[BenchResult], *, anchors: Sequence[Anchor] = (), title: str = "") -> Figure:
    """Peak allocated memory against whole-step TFLOP/s per GPU (the results table's figure), the
    Pareto frontier, OOM runs at the bottom where they failed, and `anchors` on the same axes.
    The axes span the points (with a margin), and no label overlaps another."""
    unit, factor = _memory_unit(
        max(
            [x for _, x, _ in _ok_points(results)]
            + [x for _, x in _oom_points(results)]
            + [a[1] for a in anchors]
            + [0.0]
        )
    )
    ok_points = [(name, x * factor, y) for name, x, y in _ok_points([r for r in results if r.status == "ok"])]
    oom_points = [(name, x * factor) for name, x in _oom_points(results)]
    anchors = [(label, x * factor, y) for label, x, y in anchors]

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    _draw_frontier(ax, pareto_frontier((x, y) for _, x, y in ok_points))
    if ok_points:
        ax.scatter([p[1] for p in ok_points], [p[2] for p in ok_points], color="tab:blue", zorder=3, label="runs")
    if oom_points:
        ax.scatter(
            [x for _, x in oom_points],
            [_BOTTOM] * len(oom_points),
            color="red",
            marker="x",
            s=60,
            zorder=3,
            transform=ax.get_xaxis_transform(),
            label="OOM (allocated at failure)",
        )
    if anchors:
        ax.scatter(
            [a[1] for a in anchors], [a[2] for a in anchors], color="grey", marker="D", zorder=3, label="reference"
        )
    ax.set_xlabel(f"peak allocated memory ({unit})")
    ax.set_ylabel("TFLOP/s/GPU (whole step, as in the table)")
    ax.margins(x=0.15, y=0.15)  # room for the labels beside the outermost points
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    fig.canvas.draw()  # the layout the labels are placed in
    _place_labels(
        ax,
        [
            *((name, x, y, False) for name, x, y in ok_points),
            *((f"{name} (OOM)", x, _BOTTOM, True) for name, x in oom_points),
            *((label, x, y, False) for label, x, y in anchors),
        ],
    )
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


_PHASES = (
    ("fwd", "forward", "tab:green"),
    ("head", "loss head", "tab:purple"),
    ("bwd", "backward", "tab:orange"),
    ("tail", "backward", "tab:orange"),
    ("optimizer", "optimizer", "tab:red"),
)


def _phase(window: str) -> tuple[str, str] | None:
    return next(((label, color) for prefix, label, color in _PHASES if window.startswith(prefix)), None)


def timeline_plot(timeline: Timeline, path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Write timeline_figure as a PNG and return its path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    timeline_figure(timeline, title=title).savefig(out, format="png", dpi=150)
    return out


def timeline_figure(timeline: Timeline, *, title: str = "") -> Figure:
    """Allocated (and reserved) memory over one step's ops, the FP8 bytes of it where there are
    any, phases shaded, each layer's forward and backward marked and named inside the axes."""
    fig = Figure(figsize=(11, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ops = range(len(timeline.allocated))
    unit, factor = _memory_unit(max([*timeline.allocated, *(timeline.reserved or []), 0]) / _GIB)
    ax.plot(ops, [b / _GIB * factor for b in timeline.allocated], color="tab:blue", linewidth=1, label="allocated")
    if timeline.reserved is not None:
        ax.plot(ops, [b / _GIB * factor for b in timeline.reserved], color="grey", linewidth=1, label="reserved")
    if timeline.fp8 is not None and any(timeline.fp8):
        ax.plot(ops, [b / _GIB * factor for b in timeline.fp8], color="tab:cyan", linewidth=1, label="of it FP8")
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
            # right of its line, so the first window's name stays inside the axes
            ax.annotate(
                window,
                (start, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=6,
                va="top",
                ha="left",
                color=color,
            )
    ax.set_xlabel("op of the training step")
    ax.set_ylabel(unit)
    ax.set_xlim(0, max(len(timeline.allocated) - 1, 1))
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if title:
        ax.set_title(title)
    ax.legend(loc="lower left", fontsize=8)
    return fig
