"""Checks for common recompute mistakes on `remat bench --json` / `remat sweep --json` results.

Each check compares results of one recipe, shape and GPU, and names the run, the numbers that
confirm the finding and what to change: mlp recompute on a large FFN, layernorm alone, mlp with
core_attn, full recompute under per-layer CUDA graphs, CPU offload with pipeline parallelism,
and what kind of out-of-memory each failed run hit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.bench.result import BenchResult, timing_noise
from remat.config.recompute import recorded_config
from remat.config.rules import rule_cpu_offload_not_with_pipeline, rule_full_recompute_graph_scope
from remat.core.problems import ConfigError, Problem, count, read_file
from remat.core.sizes import format_bytes
from remat.doctor import AllocatorState, report_of

# Every threshold the checks use, with where it comes from.
MLP_SLOWDOWN = 0.15  # Megatron users' rule of thumb: mlp recompute costs over 15% on a large FFN
LARGE_FFN = 3.0  # ffn_hidden / hidden at or above this is a large FFN (Llama-3: 14336/4096 = 28672/8192 = 3.5)
LAYERNORM_PEAK_MOVE = 0.01  # a layernorm-only change moving the peak less than this moved nothing
SLOWER_MARGIN = 0.005  # the least difference called slower, even where the runs' spread is smaller


@dataclass(frozen=True)
class Finding:
    check: str
    symptom: str
    cause: str
    confirmed_by: str  # the numbers the check used
    fix: str


def _modules(result: BenchResult) -> frozenset[str] | None:
    """The selective labels of a plain recompute config (empty: none); None for full recompute,
    offloading or per-layer plans, which the module comparisons leave out."""
    c = result.config
    if c.get("cpu_offloading") or c.get("fine_grained_activation_offloading") or "layers" in c:
        return None
    if c.get("recompute_granularity") == "selective":
        return frozenset(c.get("recompute_modules") or [])
    return frozenset() if c.get("recompute_granularity") is None else None


def _comparable(results: Sequence[BenchResult]) -> Iterator[dict[frozenset[str], BenchResult]]:
    """Results of one recipe, shape and GPU, by their selective labels."""
    groups: dict[str, dict[frozenset[str], BenchResult]] = {}
    for r in results:
        labels = _modules(r)
        if labels is not None:
            key = json.dumps([r.recipe, r.gpu, r.shape], sort_keys=True)
            groups.setdefault(key, {})[labels] = r
    yield from groups.values()


def _speed(r: BenchResult) -> tuple[float, str] | None:
    if r.status != "ok":
        return None
    if r.tflops_per_gpu is not None:
        return r.tflops_per_gpu, "TFLOP/s"
    return (r.tokens_per_s_per_gpu, "tokens/s") if r.tokens_per_s_per_gpu is not None else None


def check_mlp_slowdown(results: Sequence[BenchResult]) -> list[Finding]:
    findings = []
    for group in _comparable(results):
        base = group.get(frozenset())
        for labels, r in group.items():
            ffn, hidden = r.shape.get("ffn_hidden_size"), r.shape.get("hidden_size")
            fast, slow = _speed(base) if base else None, _speed(r)
            if (
                base is None
                or "mlp" not in labels
                or not (fast and slow and ffn and hidden)
                or ffn / hidden < LARGE_FFN
            ):
                continue
            drop = 1 - slow[0] / fast[0]
            if drop > max(MLP_SLOWDOWN, timing_noise(base, r) or 0.0):
                rest = ",".join(sorted(labels - {"mlp"}))
                offload = "" if r.config.get("pipeline_model_parallel_size", 1) > 1 else ", or offload (-ol N)"
                findings.append(
                    Finding(
                        "mlp recompute cost",
                        f"{r.name}: {drop:.1%} lower throughput than no recompute",
                        "mlp recompute reruns a large FFN in backward",
                        f"{r.name} {slow[0]:.4g} vs none {fast[0]:.4g} {slow[1]} (-{drop:.1%} > {MLP_SLOWDOWN:.0%});"
                        f" ffn/hidden {ffn}/{hidden} = {ffn / hidden:.2f} >= {LARGE_FFN:g}",
                        f"drop mlp ({f'--recompute_modules {rest}' if rest else 'no recompute'}), lower -mb"
                        f"{offload}; `remat plan --memory-budget` finds the cheapest plan that fits",
                    )
                )
    return findings


def _peak(r: BenchResult) -> int | None:
    return r.peak_allocated_bytes if r.status == "ok" else None


def check_layernorm_peak(results: Sequence[BenchResult]) -> list[Finding]:
    findings = []
    for group in _comparable(results):
        for labels, after in group.items():
            before = group.get(labels - {"layernorm"})
            if "layernorm" not in labels or before is None:
                continue
            fix = "recompute a module that holds more (mlp), or whole layers (-rl N); `remat plan` picks one"
            if before.status == after.status == "oom":
                findings.append(
                    Finding(
                        "layernorm alone",
                        f"{after.name}: still OOM after adding layernorm",
                        "layernorm activations are too small to move the peak",
                        f"{before.name} OOM at {format_bytes(before.oom.allocated_bytes)} allocated, {after.name} OOM at"
                        f" {format_bytes(after.oom.allocated_bytes)}"
                        if before.oom
                        and after.oom
                        and before.oom.allocated_bytes is not None
                        and after.oom.allocated_bytes is not None
                        else "both OOM",
                        fix,
                    )
                )
                continue
            a, b = _peak(before), _peak(after)
            if a and b is not None and abs(a - b) / a < LAYERNORM_PEAK_MOVE:
                findings.append(
                    Finding(
                        "layernorm alone",
                        f"{after.name}: peak memory did not move after adding layernorm",
                        "layernorm activations are too small to move the peak",
                        f"peak {format_bytes(a)} ({before.name}) -> {format_bytes(b)} ({after.name}),"
                        f" {(b - a) / a:+.2%} (under {LAYERNORM_PEAK_MOVE:.0%})",
                        fix,
                    )
                )
    return findings


def _rule_findings(
    results: Sequence[BenchResult], rule: Any, check: str, symptom: str, cause: str, facts: Callable[[Any], str]
) -> list[Finding]:
    """A `remat.config.rules` rule run on each result's recorded config (results from other harnesses may hold
    configs remat itself refuses); the rule's message says what to change."""
    findings = []
    for r in results:
        if "layers" in r.config:  # a per-layer plan: no Megatron keys
            continue
        config = recorded_config(r.config)
        findings += [Finding(check, f"{r.name}: {symptom}", cause, facts(config), p.message) for p in rule(config)]
    return findings


