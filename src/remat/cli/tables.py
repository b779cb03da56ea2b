"""Every table the `remat` command prints, rendered with rich in one place."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from remat.bench.findings import Finding
from remat.bench.golden import NOISE, OK, REGRESSION, STATUS_VALUES, UNEXPECTED_IMPROVEMENT, MetricCheck
from remat.bench.result import CPU_TIMING_CAVEAT, BenchResult, timing_noise
from remat.bench.spec import BenchSpec
from remat.bench.support import Cell
from remat.config.model_sites import index_runs
from remat.core.sizes import format_bytes
from remat.doctor import Report, attribution_rows
from remat.estimate.spec import EstimateSpec
from remat.estimate.stage_plans import PipelinePlan
from remat.estimate.stages import Estimate
from remat.memory.attribution import owner_name
from remat.memory.prediction import Trace, describe, describe_sites
from remat.models import parameter_count
from remat.planner import PlanResult, megatron_keys
from remat.run.verify import VerifyReport

_MISSING = "-"
_STATUS_STYLES = {"ok": "green", "oom": "bold red"}
_VERDICT_STYLES = {OK: "green", NOISE: "green", REGRESSION: "bold red", UNEXPECTED_IMPROVEMENT: "yellow"}
# (row label, MemoryBreakdown field)
_BREAKDOWN = (
    ("weights", "weights"),
    ("grads", "grads"),
    ("optimizer state", "optimizer"),
    ("activations", "activations"),
)


def fit_width(table: Table, width: int, keys: int = 1) -> list[RenderableType]:
    """`table` as one table when it fits `width` columns of text (numbers whole, text wrapped);
    else split into tables of its columns that do, each repeating the first `keys` columns,
    with the caption after them across the whole width."""
    table = _columns(table, range(len(table.columns)))
    if _narrowest(table) <= width or len(table.columns) <= keys + 1:
        return [table]
    parts: list[list[int]] = []
    for i in range(keys, len(table.columns)):
        if parts and _narrowest(_columns(table, [*range(keys), *parts[-1], i])) <= width:
            parts[-1].append(i)
        else:
            parts.append([i])
    split: list[RenderableType] = [
        _columns(table, [*range(keys), *part], title=k == 0, caption=False) for k, part in enumerate(parts)
    ]
    return split + ([Text(str(table.caption), style="table.caption")] if table.caption else [])


def _narrowest(table: Table) -> int:
    """The fewest text columns the table renders in without cutting a cell that must stay whole
    (a column kept on one line needs its widest cell, one that wraps its longest word), with a
    column's borders and padding."""
    widths = []
    for column in table.columns:
        texts = [str(column.header), *(str(cell) for cell in column.cells)]
        if column.no_wrap:
            widths.append(max(len(text) for text in texts))
        else:
            widths.append(max(len(word) for text in texts for word in text.split() or [""]))
    return 1 + sum(w + 3 for w in widths)


# Cells up to this wide stay on one line (names, numbers); longer text wraps.
_WHOLE = 24


def _columns(table: Table, chosen: Iterable[int], title: bool = True, caption: bool = True) -> Table:
    """A table of `chosen` columns of `table`, numbers and short cells kept on one line."""
    part = Table(title=table.title if title else None, caption=table.caption if caption else None)
    picked = [table.columns[i] for i in chosen]
    for column in picked:
        whole = column.justify == "right" or max((len(str(c)) for c in column.cells), default=0) <= _WHOLE
        part.add_column(column.header, justify=column.justify, style=column.style, no_wrap=column.no_wrap or whole)
    for row, *cells in zip(table.rows, *(column.cells for column in picked)):
        part.add_row(*cells, end_section=row.end_section)
    return part


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
    for header in (
        "step (ms)",
        "TFLOP/s/GPU",
        *(["fwd+bwd TFLOP/s"] if show_fwd_bwd else []),
        "tokens/s/GPU",
        "peak allocated",
        "peak reserved",
        *(["peak host"] if show_host else []),
    ):
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
    table.add_column("noise", justify="right")
    table.add_column("verdict")
    for check in checks:
        table.add_row(
            check.metric,
            _format_metric(check.metric, check.golden),
            _format_metric(check.metric, check.current),
            f"{check.rel_diff:+.1%}",
            _MISSING if check.noise is None else f"±{check.noise:.1%}",
            Text(check.verdict, style=_VERDICT_STYLES[check.verdict]),
        )
    if any(check.noise is not None for check in checks):
        table.caption = (
            "noise: the difference the runs' step-time spread alone can make (on CPU, where one "
            "process runs tens of percent faster than another, at least a factor of two)"
        )
    return table


