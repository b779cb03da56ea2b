"""Context parallelism without a launch: every problem named before a process starts, what stays
refused beside it, validate's layouts, a rank's coordinates on the mesh and what a result records.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_context_parallel_runs.py."""

from __future__ import annotations

import pytest

from remat.bench.run import run_shape
from remat.bench.spec import BenchSpec
from remat.cli import main
from remat.cli.bench import _layout_words
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.core.problems import ConfigError
from remat.run.spec import RunSpec, run_problems, single_process_problems, unrun_problems
from remat.run.step import trace_spec


def _problems(**kwargs: object) -> list[str]:
    overrides = kwargs.pop("overrides", {})
    facts = TrainingFacts.from_megatron(kwargs)
    try:
        RunSpec(recipe="llama3_tiny", overrides=overrides, device="cpu", layout=facts.layout)  # type: ignore[arg-type]
    except ConfigError as err:
        return [str(p) for p in err.problems]
    return []


def test_every_context_parallel_problem_is_named_before_any_process_starts() -> None:
    assert not _problems(context_parallel_size=2)
    said = _problems(context_parallel_size=3, overrides=dict(attention_backend="eager", attention_dropout=0.1))
    assert said == [
        "context_parallel_size: seq_length=64 does not split into 6 chunks for 3 context-parallel ranks; use a"
        " sequence length that is a multiple of 6",
        "attention_backend: is 'eager'; torch's context parallelism runs scaled_dot_product_attention as ring"
        " attention, and the eager backend computes the scores itself; use sdpa",
        "attention_dropout: is 0.1; torch's ring attention draws it per block of keys, and its backward replays one"
        " block's random state for all of them; use 0 under context parallelism",
    ]


def test_what_stays_refused_beside_context_parallelism() -> None:
    assert not list(unrun_problems(TrainingFacts(layout=ParallelLayout(cp=2, pp=2, tp=2, sp=True)).capture))
    moe_ep = RunSpec(recipe="moe_tiny", device="cpu", layout=ParallelLayout(cp=2, ep=2, num_gpus=4))
    assert not list(run_problems(moe_ep))
    assert [p.field for p in single_process_problems(ParallelLayout(cp=2))] == ["context_parallel_size"]
    with pytest.raises(ConfigError, match="context_parallel_size: is 2; the trace steps whole sequences"):
        trace_spec(RunSpec(recipe="llama3_tiny", device="cpu", layout=ParallelLayout(cp=2)))


def test_validate_takes_context_beside_tensor_and_pipeline_parallelism() -> None:
    # estimate's shards of cp beside tp (and sp): tests/unit/estimate/test_estimate.py
    tiny = ["--num_layers", "2", "-rl", "1"]
    assert main(["validate", "-mr", "llama3_tiny", *tiny, "-tp", "2", "-cp", "2", "--sequence_parallel"]) == 0
    assert main(["validate", "-mr", "moe_tiny", *tiny, "-pp", "2", "-cp", "2"]) == 0


def test_a_ranks_coordinates_on_the_pp_dp_cp_tp_mesh() -> None:
    # 2 stages x 2 replicas x 2 context ranks x 2 tensor ranks: rank 13 = ((1*2 + 1)*2 + 0)*2 + 1
    assert ParallelLayout(pp=2, tp=2, cp=2, num_gpus=16).coordinates(13) == (1, 1, 0, 1)
    assert ParallelLayout(pp=2, tp=2, cp=2, num_gpus=16).coordinates(13).cp == 0
    assert ParallelLayout(cp=2, num_gpus=4).coordinates(3) == (0, 1, 1, 0)


def test_a_context_parallel_result_records_its_size_and_says_it_in_the_title() -> None:
    spec = BenchSpec(recipe="llama3_tiny", device="cpu", layout=ParallelLayout(cp=2, num_gpus=4))
    shape = run_shape(spec)
    assert (shape["context_parallel"], shape["data_parallel"]) == (2, 2)
    assert _layout_words(spec) == (
        ", context parallel over 2 ranks (ring attention), data parallel over 2 ranks (FSDP2)"
    )
