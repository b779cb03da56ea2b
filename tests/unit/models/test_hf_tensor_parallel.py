"""Tensor parallelism for Hugging Face causal LMs by their own plans (`base_model_tp_plan`), without
a launch: plans remat does not map and models without one refused, shapes that do not split named
by field, sequence parallelism's refusals (unsplit weights, hidden dropout, odd sequences, beside
stages), attention dropout without a core_attn site, a rank's shard by shape, and the estimate's
tokens split under sequence parallelism.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_hf_tensor_parallel_runs.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


import remat  # noqa: E402
from remat import models  # noqa: E402
from remat.config.parallel import ParallelLayout  # noqa: E402
from remat.config.precision import Precision  # noqa: E402
from remat.core.problems import ConfigError  # noqa: E402
from remat.models.hf.configs import hf_config  # noqa: E402
from remat.models.hf.family import FAMILY  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "integration" / "workers"))  # the workers' helpers


import hf_tp_worker  # noqa: E402

TP2 = ParallelLayout(tp=2)


def _problems(family: str, layout: ParallelLayout = TP2, **overrides) -> str:
    config = FAMILY.config(f"hf:{family}", **overrides)
    return "\n".join(f"{p.field}: {p.message}" for p in FAMILY.layout_problems(config, layout))


def test_plans_remat_does_not_map_and_models_without_one_are_refused() -> None:
    assert "q_norm: replicated_with_grad_allreduce" in _problems("qwen3")
    assert "qkv_proj: colwise_gather_output" in _problems("phi3")
    assert "ships no tensor-parallel plan (base_model_tp_plan)" in _problems("gpt2")
    assert _problems("llama") == _problems("mixtral") == ""


def test_shapes_that_do_not_split_are_refused_each_by_its_field() -> None:
    found = _problems("llama", ParallelLayout(tp=3))
    for field in ("num_attention_heads=4", "num_key_value_heads=2", "intermediate_size=128"):
        assert field in found
    # Mixtral's plan splits attention only: its experts' intermediate size is no concern
    assert "intermediate_size" not in _problems("mixtral", ParallelLayout(tp=2), ffn_hidden_size=127)


def test_a_heterogeneous_config_is_split_layer_by_layer() -> None:
    # dots3's tiny config: 4 heads in layer 0, 64 in layer 1 (read globally, transformers refuses)
    hf = hf_config("dots3_note_text")
    assert [layer.num_attention_heads for layer in hf.per_layer_config] == [4, 64]
    found = _problems("dots3_note_text", ParallelLayout(tp=8))
    assert "num_attention_heads=4 does not split" in found and "num_attention_heads=64" not in found


def test_a_size_listed_per_layer_is_split_layer_by_layer() -> None:
    # Gemma 3n's config holds one intermediate_size per layer
    assert hf_config("gemma3n_text", intermediate_size=[128, 130]).intermediate_size == [128, 130]
    found = _problems("gemma3n_text", ParallelLayout(tp=4), intermediate_size=[128, 130])
    assert "intermediate_size=130 does not split" in found and "intermediate_size=128" not in found


def test_sequence_parallelism_refuses_unsplit_weights_hidden_dropout_and_odd_sequences() -> None:
    import transformers

    sp = ParallelLayout(tp=2, sp=True)
    assert _problems("llama", sp) == ""
    assert _problems("llama", sp, seq_length=15) == (
        "sequence_parallel: seq_length=15 does not split over 2 tensor-parallel ranks; use a multiple of the"
        " tensor-parallel size, or drop --sequence_parallel"
    )
    mixtral = hf_tp_worker.model("mixtral", 0.0)
    assert [p.message for p in FAMILY.parallelism(mixtral, sp).problems()] == [
        "the layers' MixtralSparseMoeBlock hold weights the tensor-parallel plan does not split, which would run on"
        " this rank's tokens only; drop --sequence_parallel"
    ]
    with pytest.raises(ConfigError, match="MixtralSparseMoeBlock"):  # the estimate's points refuse it alike
        FAMILY.parallelism(mixtral, sp).sequence_points()
    llama = transformers.AutoModelForCausalLM.from_config(hf_config("llama", num_layers=1))
    llama.model.layers[0].add_module("hidden_dropout", torch.nn.Dropout(0.1))
    assert [p.message for p in FAMILY.parallelism(remat.adapt(llama), sp).problems()] == [
        "the layers' dropout (hidden_dropout) outside attention would draw the same masks on every rank's tokens;"
        " set it to 0 or drop --sequence_parallel"
    ]


def test_sequence_parallelism_beside_stages_stays_refused() -> None:
    assert "drop --sequence_parallel beside -pp" in _problems("llama", ParallelLayout(tp=2, sp=True, pp=2))


def test_attention_dropout_without_a_core_attn_site_is_refused() -> None:
    import transformers

    config = hf_config("llama", num_layers=1, attention_dropout=0.1)
    plain = transformers.AutoModelForCausalLM.from_config(config)  # no Sites: nothing forks its dropout
    assert models.family_of_model(plain) is FAMILY
    found = [p.field for p in FAMILY.parallelism(plain, TP2).problems()]
    assert found == ["attention_dropout"]


def test_a_rank_shard_splits_heads_and_the_planned_ffn() -> None:
    config = FAMILY.config("hf:llama")
    llama = FAMILY.shard(config, TP2, range(config.num_layers)).hf
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.intermediate_size, llama.head_dim) == (
        2,
        1,
        64,
        16,
    )
    config = FAMILY.config("hf:mixtral")
    mixtral = FAMILY.shard(config, TP2, range(config.num_layers)).hf
    assert (mixtral.num_attention_heads, mixtral.intermediate_size) == (2, 128)


def test_the_estimate_splits_the_tokens_between_blocks_under_sequence_parallelism() -> None:
    """By shape, one rank of tp 2: with sequence parallelism the norms' inputs and the residual
    stream between the planned blocks are this rank's half of the tokens, so each layer saves less."""
    from remat.estimate.spec import EstimateSpec
    from remat.estimate.stages import estimate

    def saved(sp: bool) -> int:
        spec = EstimateSpec(
            recipe="hf:llama",
            overrides={"num_layers": 2, "seq_length": 32},
            optimizer=False,
            precision=Precision("fp32"),
            device="cpu",
            layout=ParallelLayout(tp=2, sp=sp),
        )
        (result,) = estimate(spec, [("none", None)])
        return result.stages[0].activations

    assert saved(True) < saved(False)
