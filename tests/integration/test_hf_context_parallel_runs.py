"""Hugging Face causal LMs under context parallelism (torch's ring attention; on CPU remat hands it
the CPU flash kernel): one 2-process launch (tests/integration/workers/hf_cp_worker.py: hf:llama
under every plan and SFT, hf:mixtral, a bench run) and, slow, one of 4 (cp 2 beside tp 2 and beside
pp 2).

The rotary embedding takes where each rank's tokens sit in the whole sequence, and the labels are
shifted over the whole sequence before sharding (models/hf/context_parallel.py): without either a
gradient is off by far more than the tolerances below.

Recompute under context parallelism is bit-identical to it without recompute: a replay runs the
ring's forward again from backward on both ranks, in the same order, on the same blocks. Against
one process on the same batches and weights, in float64, it holds to float32 rounding (rtol 1e-5,
atol 1e-7; seen: 4e-7 relative to a gradient's largest entry): torch's ring merges its blocks'
outputs and accumulates their gradients in float32 (its convert_to_f32, a downcast to a float64
run), and the step sums its loss in float32.

The quick tests of the same code: tests/unit/models/test_hf_context_parallel.py."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import torchrun_results

pytest.importorskip("transformers")


sys.path.insert(0, str(Path(__file__).parent / "workers"))


import hf_cp_worker  # noqa: E402

PLANS = [name for name in hf_cp_worker.PLANS if name != "none"]


def _run(tmp_path_factory, nproc: int) -> dict[str, object]:
    return torchrun_results(tmp_path_factory, Path(hf_cp_worker.__file__), nproc)


@pytest.fixture(scope="module")
def cp(tmp_path_factory) -> dict[str, object]:
    return _run(tmp_path_factory, hf_cp_worker.CP)


@functools.cache
def one_process(recipe: str = "hf:llama", task: str = "pretrain") -> hf_cp_worker.Step:
    """One process's step on the batches every run of the worker draws, from the same seed (SFT's
    through the chunked loss head, as the worker's)."""
    sft = task == "sft"
    return hf_cp_worker.step(
        hf_cp_worker.spec(
            recipe, task, context_parallel=1, compile=sft, seq_length=hf_cp_worker.SFT_SEQ if sft else hf_cp_worker.SEQ
        )
    )


def assert_matches_one_process(found: hf_cp_worker.Step, one: hf_cp_worker.Step) -> None:
    assert found[0] == pytest.approx(one[0], rel=1e-6)
    assert found[1].keys() == one[1].keys()
    for name, grad in found[1].items():
        torch.testing.assert_close(grad, one[1][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "case,recipe,task",
    [
        ("llama:none", "hf:llama", "pretrain"),
        ("llama:sft", "hf:llama", "sft"),
        ("mixtral:none", "hf:mixtral", "pretrain"),
    ],
)
def test_a_context_parallel_step_matches_one_process(cp, case, recipe, task) -> None:
    """SFT masks the first quarter: rank 0's head chunk is all prompt, so the ranks' losses are
    means over unequal shares, weighted back to the sequence's mean; its loss is the chunked
    head's, HF's own the others'."""
    assert_matches_one_process(cp[case], one_process(recipe, task))  # type: ignore[arg-type]


@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_under_context_parallelism_is_bit_identical_to_none(cp, plan) -> None:
    assert_same_step(cp[f"llama:{plan}"], cp["llama:none"])  # type: ignore[arg-type]


def assert_same_step(found: hf_cp_worker.Step, plain: hf_cp_worker.Step) -> None:
    assert found[0] == plain[0] and found[1].keys() == plain[1].keys()
    assert all(torch.equal(grad, plain[1][name]) for name, grad in found[1].items())


def test_bench_runs_a_transformers_model_under_context_parallelism(cp) -> None:
    status, losses = cp["bench"]  # type: ignore[misc]
    assert status == "ok" and len(losses) == 2


@pytest.mark.slow
def test_context_beside_tensor_and_pipeline_parallelism_matches_one_process(tmp_path_factory) -> None:
    """cp 2 x tp 2 (the model's own plan; sequence parallelism off and on, each rank's 8 tokens
    split again over tp), Mixtral's experts whole beside it; pp 2 x cp 2, each stage the model cut
    to its layers, its hidden states sent to the same cp rank of the next."""
    four = _run(tmp_path_factory, 2 * hf_cp_worker.CP)
    for sp in (False, True):
        assert_matches_one_process(four[f"llama:none@sp={sp}"], one_process())  # type: ignore[arg-type]
        assert_same_step(four[f"llama:selective@sp={sp}"], four[f"llama:none@sp={sp}"])  # type: ignore[arg-type]
    assert_matches_one_process(four["mixtral@tp"], one_process("hf:mixtral"))  # type: ignore[arg-type]
    assert_matches_one_process(four["llama@pp"], one_process())  # type: ignore[arg-type]
    assert_same_step(four["llama@pp:selective"], four["llama@pp"])  # type: ignore[arg-type]
