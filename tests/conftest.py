"""Shared test helpers; the fixtures both the unit and the integration tests of a module use come
from helpers/ (registered here)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # remat's CUDA kernels (Triton) are tested in Triton's interpreter on CPU. Triton reads this
    # when a function is decorated, its own library's (tl.sigmoid...) included, and importing
    # remat imports triton.language through torch's submodules: so it is set before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["helpers.bench", "helpers.hostile", "helpers.planning", "helpers.trace"]

import remat  # noqa: E402
from remat.memory import peak_during  # noqa: E402
from remat.memory.meter import held_tensors, storage_bytes  # noqa: E402


def measure_peak(model, batch, plan, optimizer=None) -> int:
    """The independent count of a steady step's peak: every storage alive at once, on top of the
    weights, gradients and optimizer state the step starts with (after one step first, as the trace
    measures: without an optimizer gradients persist across steps, with one its state does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(model, plan)

    def step() -> None:
        torch.manual_seed(0)
        model(*batch).backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()
    return storage_bytes(held_tensors(model, optimizer)) + peak_during(step)[1]


def allocations(forward, inputs: tuple[torch.Tensor, ...]) -> tuple[int, int, list]:
    """Of `forward(*inputs)` then its backward (gradients of ones): the bytes of the storages the
    forward leaves alive, the backward's peak, and the gradients' shapes and dtypes, counted by
    the storages ops create: on meta, what remat estimate counts for the real device."""
    outputs, saved = remat.measure_saved(lambda: forward(*inputs))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    wanted = [t for t in inputs if t.requires_grad]
    grads, peak = peak_during(lambda: torch.autograd.grad(outputs, wanted, [torch.ones_like(o) for o in outputs]))
    return saved.bytes, peak, [(g.shape, g.dtype) for g in grads]


def verify_preset(model, ids, preset: str):
    """remat.run.verify of a Megatron preset ("full": uniform, one layer; else one selective label) on
    next-token batch ids [b, s + 1]."""
    config = (
        remat.RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if preset == "full"
        else remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=[preset])
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        return remat.verify(model, config, ids[:, :-1], ids[:, 1:])


@pytest.fixture
def verified_preset():
    return verify_preset


@pytest.fixture
def measured_peak():
    return measure_peak


@pytest.fixture
def deterministic():
    """torch's deterministic algorithms for the test (a module asks for it: usefixtures)."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Command output as a log gets it (160 columns, lines whole), whatever COLUMNS the test
    runner sets (pytest-xdist's workers get the terminal's); tests of narrow terminals set their own."""
    from remat.cli import common

    for console in (common.out, common.err):
        monkeypatch.setattr(console, "width", 160)
        monkeypatch.setattr(console, "soft_wrap", True)


def worker_env() -> dict[str, str]:
    """The environment of a process a test starts: this tree's remat, one thread, no warnings, and
    output as a log gets it (no COLUMNS: pytest-xdist's workers get the terminal's)."""
    env = {name: value for name, value in os.environ.items() if name != "COLUMNS"}
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }


def torchrun_results(tmp_path_factory: Any, worker: Path, nproc: int = 2) -> Any:
    """What `worker` run under torchrun with `nproc` CPU processes saved (its rank 0's results)."""
    out = tmp_path_factory.mktemp(worker.stem) / "results.pt"
    run_under_torchrun(worker, out, nproc)
    return torch.load(out)


def run_under_torchrun(worker: Path, out: Path, nproc: int = 2, *args: str) -> None:
    """Run the script `worker` (its argv[1]: `out`, then `args`) under torchrun with `nproc` CPU processes."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(worker),
            str(out),
            *args,
        ],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
