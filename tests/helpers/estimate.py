"""Shared by the unit and integration tests of estimate."""

from __future__ import annotations

import warnings

import remat
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.estimate.spec import EstimateSpec

SHAPE = dict(num_layers=4, seq_length=32)


SMALL = dict(num_layers=2, seq_length=32)  # where a trace per case is enough


MB = 2


FULL = RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _spec(**kw) -> EstimateSpec:
    base = dict(
        recipe="llama3_tiny",
        overrides=dict(SMALL),
        micro_batch_size=MB,
        optimizer=False,
        precision=Precision("fp32"),
        device="cpu",
    )
    return EstimateSpec(**{**base, **kw})


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        return fn(*args, **kwargs)


VPP = TrainingFacts(layout=ParallelLayout(pp=2, vp=2))


def _figures(est) -> list[tuple]:
    return [(s.layers, s.activations, s.peak, s.peak_window, s.micro_batch_time_s) for s in est.stages]
