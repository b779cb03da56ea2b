"""remat estimate in one process, shapes only on the meta device: weights, gradients and AdamW's
state; what tensor, sequence, context and pipeline parallelism leave each rank (micro-batches in
flight by Megatron's schedules, per-layer plans on interleaved stages); step time with the
recompute FLOPs; the layout and batch rules, every problem at once; what only CUDA saves or holds
(compiled regions, layernorm discard, cuBLAS workspaces); offload it cannot price; the command's
refusals.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_estimate_runs.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.estimate import FULL, MB, SHAPE, SMALL, VPP, _figures, _quiet, _spec

import remat
from remat.cli import main
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan, pipeline_range_problems
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.estimate.spec import cublas_workspace_bytes
from remat.estimate.stages import estimate
from remat.models import family_of, recipe_config

LAYER_INPUT = MB * SHAPE["seq_length"] * 64 * 4  # [b, s, h] fp32


def test_optimizer_state_and_weights_are_those_of_adamw() -> None:
    (est,) = _quiet(estimate, _spec(optimizer=True, global_batch_size=2 * MB))
    model = remat.models.build("llama3_tiny", dtype=torch.float32, **SMALL)
    weights = sum(p.numel() * 4 for p in model.parameters())
    (stage,) = est.stages
    assert (stage.weights, stage.grads, stage.optimizer_state) == (weights, weights, 2 * weights)


def test_pipeline_stages_split_the_weights_and_hold_their_micro_batches_in_flight() -> None:
    (whole,) = _quiet(estimate, _spec(optimizer=True))
    layout = ParallelLayout(pp=2)
    (split,) = _quiet(estimate, _spec(optimizer=True, layout=layout, global_batch_size=4 * MB), [("full", FULL)])
    first, last = split.stages
    assert first.weights + last.weights == whole.stages[0].weights  # embedding first, head last
    assert (first.in_flight, last.in_flight) == (2, 1)
    # full recompute of single layers keeps each layer's input, for each micro-batch in flight
    assert first.activations == 2 * LAYER_INPUT


@pytest.mark.parametrize("sp, cp, kept", [(False, 1, 1.0), (True, 1, 0.5), (True, 2, 0.25)])
def test_sequence_and_context_parallel_shard_the_kept_layer_inputs(sp, cp, kept) -> None:
    layout = ParallelLayout(tp=2, sp=sp, cp=cp, pp=2)
    (est,) = _quiet(estimate, _spec(layout=layout, global_batch_size=1 * MB), [("full", FULL)])
    assert est.stages[0].activations == kept * LAYER_INPUT  # the first stage's one layer


def test_tensor_parallel_divides_the_layer_weights() -> None:
    (one,) = _quiet(estimate, _spec())
    (two,) = _quiet(estimate, _spec(layout=ParallelLayout(tp=2)))
    model = remat.models.build("llama3_tiny", dtype=torch.float32, **SMALL)
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "layernorm" in n)
    vocab = model.config.vocab_size  # 512: already a multiple of 128 x 2, so no padding
    assert vocab % 256 == 0
    assert two.stages[0].weights == (one.stages[0].weights - norms) // 2 + norms


@pytest.mark.parametrize(
    "pp, vpp, stage, micro_batches, expected",
    [
        (4, None, 0, 8, 4),
        (4, None, 3, 8, 1),
        (4, None, 0, 2, 2),
        # Megatron's interleaved warm-up: (pp - rank - 1) * 2 + (vpp - 1) * pp chunks, plus one
        (4, 2, 0, 8, (3 * 2 + 4 + 1) / 2),
        (4, 2, 3, 8, (0 + 4 + 1) / 2),
        (2, 2, 0, 1, 1),
    ],
)
def test_micro_batches_in_flight_follow_megatrons_schedules(pp, vpp, stage, micro_batches, expected) -> None:
    layout = ParallelLayout(pp=pp, vp=vpp)
    assert layout.in_flight(stage, micro_batches) == expected


def test_step_time_counts_the_recompute_flops() -> None:
    mlp = RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"])
    none, recomputed, full = _quiet(estimate, _spec(tflops=1.0), [("none", None), ("mlp", mlp), ("full", FULL)])
    config = recipe_config("llama3_tiny", **SMALL)
    tokens, h, ffn = MB * config.seq_length, config.hidden_size, config.ffn_hidden_size
    # the replay runs linear_fc1 (gate and up) and stops: linear_fc2's output is not needed by backward
    fc1 = 2 * tokens * h * 2 * ffn * config.num_layers
    assert (recomputed.step_time_s - none.step_time_s) * 1e12 == pytest.approx(fc1, rel=1e-9)
    assert full.step_time_s > recomputed.step_time_s > none.step_time_s > 0


@pytest.mark.parametrize(
    "layout, shapes, field",
    [
        (ParallelLayout(tp=3), {}, "tensor_model_parallel_size"),
        (ParallelLayout(cp=3), {}, "context_parallel_size"),
        (
            ParallelLayout(tp=3, sp=True),
            {"num_attention_heads": 6, "num_query_groups": 3, "ffn_hidden_size": 96, "hidden_size": 96},
            "sequence_parallel",
        ),
    ],
)
def test_parallel_shape_rules_fail_and_pass(layout, shapes, field) -> None:
    family = family_of("llama3_tiny")
    model = dict(num_attention_heads=4, num_query_groups=2, ffn_hidden_size=160, seq_length=32)
    config = recipe_config("llama3_tiny", **{**model, **shapes})
    assert {p.field for p in family.layout_problems(config, layout)} == {field}
    assert not list(family.layout_problems(recipe_config("llama3_tiny", **model), ParallelLayout(tp=2)))


def test_batch_split_rules_fail_and_pass() -> None:
    def fields(num_gpus: int, micro_batch_size: int, global_batch_size: int | None) -> list[str]:
        try:
            _spec(
                layout=ParallelLayout(tp=2, pp=2, num_gpus=num_gpus),
                micro_batch_size=micro_batch_size,
                global_batch_size=global_batch_size,
            )
        except ConfigError as err:
            return [p.field for p in err.problems]
        return []

    assert fields(6, 1, None) == ["num_gpus"]
    assert fields(8, 2, 6) == ["global_batch_size"]
    assert not fields(8, 2, 8)


def test_a_spec_reports_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        _spec(device="tpu", tflops=0, micro_batch_size=0, layout=ParallelLayout(pp=3))
    fields = {p.field for p in err.value.problems}
    assert {"target", "tflops", "micro_batch_size", "num_layers"} <= fields
    assert _spec(device="cuda", tflops=1, global_batch_size=1 * MB).target == "cuda"


@pytest.mark.parametrize("num_layers, vpp", [(2, None), (4, 2)])
def test_a_plan_range_across_a_model_chunk_is_refused(num_layers, vpp) -> None:
    """Layers 0 and 1 are different stages' (with -vp 2 over 4 layers: rank 0 runs 0 and 2)."""
    layout = ParallelLayout(pp=2, vp=vpp)
    plan = Plan([{}] * num_layers, [(0, 2)])
    with pytest.raises(ConfigError, match=r"full_recompute\[0\]: \[0, 2\) spans .* split the range at layer 1$"):
        _quiet(estimate, _spec(layout=layout, overrides={**SMALL, "num_layers": num_layers}), [("plan", plan)])


