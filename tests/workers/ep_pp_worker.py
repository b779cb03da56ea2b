"""Run by tests/test_moe_parallel.py under torchrun (gloo, CPU, 4 processes), one launch for all:
the MoE recipes of moe_worker over pp 2 x dp 2 with their experts split over ep 2 (each pipeline
stage's experts over the 2 data-parallel ranks of that stage), built by `remat.step.build_model`
under 1F1B and interleaved 1F1B, each rank holding the whole model's weights for its layers and
experts; one step per plan of moe_worker's, on each replica's half of the same 4 micro-batches,
then the balancing step. Rank 0 saves everything to the file argv[1], gradients whole."""
from __future__ import annotations

from typing import Any

from moe_worker import CASES, MICRO_BATCHES, pipelined, spec, state, whole

import gloo

EP, GPUS = 2, 4


def results() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for (recipe, layout), names in CASES.items():
        source = {name: t.detach().clone() for name, t in state(whole(recipe)).items()}
        found.update({f"{recipe}:{layout}:{name}": pipelined(spec(recipe, layout, GPUS, EP), name, source)
                      for name in names})
    return found


if __name__ == "__main__":
    assert MICRO_BATCHES == 4  # 2 a replica: 1F1B over 2 stages needs 2
    gloo.run(results)
