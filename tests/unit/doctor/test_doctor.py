"""remat doctor in one process: OOM classification on recorded allocator snapshots and on the OOM
messages of several torch versions, the recommendations, the watch() context manager, the checks
on bench results, what each site of each layer saved, and the doctor command's files and refusals.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_doctor_runs.py."""

from __future__ import annotations

import json
import pickle
import warnings
from typing import Any

import pytest
import torch

import remat
from remat import doctor
from remat.bench import findings as checks
from remat.bench.result import BenchResult, OomInfo
from remat.cli import main
from remat.config.megatron import TrainingFacts
from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.doctor import (
    EXPANDABLE_SEGMENTS,
    AllocatorState,
    classify,
    parse_oom_message,
    recommend,
)
from remat.doctor import allocator as doctor_allocator
from remat.doctor import report as doctor_report
from remat.memory import measure_saved
from remat.memory.prediction import Prediction
from remat.planner import PlanResult
from remat.planner.solver import NoPlanFits, Solution

GIB, MIB = 1 << 30, 1 << 20


def segment(*blocks: tuple[int, str], kind: str = "large", **extra: Any) -> dict[str, Any]:
    """A snapshot segment as torch.cuda.memory._snapshot() writes it (the fields the doctor reads)."""
    return {
        "device": 0,
        "address": 0,
        "total_size": sum(size for size, _ in blocks),
        "segment_type": kind,
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "blocks": [{"size": size, "state": state, "requested_size": size} for size, state in blocks],
        **extra,
    }


# 4 segments of 16 GiB, each 1 GiB tensors with every other one freed: 32 GiB allocated, 64 reserved,
# 32 free in 32 holes of 1 GiB.
CHECKERED = {"segments": [segment(*[(GIB, "active_allocated"), (GIB, "inactive")] * 8) for _ in range(4)]}


# 64 GiB reserved, 63 allocated, one 1 GiB hole.
FULL = {
    "segments": [segment((16 * GIB, "active_allocated")) for _ in range(3)]
    + [segment((15 * GIB, "active_allocated"), (GIB, "inactive"))]
}


def state_of(snapshot: dict[str, Any], request: int | None, limit: int = 66 * GIB) -> AllocatorState:
    return AllocatorState.from_snapshot(snapshot, {}, limit, request)


def test_snapshot_counts_allocated_reserved_and_holes() -> None:
    s = state_of(CHECKERED, 4 * GIB)
    assert (s.allocated, s.reserved, s.gap, s.headroom) == (32 * GIB, 64 * GIB, 32 * GIB, 2 * GIB)
    assert (s.largest_free_block, s.segments, s.free_blocks) == (GIB, 4, 32)
    # allocator statistics win over the block sums; adjacent free blocks are one hole
    s = AllocatorState.from_snapshot(
        {"segments": [segment((GIB, "inactive"), (GIB, "inactive"), (GIB, "active_allocated"))]},
        {"allocated_bytes.all.current": 5, "reserved_bytes.all.current": 7},
        8,
    )
    assert (s.allocated, s.reserved, s.largest_free_block, s.free_blocks) == (5, 7, 2 * GIB, 1)


