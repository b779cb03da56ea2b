"""Rich tables of benchmark results, memory breakdowns and golden checks."""
from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from remat.bench.golden import OK, REGRESSION, STATUS_VALUES, UNEXPECTED_IMPROVEMENT, MetricCheck
from remat.bench.result import BenchResult
from remat.config import format_bytes

_MISSING = "-"
_STATUS_STYLES = {"ok": "green", "oom": "bold red"}
_VERDICT_STYLES = {OK: "green", REGRESSION: "bold red", UNEXPECTED_IMPROVEMENT: "yellow"}
# (row label, MemoryBreakdown field)
_BREAKDOWN = (
    ("weights", "weights"),
    ("grads", "grads"),
    ("optimizer state", "optimizer"),
    ("activations", "activations"),
)


def format_gib(n_bytes: float | None) -> str:
    """GiB, or MiB below a tenth of a GiB (tiny CPU recipes)."""
    return _MISSING if n_bytes is None else format_bytes(n_bytes)


def _tflops(value: float | None) -> str:
    # three significant digits keep CPU-sized throughputs readable
    return _MISSING if value is None else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _number(value: float | None, spec: str, scale: float = 1.0) -> str:
    return _MISSING if value is None else format(value * scale, spec)


def _peak_cells(result: BenchResult) -> tuple[str, str]:
    """Peak allocated/reserved; an OOM run has no peak, so show what was held when it failed."""
    if result.oom is not None:
        return (f"{format_gib(result.oom.allocated_bytes)} at OOM", f"{format_gib(result.oom.reserved_bytes)} at OOM")
    return format_gib(result.peak_allocated_bytes), format_gib(result.peak_reserved_bytes)


def results_table(results: Sequence[BenchResult], *, title: str = "") -> Table:
    show_fwd_bwd = any(r.tflops_fwd_bwd is not None for r in results)
    show_host = any(r.peak_host_bytes is not None for r in results)
    table = Table(title=title or None)
    table.add_column("name")
    table.add_column("status")
    for header in ("step (ms)", "TFLOP/s/GPU", *(["fwd+bwd TFLOP/s"] if show_fwd_bwd else []), "tokens/s/GPU",
                   "peak allocated", "peak reserved", *(["peak host"] if show_host else [])):
        table.add_column(header, justify="right")
    for r in results:
        fwd_bwd = [_tflops(r.tflops_fwd_bwd)] if show_fwd_bwd else []
        table.add_row(
            r.name,
            Text(r.status, style=_STATUS_STYLES.get(r.status, "")),
            _number(r.step_time_s, ".1f", scale=1000.0),
            _tflops(r.tflops_per_gpu),
            *fwd_bwd,
            _number(r.tokens_per_s_per_gpu, ",.0f"),
            *_peak_cells(r),
            *([format_gib(r.peak_host_bytes)] if show_host else []),
        )
    return table


def memory_table(result: BenchResult) -> Table:
    table = Table(title=f"memory at peak: {result.name}")
    table.add_column("")
    table.add_column("size", justify="right")
    table.add_column("share of peak allocated", justify="right")
    peak = result.peak_allocated_bytes
    for label, attr in _BREAKDOWN:
        n_bytes = getattr(result.memory, attr) if result.memory is not None else None
        share = n_bytes / peak if n_bytes is not None and peak else None
        if attr == "grads" and result.memory is not None and not result.memory.grads_persist:
            # built during backward: what of them is alive at the peak is in the activations' row
            table.add_row(label, format_gib(n_bytes), "within activations")
        else:
            table.add_row(label, format_gib(n_bytes), _number(share, ".1%"))
    table.add_section()
    allocated, reserved = _peak_cells(result)
    table.add_row("peak allocated", allocated, "")
    table.add_row("peak reserved", reserved, "")
    if result.peak_host_bytes is not None:
        table.add_row("peak host (offloaded)", format_gib(result.peak_host_bytes), "")
    return table


def _format_metric(metric: str, value: float) -> str:
    if metric == "status":
        return next(name for name, number in STATUS_VALUES.items() if number == value)
    if metric.endswith("_bytes"):
        return format_gib(value)
    if metric == "loss":
        return f"{value:.4f}"
    return _tflops(value)  # as the results table writes it


def checks_table(checks: Sequence[MetricCheck], *, title: str = "golden comparison") -> Table:
    table = Table(title=title or None)
    table.add_column("metric")
    table.add_column("golden", justify="right")
    table.add_column("current", justify="right")
    table.add_column("diff", justify="right")
    table.add_column("verdict")
    for check in checks:
        table.add_row(
            check.metric,
            _format_metric(check.metric, check.golden),
            _format_metric(check.metric, check.current),
            f"{check.rel_diff:+.1%}",
            Text(check.verdict, style=_VERDICT_STYLES[check.verdict]),
        )
    return table
