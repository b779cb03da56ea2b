"""The benchmark harness end to end: `remat bench` / `remat sweep` on a tiny recipe on CPU, every
bad flag refused without a step, real training steps and the result they write (whether gradient
accumulation was fused too), golden checks and history through the CLI, simulated out-of-memory
errors, sweeps and their advice, and --no_optimizer's gradients accumulating over the run (bf16:
within 2% of the largest entry).

The quick tests of the same code: tests/unit/bench/test_bench.py."""

from __future__ import annotations

import json
import shlex
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

import pytest
import torch
from helpers.bench import MB, NUM_LAYERS, SEQ, STEPS, TINY, _edit_golden, cli, oom_error, tiny_spec

import remat.bench.run as bench_run
import remat.run.build as run_build
import remat.run.step as step
from remat.bench import BenchResult
from remat.bench.history import recent
from remat.bench.run import MockData
from remat.cli import main
from remat.models import build, family_of
from remat.models.llama import MLP

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


pytestmark = pytest.mark.usefixtures("_private_history")


REJECTED = [
    pytest.param(["-c", "fp8_mx"], ["compute_dtype: 'fp8_mx': MXFP8 needs Blackwell", "use -c fp8_cs"], id="fp8"),
    pytest.param(["-c", "nonsense"], ["compute_dtype: 'nonsense' is not a compute dtype"], id="dtype-unknown"),
    pytest.param(["-c", "bf61"], ["did you mean 'bf16'?"], id="dtype-typo"),
    pytest.param(
        ["-c", "fp8"],
        ["'fp8' is not a compute dtype (did you mean 'fp8_cs'?)"],
        id="dtype-bridge-prefix",
    ),
    pytest.param(["-ng", "0"], ["num_gpus: is 0"], id="num-gpus"),
    pytest.param(["-tp", "3"], ["tensor_model_parallel_size: num_attention_heads=4 does not split over 3"], id="tp"),
    pytest.param(
        ["-pp", "2"],
        ["global_batch_size: gives 1 micro-batch(es) a step; 1F1B over 2 stages needs at least 2: raise -gb"],
        id="pp",
    ),
    pytest.param(["-cp", "3"], ["context_parallel_size: seq_length=16 (-sl 16) does not split into 6 chunks"], id="cp"),
    pytest.param(["-vp", "2"], ["virtual_pipeline_model_parallel_size"], id="vp"),
    pytest.param(
        ["--num_layers", "4", "-pp", "2", "-vp", "2", "-gb", "6"],
        ["interleaved 1F1B runs them in rounds of pp = 2: use a multiple"],
        id="pp-vp",
    ),
    pytest.param(
        ["-pp", "2", "-gb", "2", "-ng", "3"],
        ["num_gpus: 3 GPUs do not split into data-parallel groups"],
        id="ng-not-multiple",
    ),
    pytest.param(
        ["-mb", "2", "-gb", "3"],
        ["global_batch_size: 3 is not a positive multiple of the micro-batch size 2"],
        id="gb-not-multiple",
    ),
    pytest.param(["-mb", "4", "-gb", "2"], ["global_batch_size: 2 is not a positive multiple"], id="gb-below-mb"),
    pytest.param(["-mb", "0"], ["micro_batch_size: is 0"], id="mb-zero"),
    pytest.param(["-ms", "3", "--warmup_steps", "3"], ["max_steps: 3 steps leave no steady step"], id="ms-eq-warmup"),
    pytest.param(["-ms", "2", "--warmup_steps", "3"], ["max_steps: 2 steps"], id="ms-below-warmup"),
    pytest.param(["--warmup_steps", "-1"], ["warmup_steps: is -1; use --warmup_steps 0 or more"], id="warmup-negative"),
    pytest.param(
        ["--compile", "--warmup_steps", "0"],
        ["warmup_steps: is 0 with --compile: the first step compiles"],
        id="compile-no-warmup",
    ),
    pytest.param(
        ["--task", "bogus"],
        ["task: 'bogus' is not a task; Megatron Bridge's are 'pretrain', 'sft', 'peft'", "use pretrain or sft"],
        id="task",
    ),
    pytest.param(["--task", "sfft"], ["did you mean 'sft'?"], id="task-typo"),
    pytest.param(["--task", "peft"], ["task: 'peft' is not supported yet; use pretrain or sft"], id="task-peft"),
    pytest.param(["-g", "h300"], ["gpu: 'h300' is not a GPU name (did you mean 'h200'?)"], id="gpu-unknown"),
    pytest.param(["-g", "h100", "--device", "cpu"], ["-g h100 names a GPU but this run is on CPU"], id="gpu-on-cpu"),
    pytest.param(["--device", "cuda"], ["device: a CUDA GPU was asked for"], id="cuda-missing", marks=NO_CUDA),
    pytest.param(
        ["-mr", "llama3_8b", "--num_layers", "32", "-sl", "8192", "--device", "cpu"],
        ["8.03B parameters is a GPU job"],
        id="big-on-cpu",
    ),
    pytest.param(["-rl", "1", "--recompute_modules", "mlp"], ["pass one of them"], id="rl-and-modules"),
    pytest.param(
        ["--recompute_granularity", "full", "--recompute_modules", "mlp"],
        ["invalid config (1 problem)", "--recompute_granularity: full recomputes whole layers"],
        id="full-and-modules",
    ),
    pytest.param(["-rl", "3"], ["recompute_num_layers: 3 is out of range", "between 1 and 2"], id="rl-too-many"),
    pytest.param(["--recompute_modules", "moe"], ["'moe' matches no site in LlamaModel"], id="label-moe"),
    pytest.param(
        ["--recompute_modules", "mlp,shared_experts"], ["'shared_experts' matches no site"], id="label-shared-experts"
    ),
    pytest.param(["--recompute_modules", "moe_act"], ["recompute_modules: 'moe_act'"], id="label-moe-act"),
    pytest.param(["--recompute_modules", "mlpp"], ["unknown label 'mlpp' (did you mean 'mlp'?)"], id="label-typo"),
    pytest.param(
        ["--recompute_method", "uniform", "--recompute_granularity", "full"],
        ["recompute_num_layers"],
        id="full-without-layers",
    ),
    pytest.param(
        ["--recompute_method", "uniform"],
        [
            "recompute_method: 'uniform' applies only to full recompute, which is off (recompute_granularity"
            " is null), so it would do nothing; set recompute_granularity: full (on the command line -rl N)"
        ],
        id="method-without-rl",
    ),
    pytest.param(["-mr", "llama3_tin"], ["did you mean 'llama3_tiny'?"], id="recipe-typo"),
]


