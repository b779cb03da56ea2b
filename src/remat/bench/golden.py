"""Compare a run with a stored golden run the way Megatron Bridge's perf evaluator does.

A golden of another parallel layout (the same model, recipe and global batch on other GPUs) checks the
loss alone: remat draws the same weights and data whatever the layout, so the loss must agree, while
throughput and memory per GPU are the layout's own.

A relative difference beyond the threshold fails in both directions: a slower or bigger run is a REGRESSION, and a
faster or smaller one is an UNEXPECTED IMPROVEMENT, since it usually means the run measured something other than
the golden did (and if it is real, the golden should be updated). A timing difference inside what noise alone makes
of the two runs (their step times' spread; on CPU, a factor of two) is not a failure: it is "within noise".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from remat.bench.result import BenchResult, timing_noise
from remat.config.fields import public_names
from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError, Problem, read_file

Verdict = Literal["ok", "within noise", "REGRESSION", "UNEXPECTED IMPROVEMENT"]
OK: Verdict = "ok"
# beyond the threshold but inside what noise alone makes of these two runs' step times: no failure
NOISE: Verdict = "within noise"
REGRESSION: Verdict = "REGRESSION"
UNEXPECTED_IMPROVEMENT: Verdict = "UNEXPECTED IMPROVEMENT"

DEFAULT_THRESHOLD = 0.05  # Bridge's --timing_threshold and --memory_threshold
# Numeric values of the `status` pseudo-metric: an OOM run delivers none of the golden's throughput.
STATUS_VALUES: dict[str, float] = {"ok": 1.0, "oom": 0.0}
# Lets a difference of exactly the threshold pass although the subtraction rounds.
_ROUNDING_SLACK = 1e-12


@dataclass(frozen=True)
class MetricCheck:
    """One metric of a run against the golden; rel_diff is signed, (current - golden) / |golden|."""

    metric: str
    golden: float
    current: float
    rel_diff: float
    verdict: Verdict
    noise: float | None = None  # the relative difference noise alone can make (timed metrics)


@dataclass(frozen=True)
class _Metric:
    name: str
    read: Callable[[BenchResult], float | None]
    higher_is_worse: bool
    timed: bool = False  # measured by the clock, so as noisy as the runs' step times


def _last_loss(result: BenchResult) -> float | None:
    return result.losses[-1] if result.losses else None


METRICS: tuple[_Metric, ...] = (
    _Metric("tflops_per_gpu", lambda r: r.tflops_per_gpu, higher_is_worse=False, timed=True),
    _Metric("peak_allocated_bytes", lambda r: r.peak_allocated_bytes, higher_is_worse=True),
    _Metric("peak_reserved_bytes", lambda r: r.peak_reserved_bytes, higher_is_worse=True),
    _Metric("loss", _last_loss, higher_is_worse=True),
)


# the parallel sizes a result's shape records (bench.run.run_shape), each only where above 1
LAYOUT_FIELDS = (
    "data_parallel",
    "tensor_parallel",
    "sequence_parallel",
    "pipeline_parallel",
    "virtual_pipeline_parallel",
    "context_parallel",
    "expert_model_parallel_size",
)


def _layout_of(shape: Mapping[str, Any]) -> dict[str, Any]:
    return {key: shape[key] for key in LAYOUT_FIELDS if key in shape}


def _without_layout(shape: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in shape.items() if key not in LAYOUT_FIELDS}


def _describe_layout(shape: Mapping[str, Any]) -> str:
    sizes = _layout_of(shape)
    return ", ".join(f"{key}={size}" for key, size in sizes.items()) or "one process"


def _relative_diff(current: float, golden: float) -> float:
    if golden == 0:
        return 0.0 if current == 0 else math.copysign(math.inf, current)
    return (current - golden) / abs(golden)


def _verdict(rel_diff: float, *, higher_is_worse: bool, threshold: float, noise: float | None) -> Verdict:
    if math.isnan(rel_diff):  # a NaN loss (or golden) cannot be vouched for
        return REGRESSION
    if abs(rel_diff) <= threshold + _ROUNDING_SLACK:
        return OK
    if noise is not None and abs(math.log1p(rel_diff)) <= math.log1p(noise):  # as far either way, by ratio
        return NOISE
    worse = rel_diff > 0 if higher_is_worse else rel_diff < 0
    return REGRESSION if worse else UNEXPECTED_IMPROVEMENT


def _check(
    name: str, current: float, golden: float, *, higher_is_worse: bool, threshold: float, noise: float | None = None
) -> MetricCheck:
    rel = _relative_diff(current, golden)
    verdict = _verdict(rel, higher_is_worse=higher_is_worse, threshold=threshold, noise=noise)
    return MetricCheck(name, float(golden), float(current), rel, verdict, noise)


def threshold_problems(threshold: float) -> Iterator[Problem]:
    if not threshold >= 0:
        yield Problem("threshold", f"is {threshold}; a golden comparison needs a relative threshold >= 0, e.g. 0.05")


def compare(current: BenchResult, golden: BenchResult, threshold: float = DEFAULT_THRESHOLD) -> list[MetricCheck]:
    """Check every metric present on both sides. When the statuses differ only the `status` pseudo-metric is
    reported: an OOM run's partial numbers say nothing about the configuration's steady state."""
    problems = list(threshold_problems(threshold))
    if problems:
        raise ConfigError(problems)
    if current.status != golden.status:
        return [
            _check(
                "status",
                STATUS_VALUES[current.status],
                STATUS_VALUES[golden.status],
                higher_is_worse=False,
                threshold=threshold,
            )
        ]
    checks = []
    noise = timing_noise(current, golden)
    for metric in _comparable(current, golden):
        golden_value, current_value = metric.read(golden), metric.read(current)
        if golden_value is None or current_value is None:
            continue
        checks.append(
            _check(
                metric.name,
                current_value,
                golden_value,
                higher_is_worse=metric.higher_is_worse,
                threshold=threshold,
                noise=noise if metric.timed else None,
            )
        )
    return checks


def _comparable(current: BenchResult, golden: BenchResult) -> tuple[_Metric, ...]:
    """Every metric on the golden's layout; the loss alone on another (throughput and memory per GPU
    are the layout's own)."""
    if _layout_of(current.shape) == _layout_of(golden.shape):
        return METRICS
    return tuple(metric for metric in METRICS if metric.name == "loss")


