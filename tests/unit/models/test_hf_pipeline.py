"""Pipeline parallelism for Hugging Face causal LMs: stages cut from the transformers model by the hf
family, on CPU under torchrun with gloo (tests/workers/hf_pp_worker.py), and the refusals without a
launch.

A tiny HF Llama and Mixtral (float64, 4 layers) under 1F1B over 2 stages and interleaved 1F1B over
2 x 2 virtual stages give the loss and every gradient of the whole model's step on one process bit
for bit: each stage runs the base model's own forward on its layers (position ids, causal mask and
rotary tables computed again, alike), so every micro-batch runs the same ops in the same order.
HF's loss head reduces in float32 on both. With attention dropout each rank draws its own masks,
so every recompute plan is held against the pipeline without recompute, also bit for bit.
Beside tensor parallelism (pp 2 x tp 2, four processes, slow) the loss and gradients agree with
one process to 1e-12 (the row-parallel projections sum each rank's partial products, which
reorders one process's additions), and every plan is bit-identical to none.

A Llama with tied embeddings holds the weight on both ends (the first stage's embedding, the last
stage's output layer), their gradients summed after the step: every gradient is one process's bit
for bit, the tied one the sum of the embedding's and the output layer's gradients of the untied
model, which one process with the tied weight adds up in autograd's order instead: to 1e-15 of it.
Under FSDP2 (pp 2 x dp 2, slow) each end's shard is summed with the other's, bit for bit too. A
rank holding both ends (virtual stages of one rank) sums them itself; Megatron's main gradients,
which take the gradient out of .grad, are summed where they are (`main_grad`).

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_hf_pipeline_runs.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.hf_pipeline import TIED_TOLERANCE
from torch import nn

pytest.importorskip("transformers")


from remat.config.parallel import ParallelLayout  # noqa: E402
from remat.models.hf.family import FAMILY  # noqa: E402
from remat.parallel.tied import TiedEnds  # noqa: E402
from remat.run.optimizer import MainParamsAdamW, OptimizerPrecision  # noqa: E402
from remat.sites.calls import forward_loss  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "integration" / "workers"))  # the workers' helpers


import hf_pp_worker  # noqa: E402


def _stages(config, layers: list[tuple[int, ...]], skip: str | None = None) -> tuple[nn.Module, list[nn.Module]]:
    """The whole model of `config` and its stages holding `layers`, with its weights (by every name
    a weight has, but `skip`)."""
    torch.manual_seed(0)
    whole = FAMILY.build(config, dtype=torch.float64).train()
    source = hf_pp_worker.weights(whole)
    stages = []
    for index, share in enumerate(layers):
        shard = FAMILY.shard(config, ParallelLayout(pp=len(layers)), share)
        stage = FAMILY.build(
            shard, dtype=torch.float64, pre_process=index == 0, post_process=index == len(layers) - 1
        ).train()
        assert [layer.self_attn.layer_idx for layer in stage.model.layers] == list(share)
        with torch.no_grad():
            for name, p in stage.named_parameters():
                if name != skip:
                    p.copy_(source[name])
        stages.append(stage)
    assert sorted(n for s in stages for n, _ in s.named_parameters()) == sorted(source)
    return whole, stages


def _step(chained: list[nn.Module], vocab_size: int) -> float:
    """The loss of `chained` (stages, or the whole model) on one batch, backwarded."""
    ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    x = ids
    for stage in chained:
        x = forward_loss(stage, x, ids)
    x.backward()
    return x.item()


@pytest.mark.parametrize(
    "family, overrides, layers",
    [
        ("qwen2", dict(use_sliding_window=True, max_window_layers=1, sliding_window=4), [(0,), (1, 2, 3)]),
        ("deepseek_v3", {}, [(0, 1), (2, 3)]),  # a dense first layer, MoE after
    ],
)
def test_stages_keep_layer_numbers_names_and_masks(family, overrides, layers) -> None:
    """Qwen2 picks each layer's mask (sliding or full) by its position in the base model's layers,
    DeepSeek-V3 a layer's kind by its number: stages chained on one process are the whole model."""
    config = FAMILY.config(f"hf:{family}", num_layers=4, seq_length=16, **overrides)
    whole, stages = _stages(config, layers)
    assert _step(stages, config.vocab_size) == _step([whole], config.vocab_size)
    source = dict(whole.named_parameters())
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p.grad, source[name].grad), name


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # Gemma's embedding scales its lookups, not its weight
def test_one_rank_holding_both_ends_of_a_tied_embedding_ties_them_itself(family) -> None:
    """A pipeline rank running both the first and the last stage (virtual stages of one rank):
    the last copy starts as the first and their gradients are summed, with no communication."""
    config = FAMILY.config(f"hf:{family}", num_layers=4, seq_length=16, tie_word_embeddings=True)
    whole, stages = _stages(config, [(0, 1), (2, 3)], skip="lm_head.weight")
    ends = TiedEnds(stages, first=True, last=True, group=None)
    ends.copy_first()
    assert _step(stages, config.vocab_size) == _step([whole], config.vocab_size)
    ends.sum_gradients()
    source = hf_pp_worker.weights(whole)
    for stage in stages:
        for name, p in stage.named_parameters():
            if name in hf_pp_worker.TIED_NAMES:
                torch.testing.assert_close(p.grad, source[name].grad, rtol=0, atol=TIED_TOLERANCE, msg=name)
            else:
                assert torch.equal(p.grad, source[name].grad), name
    embedding, output = (dict(s.named_parameters())[n] for s, n in zip(stages, hf_pp_worker.TIED_NAMES))
    assert torch.equal(embedding, output) and torch.equal(embedding.grad, output.grad)


