"""Context parallelism (torch's ring attention, remat.parallel.context_parallel) on CPU: two
processes under torchrun with gloo, one launch for every case (tests/workers/cp_worker.py).

torch dispatches its ring to CUDA's attention kernels only; on CPU remat hands torch's own ring
the CPU flash kernel, so what runs here is torch's ring, head-tail load balancing and merge, with
the kernel of the other device.

Recompute under context parallelism is bit-identical to it without recompute: a replay runs the
ring's forward again from backward on both ranks, in the same order, on the same blocks. Against
one process on the same batches it holds within float32 rounding (rtol 1e-5, atol 1e-6; seen:
5e-7 relative): torch's ring merges each block's output by its log-sum-exp, and FSDP2 sums the
ranks' gradients, in another order than one kernel's softmax and one backward."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import run_under_torchrun
from remat.bench.run import run_shape
from remat.bench.spec import BenchSpec
from remat.cli.bench import _layout_words
from remat.parallel import coordinates
from remat.problems import ConfigError
from remat.recompute import TrainingFacts
from remat.step import RunSpec, single_process_problems, trace_spec, unrun_problems

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import cp_worker  # noqa: E402

PLANS = [name for name in cp_worker.PLANS if name != "none"]


@pytest.fixture(scope="module")
def cp(tmp_path_factory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("cp") / "results.pt"
    run_under_torchrun(Path(cp_worker.__file__), out)
    return torch.load(out)


@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_under_context_parallelism_is_bit_identical_to_none(cp, plan) -> None:
    loss, grads = cp[f"{plan}@0.1"]  # type: ignore[misc]
    plain_loss, plain_grads = cp["none@0.1"]  # type: ignore[misc]
    assert loss == plain_loss
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_dropout_changes_the_step(cp) -> None:  # the comparison above is not of two plain runs
    assert cp["none@0.1"][0] != cp["pretrain:none"][0]  # type: ignore[index]


@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_context_parallel_step_matches_one_process(cp, task) -> None:
    """SFT masks the prompt, the first quarter: rank 0's head chunk is all prompt, so the ranks'
    losses are means over 4 and 8 tokens, weighted back to the sequence's mean."""
    loss, grads = cp[f"{task}:none"]  # type: ignore[misc]
    one_loss, one_grads = cp_worker.step(cp_worker.spec(task=task, context_parallel=1), None)
    assert grads.keys() == one_grads.keys()
    assert loss == pytest.approx(one_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, one_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_each_rank_holds_a_head_and_a_tail_chunk_of_the_sequence(cp) -> None:
    assert cp["shares"] == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]


def test_bench_runs_under_context_parallelism(cp) -> None:
    status, losses = cp["bench"]  # type: ignore[misc]
    assert status == "ok" and len(losses) == 2


def test_what_context_parallelism_refuses_at_run_time(cp) -> None:
    said: dict[str, list[str]] = cp["refusals"]  # type: ignore[assignment]
    assert said["mesh"][0].startswith("mesh: has 2 dimensions ('dp', 'cp'); pass its context-parallel one")
    assert "attention_backend: is 'eager'; torch's context parallelism runs" in said["model"][0]
    assert "attention_dropout: is 0.1; torch's ring attention draws it per block of keys" in said["model"][0]
    assert said["short"] == ["the batch, its labels and the model's position tables have [8, 16] positions;"
                             " context parallelism needs a batch of the model's seq_length"]


def _problems(**kwargs: object) -> list[str]:
    overrides = kwargs.pop("overrides", {})
    facts = TrainingFacts(**kwargs)  # type: ignore[arg-type]
    try:
        RunSpec(recipe="llama3_tiny", overrides=overrides, device="cpu", facts=facts)  # type: ignore[arg-type]
    except ConfigError as err:
        return [str(p) for p in err.problems]
    return []


def test_every_context_parallel_problem_is_named_before_any_process_starts() -> None:
    assert not _problems(context_parallel_size=2)
    said = _problems(context_parallel_size=3, overrides=dict(attention_backend="eager", attention_dropout=0.1))
    assert said == [
        "context_parallel_size: seq_length=64 does not split into 6 chunks for 3 context-parallel ranks; use a"
        " sequence length that is a multiple of 6",
        "attention_backend: is 'eager'; torch's context parallelism runs scaled_dot_product_attention as ring"
        " attention, and the eager backend computes the scores itself; use sdpa",
        "attention_dropout: is 0.1; torch's ring attention draws it per block of keys, and its backward replays one"
        " block's random state for all of them; use 0 under context parallelism"]


def test_context_parallelism_beside_other_layouts_and_families_is_refused() -> None:
    said = [str(p) for p in unrun_problems(TrainingFacts(context_parallel_size=2, pipeline_model_parallel_size=2))]
    assert said == ["context_parallel_size: is 2 with -tp 1 -pp 2; remat runs context parallelism beside data"
                    " parallelism only, not with tensor or pipeline parallelism yet (remat estimate predicts it);"
                    " use -cp 1, or -tp 1 and -pp 1"]
    assert not list(unrun_problems(TrainingFacts(context_parallel_size=2)))
    with pytest.raises(ConfigError, match="context_parallel_size: is 2; MoE models"):
        RunSpec(recipe="moe_tiny", device="cpu", facts=TrainingFacts(context_parallel_size=2))
    assert [p.field for p in single_process_problems(TrainingFacts(context_parallel_size=2))] == [
        "context_parallel_size"]
    with pytest.raises(ConfigError, match="context_parallel_size: is 2; the trace steps whole sequences"):
        trace_spec(RunSpec(recipe="llama3_tiny", device="cpu", facts=TrainingFacts(context_parallel_size=2)))


def test_a_ranks_coordinates_on_the_pp_dp_cp_tp_mesh() -> None:
    # 2 stages x 2 replicas x 2 context ranks x 2 tensor ranks: rank 13 = ((1*2 + 1)*2 + 0)*2 + 1
    assert coordinates(13, 2, 2, tensor=2, context=2) == (1, 1, 1, 0)
    assert coordinates(13, 2, 2, tensor=2, context=2).context == 0
    assert coordinates(3, 1, 2, context=2) == (0, 1, 0, 1)


def test_a_context_parallel_result_records_its_size_and_says_it_in_the_title() -> None:
    spec = BenchSpec(recipe="llama3_tiny", device="cpu", num_gpus=4, facts=TrainingFacts(context_parallel_size=2))
    shape = run_shape(spec)
    assert (shape["context_parallel"], shape["data_parallel"]) == (2, 2)
    assert _layout_words(spec) == (", context parallel over 2 ranks (ring attention), data parallel over 2 ranks"
                                   " (FSDP2)")