def test_pipeline_range_rule_fails_and_passes() -> None:
    layout = ParallelLayout(pp=2, vp=2)
    problems = list(pipeline_range_problems([(0, 2), (3, 8)], 8, layout))  # chunks of 2 layers
    assert [p.field for p in problems] == ["full_recompute[1]"]
    assert problems[0].message.startswith("[3, 8) spans virtual pipeline stages 1, 2, 3 (2 layers each;")
    assert problems[0].message.endswith("split the range at layers 4, 6")
    assert not list(pipeline_range_problems([(1, 2), (7, 8)], 8, layout))
    assert not list(pipeline_range_problems([(0, 8)], 8, ParallelLayout()))


def test_a_per_layer_plan_under_virtual_stages_acts_on_each_ranks_interleaved_layers() -> None:
    """4 layers, pp 2, vpp 2: chunks of one layer, rank 0 runs layers 0 and 2, rank 1 layers 1 and 3
    (a contiguous split would give rank 0 layers 0 and 1)."""
    mlp = RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"])
    rank_0 = Plan([{"mlp": "recompute"}, {}, {"mlp": "recompute"}, {}])
    none, everywhere, plan = _quiet(
        estimate,
        _spec(overrides=SHAPE, layout=VPP.layout, global_batch_size=2 * MB),
        [("none", None), ("mlp", mlp), ("rank 0", rank_0)],
    )
    assert _figures(plan) == [_figures(everywhere)[0], _figures(none)[1]]


