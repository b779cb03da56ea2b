"""remat doctor across ranks: an OOM on any rank of a torchrun launch is diagnosed with that rank's
numbers, reaches the user although the other ranks are stopped, and ends the run with a non-zero
status; a torchrun log's OOM messages are told apart by rank.

One launch (`remat bench -ng 2` on two gloo processes, rank 1 out of memory in its first step)
checks the whole path; the rest runs in this process.

The quick tests of the same code: tests/unit/doctor/test_doctor_ranks.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import worker_env
from helpers.doctor_ranks import GIB, RANK1

from remat.bench.history import recent
from remat.cli import main

sys.path.insert(0, str(Path(__file__).parent / "workers"))


import oom_worker  # noqa: E402

RANK1_ALLOCATED, RANK1_LIMIT = round(75.80 * GIB), round(79.11 * GIB)


SECONDS = 120  # the launch takes ~15 s on 2 busy cores; a hang would take torch's 30 minute collective timeout


def _run_to_end(argv: list[str]) -> tuple[int, str, str]:
    """Run `python oom_worker.py ARGV` (it starts torchrun) to its end; fail, stopping every process
    it started, if it outlives SECONDS."""
    process = subprocess.Popen(
        [sys.executable, oom_worker.__file__, *argv],
        env=worker_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"the run did not end within {SECONDS} s: a rank hangs")
    return process.returncode, out, err


def test_an_oom_on_rank_1_is_diagnosed_with_its_numbers_and_ends_the_run(tmp_path, capsys) -> None:
    result, history = tmp_path / "bench.json", tmp_path / "history.sqlite"
    code, out, err = _run_to_end(
        [
            "bench",
            "-mr",
            "llama3_tiny",
            "--device",
            "cpu",
            "-ng",
            "2",
            "--num_layers",
            "2",
            "-ms",
            "2",
            "--warmup_steps",
            "1",
            "--no_progress",
            "--json",
            str(result),
            "--history",
            str(history),
        ]
    )
    assert code == 1, err[-3000:]
    # the process that started torchrun reports rank 1's OOM, diagnosed with rank 1's numbers
    assert f"{RANK1} ran out of memory: CUDA out of memory. Tried to allocate 2.00 GiB." in out
    assert f"remat doctor on {RANK1}: capacity" in out
    assert "75.80 GiB at OOM" in out and "allocated 75.80 GiB + the 2.00 GiB request" in out
    # rank 0 lost its peer in a collective: one line, not a failure of its own
    assert "rank 0" not in out and "[rank0]: Traceback" not in err
    assert "rank 0 stopped after another rank failed: RuntimeError" in err
    # the result written and recorded is rank 1's
    oom = json.loads(result.read_text())["oom"]
    assert (oom["rank"], oom["coordinates"]) == (1, {"pp": 0, "dp": 1, "cp": 0, "tp": 0})
    assert (oom["allocated_bytes"], oom["allocator"]["allocated"], oom["allocator"]["limit"]) == (
        RANK1_ALLOCATED,
        RANK1_ALLOCATED,
        RANK1_LIMIT,
    )
    (recorded,) = recent(path=history)
    assert recorded.status == "oom" and recorded.oom is not None and recorded.oom.rank == 1
    # remat doctor on those results names the rank and classifies it by its numbers
    assert main(["doctor", "--results", str(result)]) == 1
    said = capsys.readouterr().out  # a table, its cells wrapped
    assert "none: out of memory on rank 1" in said and "│ capacity │ allocated 75.80 GiB + the 2.00 GiB" in said
