"""Context parallelism (torch's ring attention, remat.parallel.context_parallel) on CPU: two
processes under torchrun with gloo, one launch for every case
(tests/integration/workers/cp_worker.py: the Llama and the MoE recipes), four for context
parallelism beside tensor parallelism (cp 2 x tp 2, sequence parallelism off and on) and beside
pipeline parallelism (pp 2 x cp 2), one launch, and eight for all three (a slow test).

torch dispatches its ring to CUDA's attention kernels only; on CPU remat hands torch's own ring
the CPU flash kernel, so what runs here is torch's ring, head-tail load balancing and merge, with
the kernel of the other device.

Recompute under context parallelism is bit-identical to it without recompute: a replay runs the
ring's forward again from backward on both ranks, in the same order, on the same blocks. Against
one process on the same batches it holds within float32 rounding (rtol 1e-5, atol 1e-6; seen:
5e-7 relative): torch's ring merges each block's output by its log-sum-exp, and FSDP2 sums the
ranks' gradients, in another order than one kernel's softmax and one backward.

The quick tests of the same code: tests/unit/parallel/test_context_parallel.py."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from conftest import torchrun_results

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import cp_worker  # noqa: E402
import fsdp_worker  # noqa: E402
import tp_worker  # noqa: E402

PLANS = [name for name in cp_worker.PLANS if name != "none"]


SPLIT = [False, True]  # sequence parallelism off, on


def _run(tmp_path_factory, nproc: int) -> dict[str, object]:
    return torchrun_results(tmp_path_factory, Path(cp_worker.__file__), nproc)


@pytest.fixture(scope="module")
def cp(tmp_path_factory) -> dict[str, object]:
    return _run(tmp_path_factory, cp_worker.CP)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict[str, object]:
    return _run(tmp_path_factory, cp_worker.CP * cp_worker.TP)


@pytest.mark.parametrize("plan", PLANS)
def test_every_plan_under_context_parallelism_is_bit_identical_to_none(cp, plan) -> None:
    assert_same_step(cp[f"{plan}@0.1"], cp["none@0.1"])  # type: ignore[arg-type]


def test_dropout_changes_the_step(cp) -> None:  # the comparison above is not of two plain runs
    assert cp["none@0.1"][0] != cp["pretrain:none"][0]  # type: ignore[index]


@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_context_parallel_step_matches_one_process(cp, task) -> None:
    """SFT masks the prompt, the first quarter: rank 0's head chunk is all prompt, so the ranks'
    losses are means over 4 and 8 tokens, weighted back to the sequence's mean."""
    loss, grads, _ = cp[f"{task}:none"]  # type: ignore[misc]
    one_loss, one_grads, _ = cp_worker.step(cp_worker.spec(task=task, context_parallel=1), None)
    assert grads.keys() == one_grads.keys()
    assert loss == pytest.approx(one_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, one_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("recipe", cp_worker.MOE)
def test_an_moe_step_under_context_parallelism_matches_one_process(cp, recipe) -> None:
    """moe_tiny and deepseek_tiny (MLA, expert bias, per-sequence aux loss) over cp 2: each rank
    routes its share of every sequence, its aux loss on the group's load (all-reduced) and its
    own scores, weighted so that FSDP2's mean over the ranks is one process's gradient; the
    expert bias balances on the token counts summed over the group."""
    assert_matches_one_process(cp[f"{recipe}:none"], one_process(recipe))  # type: ignore[arg-type]
    assert len(one_process(recipe)[2]) == 3


@pytest.mark.parametrize("recipe", cp_worker.MOE)
@pytest.mark.parametrize("plan", cp_worker.MOE_PLANS[1:])
def test_every_moe_plan_under_context_parallelism_is_bit_identical_to_none(cp, recipe, plan) -> None:
    assert_same_step(cp[f"{recipe}:{plan}"], cp[f"{recipe}:none"])  # type: ignore[arg-type]


def assert_same_step(found: cp_worker.Step, plain: cp_worker.Step) -> None:
    """Loss, gradients and expert biases bit for bit."""
    assert found[0] == plain[0]
    for got, expected in zip(found[1:], plain[1:]):
        assert got.keys() == expected.keys()
        for name, tensor in got.items():
            assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("sp", SPLIT)
@pytest.mark.parametrize("plan", [name for name in cp_worker.CP_TP_PLANS if name != "none"])
def test_every_plan_beside_tensor_parallelism_is_bit_identical_to_none(four, plan, sp) -> None:
    assert_same_step(four[f"{plan}@sp={sp}@0.1"], four[f"none@sp={sp}@0.1"])  # type: ignore[arg-type]
    assert four[f"none@sp={sp}@0.1"][0] != four[f"none@sp={sp}@0.0"][0]  # type: ignore[index]


@functools.cache
def one_process(recipe: str = "llama3_tiny", task: str = "pretrain") -> cp_worker.Step:
    """One process's step in float64, on the batches every run of the worker draws."""
    return cp_worker.step(cp_worker.spec(recipe=recipe, task=task, context_parallel=1, compute_dtype="fp64"), None)


def assert_matches_one_process(found: cp_worker.Step, one: cp_worker.Step, tensor_parallel: bool = False) -> None:
    """In float64, to float32 rounding of attention: torch's ring merges its blocks' outputs and
    accumulates their gradients in float32 (its convert_to_f32 option, which a float64 run meets
    as a downcast); seen: 4e-8 absolute on gradients up to 0.17. One process sums the step's loss
    in float32. An MoE router's expert bias equal: every token routes alike and its counts are
    integers. Under tensor parallelism linear_fc1's rows (and each routed expert's) are in the
    ranks' order."""
    assert found[0] == pytest.approx(one[0], rel=1e-6)
    assert found[1].keys() == one[1].keys() and found[2].keys() == one[2].keys()
    for name, grad in found[1].items():
        grad = gate_then_up(name, grad) if tensor_parallel else grad
        torch.testing.assert_close(grad, one[1][name], rtol=1e-5, atol=1e-7, msg=name)
    assert all(torch.equal(bias, one[2][name]) for name, bias in found[2].items())


def gate_then_up(name: str, grad: torch.Tensor) -> torch.Tensor:
    """tp_worker's, and an MoE layer's routed experts' weight1 [experts, 2 x ffn, hidden] alike."""
    if name.endswith("experts.weight1"):
        return tp_worker.gate_then_up("linear_fc1.weight", grad.transpose(0, 1)).transpose(0, 1)
    return tp_worker.gate_then_up(name, grad)


@pytest.mark.parametrize("recipe,plan,sp", cp_worker.MOE_TP)
def test_an_moe_step_beside_tensor_parallelism_matches_one_process(four, recipe, plan, sp) -> None:
    assert_matches_one_process(
        four[f"{recipe}:{plan}@sp={sp}"],
        one_process(recipe),  # type: ignore[arg-type]
        tensor_parallel=True,
    )


def test_selective_moe_recompute_beside_tensor_parallelism_is_bit_identical_to_none(four) -> None:
    assert_same_step(four["deepseek_tiny:selective@sp=True"], four["deepseek_tiny:none@sp=True"])  # type: ignore[arg-type]


@pytest.mark.parametrize("sp", SPLIT)
def test_context_parallelism_beside_tensor_parallelism_matches_one_process(four, sp) -> None:
    assert_matches_one_process(four[f"none@sp={sp}@0.0"], one_process(), tensor_parallel=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("plan", [name for name in cp_worker.CP_TP_PLANS if name != "none"])
def test_every_plan_beside_pipeline_parallelism_is_bit_identical_to_none(four, plan) -> None:
    assert_same_step(four[f"pp:{plan}@0.1"], four["pp:none@0.1"])  # type: ignore[arg-type]
    assert four["pp:none@0.1"][0] != four["pp:pretrain"][0]  # type: ignore[index]


@pytest.mark.parametrize("case,task", [("pretrain", "pretrain"), ("sft", "sft"), ("interleaved", "sft")])
def test_context_parallelism_beside_pipeline_parallelism_matches_one_process(four, case, task) -> None:
    """Each stage's cp ranks send their shards of the hidden states to the same cp rank of the
    next stage; SFT's micro-batches weigh each rank's loss by its share of their labelled tokens."""
    assert_matches_one_process(four[f"pp:{case}"], one_process(task=task))  # type: ignore[arg-type]


@pytest.mark.parametrize("recipe", cp_worker.MOE)
def test_an_moe_step_beside_pipeline_parallelism_matches_one_process(four, recipe) -> None:
    assert_matches_one_process(four[f"pp:{recipe}:none"], one_process(recipe))  # type: ignore[arg-type]
    assert_same_step(four[f"pp:{recipe}:full_uniform_1"], four[f"pp:{recipe}:none"])  # type: ignore[arg-type]


@pytest.mark.slow
def test_context_beside_pipeline_and_tensor_parallelism_matches_one_process(tmp_path_factory) -> None:
    """pp 2 x cp 2 x tp 2: 8 processes, about 25 s on 2 cores."""
    found = _run(tmp_path_factory, cp_worker.PP * cp_worker.CP * cp_worker.TP)
    for sp in SPLIT:
        assert_matches_one_process(
            found[f"sp={sp}"],
            one_process(task="sft"),  # type: ignore[arg-type]
            tensor_parallel=True,
        )
    assert_same_step(found["full"], found["sp=True"])  # type: ignore[arg-type]


def test_bench_runs_beside_pipeline_parallelism(four) -> None:
    status, losses = four["pp:bench"]  # type: ignore[misc]
    assert status == "ok" and len(losses) == 2


def test_hidden_dropout_masks_beside_tensor_parallelism_are_megatrons(four) -> None:
    """Megatron seeds a tensor-parallel rank's stream seed + 2718 + its tp rank, whatever its cp
    rank, and the default generators alike: without sequence parallelism every rank draws the
    same hidden masks; with it, each tp rank its own, the same on its cp peers' tokens."""

    def same(ranks: list[list[torch.Tensor]], a: int, b: int) -> bool:
        return all(torch.equal(x, y) for x, y in zip(ranks[a], ranks[b], strict=True))

    plain, split = four["masks@sp=False"], four["masks@sp=True"]  # ranks: cp-major, tp-minor
    assert all(len(rank) == 2 * fsdp_worker.LAYERS + 1 for rank in (*plain, *split))  # type: ignore[union-attr]
    assert all(same(plain, 0, r) for r in (1, 2, 3))  # type: ignore[arg-type]
    assert same(split, 0, 2) and same(split, 1, 3) and not same(split, 0, 1)  # type: ignore[arg-type]


def test_context_parallelism_refuses_too_few_tokens_to_split_over_the_sequence_parallel_ranks(four) -> None:
    assert four["sequence split"] == [
        "sequence_parallel: each rank's 10 tokens do not split over 4 tensor-parallel"
        " ranks; use a sequence length that is a multiple of 8, or turn sequence"
        " parallelism off"
    ]


def test_bench_runs_beside_tensor_parallelism(four) -> None:
    status, losses = four["bench"]  # type: ignore[misc]
    assert status == "ok" and len(losses) == 2


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
    assert said["short"] == [
        "the batch, its labels and the model's position tables have [8, 16] positions;"
        " context parallelism needs a batch of the model's seq_length"
    ]


def test_experts_split_beside_context_parallelism_train_as_without_the_split(four) -> None:
    """dp 2 x cp 2, moe_tiny's experts over the 2 data-parallel ranks (ep 2): FSDP2 averages an
    expert's gradient over the ranks holding it, edp x cp, as every other over dp x cp. Against
    the same layout without expert parallelism, float64 within 1e-12 of each gradient's largest
    value (an expert's GEMMs take both ranks' rows at once, and FSDP2 sums other groups of ranks);
    the expert bias moves on the same counts, exact. Selective recompute of the MoE layer, which
    exchanges the token slots again in its replay, is bit-identical to none."""
    (loss, grads, bias, held), (split_loss, split_grads, split_bias, split_held) = (
        four[f"ep:{ep}:none"] for ep in (1, 2)
    )
    assert {int(n) for n in held.values()} == {4} and {int(n) for n in split_held.values()} == {2}
    assert split_loss == pytest.approx(loss, rel=1e-12)
    assert split_grads.keys() == grads.keys() and any(".experts." in name for name in grads)
    for name, grad in grads.items():
        assert (split_grads[name] - grad).abs().max() <= 1e-12 * grad.abs().max(), name
    assert split_bias.keys() == bias.keys() and all(torch.equal(b, bias[n]) for n, b in split_bias.items())
    assert_same_step(four["ep:2:selective"], four["ep:2:none"])  # type: ignore[arg-type]