@pytest.mark.parametrize(
    "flags, chosen",
    [
        (
            ["-ol", "1", "--recompute_modules", "core_attn"],
            "recompute_granularity, recompute_modules, cpu_offloading, cpu_offloading_num_layers",
        ),
        (["-rl", "1"], "recompute_granularity, recompute_method, recompute_num_layers"),
        (["--config", "PLAN"], "--config (a per-layer plan)"),
    ],
)
def test_cli_refuses_recompute_flags_beside_configs(flags, chosen, tmp_path, capsys) -> None:
    """--configs lists what is estimated: a config the flags choose too is refused, not dropped."""
    Plan.none(2).save(tmp_path / "plan.yaml")
    flags = [str(tmp_path / "plan.yaml") if f == "PLAN" else f for f in flags]
    assert (
        main(
            [
                "estimate",
                "--num_layers",
                "2",
                "-sl",
                "32",
                "-ng",
                "1",
                "--target",
                "cpu",
                "--no_progress",
                "--configs",
                "none",
                *flags,
            ]
        )
        == 1
    )
    assert f"--configs: estimates only the entries it lists, so what the flags set ({chosen})" in (
        capsys.readouterr().err.replace("\n", "")
    )


def test_cli_reports_shapes_that_do_not_split(capsys) -> None:
    assert main(["estimate", "-tp", "3", "-ng", "3", "--no_progress"]) == 1
    assert "tensor_model_parallel_size" in capsys.readouterr().err


def test_compiled_regions_on_cuda_save_only_the_gate_up_input() -> None:
    """On CUDA the SwiGLU Function saves only its gate/up input: MLP recompute frees that and the
    activation linear_fc2 saves (3 x ffn), discarding mlp_act the activation alone (1 x ffn)."""
    mlp, act = (
        RecomputeConfig(recompute_granularity="selective", recompute_modules=[label]) for label in ("mlp", "mlp_act")
    )
    none, recomputed, discarded = _quiet(
        estimate,
        _spec(compile=True, device="cuda", precision=Precision("bf16")),
        [("none", None), ("mlp", mlp), ("mlp_act", act)],
    )
    tokens, ffn, layers = MB * SMALL["seq_length"], 160, SMALL["num_layers"]
    assert none.stages[0].activations - recomputed.stages[0].activations == layers * 3 * ffn * tokens * 2
    assert none.stages[0].activations - discarded.stages[0].activations == layers * ffn * tokens * 2


@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_layernorm_discard_frees_each_norm_output_and_its_scale(compiled: bool) -> None:
    """For CUDA the norms run remat's RMSNorm Function (what torch's fused kernel saves: the input
    and a float32 1/rms per row): discarding both norm outputs of a layer frees them and the two
    scales, the inputs being saved anyway."""
    layernorm = RecomputeConfig(recompute_granularity="selective", recompute_modules=["layernorm"])
    none, discarded = _quiet(
        estimate,
        _spec(compile=compiled, device="cuda", precision=Precision("bf16")),
        [("none", None), ("layernorm", layernorm)],
    )
    tokens, hidden = MB * SMALL["seq_length"], 64
    assert none.stages[0].activations - discarded.stages[0].activations == (
        SMALL["num_layers"] * 2 * (tokens * hidden * 2 + tokens * 4)
    )


@pytest.mark.slow  # traces a model per plan: 11 s of the README's suite
def test_an_offload_plan_that_would_move_nothing_says_why() -> None:
    for threshold, moved in ((1 << 20, False), (64, True)):  # the default, above every tiny tensor; then below
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", remat.RematWarning)
            [est] = estimate(
                _spec(), [("offload", Plan([{"layer": "offload"}, {}], min_offloaded_tensor_size=threshold))]
            )
        assert (est.stages[0].host > 0) == moved
        assert any("nothing moved to host" in str(w.message) for w in caught) == (not moved)


def test_flops_of_matmuls_that_add_into_their_input_are_counted() -> None:
    """The loss head's weight gradient adds each chunk's matmul into a float32 buffer: on meta
    (as torch 2.11, whose meta addmm(out_dtype=) fails, needs) it is counted as the matmul it is."""
    from torch.utils.flop_counter import FlopCounterMode

    from remat.memory.flops import FLOP_FORMULAS as _FLOP_FORMULAS
    from remat.models.kernels.loss import _accumulate_mm

    acc = torch.zeros(8, 6, device="meta")
    a, b = (
        torch.empty(8, 4, device="meta", dtype=torch.bfloat16),
        torch.empty(4, 6, device="meta", dtype=torch.bfloat16),
    )
    with FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS) as counter:
        acc.addmm_(a.float(), b.float())
        assert _accumulate_mm(acc, a, b, torch.float32) is acc  # in place: no second buffer
    assert counter.get_total_flops() == 2 * (2 * 8 * 4 * 6)


