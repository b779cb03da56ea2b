"""adapt() on a model remat did not write (a torchtitan-style module tree, from a site map), in one
process: where the sites go (parameters and state_dict untouched), adapting again and unadapt
(the model restored exactly), an adapted model moved, copied, saved and compiled as before, the
exact bytes mlp frees, site maps read from YAML and their mistakes named all at once, and a
--model factory that cannot load.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_adapt_runs.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers.adapt import BATCH, FFN, LAYERS, SELECTIVE, SEQ, SITE_MAP, _batch, _model

import remat
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.run.verify import run_step, verify
from remat.sites.apply import find_sites
from remat.sites.placement import SITE_NAME, site_map_of

F64 = 8


def test_mlp_recompute_frees_exactly_the_feed_forward_intermediates() -> None:
    """w1's output (silu's input), silu's output and w3's output (the product's inputs) and the
    product (w2's input): four [b, s, ffn] tensors a layer; the input is kept."""
    model = remat.adapt(_model(dropout=0.0), SITE_MAP)
    report = verify(model, RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]), *_batch())
    assert report.freed_bytes == LAYERS * 4 * BATCH * SEQ * FFN * F64


def test_adapt_places_sites_and_leaves_parameters_and_state_dict_alone() -> None:
    model = _model()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    remat.adapt(model, SITE_MAP)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    model_sites = find_sites(model).model_sites
    assert model_sites.num_layers == LAYERS and model_sites.model == "Transformer"
    assert all(labels == frozenset(SELECTIVE) for labels in model_sites.labels)
    assert isinstance(model.layers["0"].feed_forward.get_submodule(SITE_NAME), remat.Site)


def test_adapt_is_idempotent_and_a_new_map_replaces_the_old() -> None:
    model = remat.adapt(_model(), SITE_MAP)
    sites = [m for m in model.modules() if isinstance(m, remat.Site)]
    remat.adapt(model, dict(SITE_MAP))
    assert [m for m in model.modules() if isinstance(m, remat.Site)] == sites
    remat.adapt(model, {"layer": "layers.*"})
    assert [s.label for s in model.modules() if isinstance(s, remat.Site)] == ["layer"] * LAYERS
    assert site_map_of(model) == {"layer": ("layers.*",)}


def test_unadapt_restores_the_model_exactly() -> None:
    model = _model()
    before = run_step(model, *_batch(), seed=2)
    remat.adapt(model, SITE_MAP)
    remat.apply(
        model, RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    )
    remat.unadapt(model)
    assert not any(isinstance(m, remat.Site) for m in model.modules())
    assert not any("forward" in m.__dict__ for m in model.modules())
    after = run_step(model, *_batch(), seed=2)
    assert torch.equal(before.loss, after.loss) and before.saved.bytes == after.saved.bytes
    assert remat.unadapt(model) is model  # a second time: nothing to undo


def test_an_adapted_model_moves_copies_saves_and_compiles_as_before() -> None:
    model = remat.adapt(_model(dropout=0.0), SITE_MAP)
    remat.apply(model, RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]))
    ids, labels = _batch()
    expected = model(ids, labels)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    fresh = _model(dropout=0.0)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert torch.equal(fresh(ids, labels), expected)
    assert torch.equal(copy.deepcopy(model)(ids, labels), expected)
    assert model.float().layers["0"].feed_forward.w1.weight.dtype == torch.float32
    model.double()
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(ids, labels), expected)


def test_a_site_map_loads_from_yaml(tmp_path) -> None:
    path = tmp_path / "sites.yaml"
    path.write_text(
        "layer: layers.*\nmlp: layers.*.feed_forward\nlayernorm:\n  - layers.*.attention_norm\n  - layers.*.ffn_norm\n"
    )
    model = remat.adapt(_model(), path)
    assert find_sites(model).model_sites.labels[0] == frozenset({"mlp", "layernorm"})


def test_site_map_errors_name_every_bad_label_and_pattern_at_once() -> None:
    model = _model()
    with pytest.raises(ConfigError) as err:
        remat.adapt(
            model, {"mpl": "layers.*.feed_forward", "layer": "blocks.*", "core_attn": "layers.*.attn", "mlp": 3}
        )
    text = str(err.value)
    assert "'mpl' is not a site label (did you mean 'mlp'?)" in text
    assert "'mlp' needs a module path pattern or a list of them" in text
    assert len(err.value.problems) == 2  # patterns are matched once the labels are right
    with pytest.raises(ConfigError) as err:
        remat.adapt(model, {"layer": "blocks.*", "core_attn": "layers.*.attn"})
    text = str(err.value)
    assert "layer: pattern 'blocks.*' matches no module of Transformer; its modules at that depth:" in text
    assert "core_attn: pattern 'layers.*.attn' matches no module of Transformer" in text
    assert "layers.*.attention" in text  # what it could have meant
    assert not any(isinstance(m, remat.Site) for m in model.modules())


def test_one_module_cannot_hold_two_sites() -> None:
    with pytest.raises(ConfigError, match=r"layers.0.feed_forward is claimed by both 'mlp' and 'core_attn'"):
        remat.adapt(_model(), {"mlp": "layers.*.feed_forward", "core_attn": "layers.0.feed_forward"})


def test_a_model_remat_does_not_know_needs_a_map() -> None:
    with pytest.raises(ConfigError, match="remat does not know Transformer's family; give a site map"):
        remat.adapt(_model())


def test_a_label_the_adapted_model_has_no_place_for_names_the_model_and_its_labels() -> None:
    model = remat.adapt(_model(), SITE_MAP)
    with pytest.raises(
        ConfigError,
        match=r"'moe' matches no site in Transformer \(its sites: core_attn, layernorm,"
        r" mlp\); drop 'moe'",
    ):
        remat.apply(model, RecomputeConfig(recompute_granularity="selective", recompute_modules=["moe"]))


def test_a_pattern_star_never_spans_a_dot() -> None:
    from remat.sites.placement import matches

    assert matches("layers.*", "layers.0") and not matches("layers.*", "layers.0.feed_forward")
    assert matches("layers.*.w[13]", "layers.2.w3") and not matches("layers.*.w[13]", "layers.2.w2")


def test_a_factory_that_cannot_load_is_named(capsys) -> None:
    from remat.cli import main

    assert main(["bench", "--model", "test_adapt:no_such", "--no_history", "--device", "cpu"]) == 1
    assert "cannot load 'test_adapt:no_such'" in capsys.readouterr().err
    assert (
        main(["bench", "--model", "helpers.adapt:titan_model", "--num_layers", "2", "--no_history", "--device", "cpu"])
        == 1
    )
    assert "a factory's model takes only -sl/--seq_length" in capsys.readouterr().err


def test_a_container_module_is_refused_as_a_site() -> None:
    """An nn.Sequential runs every child, a Site too: the Site goes on the module that calls it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    with pytest.raises(ConfigError, match="mlp: 1 is a Sequential, which runs or lists every child"):
        remat.adapt(model, {"layer": "0", "mlp": "1"})
    assert not any(isinstance(m, remat.Site) for m in model.modules())
