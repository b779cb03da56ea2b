"""Tensor parallelism for Hugging Face causal LMs by their own plans (`base_model_tp_plan`) on CPU:
two processes under torchrun with gloo (tests/integration/workers/hf_tp_worker.py).

Split over two ranks, a tiny HF Llama (attention and MLP split; with and without sequence
parallelism) and Mixtral (attention split, the experts whole) give the loss and every gradient of
one process in float64 to 1e-12: the row-parallel projections sum each rank's partial products,
which reorders the additions of one process's matmul (rounding, not a different computation).
Every recompute plan is bit-identical to the split run without recompute, attention dropout on or
off: each rank's dropout over its own heads draws from its own stream, which every replay
restores.

The quick tests of the same code: tests/unit/models/test_hf_tensor_parallel.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


from conftest import run_under_torchrun  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import hf_tp_worker  # noqa: E402

TOLERANCE = 1e-12  # float64, additions reordered by the row-parallel sums


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hf_tp") / "results.pt"
    run_under_torchrun(Path(hf_tp_worker.__file__), out, 2)
    return torch.load(out)


SPLITS = [
    (family, sp)
    for family in hf_tp_worker.FAMILIES
    for sp in ((False, True) if family in hf_tp_worker.SEQUENCE_PARALLEL else (False,))
]


@pytest.mark.parametrize("family,sp", SPLITS)
def test_a_split_hf_model_gives_the_loss_and_gradients_of_one_process(split, family, sp) -> None:
    loss, grads = split[f"{family}@sp={sp}@none@0.0"]
    one_loss, one_grads = split[f"{family}@one process"]
    assert loss == pytest.approx(one_loss, abs=TOLERANCE)
    assert grads.keys() == one_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, one_grads[name], rtol=0, atol=TOLERANCE, msg=name)
    assert split[f"{family}@local q_proj"] == (32, 64)  # 2 of 4 heads of 16 on each rank
    if sp:
        assert split[f"{family}@tokens a norm sees"] == [hf_tp_worker.BATCH, hf_tp_worker.SEQ // 2, 64]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("plan", ["selective", "full"])
@pytest.mark.parametrize("family,sp", SPLITS)
def test_every_plan_on_a_split_hf_model_is_bit_identical_to_it_without_recompute(
    split, family, sp, plan, dropout
) -> None:
    loss, grads = split[f"{family}@sp={sp}@{plan}@{dropout}"]
    plain_loss, plain_grads = split[f"{family}@sp={sp}@none@{dropout}"]
    assert loss == plain_loss
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize("family", list(hf_tp_worker.FAMILIES))
def test_attention_dropout_draws_from_the_rank_stream_and_ranks_agree(split, family) -> None:
    assert split[f"{family}@rank stream"] == [False, True]  # dropout off, on
    every = split["every rank's losses"]
    assert every[0] == every[1]
