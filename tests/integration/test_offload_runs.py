"""Offload on CPU (host copies are plain copies, same logic as CUDA): gradients bit-identical on
the tiny Llama, exact byte counts, views and dedup, pool reuse, prefetch order, plan lowering.

The quick tests of the same code: tests/unit/engine/test_offload.py."""

from __future__ import annotations

import pytest
import torch
from helpers.offload import PLANS, _config, _model, _verify

from remat.config.plan import Plan
from remat.sites.apply import offloader_of


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _without_offload(plan):
    """The same recompute with offload off."""
    if isinstance(plan, Plan):
        return Plan([{k: v for k, v in a.items() if v != "offload"} for a in plan.layers], plan.full_recompute)
    return _config(
        **{
            **plan.to_megatron(),
            "cpu_offloading": False,
            "cpu_offloading_num_layers": 0,
            "fine_grained_activation_offloading": False,
            "offload_modules": [],
        }
    )


@pytest.mark.parametrize("name", PLANS)
def test_offload_is_bit_identical_and_frees_what_it_moves(name: str) -> None:
    model = _model()
    report = _verify(model, PLANS[name])
    stats = offloader_of(model).stats()
    assert report.bit_identical, f"max grad diff {report.max_grad_diff}"
    assert len(report.candidate.grads) == len(list(model.parameters()))
    assert stats.offloaded_bytes > 0 and stats.host_bytes == 0  # all back in the pool after backward
    recompute_only = _verify(_model(), _without_offload(PLANS[name]))
    assert report.candidate.saved.bytes < recompute_only.candidate.saved.bytes
    assert report.candidate.saved.bytes >= recompute_only.candidate.saved.bytes - stats.offloaded_bytes
