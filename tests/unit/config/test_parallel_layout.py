"""remat.config.parallel: a layout's sizes, its mesh and coordinates, its stages and its checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remat.config.parallel import SCHEDULES, Coordinates, ParallelLayout

sizes = st.sampled_from([1, 2, 3, 4])


@given(tp=sizes, pp=sizes, cp=sizes, dp=sizes)
def test_coordinates_place_every_rank_once_with_tp_innermost(tp, pp, cp, dp) -> None:
    layout = ParallelLayout(tp=tp, pp=pp, cp=cp, num_gpus=tp * pp * cp * dp)
    assert layout.dp == dp and layout.gpus == tp * pp * cp * dp and layout.mesh_shape == (pp, dp, cp, tp)
    assert layout.replicas == dp * cp
    places = [layout.coordinates(rank) for rank in range(layout.gpus)]
    assert sorted(places) == places  # rank order is the mesh's row-major order: pp, dp, cp, tp
    assert len(set(places)) == layout.gpus
    assert places[-1] == Coordinates(pp - 1, dp - 1, cp - 1, tp - 1)


def test_without_num_gpus_a_layout_is_one_copy_of_the_model() -> None:
    layout = ParallelLayout(tp=2, pp=4, cp=2)
    assert (layout.dp, layout.gpus, layout.model_parallel) == (1, 16, 16)


@pytest.mark.parametrize(
    "layout, ranks",
    [
        (ParallelLayout(pp=2), [(0, 1, 2, 3), (4, 5, 6, 7)]),
        (ParallelLayout(pp=2, vp=2), [(0, 1, 4, 5), (2, 3, 6, 7)]),
        (ParallelLayout(pp=4, vp=2), [(0, 4), (1, 5), (2, 6), (3, 7)]),
    ],
)
def test_each_pipeline_rank_runs_its_chunks_round_robin(layout, ranks) -> None:
    assert [layout.rank_layers(8, rank) for rank in range(layout.pp)] == ranks
    assert layout.layers_per_chunk(8) == 8 // layout.chunks
    assert layout.layers_per_chunk(7) is None


def test_the_schedule_follows_virtual_stages_unless_named() -> None:
    assert ParallelLayout(pp=2).pipeline_schedule == "1f1b"
    assert ParallelLayout(pp=2, vp=2).pipeline_schedule == "interleaved_1f1b"
    assert ParallelLayout(pp=2, schedule="1f1b").pipeline_schedule == "1f1b"


@pytest.mark.parametrize(
    "layout, micro_batches, in_flight",
    [
        (ParallelLayout(pp=4), 8, [4.0, 3.0, 2.0, 1.0]),
        (ParallelLayout(pp=4), 2, [2.0, 2.0, 2.0, 1.0]),
        # Megatron's interleaved warm-up: (pp - rank - 1) * 2 + (vp - 1) * pp + 1 chunks, in 1/vp
        (ParallelLayout(pp=2, vp=2), 4, [5 / 2, 3 / 2]),
    ],
)
def test_in_flight_is_megatrons_warm_up(layout, micro_batches, in_flight) -> None:
    assert [layout.in_flight(rank, micro_batches) for rank in range(layout.pp)] == in_flight


def test_a_step_runs_at_the_slowest_stage_plus_the_fill_and_drain() -> None:
    assert ParallelLayout(pp=3).step_time([1.0, 2.0, 1.0], 4) == 4 * 2.0 + 2.0
    assert ParallelLayout(pp=3, vp=2).step_time([1.0, 2.0, 1.0], 4) == 4 * 2.0 + 1.0


def test_a_good_layout_has_no_problems() -> None:
    layout = ParallelLayout(tp=2, sp=True, pp=2, vp=2, cp=2, ep=2, num_gpus=32)
    assert list(layout.problems(num_layers=8)) == []
    assert list(layout.advice()) == []


def test_every_problem_is_reported_at_once_under_megatrons_names() -> None:
    layout = ParallelLayout(tp=0, pp=1, vp=2, ep=3, num_gpus=10, schedule="1f1c")
    found = {p.field: p.message for p in layout.problems(num_layers=5)}
    assert list(found) == [
        "tensor_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "num_layers",
        "pipeline_parallel_schedule",
        "expert_model_parallel_size",
    ]
    assert found["tensor_model_parallel_size"] == "got 0; set it to 1 or more"
    assert "pipeline_model_parallel_size > 1" in found["virtual_pipeline_model_parallel_size"]
    assert "do not split evenly into 2 (virtual) pipeline stages" in found["num_layers"]
    assert "did you mean '1f1b'" in found["pipeline_parallel_schedule"]
    assert "does not divide the 10 data-parallel" in found["expert_model_parallel_size"]


@pytest.mark.parametrize(
    "layout, field, message",
    [
        (ParallelLayout(tp=2, num_gpus=6, ep=2), "expert_model_parallel_size", "does not divide the 3 data-parallel"),
        (ParallelLayout(tp=4, num_gpus=6), "num_gpus", "6 GPUs do not split into data-parallel groups of"),
        (ParallelLayout(pp=2, schedule="interleaved_1f1b"), "pipeline_parallel_schedule", "needs virtual stages"),
        (ParallelLayout(pp=2, vp=2, schedule="1f1b"), "pipeline_parallel_schedule", "runs one model chunk per rank"),
        (ParallelLayout(cp=2**21), "context_parallel_size", "remat checks sizes up to 1,048,576"),
        (ParallelLayout(tp="two"), "tensor_model_parallel_size", "two"),  # type: ignore[arg-type]
    ],
)
def test_each_layout_problem_says_what_to_change(layout, field, message) -> None:
    problems = [p for p in layout.problems() if p.field == field]
    assert len(problems) == 1 and message in problems[0].message


@pytest.mark.parametrize(
    "layout, micro_batches, problem",
    [
        (ParallelLayout(pp=4), 3, "1F1B over 4 stages needs at least 4"),
        (ParallelLayout(pp=4, vp=2), 6, "runs them in rounds of pp = 4"),
        (ParallelLayout(pp=4), 6, None),
        (ParallelLayout(pp=4, vp=2), 8, None),
    ],
)
def test_a_schedule_refuses_micro_batches_it_cannot_run(layout, micro_batches, problem) -> None:
    found = [p.message for p in layout.schedule_problems(micro_batches)]
    assert len(found) == (problem is not None)
    assert problem is None or problem in found[0]


def test_sequence_parallel_without_tensor_parallel_is_advice() -> None:
    assert ParallelLayout(sp=True).sequence_split == 1
    assert [p.field for p in ParallelLayout(sp=True).advice()] == ["sequence_parallel"]
    assert ParallelLayout(tp=4, sp=True).sequence_split == 4


def test_megatrons_keys_round_trip() -> None:
    layout = ParallelLayout(tp=2, sp=True, pp=4, vp=2, cp=2, ep=4, etp=1, num_gpus=64)
    keys = layout.to_megatron()
    assert keys["tensor_model_parallel_size"] == 2 and keys["virtual_pipeline_model_parallel_size"] == 2
    assert ParallelLayout.from_megatron({**keys, "num_layers": 32}) == layout


def test_every_schedule_is_known_by_name() -> None:
    assert set(SCHEDULES) == {"1f1b", "interleaved_1f1b"}
