"""The MoE family's sweeps and commands (moe_tiny, deepseek_tiny): every label, Megatron Bridge's
label combinations and full recompute bit-identical to the unmodified model in float64 with
dropout on; expert offload bit-identical, moving exactly the experts' inputs; `remat estimate` on
an MoE slice (moe_act's saving) and with expert parallelism (one rank's share of the experts);
the planner's MoE plan as Megatron keys; `remat verify` on an MoE recipe.

The quick tests of the same code: tests/unit/models/test_moe.py."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from helpers.moe import (
    F64,
    LABELS,
    RECIPES,
    TOKENS,
    _batch,
    _config,
    _full,
    _model,
    _moe_layers,
    _random_expert_bias,
    _selective,
)

import remat
from remat.cli import main
from remat.config.plan import Plan
from remat.planner import uniform_config
from remat.run.verify import run_step, verify
from remat.sites.apply import offloader_of

pytestmark = pytest.mark.usefixtures("deterministic")


# Megatron Bridge's recipes: DeepSeek-V3 "mla_up_proj,mlp", "layernorm,moe_act", "moe"; Qwen3-MoE
# "moe_act", "moe" (single labels, run above)
COMBOS = {"moe_tiny": (), "deepseek_tiny": (("mla_up_proj", "mlp"), ("layernorm", "moe_act"))}


CASES = (
    [(r, ("selective", (label,))) for r in RECIPES for label in LABELS[r]]
    + [(r, ("selective", combo)) for r in RECIPES for combo in COMBOS[r]]
    + [(r, ("selective", LABELS[r])) for r in RECIPES]
    + [(r, ("full", m, k)) for r in RECIPES for m, k in (("uniform", 1), ("block", 2))]
)


def _case_id(case) -> str:
    recipe, what = case
    return f"{recipe}-{','.join(what[1])}" if what[0] == "selective" else f"{recipe}-{what[1]}{what[2]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_every_label_combination_and_full_recompute_is_bit_identical_with_dropout(case) -> None:
    recipe, what = case
    model = _model(recipe)
    if model.config.moe_router_enable_expert_bias:
        _random_expert_bias(model)  # the choice then depends on the bias too
    plain = run_step(model, *_batch(), seed=5)  # the model before remat touched it
    config = _selective(model, *what[1]) if what[0] == "selective" else _full(model, what[1], what[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        report = verify(model, config, *_batch(), seed=5)
    assert report.bit_identical, report.max_grad_diff
    assert torch.equal(plain.loss, report.candidate.loss)
    assert plain.grads.keys() == report.candidate.grads.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(plain.grads[n], g) for n, g in report.candidate.grads.items())
    assert report.freed_bytes > 0


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("modules", [["expert_fc1"], ["moe_act"], ["expert_fc1", "moe_act"]])
def test_expert_offload_is_bit_identical_and_moves_the_experts_inputs(recipe, modules) -> None:
    model = _model(recipe)
    c = model.config
    rows, ffn = TOKENS * c.moe_router_topk, c.moe_ffn_hidden_size
    config = _config(
        model, fine_grained_activation_offloading=True, offload_modules=modules, min_offloaded_tensor_size=0
    )
    plain = run_step(model, *_batch(), seed=5)
    report = verify(model, config, *_batch(), seed=5)
    moved = offloader_of(model).stats().offloaded_bytes
    assert report.bit_identical and torch.equal(plain.loss, report.candidate.loss)
    # expert_fc1: FC1's input, the permuted tokens [rows, hidden]; moe_act: the activation's input
    # (FC1's output, [rows, 2 ffn]), its routing probabilities and the SwiGLU intermediates
    # (silu(gate) and the product, [rows, ffn] each) FC2 does not save
    per_layer = {"expert_fc1": rows * c.hidden_size, "moe_act": rows * 2 * ffn + rows + 2 * rows * ffn}
    # Megatron offloads no module of the last layer, whose backward comes right after its forward
    offloaded_layers = _moe_layers(model) - 1
    assert moved == offloaded_layers * sum(per_layer[m] for m in modules) * F64
    assert report.freed_bytes == moved


def test_estimate_runs_an_moe_slice_and_predicts_the_moe_act_saving(capsys, tmp_path) -> None:
    out = tmp_path / "estimate.json"
    code = main(
        [
            "estimate",
            "-mr",
            "moe_tiny",
            "--num_moe_experts",
            "8",
            "--moe_layer_freq",
            "[0]*1+[1]*2",
            "-sl",
            "16",
            "--no_progress",
            "--configs",
            "none",
            "moe",
            "moe_act",
            "full_uniform_1",
            "--json",
            str(out),
        ]
    )
    capsys.readouterr()
    assert code == 0
    activations = {e["name"]: e["stages"][0]["activations"] for e in json.loads(out.read_text())}
    assert activations["full_uniform_1"] < activations["moe"] < activations["moe_act"] < activations["none"]
    # one micro-batch of 16 tokens, top-2, expert FFN 48, bf16: the three [slots, ffn] tensors of
    # the measured float64 run (test above), in 2 MoE layers
    assert activations["none"] - activations["moe_act"] == 2 * 3 * (16 * 2) * 48 * 2


@pytest.mark.slow
def test_the_planner_writes_an_moe_plan_as_megatron_keys_without_its_offload_only_sites() -> None:
    model = _model("moe_tiny", dropout=0.0)
    traced = remat.trace(model, _batch(), timing_repeats=1)
    model_sites = traced.model_sites
    assert any("expert_fc1" in labels for labels in model_sites.labels)
    for modules in (["moe_act"], ["layernorm", "moe"]):
        config = uniform_config(Plan.from_config(_selective(model, *modules), model_sites), traced)
        assert config is not None and config.recompute_modules == modules


@pytest.mark.slow
def test_estimate_with_expert_parallel_holds_one_rank_s_share_of_the_experts(capsys, tmp_path) -> None:
    weights, said = {}, {}
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}.json"
        code = main(
            [
                "estimate",
                "-mr",
                "moe_tiny",
                "--num_moe_experts",
                "8",
                "-ep",
                str(ep),
                "-sl",
                "16",
                "--no_progress",
                "--configs",
                "none",
                "--json",
                str(out),
            ]
        )
        said[ep] = capsys.readouterr().out
        assert code == 0
        weights[ep] = json.loads(out.read_text())[0]["stages"][0]["weights"]
    assert "cp 1, ep 2, etp 1, micro-batch" in said[2] and "ep 1, etp 1" in said[1]
    # half of 8 experts' FC1 [2 x 48, 64] and FC2 [64, 48], bf16, in moe_tiny's 2 MoE layers
    assert weights[1] - weights[2] == 2 * 4 * (2 * 48 * 64 + 64 * 48) * 2


def test_verify_runs_an_moe_recipe(capsys) -> None:
    code = main(
        ["verify", "-mr", "moe_tiny", "-sl", "16", "--hidden_dropout", "0.1", "--recompute_modules", "moe,moe_act"]
    )
    assert code == 0 and "bit-identical: True" in capsys.readouterr().out
