"""Shared by the unit and integration tests of planning."""

from __future__ import annotations

import pytest
import torch

import remat

MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def budget_trace():
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.float64, num_layers=4, seq_length=32)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    batch = ids[:, :-1], ids[:, 1:]
    return model, batch, remat.trace(model, batch, timing_repeats=1)
