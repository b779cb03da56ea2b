"""A pipeline's stages and their layers, and the micro-batches its schedule needs (ParallelLayout).

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_pipeline_runs.py."""

from __future__ import annotations

from remat.config.parallel import ParallelLayout


def test_stages_and_their_layers() -> None:
    interleaved = ParallelLayout(pp=2, vp=2)
    assert interleaved.stage_indices(0) == [0, 2] and interleaved.stage_indices(1) == [1, 3]
    assert interleaved.chunk_layers(8, 3) == range(6, 8)
    assert [p.message for p in ParallelLayout(pp=4).schedule_problems(3)] == [
        "gives 3 micro-batch(es) a step; 1F1B over 4 stages needs at least 4: raise -gb"
    ]
    assert [p.message for p in ParallelLayout(pp=2, vp=2).schedule_problems(3)] == [
        "gives 3 micro-batches a step; interleaved 1F1B runs them in rounds of pp = 2: use a multiple"
    ]
    assert not list(ParallelLayout(pp=2, vp=2).schedule_problems(4))