def verify_table(report: VerifyReport, recipe: str, micro_batch_size: int, dtype: str, device: str) -> Table:
    table = Table(title=f"{recipe}, micro-batch {micro_batch_size}, {dtype} on {device}")
    for column in ("run", "loss", "saved for backward", "storages"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for name, step in (("no recompute", report.baseline), ("with config", report.candidate)):
        table.add_row(name, f"{step.loss.item():.6f}", format_gib(step.saved.bytes), str(step.saved.storages))
    table.caption = (
        f"freed {format_gib(report.freed_bytes)}; bit-identical: {report.bit_identical}; "
        f"max |grad diff| {report.max_grad_diff:.3g}"
    )
    return table


def milliseconds(seconds: float) -> str:
    """A step time in ms: three significant digits (whole ms from 100), never in exponent form."""
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms" if ms >= 0.001 else "< 0.001 ms"


def _expert_parallel(spec: EstimateSpec) -> str:
    """'ep N, etp M, ' for a model with routed experts (its config has Megatron's expert sizes)."""
    layout = spec.layout
    if not hasattr(spec.model_config, "expert_model_parallel_size"):
        return ""
    return f"ep {layout.ep}, etp {layout.tp if layout.tp > 1 else layout.etp or 1}, "  # beside tp: over the tp ranks


# the columns of an estimate, by component of each rank's peak
ESTIMATE_COLUMNS = (
    "config",
    "stage",
    "layers",
    "in flight",
    "weights",
    "grads",
    "optimizer",
    "activations",
    "workspaces",
    "other",
    "peak",
    "peak in",
)


def estimate_table(spec: EstimateSpec, results: Sequence[Estimate], measured: bool = False) -> Table:
    """Each result's peak per pipeline rank, by component, and its step time (`measured`: the
    ranks' shards were traced on the device, so the times were measured there)."""
    layout = spec.layout
    title = (
        f"{spec.recipe}: tp {layout.tp}{' (sp)' if layout.sequence_split > 1 else ''}, pp {layout.pp}, vpp"
        f" {layout.virtual}, cp {layout.cp}, {_expert_parallel(spec)}"
        f"micro-batch {spec.micro_batch_size} x {spec.micro_batches}"
    )
    table = Table(title=f"estimated peak memory per GPU, {title}")
    host = any(s.host for result in results for s in result.stages)
    for column in (*ESTIMATE_COLUMNS, *(["host"] if host else []), "step"):
        table.add_column(column, justify="left" if column in ("config", "peak in") else "right")
    for result in results:
        for s in result.stages:
            first = s.stage == 0
            components = (s.weights, s.grads, s.optimizer_state, s.activations, s.workspaces, s.other, s.peak)
            table.add_row(
                result.name if first else "",
                str(s.stage),
                str(s.layers),
                f"{s.in_flight:g}",
                *(format_gib(b) for b in components),
                s.peak_window,
                *([format_gib(s.host)] if host else []),
                milliseconds(result.step_time_s) if first else "",
            )
    table.caption = _estimate_caption(spec, host, measured)
    return table


def _estimate_caption(spec: EstimateSpec, host: bool, measured: bool) -> str:
    copies = (
        f"; host: offloaded, copies at {spec.host_gbps:g} GB/s each way, hidden behind the next layer's"
        " forward and backward where they fit"
        if host
        else ""
    )
    timed = (
        "each rank's shard timed on the device, without communication"
        if measured
        else f"counted FLOPs at {spec.tflops:g} TFLOP/s"
        + (" (FP8 matmuls at twice it)" if spec.precision.is_fp8 else "")
    )
    return (
        f"activations: saved for backward by the micro-batches in flight ({spec.layout.pipeline_schedule});"
        " workspaces: cuBLAS's, one per GEMM thread (forward, autograd's backward); other: the peak window's"
        f" working memory; step: {timed}, {spec.target} kernels{', compiled regions' if spec.compile else ''}"
        f"{copies}"
    )


def stage_plans_table(result: PipelinePlan) -> Table:
    """What each pipeline rank does under its plan, and the uniform config it is compared with."""
    table = Table(title=f"a plan per pipeline rank under {format_gib(result.budget_bytes)}")
    for column in ("rank", "layers", "plan", "peak"):
        table.add_column(column, justify="right" if column in ("rank", "peak") else "left")
    for stage, estimated in zip(result.stages, result.estimate.stages):
        table.add_row(
            str(stage.stage), index_runs(stage.layers), stage.plan.describe(stage.layers), format_gib(estimated.peak)
        )
    if result.uniform is None:
        table.caption = "no Megatron recompute config (one for every stage) fits every rank under this budget"
    else:
        config, uniform = result.uniform
        keys = ", ".join(f"{k}={v}" for k, v in megatron_keys(config).items()) or "no recompute"
        table.caption = (
            f"step {milliseconds(result.estimate.step_time_s)}; the fastest Megatron config that fits "
            f"every rank ({keys}) takes {milliseconds(uniform.step_time_s)}"
        )
    return table


def trace_table(measured: Trace) -> Table:
    table = Table(title="what each action saves and costs, per layer")
    for column in ("action", "frees", "adds", "± noise"):
        table.add_column(column, justify="left" if column == "action" else "right")
    for what, freed, ms, noise in describe(measured):
        table.add_row(what, format_gib(freed), f"{ms:.2f} ms", f"{noise:.2f} ms")
    base = f"no-recompute step: {measured.base_step_time_s * 1e3:.1f} ms"
    if measured.timed_on == "meta":
        table.caption = f"{base}, counted FLOPs at the rate given (nothing ran)"
    else:
        table.caption = (
            f"{base} ± {measured.step_noise_s * 1e3:.1f} ms between steps; a cost within its noise may "
            "be none"
            + (
                "; on CPU a small model's timings are noisy and say little about a GPU"
                if measured.timed_on == "cpu"
                else ""
            )
        )
    return table


def storage_table(measured: Trace) -> Table:
    table = Table(title="what each site saves for backward (no recompute)")
    for column in ("site", "saves", "its inputs", "saved by other sites too", "recomputed alone frees"):
        table.add_column(column, justify="left" if column == "site" else "right")
    for site, s, frees in describe_sites(measured):
        others = ", ".join(sorted(owner_name(owner) for owner in s.shared_with))
        table.add_row(
            site,
            format_gib(s.saved_bytes),
            format_gib(s.input_bytes),
            f"{format_gib(s.shared_bytes)} ({others})" if others else "-",
            "-" if frees is None else format_gib(frees),
        )
    table.caption = (
        "recomputing a site keeps its inputs and what other sites save: it frees what it saves "
        "less those, unless something else holds them (a discard-only site, such as mlp_act:"
        " what discarding it frees)"
    )
    return table


def plan_table(result: PlanResult) -> Table:
    table = Table(title=f"fastest plan under {format_gib(result.budget_bytes)}")
    for column in ("layers", "action", "frees / layer", "adds / layer"):
        table.add_column(column, justify="right" if column.startswith(("frees", "adds")) else "left")
    rows = list(result.explain())
    for layers, what, freed, seconds in rows:
        table.add_row(layers, what, format_gib(freed), f"{seconds * 1e3:.2f} ms")
    if not rows:
        table.add_row("all", "keep (no recompute)", format_gib(0), "0.00 ms")
    p = result.prediction
    host = f", {format_gib(p.host_bytes)} offloaded to host" if p.host_bytes else ""
    table.caption = (
        f"predicted peak {format_gib(p.peak_bytes)} (in {p.peak_window}){host}, "
        f"step {p.step_time_s * 1e3:.1f} ms; every layer not listed keeps everything"
    )
    return table


def verify_plan_table(result: PlanResult, bench: BenchResult, spec: BenchSpec, trace_noise_s: float) -> Table:
    """The plan's prediction against its bench run. A step time within the noise of both (the
    trace's step spread, the run's, and on CPU a factor of two) is marked so."""
    table = Table(title="predicted vs measured")
    for column in ("", "predicted", "measured", "error"):
        table.add_column(column, justify="right" if column else "left")
    if bench.status != "ok":
        table.add_row("peak allocated", format_gib(result.prediction.peak_bytes), "OOM", "")
        return table
    rows: list[tuple[str, Any, Any, Callable[[float], str]]]  # name, predicted, measured, format
    rows = [("peak allocated", result.prediction.peak_bytes, bench.peak_allocated_bytes, format_gib)]
    if result.prediction.host_bytes and bench.peak_host_bytes:
        rows.append(("host (offloaded)", result.prediction.host_bytes, bench.peak_host_bytes, format_gib))
    if spec.micro_batches == 1:
        rows.append(("step time", result.prediction.step_time_s, bench.step_time_s, lambda s: f"{s * 1e3:.1f} ms"))
    for name, predicted, measured, fmt in rows:
        error = (predicted - measured) / measured
        noise = None if name != "step time" else (timing_noise(bench) or 0.0) + trace_noise_s / measured
        within = noise is not None and abs(math.log1p(error)) <= math.log1p(noise)
        table.add_row(name, fmt(predicted), fmt(measured), f"{error:+.1%}" + (" (within noise)" if within else ""))
    if bench.device == "cpu":
        table.caption = CPU_TIMING_CAVEAT
    return table


def doctor_report(report: Report) -> RenderableType:
    """The diagnosis with its evidence, the recommendations, and who held the memory."""
    d = report.diagnosis
    table = Table(title=f"remat doctor{report.where}: {d.kind}")
    table.add_column("")
    table.add_column("bytes", justify="right")
    for name, value in d.evidence().items():
        table.add_row(name, format_gib(value))
    table.caption = escape(d.explanation)
    parts: list[RenderableType] = [table]
    parts += [
        f"{i}. {escape(r.what)}:\n   [bold]{escape(r.setting)}[/]\n   {escape(r.why)}"
        for i, r in enumerate(report.recommendations, 1)
    ]
    rows = attribution_rows(report)
    if rows:
        held = Table(title="who held the allocated memory")
        held.add_column("")
        held.add_column("bytes", justify="right")
        for what, nbytes in rows:
            held.add_row(what, format_gib(nbytes))
        parts.append(held)
    return Group(*parts)


def history_table(runs: Sequence[tuple[int, BenchResult]], path: str) -> Table:
    """(id, run) pairs, newest first."""
    table = Table(title=f"runs in {path}, newest first (remat history show ID for one)")
    for column in ("id", "date", "recipe", "name", "status", "gpu", "TFLOP/s/GPU", "peak allocated"):
        table.add_column(column, justify="right" if column in ("id", "TFLOP/s/GPU", "peak allocated") else "left")
    for row_id, r in runs:
        table.add_row(
            str(row_id),
            r.date.replace("T", " ")[:16],
            r.recipe,
            r.name,
            Text(r.status, style=_STATUS_STYLES.get(r.status, "")),
            r.gpu,
            _tflops(r.tflops_per_gpu),
            _peak_cells(r)[0],
        )
    return table


def recipes_table(rows: Sequence[tuple[str, str, Any]]) -> Table:
    """(recipe, family, config) as a table of shapes; parameters counted on the meta device."""
    table = Table(title="recipes (override any shape with --num_layers, --hidden_size, -sl)")
    for column in ("recipe", "family", "layers", "hidden", "ffn", "heads", "kv", "seq", "vocab", "params"):
        table.add_column(column, justify="left" if column in ("recipe", "family") else "right")
    for name, family, c in rows:
        table.add_row(
            name,
            family,
            str(c.num_layers),
            str(c.hidden_size),
            str(c.ffn_hidden_size),
            str(c.num_attention_heads),
            str(c.num_query_groups),
            str(c.seq_length),
            str(c.vocab_size),
            _parameters(name),
        )
    return table


def _parameters(recipe: str) -> str:
    count = parameter_count(recipe)
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def support_table(cells: Sequence[Cell]) -> Table:
    """What runs where (bench/support.py): a row per family and precision, a column per layout."""
    table = Table(title="remat support: refused where the code refuses it, else where it is checked")
    layouts = list(dict.fromkeys(cell.layout for cell in cells))
    for column in ("family", "precision", *layouts):
        table.add_column(column)
    rows: dict[tuple[str, str], list[str]] = {}
    for cell in cells:
        rows.setdefault((cell.family, cell.precision), []).append(cell.status)
    for (family, precision), statuses in rows.items():
        table.add_row(family, precision, *statuses)
    table.caption = (
        "CPU: one process (tests); gloo: CPU processes under torchrun (tests); GPU: measured on one GPU;"
        " NCCL: measured on several; --reasons says why a cell is refused"
    )
    return table


def findings_table(findings: Sequence[Finding], path: str) -> Table:
    table = Table(title=f"remat doctor: {len(findings)} finding{'s' if len(findings) != 1 else ''} in {path}")
    for column in ("check", "symptom", "cause", "confirmed by", "fix"):
        table.add_column(column)
    for f in findings:
        table.add_row(*(escape(text) for text in (f.check, f.symptom, f.cause, f.confirmed_by, f.fix)))
    table.caption = "checks for common recompute mistakes (remat doctor --help lists them)"
    return table