def test_holes_of_private_pools_and_the_small_pool_do_not_serve_a_large_request() -> None:
    snap = {
        "segments": [
            segment((GIB, "active_allocated"), (3 * GIB, "inactive"), segment_pool_id=[1, 2]),
            segment((MIB, "inactive"), (MIB, "active_allocated"), kind="small"),
            segment((GIB, "active_allocated"), (GIB // 2, "inactive")),
        ]
    }
    assert state_of(snap, 2 * GIB).largest_free_block == GIB // 2
    assert state_of(snap, 4096).largest_free_block == GIB // 2  # the small pool's 1 MiB hole counts
    assert state_of(snap, 4096).free_blocks == 3


def test_checkered_memory_is_fragmentation() -> None:
    d = classify(state_of(CHECKERED, 4 * GIB))
    assert d.kind == "fragmentation"
    assert "32.00 GiB reserved but unallocated" in d.explanation and "1.00 GiB" in d.explanation
    assert d.evidence() == {
        "allocated": 32 * GIB,
        "reserved": 64 * GIB,
        "gap": 32 * GIB,
        "largest free block": GIB,
        "request": 4 * GIB,
        "limit": 66 * GIB,
        "headroom": 2 * GIB,
    }


def test_allocated_at_the_limit_is_capacity() -> None:
    d = classify(state_of(FULL, 4 * GIB))
    assert d.kind == "capacity"
    assert "allocated 63.00 GiB + the 4.00 GiB request exceeds the 66.00 GiB" in d.explanation


def test_a_request_that_fits_a_hole_or_the_headroom_is_not_an_oom() -> None:
    assert classify(state_of(CHECKERED, GIB)).kind == "fits"  # a 1 GiB hole holds it
    assert classify(state_of(CHECKERED, 4 * GIB, limit=80 * GIB)).kind == "fits"  # 16 GiB unreserved


def test_the_gap_plus_headroom_must_hold_the_request_for_fragmentation() -> None:
    # 32 GiB gap + 2 GiB headroom, a 40 GiB request: even compacted it would not fit
    assert classify(state_of(CHECKERED, 40 * GIB)).kind == "capacity"
    # 34 GiB would fit compacted, and no piece holds it
    assert classify(state_of(CHECKERED, 34 * GIB)).kind == "fragmentation"


def test_a_small_gap_is_rounding_slack_not_fragmentation() -> None:
    # 1 GiB in four 256 MiB holes (1.5% of 64 GiB, under MIN_FRAGMENTATION_GAP), a 512 MiB request
    snap = {"segments": [segment((16 * GIB - GIB // 4, "active_allocated"), (GIB // 4, "inactive")) for _ in range(4)]}
    s = state_of(snap, GIB // 2, limit=64 * GIB + 100 * MIB)
    assert s.gap + s.headroom >= s.request and s.gap < doctor.MIN_FRAGMENTATION_GAP * s.limit
    d = classify(s)
    assert d.kind == "capacity" and "the 1.00 GiB in holes is ordinary slack (under 5% of the limit)" in d.explanation


def test_other_processes_shrink_the_headroom() -> None:
    s = AllocatorState.from_snapshot(FULL, {}, 80 * GIB, 4 * GIB, device_free=GIB)
    d = classify(s)
    assert s.headroom == GIB and d.kind == "capacity"
    assert "15.00 GiB of the limit is held outside this allocator" in d.explanation


def test_without_a_request_the_shape_of_the_free_memory_decides() -> None:
    assert classify(state_of(CHECKERED, None)).kind == "fragmentation"
    assert classify(state_of(FULL, None)).kind == "capacity"
    one_hole = {"segments": [segment((16 * GIB, "active_allocated"), (16 * GIB, "inactive"))]}
    assert classify(state_of(one_hole, None)).kind == "fits"


OLD = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 45.11 GiB already "
    "allocated; 1.23 GiB free; 77.00 GiB reserved in total by PyTorch) If reserved memory is >> allocated "
    "memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory Management "
    "and PYTORCH_CUDA_ALLOC_CONF"
)


OLD_FRACTION = (
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.15 GiB total capacity; 15.11 GiB "
    "already allocated; 60.23 GiB free; 16.00 GiB allowed; 15.50 GiB reserved in total by PyTorch)"
)


NEW = (
    "CUDA out of memory. Tried to allocate 1.22 GiB. GPU 0 has a total capacity of 15.77 GiB of which "
    "959.44 MiB is free. Process 12447 has 14.83 GiB memory in use. Of the allocated memory 14.01 GiB is "
    "allocated by PyTorch, and 472.05 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
    "See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-"
    "variables)"
)


NEW_POOLS = (
    "CUDA out of memory. Tried to allocate 512 bytes. GPU 1 has a total capacity of 139.81 GiB of "
    "which 4.00 KiB is free. Including non-PyTorch memory, this process has 139.80 GiB memory in use. "
    "20.00 GiB allowed; Of the allocated memory 60.00 GiB is allocated by PyTorch, with 2.00 GiB "
    "allocated in private pools (e.g., CUDA Graphs), and 12.50 GiB is reserved by PyTorch but "
    "unallocated."
)


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            OLD,
            dict(
                request=2 * GIB,
                capacity=round(79.15 * GIB),
                free=round(1.23 * GIB),
                allowed=None,
                allocated=round(45.11 * GIB),
                reserved=77 * GIB,
            ),
        ),
        (
            OLD_FRACTION,
            dict(
                request=20 * MIB,
                capacity=round(79.15 * GIB),
                free=round(60.23 * GIB),
                allowed=16 * GIB,
                allocated=round(15.11 * GIB),
                reserved=round(15.5 * GIB),
            ),
        ),
        (
            NEW,
            dict(
                request=round(1.22 * GIB),
                capacity=round(15.77 * GIB),
                free=round(959.44 * MIB),
                allowed=None,
                allocated=round(14.01 * GIB),
                reserved=round(14.01 * GIB) + round(472.05 * MIB),
            ),
        ),
        (
            NEW_POOLS,
            dict(
                request=512,
                capacity=round(139.81 * GIB),
                free=4096,
                allowed=20 * GIB,
                allocated=60 * GIB,
                reserved=72.5 * GIB,
            ),
        ),
        (
            "RuntimeError: CUDA error: an illegal memory access",
            dict(request=None, capacity=None, free=None, allowed=None, allocated=None, reserved=None),
        ),
    ],
)
def test_oom_messages_of_several_torch_versions(message: str, expected: dict[str, Any]) -> None:
    parsed = parse_oom_message(message)
    assert {k: getattr(parsed, k) for k in expected} == expected
    assert parsed.limit == (expected["allowed"] or expected["capacity"])


def test_a_message_alone_classifies() -> None:
    # 77 reserved, 45 allocated: 32 GiB in holes, yet 2 GiB failed
    assert classify(AllocatorState.from_oom_message(OLD)).kind == "fragmentation"
    # 0.46 GiB holes + 0.94 GiB free would hold 1.22 GiB, but 0.46 GiB is 2.9% of the card: capacity
    assert classify(AllocatorState.from_oom_message(NEW)).kind == "capacity"
    holed = NEW.replace("14.01 GiB is allocated", "10.01 GiB is allocated").replace("472.05 MiB", "4.47 GiB")
    assert classify(AllocatorState.from_oom_message(holed)).kind == "fragmentation"
    with pytest.raises(ValueError, match="pass a snapshot"):
        AllocatorState.from_oom_message("CUDA out of memory. Tried to allocate 2.00 GiB")


def plan_result(config: RecomputeConfig | None, budget: int, peak: int = 60 * GIB) -> PlanResult:
    return PlanResult(budget, Plan.none(8), config, Prediction(10 * GIB, peak, 1.25, "bwd7"), ())


def test_fragmentation_recommends_expandable_segments_only() -> None:
    recs = recommend(classify(state_of(CHECKERED, 4 * GIB)), plan_fn=lambda b: pytest.fail("no plan needed"))
    assert [r.setting for r in recs] == [EXPANDABLE_SEGMENTS]
    assert recs[0].setting == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert "32.00 GiB reserved but unallocated, largest free block 1.00 GiB" in recs[0].why


def test_capacity_recommends_the_planners_fastest_plan_with_its_flags() -> None:
    budgets: list[int] = []

    def plan_fn(budget: int) -> PlanResult:
        budgets.append(budget)
        return plan_result(RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]), budget)

    recs = recommend(classify(state_of(FULL, 4 * GIB)), plan_fn=plan_fn, micro_batch_size=4)
    assert budgets == [int(66 * GIB * doctor.PLAN_BUDGET_SHARE)]
    assert [r.setting for r in recs] == ["--recompute_modules mlp"]
    assert recs[0].why == "predicted peak 60.00 GiB (in bwd7) under the 62.70 GiB budget, step 1250.0 ms"
    full = RecomputeConfig(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=2,
        facts=TrainingFacts(num_layers=8),
    )
    assert (
        recommend(classify(state_of(FULL, 4 * GIB)), plan_fn=lambda b: plan_result(full, b))[0].setting
        == "--recompute_method uniform -rl 2"
    )
    per_layer = recommend(classify(state_of(FULL, 4 * GIB)), plan_fn=lambda b: plan_result(None, b))[0]
    assert per_layer.setting == "remat bench --config plan.yaml" and per_layer.plan is not None


def test_when_no_plan_fits_smaller_micro_batch_then_more_gpus() -> None:
    def plan_fn(budget: int) -> PlanResult:
        raise NoPlanFits(budget, Solution(Plan.none(8), (), 100 * GIB, "bwd0", 0.0))

    recs = recommend(classify(state_of(FULL, 4 * GIB)), plan_fn=plan_fn, micro_batch_size=4)
    assert [r.setting for r in recs] == ["-mb 2", "-tp 2 --sequence_parallel, or -pp 2, or -cp 2"]
    assert recs[0].why.startswith("the lowest peak any plan reaches, 100.00 GiB, is 1.59x the 62.70 GiB budget")
    # micro-batch 1 cannot shrink; 3.2x over needs 4 GPUs
    recs = recommend(
        classify(state_of(FULL, 4 * GIB)),
        micro_batch_size=1,
        plan_fn=lambda b: (_ for _ in ()).throw(NoPlanFits(b, Solution(Plan.none(8), (), 200 * GIB, "bwd0", 0.0))),
    )
    assert [r.setting for r in recs] == ["-tp 4 --sequence_parallel, or -pp 4, or -cp 4"]
    # 10000x over: no layout helps; the sizes given are suspect
    recs = recommend(
        classify(state_of(FULL, 4 * GIB)),
        micro_batch_size=1,
        plan_fn=lambda b: (_ for _ in ()).throw(
            NoPlanFits(b, Solution(Plan.none(8), (), 10**4 * 63 * GIB, "bwd0", 0.0))
        ),
    )
    assert [r.setting for r in recs] == ["--limit / --memory-budget"] and "more than 64 GPUs' worth" in recs[0].why


def test_capacity_without_a_planner_gives_the_plan_command() -> None:
    recs = recommend(classify(state_of(FULL, 4 * GIB)), micro_batch_size=2)
    assert (
        recs[0].setting == "remat plan [the run's -mr/-sl/-mb/... flags] --memory-budget 62.7GiB -o plan.yaml --verify"
    )
    assert [r.setting for r in recs[1:]] == ["-mb 1", "-tp 2 --sequence_parallel, or -pp 2, or -cp 2"]
    with_flags = recommend(classify(state_of(FULL, 4 * GIB)), micro_batch_size=2, run_flags="-mr llama3_8b -mb 2")
    assert with_flags[0].setting == "remat plan -mr llama3_8b -mb 2 --memory-budget 62.7GiB -o plan.yaml --verify"


def test_a_request_that_fits_needs_nothing_and_expandable_fragmentation_needs_less_memory() -> None:
    assert recommend(classify(state_of(CHECKERED, GIB))) == []
    grown = {"segments": [dict(s, is_expandable=True) for s in CHECKERED["segments"]]}
    recs = recommend(classify(state_of(grown, 4 * GIB)), micro_batch_size=2)
    # 36 GiB needed of a 62.7 GiB budget: no more GPUs or smaller micro-batch, a plan with room
    assert [r.setting for r in recs] == [
        "remat plan [the run's -mr/-sl/-mb/... flags] --memory-budget 62.7GiB -o plan.yaml --verify"
    ]


def test_diagnose_classifies_the_allocator_now(monkeypatch) -> None:
    monkeypatch.setattr(doctor_report, "capture", lambda device, request: state_of(CHECKERED, request))
    report = doctor.diagnose(request_bytes=4 * GIB)
    assert report.diagnosis.kind == "fragmentation" and report.recommendations[0].setting == EXPANDABLE_SEGMENTS
    monkeypatch.setattr(doctor_report, "capture", lambda device, request: state_of(FULL, request))
    assert doctor.diagnose(request_bytes=4 * GIB, micro_batch_size=2).diagnosis.kind == "capacity"


def test_watch_diagnoses_an_oom_and_reraises(monkeypatch) -> None:
    requests: list[int | None] = []

    def fake_capture(device: Any, request: int | None) -> AllocatorState:
        requests.append(request)
        return state_of(CHECKERED, request)

    monkeypatch.setattr(doctor_allocator, "capture", fake_capture)
    seen: list[doctor.Report] = []
    with pytest.raises(torch.OutOfMemoryError):
        with doctor.watch(torch.nn.Linear(2, 2), on_oom=seen.append) as doc:
            raise torch.OutOfMemoryError(NEW.replace("1.22 GiB", "4.00 GiB", 1))
    assert requests == [4 * GIB]
    assert seen == [doc.report] and doc.report.diagnosis.kind == "fragmentation"
    assert doc.report.recommendations[0].setting == EXPANDABLE_SEGMENTS
    assert doc.report.message.startswith("CUDA out of memory. Tried to allocate 4.00 GiB")
    assert "remat doctor: fragmentation" in str(doc.report)


def test_watch_can_swallow_and_falls_back_to_the_message_without_cuda() -> None:
    with doctor.watch(on_oom=None, reraise=False) as doc:
        raise torch.OutOfMemoryError(OLD)
    assert doc.report is not None and doc.report.diagnosis.kind == "fragmentation"  # no CUDA: the message
    assert doc.report.diagnosis.state.largest_free_block is None


def test_watch_takes_the_limit_of_a_memory_fraction_from_the_message(monkeypatch) -> None:
    # older torch cannot read the per-process fraction back: capture sees the whole device
    monkeypatch.setattr(doctor_allocator, "capture", lambda device, request: state_of(FULL, request, limit=140 * GIB))
    with doctor.watch(on_oom=None, reraise=False) as doc:
        raise torch.OutOfMemoryError(NEW_POOLS.replace("512 bytes", "4.00 GiB").replace("20.00 GiB", "66.00 GiB"))
    assert doc.report.diagnosis.state.limit == 66 * GIB and doc.report.diagnosis.kind == "capacity"


def test_an_oom_without_numbers_passes_through_undiagnosed() -> None:
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        with doctor.watch(on_oom=pytest.fail, reraise=False) as doc:
            raise torch.OutOfMemoryError("CUDA error: out of memory")
    assert doc.report is None


def test_watch_leaves_other_errors_and_clean_exits_alone() -> None:
    with pytest.raises(ValueError):
        with doctor.watch(on_oom=pytest.fail) as doc:
            raise ValueError("not memory")
    with doctor.watch(on_oom=pytest.fail) as clean:
        pass
    assert doc.report is None and clean.report is None


def result(name: str, tflops: float | None = 700.0, peak: int | None = 55 * GIB, **overrides: Any) -> BenchResult:
    modules = [m for m in name.split("+") if m != "none"]
    config: dict[str, Any] = (
        {"recompute_granularity": "selective", "recompute_modules": modules}
        if modules
        else {"recompute_granularity": None}
    )
    fields: dict[str, Any] = dict(
        name=name,
        recipe="llama3_70b",
        status="ok",
        config=config,
        shape={
            "num_layers": 4,
            "hidden_size": 8192,
            "ffn_hidden_size": 28672,
            "seq_length": 4096,
            "micro_batch_size": 1,
        },
        device="cuda",
        gpu="NVIDIA H100",
        torch="2.13.0",
        date="2026-01-01T00:00:00+00:00",
        command="remat sweep",
        step_time_s=1.0,
        tflops_per_gpu=tflops,
        peak_allocated_bytes=peak,
    )
    fields.update(overrides)
    return BenchResult(**fields)


def oom(name: str, allocated: int = 79 * GIB) -> BenchResult:
    return result(name, None, None, status="oom", oom=OomInfo(allocated, allocated + GIB, "CUDA out of memory"))


def test_mlp_slowdown_on_a_large_ffn() -> None:
    runs = [result("none", 709.9), result("mlp", 593.6, 52 * GIB)]
    (f,) = checks.check_mlp_slowdown(runs)
    assert f.symptom == "mlp: 16.4% lower throughput than no recompute"
    assert f.confirmed_by == "mlp 593.6 vs none 709.9 TFLOP/s (-16.4% > 15%); ffn/hidden 28672/8192 = 3.50 >= 3"
    assert f.fix.startswith("drop mlp (no recompute), lower -mb, or offload (-ol N)")
    assert checks.check_mlp_slowdown([result("none", 709.9), result("mlp", 620.0)]) == []  # -12.7%
    small_ffn = {"hidden_size": 8192, "ffn_hidden_size": 16384}
    assert (
        checks.check_mlp_slowdown([result("none", 709.9, shape=small_ffn), result("mlp", 593.6, shape=small_ffn)]) == []
    )
    other_shape = dict(result("mlp").shape, micro_batch_size=2)
    assert checks.check_mlp_slowdown([result("none", 709.9), result("mlp", 593.6, shape=other_shape)]) == []


def test_layernorm_that_did_not_move_the_peak() -> None:
    (f,) = checks.check_layernorm_peak(
        [result("core_attn", peak=58 * GIB), result("core_attn+layernorm", peak=58 * GIB - 300 * MIB)]
    )
    assert f.confirmed_by == "peak 58.00 GiB (core_attn) -> 57.71 GiB (core_attn+layernorm), -0.51% (under 1%)"
    (f,) = checks.check_layernorm_peak([oom("core_attn"), oom("core_attn+layernorm")])
    assert f.symptom == "core_attn+layernorm: still OOM after adding layernorm"
    assert checks.check_layernorm_peak([result("none", peak=58 * GIB), result("layernorm", peak=54 * GIB)]) == []
    assert checks.check_layernorm_peak([oom("none"), result("layernorm")]) == []


def test_full_recompute_with_module_scoped_cuda_graphs() -> None:
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1, "num_layers": 4}
    graphed = result(
        "full_uniform_1", config={**full, "cuda_graph_impl": "transformer_engine", "cuda_graph_scope": ["mlp"]}
    )
    (f,) = checks.check_full_recompute_graphs([graphed])
    assert f.confirmed_by == (
        "recompute_granularity=full, cuda_graph_impl=transformer_engine, cuda_graph_scope=['mlp']"
    )
    assert "use selective recompute, cuda_graph_impl='none', or a full_iteration graph" in f.fix
    whole = result(
        "full_uniform_1", config={**full, "cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}
    )
    assert checks.check_full_recompute_graphs([whole, result("mlp")]) == []


def test_cpu_offloading_with_pipeline_parallel() -> None:
    offload = {"recompute_granularity": None, "cpu_offloading": True, "cpu_offloading_num_layers": 2, "num_layers": 8}
    (f,) = checks.check_offload_pipeline(
        [result("none+offload_2", config={**offload, "pipeline_model_parallel_size": 2})]
    )
    assert f.confirmed_by == "cpu_offloading=True (2 layers), pipeline_model_parallel_size=2"
    assert "set pipeline_model_parallel_size=1 or cpu_offloading=False" in f.fix
    assert checks.check_offload_pipeline([result("none+offload_2", config=offload)]) == []


def test_mlp_plus_core_attn_slower_than_mlp_alone() -> None:
    (f,) = checks.check_mlp_core_attn([result("mlp", 593.6, 52 * GIB), result("mlp+core_attn", 586.8, 52 * GIB)])
    assert f.confirmed_by == (
        "mlp+core_attn 586.8 vs mlp 593.6 TFLOP/s (-1.1%, beyond 0.5%); peak 52.00 GiB -> 52.00 GiB"
    )
    assert f.fix == "use --recompute_modules mlp alone"
    assert checks.check_mlp_core_attn([result("mlp", 593.6), result("mlp+core_attn", 592.0)]) == []  # noise


def test_each_oom_with_the_allocators_numbers_is_classified() -> None:
    runs = [
        result("none", 709.9),
        oom("core_attn"),
        result("mlp", None, None, status="oom", oom=OomInfo(45 * GIB, 77 * GIB, OLD)),
    ]
    (f,) = checks.check_oom_kind(runs)
    assert (f.symptom, f.cause, f.fix) == ("mlp: out of memory", "fragmentation", EXPANDABLE_SEGMENTS)
    assert f.confirmed_by.startswith(
        "31.89 GiB reserved but unallocated (+1.23 GiB unreserved) would hold"
        " the 2.00 GiB request, but no free block held it"
    )
    (f,) = checks.check_oom_kind([result("mlp", None, None, status="oom", oom=OomInfo(0, 0, NEW))])
    assert f.cause == "capacity" and f.fix.startswith("remat plan")


def test_a_measured_sweep_trips_every_results_check() -> None:
    runs = [
        result("none", 709.9),
        oom("core_attn"),
        result("mlp", 593.6, 52 * GIB),
        result("mlp+core_attn", 586.8, 52 * GIB),
        oom("core_attn+layernorm"),
    ]
    assert [f.check for f in checks.check_results(runs)] == [
        "mlp recompute cost",
        "mlp recompute cost",
        "layernorm alone",
        "mlp+core_attn",
    ]


def test_cli_checks_results_from_a_json_file(tmp_path, capsys) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps([r.to_dict() for r in (result("mlp", 593.6), result("mlp+core_attn", 586.8))]))
    assert main(["doctor", "--results", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1 finding" in out and "double recompute overhead" in out and "-1.1%" in out
    path.write_text(json.dumps(result("mlp").to_dict()))  # `remat bench --json`: one result
    assert main(["doctor", "--results", str(path)]) == 0
    assert "0 findings" in capsys.readouterr().out


def test_cli_classifies_a_snapshot(tmp_path, capsys) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(CHECKERED))
    assert main(["doctor", "--snapshot", str(path), "--request", str(4 * GIB), "--limit", "66GiB"]) == 0
    out = capsys.readouterr().out
    assert "remat doctor: fragmentation" in out and EXPANDABLE_SEGMENTS in out
    (tmp_path / "full.json").write_text(json.dumps(FULL))
    assert (
        main(["doctor", "--snapshot", str(tmp_path / "full.json"), "--request", "4GiB", "--limit", "66GiB", "-mb", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "remat doctor: capacity" in out and "-mb 1" in out
    assert "remat plan [the run's -mr/-sl/-mb/... flags] --memory-budget 62.7GiB" in out


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--results", "{missing}"], "missing.json: cannot read the file"),
        (["--results", "{bad}"], "bad.json: is not valid JSON"),
        (["--results", "{other}"], "other.json: is not a remat bench result"),
        (["--snapshot", "{missing}", "--limit", "80GiB"], "missing.json: cannot read the file"),
        (["--snapshot", "{bad_pickle}", "--limit", "80GiB"], "bad.pickle: is not valid pickle"),
        (["--oom_message", OLD, "--request", "much"], "request: cannot read 'much'"),
        (["--snapshot", "{other}", "--limit", "lots"], "limit: cannot read 'lots'"),
        (["--snapshot", "{other}", "--limit", ""], "limit: cannot read ''"),
        (["--oom_message", OLD, "--request", ""], "request: cannot read ''"),
    ],
)
def test_cli_reports_unreadable_files_and_sizes_by_name(tmp_path, capsys, flags, said) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"a": 1}))
    (tmp_path / "bad.pickle").write_bytes(b"not a pickle")
    paths = dict(
        missing=tmp_path / "missing.json",
        bad=tmp_path / "bad.json",
        other=tmp_path / "other.json",
        bad_pickle=tmp_path / "bad.pickle",
    )
    assert main(["doctor", *(f.format(**paths) for f in flags)]) == 1
    assert said in capsys.readouterr().err