def check_full_recompute_graphs(results: Sequence[BenchResult]) -> list[Finding]:
    return _rule_findings(
        results,
        rule_full_recompute_graph_scope,
        "full recompute + CUDA graphs",
        "AssertionError: full recompute is only supported with full iteration CUDA graph",
        "layer-level recompute with module-scoped graph capture",
        lambda c: (
            f"recompute_granularity={c.recompute_granularity}, cuda_graph_impl={c.facts.capture.cuda_graph_impl},"
            f" cuda_graph_scope={list(c.facts.capture.cuda_graph_scope) or '[] (whole layers)'}"
        ),
    )


def check_offload_pipeline(results: Sequence[BenchResult]) -> list[Finding]:
    return _rule_findings(
        results,
        rule_cpu_offload_not_with_pipeline,
        "CPU offload + pipeline",
        "ValueError: PP + CPU offloading",
        "cpu_offloading=True with pipeline_model_parallel_size > 1",
        lambda c: (
            f"cpu_offloading={c.cpu_offloading} ({count(c.cpu_offloading_num_layers, 'layer')}),"
            f" pipeline_model_parallel_size={c.facts.layout.pp}"
        ),
    )


def check_mlp_core_attn(results: Sequence[BenchResult]) -> list[Finding]:
    findings = []
    for group in _comparable(results):
        alone, both = group.get(frozenset({"mlp"})), group.get(frozenset({"mlp", "core_attn"}))
        if not (alone and both):
            continue
        fast, slow = _speed(alone), _speed(both)
        noise = timing_noise(alone, both) or 0.0
        margin = max(SLOWER_MARGIN, noise)
        why = ", the runs' noise" if noise > SLOWER_MARGIN else ""
        if not (fast and slow) or 1 - slow[0] / fast[0] <= margin:
            continue
        a, b = _peak(alone), _peak(both)
        peaks = f"; peak {format_bytes(a)} -> {format_bytes(b)}" if a and b else ""
        findings.append(
            Finding(
                "mlp+core_attn",
                f"{both.name} slower than {alone.name}",
                "double recompute overhead",
                f"{both.name} {slow[0]:.4g} vs {alone.name} {fast[0]:.4g} {slow[1]} ({slow[0] / fast[0] - 1:+.1%},"
                f" beyond {margin:.1%}{why}){peaks}",
                "use --recompute_modules mlp alone",
            )
        )
    return findings


def check_oom_kind(results: Sequence[BenchResult]) -> list[Finding]:
    """Rule out fragmentation before recomputing more: each OOM whose allocator was recorded, or
    whose message gives its numbers, is classified; under torchrun, with the numbers of the rank
    that ran out."""
    findings = []
    for r in results:
        if r.oom is None:
            continue
        try:
            state = r.oom.allocator or AllocatorState.from_oom_message(r.oom.message)
        except ValueError:  # a message without the numbers (torch < 2.1 multi-line, or another harness)
            continue
        report = report_of(state, rank=r.oom.rank, coordinates=r.oom.coordinates)
        fix = report.recommendations[0].setting if report.recommendations else "nothing: the request fits now"
        findings.append(
            Finding(
                "OOM kind",
                f"{r.name}: out of memory{report.where}",
                report.diagnosis.kind,
                report.diagnosis.explanation,
                fix,
            )
        )
    return findings


CHECKS: tuple[Callable[[Sequence[BenchResult]], list[Finding]], ...] = (
    check_oom_kind,
    check_mlp_slowdown,
    check_layernorm_peak,
    check_full_recompute_graphs,
    check_offload_pipeline,
    check_mlp_core_attn,
)


def check_results(results: Sequence[BenchResult]) -> list[Finding]:
    """Every check on a bench or sweep's results."""
    return [finding for check in CHECKS for finding in check(results)]


def load_results(path: str | Path) -> list[BenchResult]:
    """`remat bench --json` (one result) or `remat sweep --json` (a list)."""
    data = read_file(Path(path), json.loads, "JSON")
    if data == []:
        raise ConfigError(
            [Problem(str(path), "holds no results; pass what `remat bench --json` or `remat sweep --json` wrote")]
        )
    try:
        return [BenchResult.from_dict(d) for d in (data if isinstance(data, list) else [data])]
    except (ValueError, TypeError, AttributeError) as err:
        raise ConfigError(
            [
                Problem(
                    str(path),
                    f"is not a remat bench result ({err}); pass what `remat bench "
                    "--json` or `remat sweep --json` wrote",
                )
            ]
        ) from None
