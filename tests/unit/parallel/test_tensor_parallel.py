"""Tensor parallelism without a launch: a replay draws from a registered stream what the forward
drew, and parallelize_tensor says what is missing.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_tensor_parallel_runs.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat.core.problems import ConfigError
from remat.engine import checkpoint, register_stream, rng
from remat.parallel.tensor_parallel import RankStream, parallelize_tensor


def test_a_replay_draws_from_a_registered_stream_what_the_forward_drew(monkeypatch) -> None:
    monkeypatch.setattr(rng, "_streams", {})
    x = torch.randn(256, dtype=torch.float64, requires_grad=True)

    def grad_through(stream: RankStream, recompute: bool) -> torch.Tensor:
        def f(t: torch.Tensor) -> torch.Tensor:
            with stream.fork():
                return F.dropout(t, 0.5) * t

        register_stream("tensor_parallel", stream)
        y = checkpoint(f, x) if recompute else f(x)
        torch.rand(1)  # the default stream moves on between forward and backward
        with stream.fork():
            torch.rand(1)  # and so does the rank's own
        return torch.autograd.grad(y.sum(), x)[0]

    default = torch.get_rng_state()
    plain = grad_through(RankStream(torch.device("cpu"), seed=5), recompute=False)
    assert torch.equal(grad_through(RankStream(torch.device("cpu"), seed=5), recompute=True), plain)
    assert not torch.equal(grad_through(RankStream(torch.device("cpu"), seed=6), recompute=True), plain)
    torch.set_rng_state(default)


def test_parallelize_tensor_says_what_is_missing() -> None:
    with pytest.raises(ConfigError) as err:
        parallelize_tensor(torch.nn.Linear(4, 4), sequence_parallel=False)
    assert str(err.value).splitlines() == [
        "torch.distributed: no process group: launch with torchrun and call torch.distributed.init_process_group()"
        " first",
        "model: Linear belongs to no model family remat knows; build it with remat.models.build",
    ]