def test_cli_says_what_to_pass(tmp_path, capsys) -> None:
    (tmp_path / "s.json").write_text(json.dumps(CHECKERED))
    assert main(["doctor", "--snapshot", str(tmp_path / "s.json"), "--limit", "40GiB"]) == 1
    assert "less than the 64.00 GiB the snapshot reserves" in capsys.readouterr().err
    assert main(["doctor", "--snapshot", str(tmp_path / "s.json")]) == 1
    assert "pass --limit" in capsys.readouterr().err
    assert main(["doctor", "--oom_message", OLD]) == 0
    assert EXPANDABLE_SEGMENTS in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["doctor", "-mr", "llama3_tiny"]) == 1
        assert (
            "pass --timeline PNG to plot one step's memory (CPU too), or --results, --snapshot or --oom_message"
            in capsys.readouterr().err
        )


@pytest.mark.parametrize(
    "flags, said",
    [
        (
            ["--timeline", "{tmp}/t.txt", "-mb", "0", "--request", "1GiB"],
            ["--timeline: {tmp}/t.txt: the plot is a PNG", "micro_batch_size: is 0", "--request: describes an OOM's"],
        ),
        (["--results", "{tmp}/missing.json", "--limit", "1GiB"], ["missing.json: cannot read the file", "--limit:"]),
        pytest.param(
            ["-mr", "llama3_tiny", "-mb", "0"],
            [
                "doctor: without --results, --snapshot, --oom_message or --timeline it runs the bench",
                "micro_batch_size",
            ],
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
)
def test_cli_reports_every_problem_of_a_doctor_command_at_once(tmp_path, capsys, flags, said) -> None:
    assert main(["doctor", *(f.format(tmp=tmp_path) for f in flags)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    for text in said:
        assert text.format(tmp=tmp_path) in err


def _tiny(layers: int = 3):
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float32, num_layers=layers, seq_length=16)
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    return model, ids[:, :-1], ids[:, 1:].contiguous()


@pytest.mark.parametrize("modules", [None, ["mlp"]])
def test_attribution_names_what_each_site_of_each_layer_saved(modules) -> None:
    model, ids, labels = _tiny()
    plan = RecomputeConfig(recompute_granularity="selective", recompute_modules=modules) if modules else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(model, plan)
    optimizer = torch.optim.AdamW(model.parameters())
    weights = sum(p.numel() * 4 for p in model.parameters())
    # an independent count, by unique storage, of what a forward leaves alive, less the loss itself
    left_alive = measure_saved(lambda: model(ids, labels))[1].bytes - 4
    with doctor.watch(model, optimizer=optimizer, on_oom=None) as doc:
        loss = model(ids, labels)
        held = doc.attribute()
        if modules is None:  # exactly that, plus the input ids the embedding saved (created before)
            assert sum(held.activations.values()) == left_alive + ids.untyped_storage().nbytes()
        loss.backward()
        optimizer.step()
        after = doc.attribute()
    assert (held.weights, held.grads, held.optimizer_state) == (weights, 0, 0)
    assert (after.grads, after.optimizer_state) == (weights, 2 * weights + 4 * len(list(model.parameters())))
    by_site = {label: [held.activations.get((i, label), 0) for i in range(3)] for label in ("mlp", "layernorm")}
    if modules:  # mlp recomputed: it keeps nothing of its own
        assert by_site["mlp"] == [0, 0, 0]
    else:
        assert by_site["mlp"] == [by_site["mlp"][0]] * 3 and by_site["mlp"][0] > 0
    assert by_site["layernorm"] == [by_site["layernorm"][0]] * 3 and by_site["layernorm"][0] > 0
    assert held.activations[(None, "loss head")] > 0
    assert sum(after.activations.values()) < sum(held.activations.values()) / 10  # backward freed them
    assert doc.attribute() is None  # outside `with`


def test_attribution_stays_right_step_after_step_under_full_recompute() -> None:
    """A replay stops part way through a layer (by raising): the sites it entered are left all the
    same, so the next steps still give the loss head and the embedding what they saved."""
    model, ids, labels = _tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(
            model, RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        )
    steps = []
    with doctor.watch(model, on_oom=None) as doc:
        for _ in range(3):
            loss = model(ids, labels)
            steps.append(doc.attribute().activations)
            loss.backward()
    assert steps[0][(None, "loss head")] > 0 and steps[0][(None, "embedding")] > 0
    assert steps[1] == steps[2] == steps[0]


def test_an_oom_report_attributes_allocated_memory(monkeypatch) -> None:
    model, ids, labels = _tiny(2)
    monkeypatch.setattr(doctor_allocator, "capture", lambda device, request: state_of(FULL, request))
    with doctor.watch(model, on_oom=None, reraise=False) as doc:
        loss = model(ids, labels)
        raise torch.OutOfMemoryError(NEW.replace("1.22 GiB", "4.00 GiB", 1))
    rows = dict(doctor.attribution_rows(doc.report))
    assert rows["weights"] == sum(p.numel() * 4 for p in model.parameters())
    assert rows["layer 1 mlp"] > 0 and "loss head" in rows
    state = doc.report.diagnosis.state
    assert rows["allocator slack"] == state.reserved - state.allocated
    assert rows["other allocated"] == state.allocated - doc.report.attribution.total
    assert "layer 0 mlp" in str(doc.report)
    del loss