@pytest.mark.parametrize(("flags", "messages"), REJECTED)
@pytest.mark.usefixtures("no_steps")
def test_bench_rejects_bad_flags(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], messages: list[str]
) -> None:
    out_json = tmp_path / "r.json"
    code, out, err = cli(capsys, "bench", *TINY, *flags, "--json", str(out_json))
    assert code == 1
    for message in messages:
        assert message in err
    assert "remat bench" not in out  # no results table
    assert not out_json.exists()
    assert not (tmp_path / "default-history.sqlite").exists()


def test_a_sweep_prints_its_advice_before_it_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep can take hours: what its check advised is printed before the first run, once."""
    import remat.cli.sweep as sweep_command

    seen_before_running = []

    def sweep(spec, plans, on_step=None, into=None):
        seen_before_running.append(capsys.readouterr().err)
        return real_sweep(spec, plans, on_step=on_step, into=into)

    offload = tmp_path / "offload.yaml"
    offload.write_text("cpu_offloading: true\ncpu_offloading_num_layers: 1\n")
    real_sweep = sweep_command.sweep
    monkeypatch.setattr(sweep_command, "sweep", sweep)
    code, _, err = cli(
        capsys, "sweep", *TINY, "--configs", str(offload), "--no_history", "--plot", str(tmp_path / "p.png")
    )
    assert code == 0 and "offload on CPU (offload) copies CPU memory" in seen_before_running[0]
    assert "offload on CPU" not in err  # not again after the runs
    assert seen_before_running[0].count("offload on CPU") == 1


def test_bench_run_writes_a_sensible_result(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "new" / "r.json"  # missing folders are created, as for --save-golden and --plot
    code, out, err = cli(
        capsys, "bench", *TINY, "-gb", "4", "--recompute_modules", "mlp", "--no_history", "--json", str(out_json)
    )
    assert code == 0, err
    data = json.loads(out_json.read_text())
    result = BenchResult.from_dict(data)
    assert (result.status, result.name, result.recipe, result.device, result.gpu) == (
        "ok",
        "mlp",
        "llama3_tiny",
        "cpu",
        "cpu",
    )
    assert result.config["recompute_granularity"] == "selective"
    assert result.config["recompute_modules"] == ["mlp"]
    assert result.shape["num_layers"] == NUM_LAYERS and result.shape["seq_length"] == SEQ
    assert result.shape["micro_batch_size"] == MB and result.shape["global_batch_size"] == 4
    assert len(result.losses) == STEPS
    assert all(5.0 < loss < 7.0 for loss in result.losses)  # ~ln(512) at init
    assert result.step_time_s is not None and result.fwd_bwd_time_s is not None
    assert 0 < result.fwd_bwd_time_s <= result.step_time_s
    assert result.tflops_per_gpu is not None and result.tflops_per_gpu > 0
    assert result.tflops_fwd_bwd is not None and result.tflops_fwd_bwd >= result.tflops_per_gpu
    model = build("llama3_tiny", device="meta", num_layers=NUM_LAYERS, seq_length=SEQ)
    tokens = 4 * SEQ  # two micro-batches of two sequences
    assert result.tflops_per_gpu * 1e12 * result.step_time_s == pytest.approx(
        family_of("llama3_tiny").flops(model.config, SEQ, 4)
    )
    assert result.tokens_per_s_per_gpu == pytest.approx(tokens / result.step_time_s)
    memory = result.memory
    assert memory is not None
    assert memory.weights == memory.grads == 2 * model.num_parameters()  # bf16
    assert memory.optimizer == 2 * memory.weights  # AdamW's two moments
    assert result.peak_allocated_bytes is not None
    assert result.peak_allocated_bytes > memory.weights + memory.grads + memory.optimizer
    assert memory.activations == result.peak_allocated_bytes - memory.weights - memory.grads - memory.optimizer
    assert result.peak_reserved_bytes is None  # no caching allocator on CPU
    assert result.harness_overhead is not None and 0 <= result.harness_overhead < 1
    assert result.oom is None
    # the tables
    assert "remat bench: llama3_tiny" in out and "memory at peak: mlp" in out
    assert "optimizer state" in out and " ok " in out


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        ([], "none"),
        (["-rl", "1"], "full_block_1"),
        (["-rl", "2", "--recompute_method", "uniform"], "full_uniform_2"),
        (["--recompute_modules", "mlp,layernorm"], "mlp+layernorm"),
    ],
)
def test_bench_result_name_matches_the_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], name: str
) -> None:
    out_json = tmp_path / "r.json"
    code, _, err = cli(capsys, "bench", *TINY, *flags, "--no_history", "--json", str(out_json))
    assert code == 0, err
    assert json.loads(out_json.read_text())["name"] == name


@pytest.mark.parametrize("fused", [True, False])
def test_bench_records_whether_gradient_accumulation_is_fused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fused: bool
) -> None:
    out_json = tmp_path / "r.json"
    flags = [] if fused else ["--no_gradient_accumulation_fusion"]
    code, _, err = cli(capsys, "bench", *TINY, *flags, "--no_history", "--json", str(out_json))
    assert code == 0, err
    assert json.loads(out_json.read_text())["shape"]["gradient_accumulation_fusion"] is fused


def _verdicts(out: str) -> dict[str, str]:
    """metric -> verdict, from the golden comparison table."""
    verdicts = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 6 and cells[0] in (
            "tflops_per_gpu",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "loss",
            "status",
        ):
            verdicts[cells[0]] = cells[5]
    return verdicts


def test_golden_through_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    flags = [*TINY, "--recompute_modules", "mlp", "--no_history"]
    golden = tmp_path / "goldens" / "mlp.json"
    code, out, err = cli(capsys, "bench", *flags, "--save-golden", str(golden))
    assert code == 0, err
    assert "golden comparison" not in out
    saved = json.loads(golden.read_text())
    assert saved["status"] == "ok" and saved["name"] == "mlp"

    # the same config again: timing differs, memory and loss are exact on CPU
    code, out, err = cli(capsys, "bench", *flags, "--golden", str(golden), "--threshold", "1e9")
    assert code == 0, err
    assert "golden comparison" in out
    assert _verdicts(out) == {"tflops_per_gpu": "ok", "peak_allocated_bytes": "ok", "loss": "ok"}
    assert "note:" not in err  # same recipe, shape and config: nothing to warn about
    code, out, err = cli(capsys, "bench", *flags, "--golden", str(golden), "--threshold", "0")
    assert _verdicts(out)["peak_allocated_bytes"] == "ok" and _verdicts(out)["loss"] == "ok"

    # factors of 1000 so that a loaded machine (timing noise of 10x and more) keeps the verdicts
    faster = _edit_golden(golden, tmp_path / "faster.json", tflops_per_gpu=lambda t: 1000 * t)
    code, out, _ = cli(capsys, "bench", *flags, "--golden", str(faster), "--threshold", "0.5")
    assert code == 1
    assert _verdicts(out) == {"tflops_per_gpu": "REGRESSION", "peak_allocated_bytes": "ok", "loss": "ok"}

    slower = _edit_golden(golden, tmp_path / "slower.json", tflops_per_gpu=lambda t: 0.001 * t)
    code, out, _ = cli(capsys, "bench", *flags, "--golden", str(slower), "--threshold", "0.5")
    assert code == 1
    assert _verdicts(out)["tflops_per_gpu"] == "UNEXPECTED IMPROVEMENT"
    assert "REGRESSION" not in out

    # timing left out of the golden, so only the (exact) memory decides
    smaller = _edit_golden(
        golden, tmp_path / "smaller.json", tflops_per_gpu=None, peak_allocated_bytes=lambda b: int(b * 0.9)
    )
    code, out, _ = cli(capsys, "bench", *flags, "--golden", str(smaller), "--threshold", "0.05")
    assert code == 1
    assert _verdicts(out) == {"peak_allocated_bytes": "REGRESSION", "loss": "ok"}


def test_golden_of_another_config_gpu_or_metrics_is_noted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    golden = tmp_path / "none.json"
    code, _, _ = cli(capsys, "bench", *TINY, "--no_history", "--save-golden", str(golden))
    assert code == 0
    code, _, err = cli(
        capsys, "bench", *TINY, "-rl", "1", "--no_history", "--golden", str(golden), "--threshold", "1e9"
    )
    assert code == 0 and "note: config.recompute_granularity differs" in err
    # a GPU golden: reserved memory, which a CPU run has none of, is named as not compared
    on_gpu = _edit_golden(golden, tmp_path / "gpu.json", gpu="NVIDIA H200", peak_reserved_bytes=2**30)
    code, out, err = cli(capsys, "bench", *TINY, "--no_history", "--golden", str(on_gpu), "--threshold", "1e9")
    assert code == 0, err
    assert "note: gpu differs: golden 'NVIDIA H200', current 'cpu'" in err
    assert "note: peak_reserved_bytes not compared: the golden has it, this run has none" in err
    assert set(_verdicts(out)) == {"tflops_per_gpu", "peak_allocated_bytes", "loss"}


@pytest.mark.usefixtures("fake_cuda_memory")
def test_cli_bench_fails_on_oom(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    golden = tmp_path / "golden.json"
    code, _, _ = cli(capsys, "bench", *TINY, "--no_history", "--save-golden", str(golden))
    assert code == 0

    real_forward = MLP.forward

    def failing_forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta":  # the check of what a CPU step needs, before the run
            return real_forward(self, x)
        raise oom_error()

    monkeypatch.setattr(MLP, "forward", failing_forward)
    out_json, db = tmp_path / "oom.json", tmp_path / "h.sqlite"
    code, out, _ = cli(capsys, "bench", *TINY, "--json", str(out_json), "--history", str(db))
    assert code == 1
    assert " oom " in out
    assert "7.00 GiB at OOM" in out and "9.00 GiB at OOM" in out
    assert json.loads(out_json.read_text())["status"] == "oom"
    assert [r.status for r in recent(path=db)] == ["oom"]
    code, out, _ = cli(capsys, "bench", *TINY, "--no_history", "--golden", str(golden))
    assert code == 1
    assert _verdicts(out) == {"status": "REGRESSION"}


def test_history_records_one_row_per_bench(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    db = tmp_path / "h.sqlite"
    argv = ["bench", *TINY, "-rl", "1", "--history", str(db)]
    monkeypatch.setattr(sys, "argv", ["remat", *argv])  # as the console script sees it
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    rows = recent(path=db)
    assert len(rows) == 1
    row = rows[0]
    assert row.command == shlex.join(["remat", *argv])
    assert row.torch == torch.__version__
    with closing(sqlite3.connect(db)) as conn:  # the columns too, not only the stored result
        columns = conn.execute("SELECT gpu, torch, recipe, command FROM runs").fetchone()
    assert columns == ("cpu", torch.__version__, "llama3_tiny", shlex.join(["remat", *argv]))
    assert row.name == "full_block_1" and row.status == "ok"
    assert row.config["recompute_granularity"] == "full" and row.config["recompute_num_layers"] == 1
    assert len(row.losses) == STEPS
    assert not (tmp_path / "default-history.sqlite").exists()
    code, _, _ = cli(capsys, *argv)
    assert len(recent(path=db)) == 2  # appended, not replaced


def test_no_history_writes_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path, _private_history: Path) -> None:
    code, _, _ = cli(capsys, "bench", *TINY, "--no_history")
    assert code == 0 and not _private_history.exists()
    code, _, _ = cli(capsys, "bench", *TINY)  # default: $REMAT_HISTORY
    assert code == 0
    assert [r.name for r in recent(path=_private_history)] == ["none"]


def test_sweep_through_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    entries = ["none", "mlp", "full_uniform_1", "core_attn+layernorm"]
    plot, out_json, db = tmp_path / "p.png", tmp_path / "s.json", tmp_path / "h.sqlite"
    code, out, err = cli(
        capsys,
        "sweep",
        *TINY,
        "--plot",
        str(plot),
        "--json",
        str(out_json),
        "--history",
        str(db),
        "--configs",
        *entries,
    )
    assert code == 0, err
    assert "remat sweep: llama3_tiny" in out
    for name in entries:
        assert f" {name} " in out
    assert plot.read_bytes().startswith(PNG_SIGNATURE)
    assert f"Pareto plot: {plot}" in out
    results = [BenchResult.from_dict(d) for d in json.loads(out_json.read_text())]
    assert [r.name for r in results] == entries
    assert all(r.status == "ok" and len(r.losses) == STEPS for r in results)
    assert len(recent(path=db)) == len(entries)
    # recompute changes memory, never the math: every config trains bit-identically from the same start
    assert all(r.losses == results[0].losses for r in results)
    peak = {r.name: r.peak_allocated_bytes for r in results}
    assert peak["mlp"] < peak["none"] and peak["full_uniform_1"] < peak["none"]
    # a warning repeated by every run is printed once
    assert err.count("core_attn' saves almost nothing") == 1


def test_no_optimizer_measures_forward_and_backward_with_gradients_accumulating(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", *TINY, "--no_history", "--no_progress", "--no_optimizer", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["memory"]["optimizer"] == 0 and result["memory"]["grads_persist"]
    # the gradients left at the end are the sum over every micro-batch the run took (the steps and,
    # on CPU, the one that counts the peak), as the anchor's loop without zero_grad leaves them
    spec = tiny_spec(optimizer=False, micro_batch_size=1, global_batch_size=2)
    left = {}
    release = step.release_memory
    monkeypatch.setattr(
        step,
        "release_memory",
        lambda model: left.update({n: p.grad.clone() for n, p in model.named_parameters()}) or release(model),
    )
    model = run_build.build_model(spec)
    bench_run.run_bench(spec, model=model)
    data = MockData(spec)
    want = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for _ in range((STEPS + 1) * spec.micro_batches):
        grads = torch.autograd.grad(model(*data.batch()) / spec.micro_batches, list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), grads):
            want[n] += g.double()
    assert spec.micro_batches == 2 and left.keys() == want.keys()
    for n, g in want.items():  # bf16 sums: within 2% of the largest entry (one micro-batch less: ~100%)
        assert (left[n].double() - g).abs().max() <= 0.02 * g.abs().max(), n
