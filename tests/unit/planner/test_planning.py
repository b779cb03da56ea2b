"""remat.plan in one process: budgets read and refused, a host budget needing an offload trace,
uniform plans as Megatron configs, a site that frees nothing never chosen, explain's merged
layers, this rank's weights against the budget, and the plan command's refusals before tracing.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_planning_runs.py."""

from __future__ import annotations

import pytest
import torch
from helpers.planning import MiB

import remat
from remat.cli import main
from remat.config.model_sites import ModelSites
from remat.config.plan import Plan
from remat.memory.prediction import Effect, LayerEffects, Trace
from remat.memory.windows import Window
from remat.planner import NoPlanFits, plan_from_trace, uniform_config


def test_a_budget_below_every_plan_says_by_how_much(budget_trace) -> None:
    _, _, trace = budget_trace
    with pytest.raises(NoPlanFits, match="more, in window .* optimizer state take .* alone") as info:
        plan_from_trace(trace, 1024)
    assert info.value.lowest.peak_bytes > 1024


def test_a_host_budget_needs_an_offload_trace(budget_trace) -> None:
    _, _, plain = budget_trace
    with pytest.raises(remat.ConfigError, match="turn offload on"):
        plan_from_trace(plain, "1GiB", host_budget="1GiB")


def test_uniform_plans_come_back_as_megatron_configs(budget_trace) -> None:
    _, _, trace = budget_trace
    mlp = uniform_config(Plan([{"mlp": "recompute"}] * 4), trace)
    assert mlp.recompute_granularity == "selective" and mlp.recompute_modules == ["mlp"]
    ln = uniform_config(Plan([{"layernorm": "discard", "core_attn": "recompute"}] * 4), trace)
    assert ln.recompute_modules == ["core_attn", "layernorm"]
    full = uniform_config(Plan(Plan.none(4).layers, [(0, 2), (2, 4)]), trace)
    assert (full.recompute_method, full.recompute_num_layers) == ("uniform", 2)
    block = uniform_config(Plan(Plan.none(4).layers, [(0, 1)]), trace)
    assert (block.recompute_method, block.recompute_num_layers) == ("block", 1)
    assert uniform_config(Plan([{"mlp": "recompute"}, {}, {}, {}]), trace) is None
    offload = uniform_config(
        Plan([{"layer": "offload"}] * 3 + [{}], [(i, i + 1) for i in range(4)], min_offloaded_tensor_size=256), trace
    )
    assert (offload.recompute_method, offload.cpu_offloading_num_layers, offload.min_offloaded_tensor_size) == (
        "uniform",
        3,
        256,
    )
    from remat.planner import PlanResult

    keys = PlanResult(0, Plan.none(4), offload, trace.predict(None), ()).megatron_keys()
    assert keys["cpu_offloading_num_layers"] == 3 and keys["min_offloaded_tensor_size"] == 256
    assert uniform_config(Plan([{"layer": "offload"}] * 4), trace) is None  # Megatron keeps the last layer


def _synthetic(attn_freed: int) -> Trace:
    """Two layers; core_attn recompute frees `attn_freed` and costs nothing; mlp frees 10 MiB at 1 ms,
    both together the sum, in the same time."""
    none = Effect(0, {("fwd", 0): 0, ("bwd", 0): 0})
    combos = {
        frozenset(): none,
        frozenset({("core_attn", "recompute")}): Effect(attn_freed, {}, 0.0),
        frozenset({("mlp", "recompute")}): Effect(10 * MiB, {}, 0.001),
        frozenset({("core_attn", "recompute"), ("mlp", "recompute")}): Effect(10 * MiB + attn_freed, {}, 0.001),
    }
    effects = LayerEffects(combos, {1: Effect(20 * MiB, {}, 0.01), 2: Effect(40 * MiB, {}, 0.02)}, 0, 0.01)
    windows = (
        Window("fwd0", 0, 0, 50 * MiB),
        Window("fwd1", 1, 1, 60 * MiB),
        Window("head", None, 2, 100 * MiB),
        Window("bwd1", 1, 1, 90 * MiB),
        Window("bwd0", 0, 0, 70 * MiB),
    )
    return Trace(
        ModelSites(labels=(frozenset({"core_attn", "mlp"}),) * 2, has_layer_sites=True),
        0,
        0.1,
        windows,
        (effects, effects),
    )