def test_offload_an_estimate_cannot_price_is_refused_before_any_trace(monkeypatch) -> None:
    from remat.estimate import stages as estimating

    monkeypatch.setattr(estimating, "trace_stage", lambda *a, **k: pytest.fail("traced before checking"))
    with pytest.raises(ConfigError, match="the plan has 1 layer but the model has 2"):
        estimate(_spec(), [("short", Plan([{}]))])
    two_sites = Plan([{"core_attn": "offload", "layernorm": "offload"}, {}], min_offloaded_tensor_size=64)
    with pytest.raises(ConfigError, match="did not measure core_attn=offload, layernorm=offload"):
        estimate(_spec(), [("two sites", two_sites)])
    with pytest.raises(ConfigError, match="last layer"):
        estimate(_spec(), [("last", Plan([{}, {"mlp": "offload"}], min_offloaded_tensor_size=64))])
    stage_end = Plan([{"mlp": "offload"}, {}], min_offloaded_tensor_size=64)  # layer 0 ends stage 0 of 2
    with pytest.raises(ConfigError, match="last layer"):
        estimate(_spec(layout=ParallelLayout(pp=2), global_batch_size=2 * MB), [("stage end", stage_end)])


def test_cublas_workspace_config_is_read_in_cublas_format() -> None:
    """CUBLAS_WORKSPACE_CONFIG: ':SIZE:COUNT' pairs, SIZE in KiB; unset, torch's 32 MiB on an H200."""
    assert cublas_workspace_bytes(None) == 32 * 2**20
    assert cublas_workspace_bytes(":4096:8") == 32 * 2**20
    assert cublas_workspace_bytes(":4096:2:16:8") == 8 * 2**20 + 128 * 2**10
    for bad in ("4096:8", ":4096", ":4k:8", ""):
        with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG: cannot read .* or unset it"):
            cublas_workspace_bytes(bad)


def test_on_cuda_the_peak_holds_one_cublas_workspace_per_gemm_thread(monkeypatch) -> None:
    """The forward's thread and autograd's each hold a workspace through the step (measured on an
    H200: workspace_bytes_h200.json): on the peak, beside the traced bytes; none on CPU."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cuda = dict(device="cuda", precision=Precision("bf16"))
    (default,), (zero,) = (_quiet(estimate, _spec(**cuda, cublas_workspace=w)) for w in (None, 0))
    assert (default.stages[0].workspaces, zero.stages[0].workspaces) == (64 * 2**20, 0)
    assert default.peak - zero.peak == 64 * 2**20
    assert default.stages[0].other == zero.stages[0].other
    assert _spec(**cuda, cublas_workspace=2**20).workspace_bytes == 2 * 2**20
    assert _spec(device="cpu").workspace_bytes == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    spec = _spec(**cuda)
    assert spec.workspace_bytes == 2 * 8 * 2**20
    assert _spec(**cuda, cublas_workspace=0).workspace_bytes == 0  # the argument wins
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert spec.workspace_bytes == 2 * 8 * 2**20  # read once, when the spec was made
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "lots")
    with pytest.raises(ConfigError) as err:
        _spec(**cuda, tflops=0)
    assert {p.field for p in err.value.problems} == {"CUBLAS_WORKSPACE_CONFIG", "tflops"}
    with pytest.raises(ConfigError, match="cublas_workspace: is -1 bytes"):
        _spec(**cuda, cublas_workspace=-1)
    with pytest.raises(ConfigError, match="cublas_workspace: counts only on the cuda target, not 'cpu'; drop it"):
        _spec(device="cpu", cublas_workspace=2**20)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_a_learned_attention_mask_runs_unfused_on_meta(target) -> None:
    """A mask with a gradient (Inkling's position bias) beside grouped key heads: torch takes the
    unfused path, which gives the mask its gradient; the fused kernels would not."""
    from remat.estimate.kernels import TargetKernels

    q = torch.empty(1, 4, 16, 8, device="meta", requires_grad=True)
    k, v = (torch.empty(1, 2, 16, 8, device="meta", requires_grad=True) for _ in range(2))
    bias = torch.empty(1, 4, 16, 16, device="meta", requires_grad=True)
    with TargetKernels(target):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        out.sum().backward()
    assert bias.grad is not None and bias.grad.shape == bias.shape
