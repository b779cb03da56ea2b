"""Your own model, as a new user brings it: one that returns logits (torchtitan's forward(tokens))
with a loss function, in Python and from the command line, imported from the current folder;
the plan's follow-up line and remat.load_plan on what `remat plan -o` wrote."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.hostile import run

import remat

TITAN = """
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, h):
        return self.down(torch.nn.functional.gelu(self.up(h)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, h):
        return h + self.mlp(h)


class Titan(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(16, 64)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def build():
    return Titan(), {"layer": "layers.*", "mlp": "layers.*.mlp"}
"""
FULL = remat.RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


@pytest.fixture
def titan_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """titan_model.py in the working folder, which is not on sys.path (as for the `remat` script)."""
    (tmp_path / "titan_model.py").write_text(TITAN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "titan_model", raising=False)
    monkeypatch.setenv("REMAT_HISTORY", str(tmp_path / "history.sqlite"))
    return tmp_path


def _titan() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    namespace: dict = {}
    exec(TITAN, namespace)
    torch.manual_seed(0)
    model, site_map = namespace["build"]()
    ids = torch.randint(0, 64, (2, 9))
    return remat.adapt(model.double(), site_map), (ids[:, :-1], ids[:, 1:])


def test_a_model_that_returns_logits_is_verified_traced_and_planned_with_a_loss_fn() -> None:
    model, (ids, labels) = _titan()
    report = remat.verify(model, FULL, ids, labels, loss_fn=remat.cross_entropy)
    assert report.bit_identical and report.freed_bytes > 0
    logits = model(ids)
    assert torch.equal(report.baseline.loss, remat.cross_entropy(logits, labels).detach())
    assert len(remat.trace(model, (ids, labels), loss_fn=remat.cross_entropy, timing_repeats=1).layers) == 2
    assert remat.plan(model, "1GiB", (ids, labels), loss_fn=remat.cross_entropy).plan.layers == [{}, {}]


@pytest.mark.parametrize("model", ["titan", "linear"])
def test_without_a_loss_fn_the_error_says_what_a_model_must_provide(model) -> None:
    module, (ids, labels) = _titan() if model == "titan" else (torch.nn.Linear(4, 4), (torch.randn(2, 4),) * 2)
    with pytest.raises(remat.ConfigError, match=r"takes no labels= .*--loss_fn remat:cross_entropy"):
        remat.verify(module, remat.RecomputeConfig(), ids, labels)


def test_the_command_line_takes_a_model_from_the_current_folder_and_its_loss_fn(capsys, titan_folder) -> None:
    model = ["--model", "titan_model:build", "-sl", "8"]
    code, out, err, _ = run(
        capsys, "verify", *model, "--loss_fn", "remat:cross_entropy", "-rl", "1", "--recompute_method", "uniform"
    )
    assert code == 0 and "bit-identical: True" in out, err
    code, _, err, _ = run(capsys, "verify", *model)
    assert code == 1 and "Titan(input_ids, labels=labels) takes no labels=" in err
    code, _, err, _ = run(capsys, "verify", "-mr", "llama3_tiny", "--loss_fn", "remat:cross_entropy")
    assert code == 1 and "--loss_fn: is the loss of a --model that returns logits; add --model" in err


@pytest.mark.slow
def test_the_plans_follow_up_line_runs_the_same_model_and_load_plan_reads_the_file(capsys, titan_folder) -> None:
    model = ["--model", "titan_model:build", "--loss_fn", "remat:cross_entropy", "-sl", "8"]
    code, out, err, _ = run(capsys, "plan", *model, "--memory-budget", "1GiB", "-o", "plan.yaml", "--no_progress")
    assert code == 0, err
    line = next(x for x in out.splitlines() if "run it with" in x).split("`")[1]
    assert (
        line
        == "remat bench --model titan_model:build --loss_fn remat:cross_entropy -sl 8 --no_progress --config plan.yaml"
    )
    assert run(capsys, *line.split()[1:], "-ms", "4", "--warmup_steps", "1")[0] == 0
    loaded = remat.load_plan("plan.yaml")  # the Megatron config a plan of no recompute is written as
    assert isinstance(loaded, remat.RecomputeConfig) and loaded.recompute_granularity is None
    with pytest.raises(remat.ConfigError, match="loads with remat.load_plan"):
        remat.Plan.load("plan.yaml")


@pytest.mark.parametrize(("plan", "said"), [({"recompute_granularity": "full"}, "from_megatron"), ("mlp", "load_plan")])
def test_apply_names_a_plan_of_the_wrong_kind(plan, said) -> None:
    model = remat.models.build("llama3_tiny", num_layers=1)
    with pytest.raises(remat.ConfigError, match=f"plan: is a {type(plan).__name__}; give a RecomputeConfig.*{said}"):
        remat.apply(model, plan)
