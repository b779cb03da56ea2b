"""Expert parallelism without a launch: the run's settings refuse an expert-parallel size the
layout cannot hold, and bench names every problem before it starts torchrun.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_expert_parallel_runs.py."""

from __future__ import annotations

import pytest

from remat.cli import main
from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError
from remat.run.spec import RunSpec, run_problems


def _problems(**settings) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        RunSpec(device="cpu", **settings)
    return {p.field: p.message for p in err.value.problems}


def test_run_settings_refuse_an_expert_parallel_size_the_layout_cannot_hold() -> None:
    assert _problems(recipe="moe_tiny", layout=ParallelLayout(ep=2, num_gpus=3)) == {
        "expert_model_parallel_size": "(2) does not divide the 3 data-parallel rank(s) (3 GPUs / tp x pp x cp 1);"
        " expert-parallel ranks are data-parallel ranks that split the experts: use"
        " a multiple of 2 GPUs"
    }
    assert _problems(recipe="llama3_tiny", layout=ParallelLayout(ep=2, num_gpus=2)) == {
        "expert_model_parallel_size": "is 2, but dense Llama models have no routed experts that remat splits; use an"
        " MoE recipe (remat recipes lists them) or drop it"
    }
    # an estimate of one rank needs no more; a run needs a process per rank, and experts it can split
    spec = RunSpec("moe_tiny", device="cpu", layout=ParallelLayout(ep=2, etp=2))
    assert [(p.field, p.message) for p in run_problems(spec)] == [
        (
            "num_gpus",
            "is not given, so this runs one copy of the model on tp x pp x cp = 1 GPU(s); -ep 2 splits the"
            " experts over 2 data-parallel ranks: use -ng 2",
        ),
        (
            "expert_tensor_parallel_size",
            "is 2; each expert runs whole on its rank (no expert tensor parallelism"
            " yet; remat estimate predicts it); use 1",
        ),
    ]


def test_bench_names_every_expert_parallel_problem_before_starting_torchrun(capsys) -> None:
    code = main(
        [
            "bench",
            "-mr",
            "moe_tiny",
            "-ep",
            "2",
            "-tp",
            "2",
            "-ng",
            "2",
            "--micro_batch_size",
            "0",
            "--device",
            "cpu",
            "--no_history",
        ]
    )
    assert code == 1
    said = capsys.readouterr().err
    assert "--micro_batch_size: is 0; use at least 1" in said
    assert "-ep/--expert_model_parallel_size: (2) does not divide the 1 data-parallel rank(s)" in said
