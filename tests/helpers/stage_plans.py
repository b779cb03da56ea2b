"""Shared by the unit and integration tests of stage plans."""

from __future__ import annotations

from remat.config.parallel import ParallelLayout
from remat.estimate.spec import EstimateSpec
from remat.estimate.stages import predict_stages

MiB = 2**20


def _spec(pp: int = 2, layers: int = 4, vpp: int | None = None, micro_batches: int = 4, seq: int = 256) -> EstimateSpec:
    return EstimateSpec(
        recipe="llama3_tiny",
        overrides={"num_layers": layers, "seq_length": seq},
        layout=ParallelLayout(pp=pp, vp=vpp),
        micro_batch_size=1,
        global_batch_size=micro_batches,
        device="cpu",
        compile=False,
    )


def _peaks(spec: EstimateSpec, traced, plans) -> list[int]:
    return [s.peak for s in predict_stages("x", spec, traced, plans).stages]
