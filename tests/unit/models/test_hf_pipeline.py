"""Pipeline stages cut from Hugging Face causal LMs by the hf family, without a launch: stages
chained on one process give the whole model's loss and gradients bit for bit (Qwen2's sliding and
full masks by layer position, DeepSeek-V3's dense first layer by number); a rank holding both
ends of a tied embedding (virtual stages of one rank) sums their gradients itself, to 1e-15 of
one process's (float64, added in autograd's order there), and sums Megatron's main gradients
(`main_grad`) where they are; which models and layouts stages are refused or accepted for.

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


def test_context_parallelism_runs_beside_stages() -> None:  # tests/integration/test_hf_context_parallel_runs.py runs it
    assert _problems("llama", ParallelLayout(pp=2, cp=2)) == ""
