"""Losses that do not depend on the layout (remat.parallel.seeding, remat.run.step.MockData): on
CPU, two processes under torchrun with gloo, one launch running remat bench's step under each
layout (tests/integration/workers/layouts_worker.py), beside one process in this one.

Every layout starts from the whole model's weights (each parameter drawn whole from its own
seed, each rank keeping its share) and steps on the same global batch (sequence k of the run from
its own seed, each data-parallel rank its consecutive share), so its losses are one process's,
in fp32: tensor (with and without sequence parallelism; the MoE family's experts and shared
experts too), pipeline (with virtual stages), data, context (the Llama and the MoE family) and
expert parallelism bit for bit or to the last bits (seen: equal, and 8e-8 relative for expert
parallelism's third step).
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

# relative tolerance against one process's losses (measured: see the module's docstring)
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, BenchResult]:
    out = tmp_path_factory.mktemp("layouts") / "results.json"
    run_under_torchrun(Path(layouts_worker.__file__), out, 2, "fp32", *layouts_worker.FP32_LAYOUTS)
    return {name: BenchResult.from_dict(result) for name, result in json.loads(out.read_text()).items()}


@pytest.fixture(scope="module")
def one_process() -> dict[str, BenchResult]:
    recipes = {layouts_worker.LAYOUTS[name][0] for name in layouts_worker.FP32_LAYOUTS}
    return {
        recipe: run_bench(layouts_worker.spec(recipe, ParallelLayout()), layouts_worker.plan()) for recipe in recipes
    }


@pytest.mark.parametrize("name", layouts_worker.FP32_LAYOUTS)
def test_each_layout_steps_as_one_process(layouts, one_process, name) -> None:
    recipe, _ = layouts_worker.LAYOUTS[name]
    losses, one = layouts[name].losses, one_process[recipe].losses
    assert len(losses) == layouts_worker.STEPS
    assert losses == pytest.approx(one, rel=TOLERANCE, abs=0)
    # a golden of one process checks the loss of this layout's run
    (loss,) = [check for check in compare(layouts[name], one_process[recipe]) if check.metric == "loss"]
    assert loss.verdict == OK and abs(loss.rel_diff) <= TOLERANCE


# FP8 (-c fp8_cs) beside every layout; bf16 compute, so the sums a layout splits differ from one
# process's after rounding: tensor parallelism's row-parallel partial products, each rounded to
# bf16 before the ranks add them (seen: 1.2e-4 relative for the Llama, 5.7e-5 MoE, 5.4e-5 HF), and
# context parallelism's ring (blocks merged in float32, each rounded to bf16; seen: 1.1e-4 Llama,
# 2.4e-4 MoE, 2.8e-5 HF); pipelines and data parallelism bit for bit, experts to the last bits.
# Each FP8 cast of a split tensor takes its scale from the whole tensor's amax (torchao on DTensor).
FP8_TOLERANCE = {
    name: 3e-4 if sizes.keys() & {"tp", "cp"} else 1e-6 if "ep" in sizes else 0.0
    for name, (_, sizes) in layouts_worker.LAYOUTS.items()
}


@pytest.mark.slow
def test_fp8_steps_as_one_process_under_every_layout_and_recomputes_bit_identically(tmp_path) -> None:
    out = tmp_path / "fp8.json"
    run_under_torchrun(Path(layouts_worker.__file__), out, 2, "fp8_cs", *FP8_TOLERANCE)
    found = {name: BenchResult.from_dict(result) for name, result in json.loads(out.read_text()).items()}
    recipes = {recipe for recipe, _ in layouts_worker.LAYOUTS.values()}
    one = {
        recipe: run_bench(layouts_worker.spec(recipe, ParallelLayout(), "fp8_cs"), layouts_worker.plan()).losses
        for recipe in recipes
    }
    for name, tolerance in FP8_TOLERANCE.items():
        recipe, _ = layouts_worker.LAYOUTS[name]
        assert found[name].losses == pytest.approx(one[recipe], rel=tolerance, abs=0), name
        # the layout's own run without recompute: the replays cast as the forward did
        assert found[name].losses == found[f"{name}@none"].losses, name


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
