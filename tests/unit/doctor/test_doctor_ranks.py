"""remat doctor across ranks without a launch: a torchrun log's OOM messages told apart by rank and
each diagnosed with its own numbers, a report naming the rank whose numbers it has, a failed
rank's result and place on the mesh, and one-process commands pointing a run on several GPUs to
bench.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_doctor_ranks_runs.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.doctor_ranks import GIB, RANK1

from remat import doctor, parallel
from remat.bench import findings as checks
from remat.bench.result import BenchResult, OomInfo
from remat.bench.spec import BenchSpec
from remat.cli import bench as bench_command
from remat.cli import common, main
from remat.doctor import AllocatorState
from remat.models.llama import MLP
from remat.parallel import launch

sys.path.insert(0, str(Path(__file__).parents[2] / "integration" / "workers"))  # the workers' helpers


import oom_worker  # noqa: E402

# a log's rank 1: 70 GiB allocated, 72 reserved, the request 8 GiB of the 5 GiB free: capacity
LOG_RANK1_MESSAGE = (
    "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 1 has a total capacity of 79.11 GiB of which"
    " 5.00 GiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 2.00 GiB is"
    " reserved by PyTorch but unallocated."
)


# rank 3's: 40 GiB allocated of 64 GiB reserved, the request 20 GiB: fragmentation
RANK3_MESSAGE = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 3 has a total capacity of 79.11 GiB of which"
    " 12.00 GiB is free. Of the allocated memory 40.00 GiB is allocated by PyTorch, and 24.00 GiB is"
    " reserved by PyTorch but unallocated."
)


# what torchrun prints when ranks 1 and 3 ran out of memory and rank 0 lost its peers
LOG = "\n".join(
    [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "train.py", line 7, in <module>',
        "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:57481.",
        "[rank1]: Traceback (most recent call last):",
        f"[rank1]: torch.OutOfMemoryError: {LOG_RANK1_MESSAGE}",
        f"[rank3]: torch.OutOfMemoryError: {RANK3_MESSAGE}",
        "E1206 04:10:39.239000 24675 api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 24759)",
    ]
)


def test_a_torchrun_logs_oom_messages_are_told_apart_by_rank() -> None:
    messages = doctor.oom_messages(LOG)
    assert list(messages) == [1, 3]  # rank 0's lost connection is no OOM
    assert AllocatorState.from_oom_message(messages[1]).allocated == 70 * GIB
    assert AllocatorState.from_oom_message(messages[3]).allocated == 40 * GIB
    assert doctor.oom_messages(RANK3_MESSAGE) == {None: RANK3_MESSAGE}  # one process's message
    no_oom = "[rank0]: RuntimeError: Connection closed by peer"
    assert doctor.oom_messages(no_oom) == {None: no_oom}


def test_cli_diagnoses_each_rank_of_a_torchrun_log_with_its_own_numbers(capsys) -> None:
    assert main(["doctor", "--oom_message", LOG]) == 0
    out = capsys.readouterr().out
    first, third = out.split("remat doctor on rank 3: fragmentation")
    assert "remat doctor on rank 1: capacity" in first and "70.00 GiB" in first and "40.00 GiB" not in first
    assert "40.00 GiB" in third and "64.00 GiB" in third and "70.00 GiB" not in third
    assert "rank 0" not in out


def test_cli_names_the_rank_whose_oom_message_lacks_the_numbers(capsys) -> None:
    log = (
        f"[rank1]: torch.OutOfMemoryError: {LOG_RANK1_MESSAGE}\n[rank2]: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert main(["doctor", "--oom_message", log]) == 1
    err = capsys.readouterr().err
    assert "oom_message of rank 2: the message does not give the device capacity" in err
    assert "rank 1" not in err


def test_a_report_names_the_rank_whose_numbers_it_has() -> None:
    state = AllocatorState.from_oom_message(LOG_RANK1_MESSAGE)
    report = doctor.report_of(state, LOG_RANK1_MESSAGE, rank=1, coordinates={"pp": 0, "dp": 1, "cp": 0, "tp": 0})
    assert str(report).startswith(f"remat doctor on {RANK1}: capacity")
    assert report.diagnosis.state.allocated == 70 * GIB
    assert str(doctor.report_of(state)).startswith("remat doctor: capacity")  # one process: no rank


def test_watch_under_torchrun_names_this_rank(monkeypatch) -> None:
    monkeypatch.setattr(parallel, "world_size", lambda: 4)
    monkeypatch.setattr(parallel, "rank", lambda: 3)
    with doctor.watch(on_oom=None, reraise=False) as doc:
        raise torch.OutOfMemoryError(RANK3_MESSAGE)
    assert doc.report is not None and doc.report.rank == 3 and doc.report.diagnosis.state.allocated == 40 * GIB
    assert str(doc.report).startswith("remat doctor on rank 3: fragmentation")


def _failed(**oom: object) -> BenchResult:
    """A run that ran out of memory on rank 2, the second stage of a pipeline."""
    info = dict(
        allocated_bytes=32 * GIB,
        reserved_bytes=64 * GIB,
        message="CUDA error: out of memory",
        rank=2,
        coordinates={"pp": 1, "dp": 0, "cp": 0, "tp": 0},
        allocator=AllocatorState(
            allocated=32 * GIB, reserved=64 * GIB, limit=66 * GIB, request=4 * GIB, largest_free_block=GIB
        ),
    )
    info.update(oom)
    return BenchResult(
        name="mlp",
        recipe="llama3_tiny",
        status="oom",
        config={},
        shape={},
        device="cuda",
        gpu="H100",
        torch=torch.__version__,
        date="2026-01-01T00:00:00+00:00",
        command="remat bench",
        oom=OomInfo(**info),
    )  # type: ignore[arg-type]


def test_a_result_keeps_the_failed_ranks_place_and_allocator() -> None:
    failed = _failed()
    assert BenchResult.from_dict(json.loads(json.dumps(failed.to_dict()))) == failed
    malformed = failed.to_dict()
    malformed["oom"]["allocator"] = {"allocated": 1}
    with pytest.raises(ValueError, match="its memory or oom record is malformed"):
        BenchResult.from_dict(malformed)


def test_results_checks_classify_an_oom_by_the_ranks_recorded_allocator() -> None:
    # the message gives no numbers: only the allocator recorded on rank 2 can classify it
    (finding,) = checks.check_oom_kind([_failed()])
    assert finding.symptom == "mlp: out of memory on rank 2 (pp 1, dp 0, cp 0, tp 0)"
    assert finding.cause == "fragmentation" and finding.fix == doctor.EXPANDABLE_SEGMENTS
    assert checks.check_oom_kind([_failed(allocator=None)]) == []


def test_a_failed_rank_leaves_its_result_to_the_remat_process_that_started_torchrun(
    tmp_path, monkeypatch, capsys
) -> None:
    spec = BenchSpec(recipe="llama3_tiny", device="cpu")
    monkeypatch.setattr(common.out, "quiet", True)  # as on every rank but 0
    monkeypatch.setenv(launch.RECORDS, str(tmp_path))
    assert not launch.left_by_ranks()
    bench_command._leave(spec, _failed())
    assert capsys.readouterr() == ("", "") and launch.left_by_ranks()
    (left,) = tmp_path.iterdir()  # whole: no partial file beside it
    assert left.name == "rank00002.json" and BenchResult.from_dict(json.loads(left.read_text())) == _failed()
    # under a torchrun started by hand, no process reads it: the rank says it itself
    monkeypatch.delenv(launch.RECORDS)
    bench_command._leave(spec, _failed())
    out, err = capsys.readouterr()
    assert "rank 2 (pp 1, dp 0, cp 0, tp 0) ran out of memory: CUDA error: out of memory" in out
    assert "remat doctor on rank 2 (pp 1, dp 0, cp 0, tp 0): fragmentation" in out
    assert "writes no --json, history or golden" in err


def test_one_process_bench_diagnoses_its_oom_without_a_rank(capsys, monkeypatch) -> None:
    monkeypatch.setattr(MLP, "forward", oom_worker.out_of_memory)
    assert (
        main(
            [
                "bench",
                "-mr",
                "llama3_tiny",
                "--num_layers",
                "2",
                "-sl",
                "16",
                "-ms",
                "2",
                "--warmup_steps",
                "1",
                "--no_progress",
                "--no_history",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "remat doctor: capacity" in out and "75.80 GiB at OOM" in out and "ran out of memory" not in out


@pytest.mark.parametrize("command", ["doctor", "sweep"])
@pytest.mark.parametrize("by_torchrun", [False, True])
def test_commands_of_one_process_point_a_run_on_several_gpus_to_bench(
    command, by_torchrun, capsys, monkeypatch
) -> None:
    if by_torchrun:  # two processes started, -ng not given
        monkeypatch.setenv("WORLD_SIZE", "2")
    flags = [] if by_torchrun else ["-ng", "2"]
    assert main([command, "-mr", "llama3_tiny", "--device", "cpu", "--no_history", *flags]) == 1
    assert (
        f"{command}: runs one process, and this run takes 2 GPUs (-ng, tp x pp x cp, or torchrun's processes);"
        " `remat bench` with the same flags runs one config on them"
    ) in capsys.readouterr().err