def golden_failed(checks: Sequence[MetricCheck]) -> bool:
    return any(check.verdict not in (OK, NOISE) for check in checks)


def uncompared(current: BenchResult, golden: BenchResult) -> list[str]:
    """The metrics `compare` skipped because one side lacks them (reserved memory on CPU against a GPU
    golden), each saying which side; none when the statuses differ and only the status counts."""
    if current.status != golden.status:
        return []
    return [
        f"{m.name} not compared: "
        + (
            "the golden has it, this run has none"
            if m.read(current) is None
            else "this run has it, the golden has none; save a new golden to compare it"
        )
        for m in _comparable(current, golden)
        if (m.read(current) is None) != (m.read(golden) is None)
    ]


_ABSENT = "<absent>"


def _dict_notes(label: str, golden: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [
        f"{label}.{key} differs: golden {golden.get(key, _ABSENT)!r}, current {current.get(key, _ABSENT)!r}"
        for key in sorted(set(golden) | set(current))
        if golden.get(key, _ABSENT) != current.get(key, _ABSENT)
    ]


def _shape(shape: Mapping[str, Any]) -> dict[str, Any]:
    # a result recorded before remat fused gradient accumulation ran without it
    return {"gradient_accumulation_fusion": False, **shape}


def _field_note(field: str, golden: Any, current: Any) -> list[str]:
    return [f"{field} differs: golden {golden!r}, current {current!r}"] if golden != current else []


def run_differences(golden: BenchResult, recipe: str, shape: Mapping[str, Any]) -> list[str]:
    """What makes a run of this recipe and shape (run.run_shape, known before it runs) another run than
    the golden's: Bridge's evaluator compares like with like, so these refuse the comparison."""
    golden_shape = _shape(golden.shape)
    if golden.status == "ok":  # recorded before max_steps was: a run that ended ok logged a loss a step
        golden_shape.setdefault("max_steps", len(golden.losses))
    return _field_note("recipe", golden.recipe, recipe) + _dict_notes(
        "shape", _without_layout(golden_shape), _without_layout(_shape(shape))
    )


def golden_match_problems(differences: Sequence[str]) -> Iterator[Problem]:
    """A golden of another recipe or shape measured another run (golden.run_differences)."""
    if differences:
        yield Problem(
            "golden",
            f"was measured on another run ({'; '.join(differences)}); run with the golden's"
            " recipe and shape, or store this run as a new golden with --save-golden",
        )


def mismatch_notes(current: BenchResult, golden: BenchResult) -> list[str]:
    """Differences worth a note that leave the comparison meaningful: the layout (the loss alone is
    compared), the GPU's name (a golden from another H100 variant still says something), the
    recompute config (what a config costs)."""
    layouts = _describe_layout(golden.shape), _describe_layout(current.shape)
    across = (
        [f"layout differs: golden {layouts[0]}, current {layouts[1]}; the loss alone is compared"]
        if layouts[0] != layouts[1]
        else []
    )
    layout_keys = public_names(ParallelLayout) if across else {}  # the config records the layout: said above
    configs = [{k: v for k, v in c.items() if k not in layout_keys} for c in (golden.config, current.config)]
    return across + _field_note("gpu", golden.gpu, current.gpu) + _dict_notes("config", *configs)


def save_golden(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return out


def load_golden(path: str | os.PathLike[str]) -> BenchResult:
    """Read a golden written by save_golden; any problem with the file is a ValueError naming it."""
    source = Path(path)
    data = read_file(source, json.loads, "JSON")
    if not isinstance(data, dict):
        raise ValueError(f"golden file {source} must hold a JSON object, got {type(data).__name__}")
    try:
        result = BenchResult.from_dict(data)
    except ValueError as err:
        raise ValueError(
            f"golden file {source} is not a remat bench result ({err}); pass a file that"
            " `remat bench --save-golden` or `--json` wrote"
        ) from None
    if result.status not in STATUS_VALUES:
        raise ValueError(f"golden file {source} has unknown status {result.status!r}")
    return result
