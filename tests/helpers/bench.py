"""Shared by the unit and integration tests of bench."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import remat.bench.run as bench_run
from remat.bench import BenchSpec
from remat.cli import main

NUM_LAYERS, SEQ, MB, STEPS, WARMUP = 2, 16, 2, 3, 1


# The shape every run here uses: two layers, 16 tokens, two sequences a micro-batch, 3 steps (1 warm-up).
TINY = [
    "--num_layers",
    str(NUM_LAYERS),
    "-sl",
    str(SEQ),
    "-mb",
    str(MB),
    "-ms",
    str(STEPS),
    "--warmup_steps",
    str(WARMUP),
    "--no_progress",
]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def tiny_spec(**kwargs: Any) -> BenchSpec:
    fields: dict[str, Any] = dict(
        recipe="llama3_tiny",
        overrides={"num_layers": NUM_LAYERS, "seq_length": SEQ},
        micro_batch_size=MB,
        max_steps=STEPS,
        warmup_steps=WARMUP,
        device="cpu",
    )
    fields.update(kwargs)
    return BenchSpec(**fields)


def oom_error() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nsecond line")


ALLOCATED, RESERVED = 7 * 2**30, 9 * 2**30


@pytest.fixture
def fake_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: ALLOCATED)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: RESERVED)


@pytest.fixture
def _private_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Runs that record history write to tmp_path, never to ~/.cache (a module asks for it: usefixtures)."""
    default = tmp_path / "default-history.sqlite"
    monkeypatch.setenv("REMAT_HISTORY", str(default))
    return default


@pytest.fixture
def no_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if anything trains."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a training step ran")

    monkeypatch.setattr(bench_run, "_iteration", refuse)


def _edit_golden(src: Path, dst: Path, **changes: Any) -> Path:
    data = json.loads(src.read_text())
    for key, change in changes.items():
        data[key] = change(data[key]) if callable(change) else change
    dst.write_text(json.dumps(data))
    return dst
