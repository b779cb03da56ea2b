"""Hugging Face causal LMs under context parallelism without a launch: the refusals by name, a
built model checked before its hooks go on, the loss head's labels shifted already, and the
estimate's share of the sequence.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_hf_context_parallel_runs.py."""

from __future__ import annotations

import pytest
import torch

from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError
from remat.models.hf import context_parallel
from remat.models.hf.configs import hf_config
from remat.models.hf.family import FAMILY
from remat.models.hf.loss_head import causal_lm_loss
from remat.run.spec import RunSpec

pytest.importorskip("transformers")


def _problems(family: str, seq_length: int = 64, **overrides: object) -> list[str]:
    config = FAMILY.config(f"hf:{family}", seq_length=seq_length, **overrides)
    return [str(p) for p in FAMILY.layout_problems(config, ParallelLayout(cp=2))]


def test_what_context_parallelism_refuses_by_name() -> None:
    assert _problems("llama") == _problems("qwen2") == _problems("mixtral") == []
    assert _problems("llama", seq_length=18) == [
        "context_parallel_size: seq_length=18 does not split into 4 chunks for 2 context-parallel ranks; use a"
        " multiple of 4"
    ]
    assert _problems("llama", attention_dropout=0.1) == [
        "attention_dropout: is 0.1; torch's ring attention draws it per block of keys, and its backward replays"
        " one block's random state for all of them; use 0 under context parallelism"
    ]
    assert _problems("mistral") == [
        "context_parallel_size: MistralConfig has sliding-window layers, whose mask torch's ring attention does"
        " not take; use 1"
    ]
    assert "GPT-2's positions are a learned table" in _problems("gpt2")[0]
    assert "soft-caps its attention scores" in " ".join(_problems("gemma2"))
    assert _problems("mixtral", output_router_logits=True) == [
        "output_router_logits: the router's load-balancing loss would count this rank's tokens only; turn it off"
        " under context parallelism"
    ]
    with pytest.raises(ConfigError, match="sliding-window"):  # before any process starts
        RunSpec(recipe="hf:mistral", device="cpu", layout=ParallelLayout(cp=2, num_gpus=2))


def test_a_built_model_is_checked_before_its_hooks_go_on() -> None:
    """context_parallel_model passes a built model's transformers config (a pipeline stage's: none,
    and the family checks its causal LM's before preparing it)."""
    layout = ParallelLayout(cp=2)
    assert [p.field for p in FAMILY.layout_problems(hf_config("mistral"), layout)] == ["context_parallel_size"]
    assert list(FAMILY.layout_problems(None, layout)) == []  # type: ignore[arg-type]
    mistral = FAMILY.build(FAMILY.config("hf:mistral", num_layers=1))
    with pytest.raises(ConfigError, match="sliding-window"):
        context_parallel.prepare(mistral, layout)
    assert not mistral.model.rotary_emb._forward_pre_hooks
    llama = FAMILY.build(FAMILY.config("hf:llama", num_layers=1))
    context_parallel.prepare(llama, layout)
    context_parallel.prepare(llama, layout)  # once is enough
    assert len(llama.model.rotary_emb._forward_pre_hooks) == 1


def test_the_chunked_loss_head_takes_labels_shifted_already() -> None:
    """As HF's ForCausalLMLoss: `shift_labels` given, the labels are not shifted again."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 8, 16, generator=g), torch.randn(32, 16, generator=g)
    labels = torch.randint(0, 32, (2, 8), generator=g)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    logits = hidden @ weight.T
    for expected in (ForCausalLMLoss(logits, labels, 32), ForCausalLMLoss(logits, labels, 32, shift_labels=shifted)):
        assert torch.allclose(causal_lm_loss(hidden, weight, labels, shift_labels=shifted), expected)


def test_estimate_takes_each_ranks_share_of_the_sequence() -> None:
    config = FAMILY.config("hf:llama", seq_length=64)
    assert FAMILY.shard(config, ParallelLayout(cp=2), range(config.num_layers)).seq_length == 32