def test_a_site_that_frees_nothing_is_never_chosen() -> None:
    trace = _synthetic(0)
    offered = [c.actions for c in trace.problem().choices if c.actions]
    assert {"mlp": "recompute"} in offered and not any("core_attn" in a for a in offered)
    result = plan_from_trace(trace, 85 * MiB)
    assert result.plan.layers == [{"mlp": "recompute"}, {"mlp": "recompute"}]
    free = plan_from_trace(_synthetic(10 * MiB), 85 * MiB)  # the same saving for free is taken
    assert free.plan.layers == [{"core_attn": "recompute"}, {"core_attn": "recompute"}]


def test_cli_plan_rejects_a_host_budget_without_offload(capsys) -> None:
    assert main(["plan", "-mr", "llama3_tiny", "--memory-budget", "1GiB", "--host-memory-budget", "1GiB"]) == 1
    assert "turn offload on" in capsys.readouterr().err


def test_cli_plan_checks_where_it_writes_before_tracing(tmp_path, capsys) -> None:
    folder = tmp_path / "taken"
    folder.mkdir()
    assert (
        main(["plan", "-mr", "llama3_tiny", "--memory-budget", "1GiB", "-o", str(folder), "--json", str(folder)]) == 1
    )
    err = capsys.readouterr().err
    assert f"--output: {folder} is a directory" in err and f"--json: {folder} is a directory" in err


def test_cli_plan_rejects_a_bad_budget_before_tracing(capsys) -> None:
    assert main(["plan", "--memory-budget", "lots"]) == 1
    assert "memory_budget: cannot read 'lots'" in capsys.readouterr().err
    assert main(["plan", "--memory-budget", "1GiB", "--offload", "--host-memory-budget", "some"]) == 1
    assert "host_memory_budget: cannot read 'some'" in capsys.readouterr().err


def test_budgets_the_weights_alone_exceed_and_bad_groups_fail_before_tracing(capsys) -> None:
    assert main(["plan", "-mr", "llama3_tiny", "--memory-budget", "1KiB", "--max_group", "0"]) == 1
    err = capsys.readouterr().err
    assert "memory_budget: the weights alone take" in err and "max_group: is 0; use 1 or more" in err
    model = remat.models.build("llama3_tiny", num_layers=2, seq_length=8)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    with pytest.raises(remat.ConfigError, match="the weights alone take"):
        remat.plan(model, "1KiB", (ids[:, :-1], ids[:, 1:]))


def test_explain_merges_only_layers_doing_the_same_at_the_same_cost() -> None:
    from remat.memory.windows import Choice
    from remat.planner import PlanResult

    mlp = {"mlp": "recompute"}
    choices = (
        Choice(0, 1, mlp, 8 * MiB, 0.001),
        Choice(1, 2, mlp, 8 * MiB, 0.001),
        Choice(2, 3, mlp, 6 * MiB, 0.001),
        Choice(3, 4, {}, 0, 0.0),
        Choice(4, 6, None, 30 * MiB, 0.02),
    )
    result = PlanResult(0, Plan.none(6), None, _synthetic(0).predict(None), choices)
    assert list(result.explain()) == [
        ("0-1", "mlp=recompute", 8 * MiB, 0.001),
        ("2", "mlp=recompute", 6 * MiB, 0.001),
        ("4-5", "full recompute, group of 2", 15 * MiB, 0.01),
    ]


@pytest.fixture
def one_rank():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_the_weights_checked_against_a_budget_are_this_ranks_on_its_device(one_rank) -> None:
    """An FSDP2 parameter's storage reads as the whole tensor's; the rank holds its shard only
    (a one-rank mesh holding half of a 16 x 4 tensor stands in for one of two ranks)."""
    from torch.distributed.tensor import DTensor, Shard

    from remat.planner import weight_bytes

    shard = DTensor.from_local(
        torch.zeros(8, 4), one_rank, [Shard(0)], run_check=False, shape=torch.Size((16, 4)), stride=(4, 1)
    )
    model = torch.nn.Module()
    model.sharded = torch.nn.Parameter(shard)
    model.elsewhere = torch.nn.Parameter(torch.zeros(100, device="meta"))  # not on the device it trains on
    assert shard.untyped_storage().nbytes() == 256
    assert weight_bytes(model, "cpu") == 8 * 4 * 4
