"""The `remat` command in one process: flags map to Megatron keys as Bridge's do, validate prints the
resolved config and plan, every bad input is refused before anything runs (exit 1, every problem
listed), and the console script's help, version and usage.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_cli_runs.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.cli import _run

from remat import __version__
from remat.cli import build_parser, main
from remat.cli.args import recompute_keys, run_parts
from remat.config.capture import Capture
from remat.config.parallel import ParallelLayout


def test_flags_map_to_megatron_keys_like_bridge() -> None:
    args = build_parser().parse_args(
        ["validate", "-rl", "2", "-ol", "3", "-tp", "2", "--sequence_parallel", "--cuda_graph_scope", "attn,mlp"]
    )
    assert recompute_keys(args) == {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 2,
        "cpu_offloading": True,
        "cpu_offloading_num_layers": 3,
    }
    parts = run_parts(args)
    assert parts["layout"] == ParallelLayout(tp=2, sp=True)
    assert parts["capture"] == Capture(cuda_graph_scope=("attn", "mlp"))
    assert {**parts["layout"].to_megatron(), **parts["capture"].to_megatron()}.items() >= {
        "tensor_model_parallel_size": 2,
        "sequence_parallel": True,
        "cuda_graph_scope": ["attn", "mlp"],
    }.items()
    args = build_parser().parse_args(["validate", "-rl", "2", "--recompute_method", "uniform"])
    assert recompute_keys(args)["recompute_method"] == "uniform"


def test_validate_prints_the_resolved_config_and_plan(capsys) -> None:
    code, out, _ = _run(capsys, "validate", "-mr", "llama3_tiny", "--recompute_modules", "mlp,layernorm")
    assert code == 0
    assert "selective" in out and "layers 0-3: layernorm=discard, mlp=recompute" in out


def test_validate_lists_every_problem_and_exits_1(capsys) -> None:
    code, _, err = _run(
        capsys,
        "validate",
        "--num_layers",
        "8",
        "-rl",
        "0",
        "-pp",
        "3",
        "--recompute_method",
        "uniform",
        "--cuda_graph_impl",
        "local",
        "--cuda_graph_scope",
        "mlp",
    )
    assert code == 1
    assert "recompute_num_layers" in err and "cuda graph" in err.lower()
    assert "num_layers: 8 layers do not split evenly" in err


def test_validate_checks_expert_parallel_sizes_against_the_recipe_as_estimate_does(capsys) -> None:
    assert _run(capsys, "validate", "-mr", "moe_tiny", "-ep", "2")[0] == 0
    code, _, err = _run(capsys, "validate", "-mr", "moe_tiny", "-ep", "3")
    assert code == 1 and "-ep/--expert_model_parallel_size: (3) must divide num_moe_experts (4)" in err
    code, _, err = _run(capsys, "validate", "-ep", "2")
    assert code == 1 and "-ep and -etp split a recipe's experts; name it with -mr" in err


def test_validate_rejects_both_rl_and_modules(capsys) -> None:
    code, _, err = _run(capsys, "validate", "-rl", "1", "--recompute_modules", "mlp")
    assert code == 1 and "pass one of them" in err


def test_validate_checks_labels_against_the_recipe(capsys) -> None:
    code, _, err = _run(capsys, "validate", "-mr", "llama3_tiny", "--recompute_modules", "moe")
    assert code == 1 and "'moe' matches no site in LlamaModel (its sites: core_attn, layernorm, mlp, mlp_act)" in err
    code, out, _ = _run(capsys, "validate", "-mr", "llama3_tiny", "--recompute_modules", "mlp")
    assert code == 0 and "layers 0-3: mlp=recompute" in out


def test_validate_refuses_megatron_labels_remat_has_no_model_for(capsys) -> None:
    code, _, err = _run(capsys, "validate", "-mr", "llama3_tiny", "--recompute_modules", "mhc,mlp")
    err = " ".join(err.split())
    assert code == 1 and "invalid config (1 problem)" in err and "unknown label" not in err
    assert (
        "'mhc' recomputes the HyperConnection (mHC) intermediates (Megatron: needs enable_mhc_connections=True" in err
    )
    assert "remat has no model with that layer yet: drop 'mhc'" in err


def test_validate_reads_a_per_layer_plan(capsys, tmp_path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("remat_plan: 1\nlayers: [{}, {mlp: recompute}, {}, {}]\nfull_recompute: [[2, 4]]\n")
    code, out, _ = _run(capsys, "validate", "-mr", "llama3_tiny", "--config", str(plan))
    assert code == 0 and "layer 1: mlp=recompute" in out
    code, _, err = _run(capsys, "validate", "-mr", "llama3_tiny", "--config", str(plan), "-rl", "1")
    assert code == 1 and "drop the recompute" in err
    plan.write_text("remat_plan: 1\nlayers: [{mlp: recompte}, {}, {}, {}]\n")
    code, _, err = _run(capsys, "validate", "-mr", "llama3_tiny", "--config", str(plan))
    assert code == 1 and "layers[0].mlp: unknown action 'recompte' (did you mean 'recompute'?)" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--recompute_granularity", "full", "--recompute_modules", "mlp"],
            "--recompute_granularity: full recomputes whole layers and --recompute_modules lists modules for selective",
        ),
        (
            ["--recompute_granularity", "selective", "-rl", "1"],
            "--recompute_granularity: selective recomputes modules in every layer and -rl N recomputes N whole layers",
        ),
    ],
    ids=["full-and-modules", "selective-and-rl"],
)
def test_a_granularity_flag_against_the_flag_choosing_the_other_one_is_that_conflict(capsys, flags, message) -> None:
    """Not the rules the resolved config would break next (full without a method, selective with layers)."""
    code, _, err = _run(capsys, "validate", "--num_layers", "4", *flags)
    assert code == 1
    assert "invalid config (1 problem)" in err and message in err


def test_unknown_recipe_is_a_clear_error(capsys) -> None:
    code, _, err = _run(capsys, "validate", "-mr", "llama3_8", "--recompute_modules", "mlp")
    assert code == 1 and "llama3_8b" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_verify_refuses_cuda_without_a_gpu(capsys) -> None:
    code, _, err = _run(capsys, "verify", "--device", "cuda", "--recompute_modules", "mlp")
    assert code == 1 and "device: a CUDA GPU was asked for but this machine has none" in err


def test_console_script_help_and_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "remat", "validate", "--help"], capture_output=True, text=True, check=True
    )
    assert "--recompute_modules" in result.stdout and "-rl" in result.stdout
    assert "Megatron's gdn_norm_out, gdp_in_proj, gdp_qkv, mhc are refused" in " ".join(result.stdout.split())
    result = subprocess.run([sys.executable, "-m", "remat", "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"remat {__version__}"


TINY_RUN = ("-mr", "llama3_tiny", "--num_layers", "2", "-sl", "16", "--no_progress")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("validate", "-mr", "llama3_tiny", "--num_layers", "0"), "num_layers: must be a positive integer, got 0"),
        (("verify", "--num_layers", "2", "-sl", "16", "-mb", "0"), "micro_batch_size: is 0; use at least 1"),
        (("estimate", *TINY_RUN, "-ng", "0"), "num_gpus: is 0; use at least 1"),
        (
            ("estimate", *TINY_RUN, "-sl", "4194304", "-mb", "2", "-cp", "1"),
            "seq_length: 4194304 x micro-batch 2 over 1 context-parallel rank(s) puts 8,388,608 tokens on each GPU",
        ),
        (("estimate", *TINY_RUN, "--json", "{tmp}"), "--json: {tmp} is a directory"),
        (
            ("plan", *TINY_RUN, "--memory-budget", "1GiB", "-o", "{tmp}/plan.txt"),
            "--output: {tmp}/plan.txt: a plan is read back by its suffix; end the name in .yaml, .yml or .json",
        ),
        (("doctor", *TINY_RUN, "--timeline", "{tmp}"), "--timeline: {tmp} is a directory"),
        (("doctor", *TINY_RUN, "--timeline", "{tmp}/t.txt"), "--timeline: {tmp}/t.txt: the plot is a PNG"),
        (
            ("sweep", *TINY_RUN, "-ms", "5", "--no_history", "--plot", "{tmp}/p.txt"),
            "--plot: {tmp}/p.txt: the plot is a PNG",
        ),
        (
            ("bench", *TINY_RUN, "-ms", "5", "--history", "{tmp}/not_a_db.sqlite"),
            "--history: {tmp}/not_a_db.sqlite is not a run history (file is not a database)",
        ),
        (
            ("doctor", "--snapshot", "{tmp}/list.json", "--limit", "12GiB"),
            "{tmp}/list.json: is not a memory snapshot (no 'segments' list)",
        ),
        (
            ("doctor", "--snapshot", "{tmp}/no_size.json", "--limit", "12GiB"),
            "{tmp}/no_size.json: is not a memory snapshot (segments[0] has no integer 'total_size')",
        ),
        (
            ("doctor", "--snapshot", "{tmp}/bad_block.json", "--limit", "12GiB"),
            "{tmp}/bad_block.json: is not a memory snapshot (segments[0].blocks[1] has no integer 'size' and 'state' name)",
        ),
        (("doctor", "--results", "{tmp}/empty.json"), "{tmp}/empty.json: holds no results"),
        (("doctor", "--results", "{tmp}/empty.json", "--timeline", "t.png"), "--timeline: plots a run of the recipe"),
        (("doctor", "--results", "{tmp}/empty.json", "--request", "5GiB"), "--request: describes an OOM's allocator"),
        (
            ("doctor", "--oom_message", "Tried to allocate 2.00 GiB", "--limit", "80GiB"),
            "--limit: the OOM message gives the device's capacity",
        ),
        (
            ("verify", "--num_layers", "2", "-sl", "16", "-tp", "2"),
            "tensor_model_parallel_size: is 2; this runs one process, without model parallelism",
        ),
        (
            ("verify", "--num_layers", "2", "-sl", "16", "--tolerance", "-1"),
            "tolerance: is -1.0; use 0 (bit-identical)",
        ),
        (
            ("plan", *TINY_RUN, "--memory-budget", "1GiB", "--min_offloaded_tensor_size", "256"),
            "min_offloaded_tensor_size: sets which tensors offload moves, and offload is off",
        ),
        (
            ("plan", *TINY_RUN, "--memory-budget", "1GiB", "-ms", "4"),
            "--max_steps: sets the run --verify makes, and there is none; pass --verify or drop it",
        ),
        (
            ("plan", *TINY_RUN, "--memory-budget", "1GiB", "--warmup_steps", "1"),
            "--warmup_steps: sets the run --verify makes",
        ),
        (
            ("plan", *TINY_RUN, "--memory-budget", "1GiB", "--history", "{tmp}/h.sqlite"),
            "--history: sets the run --verify",
        ),
        (
            ("plan", *TINY_RUN, "--memory-budget", "1GiB", "--offload", "--min_offloaded_tensor_size", "-1"),
            "min_offloaded_tensor_size: got -1; set it to 0 or more",
        ),
        (
            ("bench", *TINY_RUN, "-ms", "5", "--no_history", "--history", "{tmp}/h.sqlite"),
            "--history: names a history file and --no_history records none",
        ),
    ],
)
def test_bad_inputs_are_refused_before_anything_runs(argv, message, capsys, tmp_path, monkeypatch) -> None:
    from remat.cli import bench, doctor, estimate, plan, sweep

    def refuse(*args, **kwargs):
        raise AssertionError("ran before refusing")

    for module, name in (
        (bench, "run_bench"),
        (plan, "run_bench"),
        (plan, "trace_spec"),
        (sweep, "sweep"),
        (doctor, "run_bench"),
        (estimate, "estimate"),
        (doctor, "timeline"),
    ):
        monkeypatch.setattr(module, name, refuse)
    (tmp_path / "not_a_db.sqlite").write_text("x")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "no_size.json").write_text('{"segments": [{"foo": 1}]}')
    (tmp_path / "bad_block.json").write_text(
        '{"segments": [{"total_size": 4, "blocks": [{"size": 2, "state": "inactive"}, {"size": "2"}]}]}'
    )
    (tmp_path / "empty.json").write_text("[]")
    code, _, err = _run(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert code == 1 and message.format(tmp=tmp_path) in " ".join(err.split())


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            ("verify", "-mr", "nope", "-mb", "0", "--tolerance", "-1"),
            [
                "invalid config (3 problems)",
                "model_recipe_name: unknown recipe 'nope'",
                "micro_batch_size: is 0",
                "tolerance: is -1.0",
            ],
        ),
        (
            ("verify", "--num_layers", "2", "-sl", "16", "--tolerance", "-1", "--recompute_modules", "moe"),
            [
                "invalid config (2 problems)",
                "tolerance: is -1.0",
                "recompute_modules: 'moe' matches no site in LlamaModel",
            ],
        ),
        (
            ("validate", "-mr", "nope", "--recompute_modules", "mlpp"),
            ["invalid config (2 problems)", "model_recipe_name: unknown recipe 'nope'", "unknown label 'mlpp'"],
        ),
    ],
)
def test_verify_and_validate_report_every_problem_at_once(argv, said, capsys) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 1
    for text in said:
        assert text in " ".join(err.split())


def test_an_unknown_flag_gets_the_commands_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--memory-budget", "1GiB", "-rl", "2"])  # the planner chooses what to recompute
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: remat plan") and "unrecognized arguments: -rl 2" in err


@pytest.mark.parametrize(
    ("seconds", "shown"), [(14.9203, "14,920 ms"), (0.0123, "12.3 ms"), (1.5e-5, "0.015 ms"), (2e-8, "< 0.001 ms")]
)
def test_step_times_read_in_milliseconds_without_exponents(seconds, shown) -> None:
    from remat.cli.tables import milliseconds

    assert milliseconds(seconds) == shown


def test_a_bad_model_shape_does_not_hide_the_run_and_config_problems(capsys) -> None:
    code, _, err = _run(
        capsys,
        "bench",
        "-mr",
        "llama3_tiny",
        "--num_layers",
        "0",
        "--recompute_modules",
        "foo",
        "-mb",
        "0",
        "--no_history",
    )
    assert code == 1 and "invalid config (3 problems)" in err
    assert "num_layers: must be a positive integer" in err and "micro_batch_size: is 0" in err
    assert "recompute_modules: unknown label 'foo'" in err


def test_recipe_names_print_as_written_not_as_emoji(capsys) -> None:
    from remat.cli.common import out

    out.print("estimated peak memory per GPU, hf:llama: tp 2")  # rich would draw :llama: as an emoji
    assert "hf:llama: tp 2" in capsys.readouterr().out
