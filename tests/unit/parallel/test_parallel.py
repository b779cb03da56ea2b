"""FSDP2 without a launch: what fully_shard_layers needs, a bench spec against the processes
torchrun started, and FSDP2's shard of each parameter by shape.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_parallel_runs.py."""

from __future__ import annotations

import pytest
import torch

from remat.bench.spec import BenchSpec
from remat.core.problems import ConfigError
from remat.parallel import fully_shard_layers
from remat.parallel.data_parallel import shard_bytes


def test_fully_shard_layers_says_what_is_missing() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError) as err:
        fully_shard_layers(plain)
    said = str(err.value)
    assert "model: Sequential marks no 'layer' Sites, so FSDP2 has no per-layer units" in said
    assert "torch.distributed: no process group: launch with torchrun" in said


def test_a_bench_spec_must_match_the_processes_torchrun_started(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError,
        match="num_gpus: is 1 but torchrun started 2 processes; launch with torchrun"
        " --nproc-per-node 1, or let remat bench -ng 1 start it",
    ):
        BenchSpec(recipe="llama3_tiny", device="cpu")


def test_fsdp2_shards_each_parameter_in_padded_dim_0_chunks() -> None:
    params = [torch.empty(5, 3), torch.empty(4, dtype=torch.bfloat16), torch.empty(())]
    # ceil(5 / 2) x 3, ceil(4 / 2), one scalar: in float32
    assert shard_bytes(params, 2, torch.float32) == (3 * 3 + 2 + 1) * 4
