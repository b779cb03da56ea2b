"""The benchmark harness on a tiny recipe on CPU: its settings' checks, what a result records, and
the quick runs; the records themselves (golden comparison, history, plot, tables) are tested in
test_bench_records.py.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_bench_runs.py."""

from __future__ import annotations

import json
import re
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.bench import ALLOCATED, MB, NUM_LAYERS, RESERVED, SEQ, STEPS, TINY, _edit_golden, cli, oom_error, tiny_spec
from torch import nn

import remat.bench.run as bench_run
import remat.run.build as run_build
import remat.run.step as step
from remat.bench import BenchResult, BenchSpec, plan_name, run_bench, sweep
from remat.bench.presets import megatron_presets, parse_entry
from remat.bench.run import MockData, run_shape
from remat.cli.checks import output_path_problems
from remat.config.plan import Plan
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.models import build
from remat.models.llama import MLP
from remat.sites.apply import apply, find_sites

FACTS = {"num_layers": NUM_LAYERS, "attention_dropout": 0.0, "hidden_dropout": 0.0}


pytestmark = pytest.mark.usefixtures("_private_history")


@pytest.mark.usefixtures("no_steps")
def test_bench_lists_every_settings_problem(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(
        capsys,
        "bench",
        *TINY,
        "-c",
        "fp8_mx",
        "--task",
        "bogus",
        "-ng",
        "2",
        "-mb",
        "2",
        "-gb",
        "3",
        "-ms",
        "1",
        "-g",
        "h300",
    )
    assert code == 1
    assert "invalid config (6 problems)" in err  # -ng 2 is a data-parallel run, refused before it starts
    for field in (
        "-c/--compute_dtype",
        "--task",
        "-g/--gpu: 'h300'",
        "-gb/--global_batch_size",
        "-ms/--max_steps",
        "-g/--gpu: -g h300 names a GPU",
    ):
        assert f"  {field}" in err


@pytest.mark.usefixtures("no_steps")
def test_bench_lists_every_parallel_problem(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(
        capsys, "bench", *TINY, "--num_layers", "4", "-tp", "3", "-pp", "2", "-cp", "3", "-vp", "2", "-gb", "6"
    )
    assert code == 1
    for field in ("-tp/--tensor_model_parallel_size", "-cp/--context_parallel_size", "-gb/--global_batch_size"):
        assert f"  {field}:" in err


@pytest.mark.usefixtures("no_steps")
def test_bench_lists_problems_of_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "bench", *TINY, "-c", "fp8_mx", "-tp", "3", "-rl", "3")
    assert code == 1
    for field in ("-c/--compute_dtype", "-tp/--tensor_model_parallel_size", "-rl/--recompute_num_layers"):
        assert f"  {field}:" in err


@pytest.mark.usefixtures("no_steps")
def test_sweep_rejects_bad_settings_and_entries(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "p.png"
    code, _, err = cli(capsys, "sweep", *TINY, "-c", "nvfp4", "--plot", str(plot))
    assert code == 1 and "compute_dtype: 'nvfp4': NVFP4 needs Blackwell tensor cores" in err
    code, _, err = cli(capsys, "sweep", *TINY, "--configs", "none", "mlpp", "--plot", str(plot))
    assert code == 1 and "unknown label 'mlpp' (did you mean 'mlp'?)" in err
    code, _, err = cli(capsys, "sweep", *TINY, "--configs", "full_uniform_3", "--plot", str(plot))
    assert code == 1 and "recompute_num_layers: 3 is out of range" in err
    assert not plot.exists()


@pytest.mark.usefixtures("no_steps")
def test_sweep_refuses_a_config_file_whose_full_recompute_settings_would_be_ignored(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "half.yaml"
    config.write_text("recompute_method: block\nrecompute_num_layers: 1\n")  # no recompute_granularity: full
    code, _, err = cli(
        capsys, "sweep", *TINY, "--no_history", "--configs", "none", str(config), "--plot", str(tmp_path / "p.png")
    )
    assert code == 1
    assert "half.yaml: recompute_method: 'block' applies only to full recompute" in err
    assert "half.yaml: recompute_num_layers: 1 applies only to full recompute" in err
    assert "warning" not in err  # refused, not advised


@pytest.mark.usefixtures("no_steps")
def test_bench_refuses_a_config_file_whose_module_lists_would_be_ignored(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "lists.yaml"
    config.write_text("recompute_modules: [mlp]\noffload_modules: [core_attn]\n")  # neither switch on
    code, _, err = cli(capsys, "bench", *TINY, "--no_history", "--config", str(config))
    assert code == 1
    assert "recompute_modules: has no effect while recompute_granularity is null" in err
    assert "offload_modules: has no effect while fine_grained_activation_offloading is off" in err


def test_sweep_checks_entries_against_the_model_before_running(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[str] = []
    real = bench_run.run_bench

    def counting(spec: BenchSpec, plan: Any = None, **kwargs: Any) -> BenchResult:
        ran.append(kwargs.get("name", ""))
        return real(spec, plan, **kwargs)

    monkeypatch.setattr(bench_run, "run_bench", counting)
    code, _, err = cli(capsys, "sweep", *TINY, "--no_history", "-d", "--configs", "moe")
    assert code == 1 and "'moe' matches no site" in err
    code, _, err = cli(
        capsys, "sweep", *TINY, "--no_history", "--configs", "none", "moe", "--plot", str(tmp_path / "p.png")
    )
    assert code == 1 and ran == []  # nothing spent on `none` before finding `moe` invalid
    code, out, _ = cli(capsys, "sweep", *TINY, "--no_history", "-d", "--configs", "none", "none")
    assert code == 0 and out.split() == ["none"]  # an entry given twice runs once
    code, out, _ = cli(capsys, "sweep", *TINY, "--no_history", "-d", "--configs", "mlp+core_attn", "core_attn,mlp")
    assert code == 0 and out.split() == ["mlp+core_attn"]  # the same config under another name runs once
    code, out, _ = cli(capsys, "sweep", *TINY, "--no_history", "-d")
    presets = out.split()
    assert code == 0 and "none" in presets and "mlp+core_attn" in presets
    code, out, _ = cli(capsys, "sweep", *TINY, "--no_history", "-d", "--configs", "full_uniform_2", "presets", "mlp")
    assert code == 0 and out.split() == ["full_uniform_2", *presets]  # in place; mlp is one of them
    code, _, err = cli(capsys, "sweep", *TINY, "--no_history", "-d", "--configs", "nofile.yaml")
    assert code == 1 and "  nofile.yaml: cannot read the file" in err  # named once


@pytest.mark.usefixtures("no_steps")
def test_output_paths_are_checked_before_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """What a run writes once it is over (minutes later on a GPU) cannot fail then: a directory in a file's
    place, or a file in a folder's, is refused first."""
    folder, a_file = tmp_path / "folder", tmp_path / "file.txt"
    folder.mkdir()
    a_file.write_text("")
    code, out, err = cli(
        capsys, "bench", *TINY, "--json", str(folder), "--save-golden", str(a_file / "g.json"), "--history", str(folder)
    )
    assert code == 1 and "remat bench" not in out
    assert "invalid config (3 problems)" in err
    assert f"--json: {folder} is a directory; give a file path in it" in err
    assert f"--save-golden: {a_file} is a file, so {a_file / 'g.json'} cannot be created in it" in err
    assert f"--history: {folder} is a directory" in err
    code, out, err = cli(
        capsys, "sweep", *TINY, "--configs", "none", "--plot", str(folder), "--json", str(a_file / "s.json")
    )
    assert code == 1 and "remat sweep" not in out
    assert f"--plot: {folder} is a directory" in err and f"--json: {a_file} is a file" in err
    assert "--history" not in err  # $REMAT_HISTORY: a path that does not exist yet in a folder that does


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs Linux's /proc (read-only, even for root)")
def test_an_output_path_that_cannot_be_written_is_a_problem_even_for_root() -> None:
    # /proc takes no new files and /proc/version no writes, whoever asks: os.access would say yes to root
    [created] = output_path_problems("--json", "/proc/new/r.json")
    assert (
        created.message.startswith("/proc/new/r.json cannot be created in /proc (")
        and "choose another folder" in created.message
    )
    [overwritten] = output_path_problems("--json", "/proc/version")
    assert (
        overwritten.message.startswith("/proc/version cannot be overwritten (")
        and "choose another path" in overwritten.message
    )
    assert list(output_path_problems("--json", Path.cwd() / "fine" / "r.json")) == []


@pytest.mark.usefixtures("no_steps")
def test_bench_rejects_cuda_graphs_it_does_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "bench", *TINY, "--no_history", "--cuda_graph_impl", "local")
    assert code == 1 and "cuda_graph_impl" in err


def test_bench_rejects_an_unknown_device(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "bench", *TINY, "--no_history", "--device", "foo", "-d")
    assert code == 1 and "device: 'foo' is not a device; use cpu, cuda or cuda:N" in err


@pytest.mark.usefixtures("no_steps")
def test_bench_rejects_a_negative_threshold_before_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    record = run_bench_free_golden()  # of this run's shape: the threshold is the one problem
    record["shape"] = run_shape(tiny_spec())
    golden = tmp_path / "g.json"
    golden.write_text(json.dumps(record))
    code, _, err = cli(capsys, "bench", *TINY, "--no_history", "--golden", str(golden), "--threshold", "-1")
    assert code == 1 and "(1 problem)" in err and "threshold: is -1.0; a golden comparison needs" in err


def run_bench_free_golden() -> dict[str, Any]:
    """A syntactically valid golden record, made without running anything."""
    return BenchResult(
        name="none",
        recipe="llama3_tiny",
        status="ok",
        config={},
        shape={},
        device="cpu",
        gpu="cpu",
        torch=torch.__version__,
        date="2026-01-01T00:00:00+00:00",
        command="remat bench",
        tflops_per_gpu=1.0,
        losses=[6.0],
    ).to_dict()


@pytest.mark.parametrize(
    ("device_name", "accepted", "refused"),
    [
        ("NVIDIA H200", "h200", "h100"),
        ("NVIDIA H100 80GB HBM3", "h100", "h200"),
        ("NVIDIA GB200", "gb200", "b200"),  # a word of the name, not a part of one
        ("NVIDIA B200", "b200", "gb200"),
    ],
)
def test_gpu_label_is_checked_against_the_device(
    monkeypatch: pytest.MonkeyPatch, device_name: str, accepted: str, refused: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: device_name)
    tiny_spec(device="cuda", gpu=accepted)
    with pytest.raises(ConfigError) as info:
        tiny_spec(device="cuda", gpu=refused)
    assert str(info.value) == f"gpu: -g {refused} but this machine's GPU is {device_name}; fix -g or drop it"


@pytest.mark.usefixtures("no_steps")
def test_dry_run_prints_config_and_plan_and_runs_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    start = time.perf_counter()
    code, out, err = cli(capsys, "bench", *TINY, "-gb", "4", "-rl", "1", "-d")
    elapsed = time.perf_counter() - start
    assert code == 0, err
    assert elapsed < 5
    assert "llama3_tiny on cpu: micro-batch 2, 2 micro-batches a step, 3 steps (1 warm-up), bf16" in out
    assert "recompute: full, block" in out  # the resolved config
    assert "layer 0: full recompute" in out and "layer 1: keep everything" in out  # the per-layer plan
    assert not (tmp_path / "default-history.sqlite").exists()
    if not torch.cuda.is_available():  # a full-size recipe dry-runs on a CPU; running it there is refused
        code, out, err = cli(capsys, "bench", "-mr", "llama3_8b", "-d")
        assert code == 0 and "layers 0-31: keep everything" in out, err
        code, _, err = cli(capsys, "bench", "-mr", "llama3_8b", "-ms", "3")
        assert code == 1 and "8.03B parameters is a GPU job" in err and "use -ms 4 or more" in err


@pytest.mark.usefixtures("no_steps")
def test_flags_a_run_would_ignore_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A dry run writes nothing, and a threshold without a golden compares nothing: as a host-memory
    budget without --offload, such flags are errors rather than silently dropped."""
    out_json, golden, plot = tmp_path / "r.json", tmp_path / "g.json", tmp_path / "p.png"
    code, _, err = cli(capsys, "bench", *TINY, "-d", "--json", str(out_json), "--save-golden", str(golden))
    assert code == 1 and "invalid config (2 problems)" in err
    assert "--json: a dry run (-d) runs nothing, so nothing is written; drop it or drop -d" in err
    assert "--save-golden: a dry run (-d) runs nothing" in err
    code, _, err = cli(capsys, "sweep", *TINY, "-d", "--json", str(out_json), "--plot", str(plot))
    assert code == 1 and "--json: a dry run" in err and "--plot: a dry run" in err
    code, _, err = cli(capsys, "bench", *TINY, "-d", "--history", str(tmp_path / "h.sqlite"))
    assert code == 1 and "--history: a dry run (-d) runs nothing" in err
    code, _, err = cli(capsys, "bench", *TINY, "--threshold", "0.1")
    assert code == 1
    assert "threshold: sets how much a golden comparison may differ, and there is none; pass --golden FILE" in err
    assert not any(p.exists() for p in (out_json, golden, plot))


@pytest.mark.usefixtures("no_steps")
def test_offload_on_cpu_is_advised_as_exercising_the_mechanism_only(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It runs (the tests' path for the offload engine), but its lower peak is a copy within CPU memory."""
    advice = "offload on CPU ({}) copies CPU memory to CPU memory: it exercises the mechanism only"
    code, _, err = cli(capsys, "bench", *TINY, "-ol", "1", "-d")
    assert code == 0 and f"warning: device: {advice.format('none+offload_1')}" in err
    code, _, err = cli(capsys, "bench", *TINY, "-rl", "1", "-d")
    assert code == 0 and "offload on CPU" not in err
    offload = tmp_path / "offload.yaml"
    offload.write_text("cpu_offloading: true\ncpu_offloading_num_layers: 1\n")
    code, _, err = cli(capsys, "sweep", *TINY, "-d", "--configs", "none", "mlp", str(offload))
    assert code == 0 and advice.format("offload") in err
    assert not RecomputeConfig(cpu_offloading=True, cpu_offloading_num_layers=0).offloads()


@pytest.mark.usefixtures("no_steps")
def test_sweep_dry_run_lists_default_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "sweep", *TINY, "-d")
    assert code == 0
    assert out.split() == [
        "none",
        "core_attn",
        "layernorm",
        "mlp",
        "mlp_act",
        "mlp+core_attn",
        "core_attn+layernorm",
        "full_uniform_1",
        "full_block_1",
    ]


def test_plan_name() -> None:
    assert plan_name(None) == "none"
    assert plan_name(RecomputeConfig.from_megatron({})) == "none"
    assert (
        plan_name(
            RecomputeConfig.from_megatron(
                {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm"]}
            )
        )
        == "core_attn+layernorm"
    )
    assert plan_name(Plan.none(2)) == "plan"


@pytest.mark.usefixtures("no_steps")
def test_golden_of_another_recipe_or_shape_is_refused_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    record = run_bench_free_golden()
    record["shape"] = run_shape(tiny_spec())
    golden = tmp_path / "g.json"
    golden.write_text(json.dumps(record))
    code, _, err = cli(capsys, "bench", *TINY, "--no_history", "--golden", str(golden), "-d")
    assert code == 0, err  # like for like
    other = _edit_golden(
        golden, tmp_path / "other.json", recipe="llama3_8b", shape=lambda shape: {**shape, "seq_length": 2 * SEQ}
    )
    code, _, err = cli(capsys, "bench", *TINY, "--no_history", "--golden", str(other))
    assert code == 1
    assert (
        "golden: was measured on another run (recipe differs: golden 'llama3_8b', current 'llama3_tiny'; "
        f"shape.seq_length differs: golden {2 * SEQ}, current {SEQ}); run with the golden's recipe and "
        "shape"
    ) in err


@pytest.mark.usefixtures("no_steps")
def test_unreadable_golden_is_an_error_before_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = cli(capsys, "bench", *TINY, "--no_history", "--golden", str(bad))
    assert code == 1 and "not valid JSON" in err


@pytest.mark.usefixtures("fake_cuda_memory")
def test_run_bench_reports_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing_forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        raise oom_error()

    monkeypatch.setattr(MLP, "forward", failing_forward)
    spec = tiny_spec()
    plan = parse_entry("mlp", FACTS)[1]
    result = run_bench(spec, plan)
    assert calls == [1]  # stopped at the first failure
    assert result.status == "oom" and result.name == "mlp"
    assert result.oom is not None
    assert (result.oom.allocated_bytes, result.oom.reserved_bytes) == (ALLOCATED, RESERVED)
    assert result.oom.message == "CUDA out of memory. Tried to allocate 2.00 GiB."
    assert result.losses == [] and result.step_time_s is None and result.peak_allocated_bytes is None


@pytest.mark.usefixtures("fake_cuda_memory")
def test_sweep_goes_on_after_an_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only `mlp` fails, in its second step, inside the MLP's recomputation during backward; the next run
    trains exactly as it would alone."""
    current: list[str] = []
    real_run_bench = bench_run.run_bench

    def tracking(spec: BenchSpec, plan: Any = None, **kwargs: Any) -> BenchResult:
        current[:] = [kwargs["name"]]
        return real_run_bench(spec, plan, **kwargs)

    mlp_calls = []
    real_forward = MLP.forward

    def forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
        if current == ["mlp"]:
            mlp_calls.append(torch.is_grad_enabled())
            # per step: two forwards, then two recomputations in backward
            if len(mlp_calls) == 2 * NUM_LAYERS + NUM_LAYERS + 1:
                raise oom_error()
        return real_forward(self, x)

    monkeypatch.setattr(bench_run, "run_bench", tracking)
    monkeypatch.setattr(MLP, "forward", forward)
    spec = tiny_spec()
    plans = [parse_entry(e, FACTS) for e in ("none", "mlp", "full_uniform_1")]
    results = sweep(spec, plans)
    assert [r.name for r in results] == ["none", "mlp", "full_uniform_1"]
    assert [r.status for r in results] == ["ok", "oom", "ok"]
    assert len(mlp_calls) == 2 * NUM_LAYERS + NUM_LAYERS + 1  # it did fail where intended
    oom = results[1].oom
    assert oom is not None and (oom.allocated_bytes, oom.reserved_bytes) == (ALLOCATED, RESERVED)
    after = results[2]
    assert len(after.losses) == STEPS and after.tflops_per_gpu is not None and after.tflops_per_gpu > 0
    monkeypatch.setattr(MLP, "forward", real_forward)
    alone = run_bench(tiny_spec(), plans[2][1])
    assert after.losses == alone.losses
    assert after.peak_allocated_bytes == alone.peak_allocated_bytes


@pytest.mark.usefixtures("fake_cuda_memory")
def test_an_oom_releases_its_memory_before_the_next_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between an OOM and the next config of a sweep: the failed step's tensors are gone (its traceback
    with them), the gradients it had built are dropped, and then the caching allocator returns its blocks
    and restarts its peak (a fake allocator here, which records what is alive when it is called). A
    storage's Python object lives as long as the storage, so a weakref to it says whether it is freed."""
    events: list[Any] = []
    models: list[nn.Module] = []
    step_storages: list[weakref.ref[torch.UntypedStorage]] = []
    real_build, real_run_bench, real_forward = run_build.build_model, bench_run.run_bench, MLP.forward

    def building(spec: BenchSpec) -> nn.Module:
        models.append(real_build(spec))
        return models[-1]

    def tracking(spec: BenchSpec, plan: Any = None, **kwargs: Any) -> BenchResult:
        events.append(f"start {kwargs['name']}")
        return real_run_bench(spec, plan, **kwargs)

    def grads_built() -> int:
        return sum(p.grad is not None for p in models[0].parameters())

    calls = []

    def forward(self: MLP, x: torch.Tensor) -> torch.Tensor:
        if events[-1] == "start mlp":
            calls.append(1)
            if len(calls) == 2 * NUM_LAYERS + 1:  # the second step's first forward: x's storage is kept
                step_storages.append(weakref.ref(x.untyped_storage()))
            if len(calls) == 2 * NUM_LAYERS + NUM_LAYERS + 1:  # its backward, once gradients exist
                events.append(("OOM", grads_built()))
                raise oom_error()
        return real_forward(self, x)

    monkeypatch.setattr(run_build, "build_model", building)
    monkeypatch.setattr(bench_run, "run_bench", tracking)
    monkeypatch.setattr(MLP, "forward", forward)
    real_release = step.release_memory

    def release_with_cuda(model: nn.Module) -> None:
        with monkeypatch.context() as cuda:  # only here: the model's RNG capture would look for a GPU too
            cuda.setattr(torch.cuda, "is_available", lambda: True)
            cuda.setattr(torch.cuda, "is_initialized", lambda: True)
            real_release(model)

    monkeypatch.setattr(step, "release_memory", release_with_cuda)
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: events.append(("empty_cache", grads_built(), step_storages[0]() is None))
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args: events.append("reset_peak"))
    results = sweep(tiny_spec(), [parse_entry(e, FACTS) for e in ("mlp", "none")])
    assert [r.status for r in results] == ["oom", "ok"]
    failed = next(i for i, event in enumerate(events) if isinstance(event, tuple) and event[0] == "OOM")
    assert events[failed][1] > 0  # the failed step had built gradients
    assert events[failed + 1 :] == [
        ("empty_cache", 0, True),
        "reset_peak",
        "start none",
        ("empty_cache", 0, True),
        "reset_peak",
    ]


@pytest.mark.filterwarnings("ignore::remat.core.problems.RematWarning")  # core_attn with SDPA saves little
def test_megatron_presets() -> None:
    layout = find_sites(build("llama3_tiny", device="meta", num_layers=NUM_LAYERS)).model_sites
    labels = frozenset().union(*layout.labels)
    assert labels == {"core_attn", "layernorm", "mlp", "mlp_act"}
    presets = megatron_presets(labels, layout.num_layers)
    assert presets == [
        "none",
        "core_attn",
        "layernorm",
        "mlp",
        "mlp_act",
        "mlp+core_attn",
        "core_attn+layernorm",
        "full_uniform_1",
        "full_block_1",
    ]
    assert megatron_presets(labels, 8)[-1] == "full_block_4"
    assert megatron_presets(frozenset({"mlp"}), 1) == ["none", "mlp", "full_uniform_1", "full_block_1"]
    model = build("llama3_tiny", device="meta", num_layers=NUM_LAYERS)
    for entry in presets:  # every default preset is valid for the model it was made for
        name, plan = parse_entry(entry, FACTS)
        assert name == entry
        apply(model, plan)


def test_parse_entry_names() -> None:
    assert parse_entry("none", FACTS) == ("none", None)
    name, config = parse_entry("mlp,core_attn", FACTS)
    assert name == "mlp,core_attn" and isinstance(config, RecomputeConfig)
    assert config.recompute_granularity == "selective" and set(config.recompute_modules or []) == {"mlp", "core_attn"}
    _, config = parse_entry("full_block_2", FACTS)
    assert isinstance(config, RecomputeConfig)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    assert config.facts.num_layers == NUM_LAYERS


def test_parse_entry_names_its_problems_by_the_entry(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_entry("mlp+bogus", FACTS)
    assert [p.field for p in err.value.problems] == ["mlp+bogus: recompute_modules"]
    (tmp_path / "bad.yaml").write_text("recompute_granularity: sometimes\n")
    with pytest.raises(ConfigError) as err:
        parse_entry(str(tmp_path / "bad.yaml"), FACTS)
    assert [p.field for p in err.value.problems] == [f"{tmp_path / 'bad.yaml'}: recompute_granularity"]
    with pytest.raises(ConfigError) as err:
        parse_entry(str(tmp_path / "missing.yaml"), FACTS)
    assert [p.field for p in err.value.problems] == [str(tmp_path / "missing.yaml")]  # named once
    with pytest.raises(ConfigError) as err:
        parse_entry("full_foo", FACTS)  # no layer count: one problem saying the form, not two about its parts
    assert [(p.field, p.message.split(",")[0]) for p in err.value.problems] == [
        ("full_foo: entry", "a full-recompute entry is full_uniform_K or full_block_K")
    ]


def test_parse_entry_files(tmp_path: Path) -> None:
    config_file = tmp_path / "sel.yaml"
    config_file.write_text("recompute_granularity: selective\nrecompute_modules: [mlp, layernorm]\n")
    name, config = parse_entry(str(config_file), FACTS)
    assert name == "sel" and isinstance(config, RecomputeConfig)
    assert config.recompute_modules == ["mlp", "layernorm"] and config.facts.num_layers == NUM_LAYERS

    plan_file = tmp_path / "mine.yaml"
    plan_file.write_text("remat_plan: 1\nlayers: [{mlp: recompute}, {}]\nfull_recompute: [[1, 2]]\n")
    name, plan = parse_entry(str(plan_file), FACTS)
    assert name == "mine" and isinstance(plan, Plan)
    assert plan.layers == [{"mlp": "recompute"}, {}] and plan.full_recompute == [(1, 2)]

    json_file = tmp_path / "full.json"
    json_file.write_text(
        json.dumps({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})
    )
    name, config = parse_entry(str(json_file), FACTS)
    assert name == "full" and plan_name(config) == "full_uniform_1"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("bogus", "unknown label 'bogus'"),
        ("mlp+bogus", "unknown label 'bogus'"),
        ("full_uniform_x", "recompute_num_layers: got 'x'"),
        ("full_diagonal_1", "'diagonal' is not a method"),
        ("full_block_3", "recompute_num_layers: 3 is out of range"),
        ("full_uniform_0", "recompute_num_layers: 0 is out of range"),
    ],
)
def test_parse_entry_rejects_bad_entries(entry: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_entry(entry, FACTS)


def test_parse_entry_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("recompute_granularity: partial\n")
    with pytest.raises(ConfigError, match="'partial' is not a granularity"):
        parse_entry(str(bad), FACTS)
    bad_plan = tmp_path / "bad_plan.yaml"
    bad_plan.write_text("remat_plan: 1\nlayers: 3\n")
    with pytest.raises(ConfigError, match="layers: expected a list"):
        parse_entry(str(bad_plan), FACTS)


def test_sweep_runs_a_plan_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan_file = tmp_path / "mine.yaml"
    plan_file.write_text("remat_plan: 1\nlayers: [{mlp: recompute}, {}]\nfull_recompute: [[1, 2]]\n")
    out_json = tmp_path / "s.json"
    code, out, err = cli(
        capsys,
        "sweep",
        *TINY,
        "--no_history",
        "--plot",
        str(tmp_path / "p.png"),
        "--json",
        str(out_json),
        "--configs",
        str(plan_file),
    )
    assert code == 0, err
    (result,) = json.loads(out_json.read_text())
    assert result["name"] == "mine" and result["status"] == "ok"
    assert result["config"]["layers"] == [{"mlp": "recompute"}, {}]


def test_runs_are_reproducible() -> None:
    spec = tiny_spec()
    plan = parse_entry("mlp", FACTS)[1]
    first, second = run_bench(spec, plan), run_bench(tiny_spec(), plan)
    assert len(first.losses) == STEPS
    assert first.losses == second.losses
    assert len(set(first.losses)) == STEPS  # fresh data each step (and the weights move)
    # on one model, a later run starts again from the re-initialized weights
    results = sweep(spec, [("a", plan), ("b", plan)])
    assert results[0].losses == results[1].losses == first.losses
    # another seed, other data and weights
    assert run_bench(tiny_spec(seed=7), plan).losses != first.losses


def test_sft_masks_the_prompt() -> None:
    pretrain, sft = tiny_spec(), tiny_spec(task="sft")
    tokens_p, labels_p = MockData(pretrain).batch()
    tokens_s, labels_s = MockData(sft).batch()
    assert torch.equal(tokens_p, tokens_s)  # same seed, same tokens
    assert tokens_p.shape == labels_p.shape == (MB, SEQ)
    assert (labels_p >= 0).all()
    assert (labels_s[:, : SEQ // 4] == -100).all()
    assert torch.equal(labels_s[:, SEQ // 4 :], labels_p[:, SEQ // 4 :])
    assert torch.equal(labels_p[:, :-1], tokens_p[:, 1:])  # next-token labels
    a, b = run_bench(pretrain), run_bench(sft)
    assert a.status == b.status == "ok"
    assert a.losses != b.losses
    assert b.shape["task"] == "sft"


def test_timings_are_medians_of_the_steady_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """An even number of steady steps: the median is the mean of the middle two, not the upper one."""
    # per step: the whole step's seconds, then forward+backward's; two warm-up steps are left out
    seconds = iter([9.0, 9.0, 9.0, 9.0, 1.0, 0.5, 2.0, 1.5])
    monkeypatch.setattr(bench_run._Clock, "seconds", lambda self, start, end: next(seconds))
    result = run_bench(tiny_spec(max_steps=4, warmup_steps=2))
    assert (result.step_time_s, result.fwd_bwd_time_s) == (1.5, 1.0)


def test_micro_batches_accumulate_to_the_global_batch() -> None:
    spec = tiny_spec(global_batch_size=3 * MB)
    assert spec.micro_batches == 3
    result = run_bench(spec)
    assert result.shape["global_batch_size"] == 3 * MB
    assert result.tokens_per_s_per_gpu == pytest.approx(3 * MB * SEQ / result.step_time_s)


def test_bench_spec_validates_on_creation() -> None:
    with pytest.raises(ConfigError) as info:
        tiny_spec(precision=Precision("fp8_sc"), max_steps=1)
    assert {p.field for p in info.value.problems} == {"compute_dtype", "max_steps"}
    with pytest.raises(ConfigError) as info:
        tiny_spec(warmup_steps=-1)
    assert [p.field for p in info.value.problems] == ["warmup_steps"]  # not max_steps: -ms 3 is fine
    with pytest.raises(ConfigError, match="the first step compiles"):
        tiny_spec(compile=True, warmup_steps=0)
    assert tiny_spec(compile=True, warmup_steps=1).compile  # one warm-up step holds the compilation


SHARED_ANCHOR = Path(__file__).parents[2] / "shared" / "anchors" / "torch_baseline.py"


@pytest.mark.skipif(not SHARED_ANCHOR.exists(), reason="shared/ is not beside this checkout")
def test_the_benchmark_anchor_is_a_verbatim_copy_of_the_shared_one() -> None:
    shared = SHARED_ANCHOR
    copy = Path(__file__).parents[1] / "benchmarks" / "anchors" / "torch_baseline.py"
    assert copy.read_bytes() == shared.read_bytes()
