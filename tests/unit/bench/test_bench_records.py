"""Tests for the bench records: golden comparison, run history, Pareto plot and report tables."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import matplotlib
import pytest
from matplotlib.colors import same_color
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from remat.bench import history
from remat.bench.golden import (
    OK,
    REGRESSION,
    MetricCheck,
    compare,
    golden_failed,
    load_golden,
    mismatch_notes,
    run_differences,
    save_golden,
    uncompared,
)
from remat.bench.plot import pareto_figure, pareto_frontier, pareto_plot, timeline_figure, timeline_plot
from remat.bench.result import BenchResult, MemoryBreakdown, OomInfo
from remat.cli.tables import checks_table, format_gib, memory_table, results_table
from remat.memory.timeline import Timeline

GIB = 1 << 30


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_result(**overrides: Any) -> BenchResult:
    fields: dict[str, Any] = dict(
        name="mlp",
        recipe="llama3_8b",
        status="ok",
        config={"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
        shape={"num_layers": 4, "hidden_size": 1024, "seq_length": 2048, "micro_batch_size": 1, "max_steps": 3},
        device="cuda",
        gpu="NVIDIA H200",
        torch="2.13.0",
        date="2026-01-01T00:00:00+00:00",
        command="remat bench --recipe llama3_8b",
        step_time_s=0.5,
        fwd_bwd_time_s=0.45,
        tflops_per_gpu=100.0,
        tflops_fwd_bwd=110.0,
        tokens_per_s_per_gpu=4096.0,
        peak_allocated_bytes=1000 * GIB // 100,
        peak_reserved_bytes=1200 * GIB // 100,
        memory=MemoryBreakdown(weights=2 * GIB, grads=2 * GIB, optimizer=4 * GIB, activations=2 * GIB),
        losses=[10.0, 9.0, 8.0],
    )
    fields.update(overrides)
    return BenchResult(**fields)


def oom_result(name: str = "none", allocated: int = 20 * GIB) -> BenchResult:
    return make_result(
        name=name,
        status="oom",
        step_time_s=None,
        fwd_bwd_time_s=None,
        tflops_per_gpu=None,
        tflops_fwd_bwd=None,
        tokens_per_s_per_gpu=None,
        peak_allocated_bytes=None,
        peak_reserved_bytes=None,
        memory=None,
        losses=[],
        oom=OomInfo(allocated_bytes=allocated, reserved_bytes=allocated + GIB, message="CUDA out of memory"),
    )


def render(table: Table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


# (metric, golden value, whether a higher current value is a regression)
METRICS = [
    ("tflops_per_gpu", 100.0, False),
    ("peak_allocated_bytes", 1000, True),
    ("peak_reserved_bytes", 2000, True),
    ("loss", 2.0, True),
]


def with_metric(metric: str, value: float) -> BenchResult:
    if metric == "loss":
        return make_result(losses=[9.0, value])  # only the last step's loss counts
    return make_result(**{metric: value})


def check_of(metric: str, golden_value: float, current_value: float, **kwargs: float) -> MetricCheck:
    checks = compare(with_metric(metric, current_value), with_metric(metric, golden_value), **kwargs)
    return next(c for c in checks if c.metric == metric)


@pytest.mark.parametrize(("metric", "base", "higher_is_worse"), METRICS)
@pytest.mark.parametrize(("threshold", "factor_at", "factor_beyond"), [(None, 1.05, 1.06), (0.1, 1.1, 1.11)])
def test_compare_fails_both_directions_beyond_threshold(
    metric: str, base: float, higher_is_worse: bool, threshold: float | None, factor_at: float, factor_beyond: float
) -> None:
    kwargs = {} if threshold is None else {"threshold": threshold}
    for factor in (factor_at, 2 - factor_at):  # exactly at the threshold, either way, passes
        assert check_of(metric, base, base * factor, **kwargs).verdict == "ok"
    higher = check_of(metric, base, base * factor_beyond, **kwargs)
    lower = check_of(metric, base, base * (2 - factor_beyond), **kwargs)
    assert higher.rel_diff == pytest.approx(factor_beyond - 1)
    assert lower.rel_diff == pytest.approx(1 - factor_beyond)
    worse, better = (higher, lower) if higher_is_worse else (lower, higher)
    assert worse.verdict == "REGRESSION"
    assert better.verdict == "UNEXPECTED IMPROVEMENT"
    assert golden_failed([worse]) and golden_failed([better])


def test_compare_identical_runs_all_ok() -> None:
    checks = compare(make_result(), make_result())
    assert [c.metric for c in checks] == ["tflops_per_gpu", "peak_allocated_bytes", "peak_reserved_bytes", "loss"]
    assert all(c.verdict == "ok" and c.rel_diff == 0 for c in checks)
    assert not golden_failed(checks)


def test_compare_reports_values() -> None:
    check = check_of("tflops_per_gpu", 100.0, 90.0)
    assert (check.golden, check.current, check.verdict) == (100.0, 90.0, "REGRESSION")


def test_oom_against_ok_golden_is_status_regression() -> None:
    checks = compare(oom_result(), make_result())
    assert [(c.metric, c.verdict) for c in checks] == [("status", "REGRESSION")]
    assert golden_failed(checks)


def test_ok_against_oom_golden_is_unexpected_improvement() -> None:
    checks = compare(make_result(), oom_result())
    assert [(c.metric, c.verdict) for c in checks] == [("status", "UNEXPECTED IMPROVEMENT")]


def test_missing_metrics_are_skipped_and_named() -> None:
    current = make_result(tflops_per_gpu=None, losses=[])
    gold = make_result(peak_reserved_bytes=None)
    assert [c.metric for c in compare(current, gold)] == ["peak_allocated_bytes"]
    assert uncompared(current, gold) == [
        "tflops_per_gpu not compared: the golden has it, this run has none",
        "peak_reserved_bytes not compared: this run has it, the golden has none; save a new golden to compare it",
        "loss not compared: the golden has it, this run has none",
    ]
    assert compare(oom_result(), oom_result()) == [] and uncompared(oom_result(), oom_result()) == []
    assert uncompared(oom_result(), make_result()) == []  # only the status is compared, by design


def test_nan_loss_is_regression() -> None:
    assert check_of("loss", 2.0, float("nan")).verdict == "REGRESSION"


def test_zero_golden_compares_without_dividing_by_zero() -> None:
    assert check_of("peak_reserved_bytes", 0, 0).verdict == "ok"
    assert check_of("peak_reserved_bytes", 0, 10).verdict == "REGRESSION"


def test_negative_threshold_rejected() -> None:
    with pytest.raises(ValueError, match="threshold"):
        compare(make_result(), make_result(), threshold=-0.1)


def test_mismatch_notes_name_the_gpu_and_config() -> None:
    gold = make_result()
    assert mismatch_notes(make_result(), gold) == []
    current = make_result(gpu="NVIDIA H100 80GB HBM3", config={"recompute_granularity": "full"})
    assert mismatch_notes(current, gold) == [
        "gpu differs: golden 'NVIDIA H200', current 'NVIDIA H100 80GB HBM3'",
        "config.recompute_granularity differs: golden 'selective', current 'full'",
        "config.recompute_modules differs: golden ['mlp'], current '<absent>'",
    ]


def test_run_differences_name_the_recipe_and_shape() -> None:
    gold = make_result()
    assert run_differences(gold, gold.recipe, gold.shape) == []
    assert run_differences(gold, "qwen3_8b", {**gold.shape, "seq_length": 4096}) == [
        "recipe differs: golden 'llama3_8b', current 'qwen3_8b'",
        "shape.seq_length differs: golden 2048, current 4096",
    ]
    # a golden from before gradient accumulation was fused ran without it
    assert run_differences(gold, gold.recipe, {**gold.shape, "gradient_accumulation_fusion": True}) == [
        "shape.gradient_accumulation_fusion differs: golden False, current True"
    ]
    assert run_differences(gold, gold.recipe, {**gold.shape, "gradient_accumulation_fusion": False}) == []
    # the loss compared is the last step's: another step count is another run
    assert run_differences(gold, gold.recipe, {**gold.shape, "max_steps": 4}) == [
        "shape.max_steps differs: golden 3, current 4"
    ]
    # a golden from before max_steps was recorded: an ok run logged a loss each step
    older = make_result(shape={k: v for k, v in gold.shape.items() if k != "max_steps"})
    assert run_differences(older, gold.recipe, gold.shape) == []
    assert run_differences(older, gold.recipe, {**gold.shape, "max_steps": 6}) == [
        "shape.max_steps differs: golden 3, current 6"
    ]


def test_a_golden_of_another_layout_checks_the_loss_alone() -> None:
    gold = make_result()  # one process
    shape = {**gold.shape, "tensor_parallel": 2, "pipeline_parallel": 2}
    assert run_differences(gold, gold.recipe, shape) == []  # the same run on other GPUs
    # throughput and memory per GPU are the layout's own: a quarter of them is no regression
    current = make_result(shape=shape, tflops_per_gpu=25.0, peak_allocated_bytes=GIB, peak_reserved_bytes=GIB)
    assert [(c.metric, c.verdict) for c in compare(current, gold)] == [("loss", OK)]
    assert uncompared(make_result(shape=shape, losses=[]), gold) == [
        "loss not compared: the golden has it, this run has none"
    ]
    (loss,) = compare(make_result(shape=shape, losses=[10.0, 9.0, 8.5]), gold)
    assert loss.metric == "loss" and loss.verdict == REGRESSION
    assert mismatch_notes(current, gold) == [
        "layout differs: golden one process, current tensor_parallel=2, pipeline_parallel=2; the loss alone is compared"
    ]
    # the same layout on both sides compares every metric
    assert {c.metric for c in compare(current, make_result(shape=shape))} == {m for m, *_ in METRICS}


def test_save_load_round_trip(tmp_path: Path) -> None:
    for result in (make_result(), oom_result()):
        path = save_golden(result, tmp_path / "goldens" / f"{result.name}.json")
        assert path.read_text().startswith("{\n  ")  # pretty-printed for reviewable diffs
        assert load_golden(path) == result


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"name": "x"}', "not a remat bench result"),
        (json.dumps({**make_result().to_dict(), "status": "maybe"}), "unknown status"),
    ],
)
def test_load_golden_invalid(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "golden.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_golden(path)


def test_history_round_trip_newest_first(tmp_path: Path) -> None:
    db = tmp_path / "nested" / "history.sqlite"
    older = make_result(name="older", date="2026-01-01T00:00:00+00:00")
    newer = oom_result(name="newer")
    newer = dataclasses.replace(newer, date="2026-01-02T00:00:00+00:00")
    first = history.append(newer, db)  # inserted first, yet newest by date
    second = history.append(older, db)
    assert second == first + 1
    assert history.recent(path=db) == [newer, older]
    assert history.recent(limit=1, path=db) == [newer]


def test_history_columns(tmp_path: Path) -> None:
    """Every column holds its own field (SQL queries read them without the JSON)."""
    db = tmp_path / "history.sqlite"
    result = make_result()
    history.append(result, db)
    with closing(sqlite3.connect(db)) as conn:
        conn.row_factory = sqlite3.Row
        row = dict(conn.execute("SELECT * FROM runs").fetchone())
    assert row == {
        "id": 1,
        "date": "2026-01-01T00:00:00+00:00",
        "gpu": "NVIDIA H200",
        "torch": "2.13.0",
        "recipe": "llama3_8b",
        "name": "mlp",
        "status": "ok",
        "tflops_per_gpu": 100.0,
        "peak_allocated_bytes": 10 * GIB,
        "peak_reserved_bytes": 12 * GIB,
        "config": json.dumps(result.config, sort_keys=True),
        "command": "remat bench --recipe llama3_8b",
        "result": json.dumps(result.to_dict()),
    }


def test_history_env_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "env" / "runs.sqlite"
    monkeypatch.setenv("REMAT_HISTORY", str(db))
    assert history.default_history_path() == db
    assert history.recent() == []
    assert not db.exists()  # reading does not create a history
    history.append(make_result())
    assert db.exists()
    assert [r.name for r in history.recent()] == ["mlp"]


def test_history_default_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("REMAT_HISTORY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert history.default_history_path() == tmp_path / ".cache" / "remat" / "history.sqlite"


def test_history_concurrent_writers(tmp_path: Path) -> None:
    db = tmp_path / "history.sqlite"
    ids: list[int] = []
    lock = threading.Lock()

    def write(i: int) -> None:
        row_id = history.append(make_result(name=f"run{i}"), db)
        with lock:
            ids.append(row_id)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(ids) == list(range(1, 9))
    assert len(history.recent(limit=100, path=db)) == 8


def test_pareto_frontier() -> None:
    points = [(4.0, 90.0), (2.0, 50.0), (3.0, 40.0), (2.0, 60.0), (5.0, 80.0), (6.0, 95.0), (1.0, 10.0)]
    assert pareto_frontier(points) == [(1.0, 10.0), (2.0, 60.0), (4.0, 90.0), (6.0, 95.0)]
    assert pareto_frontier([]) == []


PARETO_RUNS = [
    make_result(name="selective", peak_allocated_bytes=30 * GIB, tflops_per_gpu=400.0),
    make_result(name="full_1", peak_allocated_bytes=20 * GIB, tflops_per_gpu=300.0),
    make_result(name="worse", peak_allocated_bytes=35 * GIB, tflops_per_gpu=350.0),
    oom_result(name="none", allocated=140 * GIB),
]


def test_pareto_plot_writes_png(tmp_path: Path) -> None:
    backend = matplotlib.get_backend()
    path = pareto_plot(PARETO_RUNS, tmp_path / "plots" / "pareto.png", anchors=[("torch", 25.0, 380.0)], title="t")
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000
    assert matplotlib.get_backend() == backend  # the user's backend is untouched


def test_pareto_plot_marks_ooms_apart_from_the_runs_and_frontier() -> None:
    """An OOM run is a red x at the memory it held when it failed, at the bottom of the axes (it has
    no throughput), named "(OOM)"; it is neither a run point nor on the frontier."""
    fig = pareto_figure(PARETO_RUNS, anchors=[("torch", 25.0, 380.0)], title="t")
    ax = fig.axes[0]
    assert scatter_points(fig, "OOM (allocated at failure)") == [(140.0, 0.03)]  # y in axes coordinates
    (ooms,) = [c for c in ax.collections if c.get_label() == "OOM (allocated at failure)"]
    assert same_color(ooms.get_facecolor()[0], "red")
    assert scatter_points(fig, "runs") == [(30.0, 400.0), (20.0, 300.0), (35.0, 350.0)]
    assert scatter_points(fig, "reference") == [(25.0, 380.0)]
    labels = {text.get_text(): text.xy for text in ax.texts}
    assert labels == {
        "selective": (30.0, 400.0),
        "full_1": (20.0, 300.0),
        "worse": (35.0, 350.0),
        "none (OOM)": (140.0, 0.03),
        "torch": (25.0, 380.0),
    }
    (frontier,) = [line for line in ax.lines if line.get_label() == "Pareto frontier"]
    assert list(zip(frontier.get_xdata(), frontier.get_ydata())) == [(20.0, 300.0), (30.0, 400.0)]
    assert "OOM (allocated at failure)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_pareto_labels_of_close_points_do_not_overlap() -> None:
    """Names of runs a hair apart (as mlp+core_attn and mlp_act were) are placed apart, inside the figure."""
    runs = [
        make_result(name=name, peak_allocated_bytes=int((30 + 0.01 * i) * GIB), tflops_per_gpu=400.0 + 0.1 * i)
        for i, name in enumerate(["mlp+core_attn", "mlp_act", "core_attn+layernorm", "layernorm", "none"])
    ]
    fig = pareto_figure(runs)
    renderer = fig.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in fig.axes[0].texts]
    assert len(boxes) == 5
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    assert all(fig.bbox.contains(b.x0, b.y0) and fig.bbox.contains(b.x1, b.y1) for b in boxes)


def test_timeline_labels_stay_in_the_figure(tmp_path: Path) -> None:
    """The first window's name (fwd0, at op 0) is not clipped at the figure's left edge."""
    timeline = Timeline(
        allocated=(1, 2, 3, 2, 1),
        reserved=None,
        marks=((0, "fwd0"), (2, "head"), (3, "bwd0")),
        peaks={"fwd0": 2, "head": 3, "bwd0": 2},
    )
    fig = timeline_figure(timeline)
    fig.canvas.draw()
    renderer, ax = fig.canvas.get_renderer(), fig.axes[0]
    inside = ax.get_window_extent(renderer)
    names = {text.get_text(): text.get_window_extent(renderer) for text in ax.texts}
    assert set(names) == {"fwd0", "bwd0"}
    assert all(inside.x0 <= box.x0 and box.x1 <= inside.x1 for box in names.values())
    assert timeline_plot(timeline, tmp_path / "t.png").read_bytes().startswith(PNG_SIGNATURE)


def scatter_points(fig: Figure, label: str) -> list[tuple[float, float]]:
    """The (x, y) of the scatter drawn with this legend label."""
    (points,) = [c for c in fig.axes[0].collections if c.get_label() == label]
    return [(float(x), float(y)) for x, y in points.get_offsets()]


def test_pareto_plot_draws_the_tables_whole_step_throughput(tmp_path: Path) -> None:
    """The y axis is the results table's TFLOP/s/GPU, not the forward+backward column beside it."""
    results = [
        make_result(name="selective", peak_allocated_bytes=30 * GIB, tflops_per_gpu=380.0, tflops_fwd_bwd=400.0),
        make_result(name="full_1", peak_allocated_bytes=20 * GIB, tflops_per_gpu=290.0, tflops_fwd_bwd=300.0),
    ]  # every bench result has both
    fig = pareto_figure(results)
    assert scatter_points(fig, "runs") == [(30.0, 380.0), (20.0, 290.0)]
    assert fig.axes[0].get_ylabel() == "TFLOP/s/GPU (whole step, as in the table)"
    # the axes span the points with a margin for their names, not from zero
    (x0, x1), (y0, y1) = fig.axes[0].get_xlim(), fig.axes[0].get_ylim()
    assert 17.0 < x0 < 20.0 and 30.0 < x1 < 33.0 and 250.0 < y0 < 290.0 and 380.0 < y1 < 420.0
    assert pareto_plot([], tmp_path / "empty.png").read_bytes().startswith(PNG_SIGNATURE)


