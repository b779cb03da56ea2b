"""Layout-independent weights and data (remat.parallel.seeding, MockData), in one process: a
pipeline stage's chunk draws the whole model's weights at its layers, a data-parallel rank's
micro-batches are its share of one process's. The runs under each layout:
tests/integration/test_layouts_runs.py."""

from __future__ import annotations

import pytest
import torch

from remat import parallel
from remat.config.parallel import ParallelLayout
from remat.parallel.seeding import named_seed, seeded_parameters, whole_model_names
from remat.run.build import chunk_config
from remat.run.spec import RunSpec
from remat.run.step import MockData


def _reset(spec: RunSpec, chunk: int) -> dict[str, torch.Tensor]:
    """Chunk `chunk` of the spec's model, its weights drawn as reset_parameters draws them,
    under their whole-model names."""
    model = spec.family.build(
        chunk_config(spec, chunk), device="cpu", pre_process=chunk == 0, post_process=chunk == spec.layout.chunks - 1
    )
    names = whole_model_names(model, spec.layout.chunk_layers(spec.model_config.num_layers, chunk))
    with seeded_parameters(model, names, spec.seed):
        spec.family.reset_parameters(model)
    return {names[n]: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["llama3_tiny", "moe_tiny"])
def test_each_pipeline_stage_draws_the_whole_models_weights_at_its_layers(recipe) -> None:
    whole = _reset(RunSpec(recipe=recipe, device="cpu"), 0)
    layout = ParallelLayout(pp=3) if recipe == "moe_tiny" else ParallelLayout(pp=2, vp=2)
    spec = RunSpec(recipe=recipe, device="cpu", layout=layout, global_batch_size=layout.chunks)
    stages = [_reset(spec, chunk) for chunk in range(layout.chunks)]
    assert sorted(n for stage in stages for n in stage) == sorted(whole)
    for stage in stages:
        for name, weight in stage.items():
            assert torch.equal(weight, whole[name]), name


def test_a_parameter_draws_from_its_own_seed_whatever_was_drawn_before() -> None:
    linear = torch.nn.Linear(8, 4, bias=False)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with seeded_parameters(linear, {"weight": "decoder.layers.3.weight"}, 1234):
        torch.nn.init.normal_(linear.weight, std=0.02)
    drawn = torch.empty(4, 8).normal_(
        0, 0.02, generator=torch.Generator().manual_seed(named_seed(1234, "decoder.layers.3.weight"))
    )
    assert torch.equal(linear.weight.detach(), drawn)
    assert torch.equal(torch.get_rng_state(), before) and torch.initial_seed() == 0  # torch's own left alone


def test_whole_model_names_renumber_a_stage_s_layers_only_when_it_counts_them_from_zero() -> None:
    class Stage(torch.nn.Module):
        def __init__(self, numbers: list[int]) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(1, 1, bias=False) for i in numbers})

    assert whole_model_names(Stage([0, 1]), range(2, 4)) == {
        "layers.0.weight": "layers.2.weight",
        "layers.1.weight": "layers.3.weight",
    }
    assert whole_model_names(Stage([2, 3]), range(2, 4)) == {
        "layers.2.weight": "layers.2.weight",
        "layers.3.weight": "layers.3.weight",
    }


def test_data_parallel_ranks_step_on_their_share_of_one_process_s_global_batch(monkeypatch) -> None:
    one = MockData(RunSpec(recipe="llama3_tiny", device="cpu", global_batch_size=4))
    sequences = [one.batch()[0] for _ in range(8)]  # two steps of 4 micro-batches
    shares = []
    for rank in range(2):
        monkeypatch.setattr(parallel, "rank", lambda rank=rank: rank)
        spec = RunSpec(
            recipe="llama3_tiny",
            device="cpu",
            layout=ParallelLayout(num_gpus=2),
            micro_batch_size=2,
            global_batch_size=4,
        )
        shares.append(MockData(spec))
    for step in range(2):
        got = torch.cat([shares[rank].batch()[0] for rank in range(2)])
        assert torch.equal(got, torch.cat(sequences[4 * step : 4 * step + 4]))
