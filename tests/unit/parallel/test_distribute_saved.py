"""distribute_saved_activations: full recompute's kept input split over the tensor-parallel ranks.

The engine's side on small functions (a call's `KeptInputs` keeps a stand-in, rebuilt before the
replay, exactly, offloaded like any kept input); the estimate's by shape (the kept inputs shrink to
1/tp, byte for byte); the rules through `remat validate`. The runs on two gloo processes are in
tests/integration/test_tensor_parallel_runs.py (one torchrun for all of its checks).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.cli import build_parser, main
from remat.cli.args import recompute_keys
from remat.config.megatron import TrainingFacts
from remat.config.model_sites import ModelSites, check_config
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.engine import KeptInputs, Offloader, Region, Restore, offloading
from remat.estimate.stages import EstimateSpec, estimate
from remat.parallel.tensor_parallel import SavedInputShards, distribute_saved_inputs, distribute_saved_inputs_by_shape


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 16, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2)]


def _layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x + F.dropout(torch.tanh(x @ w), 0.3, True)  # dropout: the replay must restore the RNG


class Halves:
    """A stand-in as one of two ranks would keep it: the first half of the flat input (the other
    half kept aside, as the other rank would), put back together before the replay."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self.other: list[torch.Tensor] = []
        self.restored = 0
        self.events: list[str] = []

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, Restore] | None:
        if t.is_leaf:
            return None
        first, second = (half.clone() for half in t.detach().reshape(-1).chunk(2))
        self.kept.append(first)
        self.other.append(second)
        shape = t.shape

        def restore(kept: torch.Tensor) -> torch.Tensor:
            self.restored += 1
            self.events.append("restore")
            return torch.cat([kept, self.other[0]]).view(shape)

        return first, restore


def _grads(
    split: Halves | None, x: torch.Tensor, *, offloader: Offloader | None = None, modify_input: bool = False
) -> list[torch.Tensor]:
    """Two linked calls of one region (a full-recompute range of two layers) on h = x * 2."""
    w1, w2 = _weights()
    h = x * 2  # an activation: not a leaf
    torch.manual_seed(5)
    if split is None:
        out = _layer(_layer(h, w1), w2)
    else:
        before = KeptInputs(split, lambda: split.events.append("before"))
        region = Region()
        with offloading(offloader, 0) if offloader is not None else torch.enable_grad():
            y = region.call(_layer, (h, w1), {}, before)
        out = region.call(_layer, (y, w2), {}, before)
        region.close()
    if modify_input:
        h.mul_(3)  # after the forward: the stand-in is a copy taken when the call ran
    out.square().sum().backward()
    return [x.grad, w1.grad, w2.grad]  # type: ignore[list-item]


def test_a_stand_in_is_kept_instead_of_the_input_and_rebuilt_once_before_the_replay() -> None:
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    plain = _grads(None, x)
    x.grad = None
    split = Halves()
    assert all(torch.equal(a, b) for a, b in zip(_grads(split, x), plain))
    # one input kept (the second call's is the first call's output), half of it; rebuilt once,
    # after the wrapped before_replay ran for the first call
    assert [t.numel() for t in split.kept] == [32] and split.restored == 1
    assert split.events == ["before", "restore", "before"]


def test_an_in_place_change_to_the_input_after_the_call_cannot_reach_a_copied_stand_in() -> None:
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    plain = _grads(None, x)
    x.grad = None
    assert all(torch.equal(a, b) for a, b in zip(_grads(Halves(), x, modify_input=True), plain))


def test_an_offloaded_range_offloads_the_stand_in() -> None:
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    plain = _grads(None, x)
    x.grad = None
    offloader = Offloader(min_numel=0, device_type="cpu")
    assert all(torch.equal(a, b) for a, b in zip(_grads(Halves(), x, offloader=offloader), plain))
    assert offloader.stats().offloaded_bytes == 32 * 8  # the half kept, not the whole input


def test_a_retained_graph_replays_twice_from_the_rebuilt_input() -> None:
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    w1, _ = _weights()
    split = Halves()
    h = x * 2
    region = Region()
    torch.manual_seed(5)
    out = region.call(_layer, (h, w1), {}, KeptInputs(split))
    region.close()
    first = torch.autograd.grad(out.sum(), w1, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(out.sum(), w1)[0], first) and split.restored == 1


def test_shards_of_saved_inputs_pad_the_last_rank_and_skip_leaves_dtensors_and_strided_views() -> None:
    x = torch.arange(7.0, requires_grad=True) * 1  # 7 elements over 3 ranks: shards of 3, the last padded
    shards = [SavedInputShards(3, rank) for rank in range(3)]
    kept = [split(x) for split in shards]
    assert [s.tolist() for s, _ in kept] == [[0, 1, 2], [3, 4, 5], [6, 0, 0]]  # type: ignore[misc]
    _, restore = kept[0]  # type: ignore[misc]
    meta = torch.empty(3, device="meta")
    assert restore(meta).shape == (7,)  # by shape: what a gather of three shards gives
    leaf = torch.ones(6, requires_grad=True)
    assert shards[0](leaf) is None and shards[0](leaf.detach()) is None
    assert shards[0]((leaf * 1).view(2, 3).t()) is None  # not contiguous: kept whole