def test_format_gib() -> None:
    assert format_gib(3 * GIB // 2) == "1.50 GiB"
    assert format_gib(None) == "-"


def test_results_table_renders() -> None:
    text = render(results_table([make_result(name="selective"), oom_result(name="none")], title="llama3_8b"))
    for expected in (
        "llama3_8b",
        "selective",
        "none",
        "oom",
        "500.0",
        "100.0",
        "110.0",
        "4,096",
        "10.00 GiB",
        "12.00 GiB",
        "20.00 GiB at OOM",
        "21.00 GiB at OOM",
        "fwd+bwd TFLOP/s",
    ):
        assert expected in text


def test_results_table_hides_fwd_bwd_when_absent() -> None:
    assert "fwd+bwd" not in render(results_table([make_result(tflops_fwd_bwd=None)]))


def test_memory_table_renders() -> None:
    text = render(memory_table(make_result()))
    for expected in (
        "weights",
        "grads",
        "optimizer state",
        "activations",
        "peak allocated",
        "peak reserved",
        "4.00 GiB",
        "40.0%",
        "12.00 GiB",
    ):
        assert expected in text
    assert "20.00 GiB at OOM" in render(memory_table(oom_result()))


def test_memory_table_counts_gradients_built_in_backward_once() -> None:
    """With one micro-batch and an optimizer step the gradients are built during backward: the
    activations' row holds them, so their own row gives no second share of the peak."""
    result = make_result()
    result.memory = dataclasses.replace(result.memory, grads_persist=False)
    rows = {line.split()[1]: line for line in render(memory_table(result)).splitlines() if len(line.split()) > 2}
    assert "within activations" in rows["grads"] and "20.0%" in rows["weights"]
    assert "within activations" not in render(memory_table(make_result()))


def test_checks_table_writes_throughput_as_the_results_table_does() -> None:
    """CPU-sized throughputs keep three significant digits instead of rounding to 0.00."""
    check = check_of("tflops_per_gpu", 6.86e-05, 7.12e-05)
    row = next(line for line in render(checks_table([check])).splitlines() if "tflops_per_gpu" in line)
    assert "6.86e-05" in row and "7.12e-05" in row
    assert "6.86e-05" in render(results_table([make_result(tflops_per_gpu=6.86e-05)]))


def test_checks_table_renders() -> None:
    checks = [
        check_of("tflops_per_gpu", 100.0, 80.0),
        check_of("peak_allocated_bytes", 10 * GIB, 8 * GIB),
        check_of("loss", 2.0, 2.0),
        *compare(oom_result(), make_result()),
    ]
    text = render(checks_table(checks))
    for expected in (
        "golden comparison",
        "REGRESSION",
        "UNEXPECTED IMPROVEMENT",
        "-20.0%",
        "10.00 GiB",
        "8.00 GiB",
        "2.0000",
        "status",
        "oom",
    ):
        assert expected in text
