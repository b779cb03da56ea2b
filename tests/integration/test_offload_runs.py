"""Offload on CPU over every plan of helpers.offload.PLANS on the tiny Llama: gradients
bit-identical to the run without offload, every offloaded byte back in the pool after backward,
and fewer bytes saved than the same recompute without offload, by at most what moved.

The quick tests of the same code: tests/unit/engine/test_offload.py."""

from __future__ import annotations

import pytest
from helpers.offload import PLANS, _config, _model, _verify

from remat.config.plan import Plan
from remat.sites.apply import offloader_of

pytestmark = pytest.mark.usefixtures("deterministic")


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