def test_main_gradients_of_a_tied_embedding_are_summed_between_the_ends() -> None:
    """Megatron's main gradients take the gradient out of .grad in each backward: the ends sum
    the main gradients (`main_grad`, Megatron's name) instead."""
    config = FAMILY.config("hf:llama", num_layers=2, seq_length=16, tie_word_embeddings=True)
    _, stages = _stages(config, [(0,), (1,)])
    optimizer = MainParamsAdamW(
        [p for stage in stages for p in stage.parameters()], OptimizerPrecision(main_params_dtype="fp32")
    )
    ends = TiedEnds(stages, first=True, last=True, group=None)
    ends.copy_first()
    _step(stages, config.vocab_size)
    embedding, output = (dict(s.named_parameters())[n] for s, n in zip(stages, hf_pp_worker.TIED_NAMES))
    assert embedding.grad is None and output.grad is None
    expected = embedding.main_grad + output.main_grad
    ends.sum_gradients()
    assert torch.equal(embedding.main_grad, expected) and torch.equal(output.main_grad, expected)
    del optimizer  # its main gradients go with it
    assert not hasattr(embedding, "main_grad")


TWO_STAGES = ParallelLayout(pp=2)


def _problems(family: str, layout: ParallelLayout = TWO_STAGES, **overrides) -> str:
    config = FAMILY.config(f"hf:{family}", **overrides)
    return "\n".join(f"{p.field}: {p.message}" for p in FAMILY.layout_problems(config, layout))


def test_llama_and_mixtral_split_into_stages() -> None:
    assert _problems("llama") == _problems("mixtral") == _problems("llama", ParallelLayout(pp=2, tp=2)) == ""


def test_models_stages_cannot_cut_are_refused_each_by_what_to_change() -> None:
    assert (
        "pipeline_model_parallel_size: is above 1; GPT2LMHeadModel has no model.embed_tokens, model.layers,"
        " model.norm, model.rotary_emb"
    ) in _problems("gpt2")
    assert _problems("gemma2") == _problems("llama", tie_word_embeddings=True) == ""  # a copy on each end
    assert "output_router_logits: is True" in _problems("mixtral", output_router_logits=True)


def test_context_parallelism_runs_beside_stages() -> None:  # tests/test_hf_context_parallel.py runs it
    assert _problems("llama", ParallelLayout(pp=2, cp=2)) == ""