def test_splitting_saved_inputs_needs_a_tensor_parallel_model() -> None:
    model = remat.models.build("llama3_tiny", num_layers=2, seq_length=16)
    with pytest.raises(ConfigError) as err:
        distribute_saved_inputs(model)
    assert str(err.value) == (
        "distribute_saved_activations: splits saved inputs over the tensor-parallel ranks"
        " of a model split by parallelize_tensor, and this one is not; split it first,"
        " or turn this off"
    )
    distribute_saved_inputs(model, on=False)  # off: nothing to check
    with pytest.raises(ValueError, match="meta device"):
        distribute_saved_inputs_by_shape(model, 2)


def test_the_layout_takes_distributed_saved_activations() -> None:
    config = RecomputeConfig(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        distribute_saved_activations=True,
        facts=TrainingFacts(layout=ParallelLayout(tp=2)),
    )
    check_config(config, ModelSites(labels=(frozenset({"mlp"}),) * 2))


TP, LAYERS, MB, SEQ, HIDDEN = 2, 3, 2, 32, 64


LAYER_INPUT = MB * SEQ * HIDDEN * 4  # [b, s, h] float32: what a range keeps without the split


# (method, k, ranges it makes, where the peak falls, ranges whose input is kept there and not replaying)
METHODS = [("uniform", 1, 3, "bwd2", 2), ("uniform", 2, 2, "bwd1", 0), ("block", 2, 2, "head", 2)]


def _full(method: str, k: int, distribute: bool) -> RecomputeConfig:
    return RecomputeConfig(
        recompute_granularity="full",
        recompute_method=method,
        recompute_num_layers=k,
        distribute_saved_activations=distribute,
        facts=TrainingFacts(layout=ParallelLayout(tp=TP)),
    )


def test_the_estimate_keeps_one_tp_th_of_each_ranges_input() -> None:
    spec = EstimateSpec(
        recipe="llama3_tiny",
        overrides=dict(num_layers=LAYERS, seq_length=SEQ),
        micro_batch_size=MB,
        optimizer=False,
        precision=Precision("fp32"),
        device="cpu",
        layout=ParallelLayout(tp=TP),
    )
    plans = [(f"{m[0]}_{m[1]}@{split}", _full(m[0], m[1], split)) for m in METHODS for split in (False, True)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        estimates = iter(estimate(spec, plans))  # one trace of each model: ranges keeping inputs whole, split
    freed = LAYER_INPUT * (TP - 1) // TP  # of each range's input
    for (method, k, ranges, window, kept_there), whole, split in zip(METHODS, estimates, estimates):
        (kept,), (shards,) = whole.stages, split.stages
        assert kept.activations - shards.activations == ranges * freed, (method, k)
        # a replaying range holds its input whole again (the shard gathered, then dropped)
        assert kept.peak_window == shards.peak_window == window, (method, k)
        assert kept.peak - shards.peak == kept_there * freed, (method, k)


def _validate(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    code = main(["validate", "-mr", "llama3_tiny", "--distribute_saved_activations", *flags])
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


def test_validate_takes_distributed_saved_activations_with_full_recompute_over_tensor_parallel_ranks(capsys) -> None:
    code, out, _ = _validate(capsys, "-tp", "2", "-rl", "1", "--recompute_method", "uniform")
    assert code == 0
    assert "recompute: full, uniform: every layer, in groups of 1" in out
    assert "saved layer inputs split over 2 tensor-parallel ranks" in out


@pytest.mark.parametrize(
    "flags, said",
    [
        (
            ("-tp", "2", "-rl", "1", "--sequence_parallel"),
            ["distribute_saved_activations: sequence parallelism already splits the saved inputs"],
        ),
        (("-tp", "2", "--recompute_modules", "mlp"), ["distribute_saved_activations: only full recompute"]),
        (
            (
                "-rl",
                "1",
            ),
            [
                "distribute_saved_activations: splits saved inputs across tensor-parallel ranks, so it needs"
                " tensor_model_parallel_size > 1"
            ],
        ),
        (
            ("--recompute_modules", "mlp"),
            ["invalid config (2 problems)", "only full recompute", "tensor_model_parallel_size > 1"],
        ),
    ],
)
def test_validate_refuses_distributed_saved_activations_without_their_conditions(
    capsys, flags: Any, said: list[str]
) -> None:
    code, _, err = _validate(capsys, *flags)
    assert code == 1
    for text in said:
        assert text in err


def test_the_flag_maps_to_megatrons_key() -> None:
    args = build_parser().parse_args(["estimate", "-tp", "2", "-rl", "1", "--distribute_saved_activations"])
    assert recompute_keys(args)["distribute_saved_activations"] is True
    assert "distribute_saved_activations" not in recompute_keys(build_parser().parse_args(["estimate"]))
