"""Losses that do not depend on the layout (remat.parallel.seeding, remat.run.step.MockData): on
CPU, two processes under torchrun with gloo, one launch running remat bench's step under each
layout (tests/integration/workers/layouts_worker.py), beside one process in this one.

Every layout starts from the whole model's weights (each parameter drawn whole from its own
seed, each rank keeping its share) and steps on the same global batch (sequence k of the run from
its own seed, each data-parallel rank its consecutive share), so its losses are one process's,
in fp32: tensor (with and without sequence parallelism; the MoE family's experts and shared
experts too), pipeline (with virtual stages), data
and expert parallelism bit for bit or to the last bits (seen: equal, and 8e-8 relative for
expert parallelism's third step); context parallelism within 3e-5 relative (seen: 1.0e-5 in
fp32, 1.1e-6 in fp64, 3.5e-6 in bf16): torch's ring merges blocks by a float32 log-sum-exp.
A golden file of one process then checks the loss of a run of any layout."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_under_torchrun, worker_env

from remat.bench.golden import OK, compare
from remat.bench.result import BenchResult
from remat.bench.run import run_bench
from remat.config.parallel import ParallelLayout

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import layouts_worker  # noqa: E402

# relative tolerance against one process's losses, by layout (measured: see the module's docstring)
TOLERANCE = {name: 3e-5 if name == "cp2" else 1e-6 for name in layouts_worker.LAYOUTS}
BF16_RUNS = [name for name in layouts_worker.LAYOUTS if name not in ("hf_pp2", "hf_dp2", "hf_cp2", "moe_dp2")]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, BenchResult]:
    out = tmp_path_factory.mktemp("layouts") / "results.json"
    run_under_torchrun(Path(layouts_worker.__file__), out, 2, "fp32", *BF16_RUNS)
    return {name: BenchResult.from_dict(result) for name, result in json.loads(out.read_text()).items()}


@pytest.fixture(scope="module")
def one_process() -> dict[str, BenchResult]:
    recipes = {layouts_worker.LAYOUTS[name][0] for name in BF16_RUNS}
    return {
        recipe: run_bench(layouts_worker.spec(recipe, ParallelLayout()), layouts_worker.plan()) for recipe in recipes
    }


@pytest.mark.parametrize("name", BF16_RUNS)
def test_each_layout_steps_as_one_process(layouts, one_process, name) -> None:
    recipe, _ = layouts_worker.LAYOUTS[name]
    losses, one = layouts[name].losses, one_process[recipe].losses
    assert len(losses) == layouts_worker.STEPS
    assert losses == pytest.approx(one, rel=TOLERANCE[name], abs=0)
    # a golden of one process checks the loss of this layout's run
    (loss,) = [check for check in compare(layouts[name], one_process[recipe]) if check.metric == "loss"]
    assert loss.verdict == OK and abs(loss.rel_diff) <= TOLERANCE[name]


# FP8 (-c fp8_cs) beside the layouts it runs in; bf16 compute, so context parallelism's float32
# merge differs more after the casts (seen: 1.0e-4 relative); the rest as in fp32
FP8_TOLERANCE = {
    **dict.fromkeys(("pp2", "pp2_vp2", "dp2", "moe_dp2", "hf_pp2", "hf_dp2"), 0.0),
    "cp2": 3e-4,
    "hf_cp2": 3e-4,
    "ep2": 1e-6,
}


@pytest.mark.slow
def test_fp8_steps_as_one_process_under_fsdp2_stages_context_and_experts(tmp_path) -> None:
    out = tmp_path / "fp8.json"
    run_under_torchrun(Path(layouts_worker.__file__), out, 2, "fp8_cs", *FP8_TOLERANCE)
    found = {name: BenchResult.from_dict(result) for name, result in json.loads(out.read_text()).items()}
    one = {
        recipe: run_bench(layouts_worker.spec(recipe, ParallelLayout(), "fp8_cs"), layouts_worker.plan()).losses
        for recipe in ("llama3_tiny", "moe_tiny", "hf:llama")
    }
    for name, tolerance in FP8_TOLERANCE.items():
        recipe, _ = layouts_worker.LAYOUTS[name]
        assert found[name].losses == pytest.approx(one[recipe], rel=tolerance, abs=0), name


def test_another_seed_gives_other_weights_and_data(one_process) -> None:
    spec = dataclasses.replace(layouts_worker.spec("llama3_tiny", ParallelLayout()), seed=7)
    assert run_bench(spec, layouts_worker.plan()).losses[0] != one_process["llama3_tiny"].losses[0]


def _bench(*flags: str) -> subprocess.CompletedProcess[str]:
    common = ["-mr", "llama3_tiny", "--device", "cpu", "-ms", "3", "--warmup_steps", "1", "-gb", "2", "-mb", "1"]
    return subprocess.run(
        [sys.executable, "-m", "remat", "bench", *common, "--no_history", "--no_progress", *flags],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_golden_of_one_process_checks_a_tensor_parallel_run(tmp_path) -> None:
    golden = tmp_path / "golden.json"
    assert _bench("--save-golden", str(golden)).returncode == 0
    run = _bench("-tp", "2", "-ng", "2", "--golden", str(golden))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    notes = [line for line in run.stderr.splitlines() if line.startswith("note:")]
    assert notes == ["note: layout differs: golden one process, current tensor_parallel=2; the loss alone is compared"]
    # a loss the layout does not reproduce fails the check
    stored = json.loads(golden.read_text())
    stored["losses"][-1] *= 1.2
    golden.write_text(json.dumps(stored))
    assert _bench("-tp", "2", "-ng", "2", "--golden", str(golden)).returncode == 1
