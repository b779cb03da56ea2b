"""adapt() on a model remat did not write (a torchtitan-style module tree, from a site map): every
plan gives the unmodified model's loss and gradients bit for bit, frees the bytes it should, and
adapt leaves parameters, state_dict, .to(), compile and saving as they were."""
from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.sites.placement import SITE_NAME, site_map_of
from remat.sites.apply import find_sites
from remat.core.problems import ConfigError
from remat.config.recompute import RecomputeConfig
from remat.run.verify import run_step, verify

DIM, FFN, HEADS, VOCAB, LAYERS, BATCH, SEQ = 32, 64, 4, 97, 3, 2, 12
F64 = 8


class Attention(nn.Module):
    """What core attention is in torchtitan: a module of its own around SDPA."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu(1)
        probs = F.dropout(scores.masked_fill(mask, float("-inf")).softmax(-1), self.dropout, self.training)
        return probs @ v


class SelfAttention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.inner_attention = Attention(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(self.inner_attention(q, k, v).transpose(1, 2).reshape(b, s, DIM))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = SelfAttention(dropout), FeedForward()
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.attention_norm(x)), self.dropout, self.training)
        return x + F.dropout(self.feed_forward(self.ffn_norm(x)), self.dropout, self.training)


class Transformer(nn.Module):
    """torchtitan's shape: layers in a ModuleDict keyed by index, loss from (tokens, labels)."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(dropout) for i in range(LAYERS)})
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return F.cross_entropy(self.output(self.norm(x)).flatten(0, 1), labels.flatten())


SITE_MAP = {
    "layer": "layers.*",
    "layernorm": ["layers.*.attention_norm", "layers.*.ffn_norm"],
    "core_attn": "layers.*.attention.inner_attention",
    "mlp": "layers.*.feed_forward",
}
SELECTIVE = ["core_attn", "layernorm", "mlp"]


def _model(dropout: float = 0.1) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dropout).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _configs() -> list[RecomputeConfig]:
    subsets = [c for r in range(1, 4) for c in itertools.combinations(SELECTIVE, r)]
    return ([RecomputeConfig(recompute_granularity="selective", recompute_modules=list(s)) for s in subsets]
            + [RecomputeConfig(recompute_granularity="full", recompute_method=m, recompute_num_layers=k)
               for m in ("uniform", "block") for k in (1, LAYERS)])


@pytest.mark.parametrize("config", _configs(), ids=lambda c: c.recompute_granularity + ":" + (
    ",".join(c.recompute_modules) if c.recompute_granularity == "selective" else f"{c.recompute_method}{c.recompute_num_layers}"))
def test_every_plan_on_an_adapted_model_is_bit_identical_to_the_unmodified_model(config) -> None:
    model = _model()
    model.train()
    plain = run_step(model, *_batch(), seed=3)
    remat.adapt(model, SITE_MAP)
    report = verify(model, config, *_batch(), seed=3)
    assert report.bit_identical, report.max_grad_diff
    assert torch.equal(report.baseline.loss, plain.loss)
    assert all(torch.equal(plain.grads[n], g) for n, g in report.candidate.grads.items())
    assert report.freed_bytes > 0


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
    remat.apply(model, RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
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
    path.write_text("layer: layers.*\nmlp: layers.*.feed_forward\nlayernorm:\n  - layers.*.attention_norm\n"
                    "  - layers.*.ffn_norm\n")
    model = remat.adapt(_model(), path)
    assert find_sites(model).model_sites.labels[0] == frozenset({"mlp", "layernorm"})


def test_site_map_errors_name_every_bad_label_and_pattern_at_once() -> None:
    model = _model()
    with pytest.raises(ConfigError) as err:
        remat.adapt(model, {"mpl": "layers.*.feed_forward", "layer": "blocks.*", "core_attn": "layers.*.attn",
                            "mlp": 3})
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
    with pytest.raises(ConfigError, match=r"'moe' matches no site in Transformer \(its sites: core_attn, layernorm,"
                                          r" mlp\); drop 'moe'"):
        remat.apply(model, RecomputeConfig(recompute_granularity="selective", recompute_modules=["moe"]))


def test_a_pattern_star_never_spans_a_dot() -> None:
    from remat.sites.placement import matches
    assert matches("layers.*", "layers.0") and not matches("layers.*", "layers.0.feed_forward")
    assert matches("layers.*.w[13]", "layers.2.w3") and not matches("layers.*.w[13]", "layers.2.w2")


def titan_model() -> tuple[Transformer, dict]:
    """A factory for `--model test_adapt:titan_model`: the model and its site map."""
    return Transformer(dropout=0.0), SITE_MAP


def test_any_model_runs_through_the_command_line_from_a_factory(capsys) -> None:
    from remat.cli import main
    code = main(["bench", "--model", "test_adapt:titan_model", "-sl", str(SEQ), "-ms", "2", "--warmup_steps", "1",
                 "--recompute_modules", "mlp,layernorm", "--no_history", "--no_progress", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "ok" in out
    code = main(["estimate", "--model", "test_adapt:titan_model", "-sl", str(SEQ), "--target", "cpu", "-rl", "1"])
    assert code == 0, capsys.readouterr().err


def test_a_factory_that_cannot_load_is_named(capsys) -> None:
    from remat.cli import main
    assert main(["bench", "--model", "test_adapt:no_such", "--no_history", "--device", "cpu"]) == 1
    assert "cannot load 'test_adapt:no_such'" in capsys.readouterr().err
    assert main(["bench", "--model", "test_adapt:titan_model", "--num_layers", "2", "--no_history",
                 "--device", "cpu"]) == 1
    assert "a factory's model takes only -sl/--seq_length" in capsys.readouterr().err
