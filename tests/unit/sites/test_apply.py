"""apply() on the reference model: every plan gives the no-recompute run's loss and gradients,
bit for bit, and frees exactly the bytes its actions should."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import remat
from remat.config.megatron import TrainingFacts
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan
from remat.config.recompute import RecomputeConfig
from remat.core.problems import ConfigError
from remat.engine.rng import ReplayState
from remat.models import build
from remat.run.verify import run_step, verify
from remat.sites.apply import find_sites

LAYERS, BATCH, SEQ = 4, 2, 16


SELECTIVE = ["core_attn", "layernorm", "mlp"]


F64 = 8  # bytes per float64 element


pytestmark = pytest.mark.usefixtures("deterministic")


def _model(backend: str = "sdpa", dropout: float = 0.0, layers: int = LAYERS) -> torch.nn.Module:
    torch.manual_seed(0)
    return build(
        "llama3_tiny",
        dtype=torch.float64,
        num_layers=layers,
        attention_backend=backend,
        attention_dropout=dropout,
        hidden_dropout=dropout,
    )


def _batch(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _selective(*modules: str) -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="selective", recompute_modules=list(modules))


def _full(method: str, k: int) -> RecomputeConfig:
    return RecomputeConfig(recompute_granularity="full", recompute_method=method, recompute_num_layers=k)


def _all_configs() -> list[RecomputeConfig]:
    subsets = [c for r in range(1, 4) for c in itertools.combinations(SELECTIVE, r)]
    return [_selective(*s) for s in subsets] + [_full(m, k) for m in ("uniform", "block") for k in range(1, LAYERS + 1)]


def _config_id(c: RecomputeConfig) -> str:
    if c.recompute_granularity == "selective":
        return "+".join(c.recompute_modules or [])
    return f"{c.recompute_method}{c.recompute_num_layers}"


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("config", _all_configs(), ids=_config_id)
def test_every_config_is_bit_identical_to_no_recompute(config, dropout, backend) -> None:
    model = _model(backend, dropout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = verify(model, config, *_batch(model))
    fused_core_attn = backend == "sdpa" and "core_attn" in (config.recompute_modules or [])
    assert any(issubclass(w.category, remat.RematWarning) for w in caught) == fused_core_attn
    assert report.bit_identical, f"max grad diff {report.max_grad_diff}"
    assert len(report.candidate.grads) == len(list(model.parameters()))
    assert report.freed_bytes > 0


def test_mixed_per_layer_plan_is_bit_identical_and_round_trips(tmp_path) -> None:
    model = _model("eager", 0.1)
    plan = Plan(
        layers=[
            {},
            {},
            {"core_attn": "recompute", "layernorm": "discard"},
            {"mlp": "recompute", "layernorm": "recompute"},
        ],
        full_recompute=[(0, 2)],
    )
    for suffix in (".yaml", ".json"):
        plan.save(tmp_path / f"plan{suffix}")
        assert Plan.load(tmp_path / f"plan{suffix}") == plan
    report = verify(model, Plan.load(tmp_path / "plan.yaml"), *_batch(model))
    assert report.bit_identical


def test_frozen_embedding_and_layers_still_get_gradients_under_full_recompute() -> None:
    # LoRA-style: nothing entering the checkpointed layers requires grad.
    model = _model("sdpa", 0.1)
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    report = verify(model, _full("uniform", 2), *_batch(model))
    assert report.bit_identical
    assert report.candidate.grads and all("mlp" in n for n in report.candidate.grads)


def _saved(model, plan) -> int:
    remat.apply(model, plan)
    return run_step(model, *_batch(model), seed=0).saved.bytes


def test_layernorm_discard_frees_exactly_the_norm_outputs() -> None:
    model = _model()
    h = model.config.hidden_size
    norm = model.decoder.layers[0].input_layernorm
    x = torch.randn(BATCH, SEQ, h, dtype=torch.float64, requires_grad=True)
    # what one norm call leaves alive: its output, plus on CPU the unfused kernel's own
    # intermediates (normalized input, rstd), which the discard region does not keep either
    out, per_norm = remat.measure_saved(lambda: norm(x))
    assert per_norm.bytes >= out.numel() * F64
    freed = _saved(model, None) - _saved(model, _selective("layernorm"))
    assert freed == LAYERS * 2 * per_norm.bytes


def test_mlp_recompute_frees_exactly_the_mlp_intermediates() -> None:
    model = _model()
    ffn = model.config.ffn_hidden_size
    # fc1 output (gate|up, 2 ffn), silu(gate) (ffn) and the product fed to fc2 (ffn)
    freed = _saved(model, None) - _saved(model, _selective("mlp"))
    assert freed == LAYERS * 4 * BATCH * SEQ * ffn * F64


def test_full_uniform_keeps_only_the_group_inputs() -> None:
    h = _model().config.hidden_size
    per_layer = _saved(_model(layers=2), None) - _saved(_model(layers=1), None)
    outside_layers = _saved(_model(), None) - LAYERS * per_layer
    for k in range(1, LAYERS + 1):
        groups = -(-LAYERS // k)
        assert _saved(_model(), _full("uniform", k)) == outside_layers + groups * BATCH * SEQ * h * F64


def test_block_keeps_everything_of_the_layers_past_k() -> None:
    h = _model().config.hidden_size
    none = _saved(_model(), None)
    per_layer = _saved(_model(layers=2), None) - _saved(_model(layers=1), None)
    for k in range(1, LAYERS + 1):
        freed = none - _saved(_model(), _full("block", k))
        assert freed == k * (per_layer - BATCH * SEQ * h * F64)


@pytest.mark.parametrize("seq", [16, 64])
def test_core_attn_frees_the_scores_under_eager_and_no_scores_under_sdpa(seq: int) -> None:
    ids = torch.randint(0, 512, (BATCH, seq + 1), generator=torch.Generator().manual_seed(1))

    def freed(backend: str) -> int:
        model = _model(backend)
        saved = []
        for plan in (None, _selective("core_attn")):
            remat.apply(model, plan)
            saved.append(run_step(model, ids[:, :-1], ids[:, 1:], seed=0).saved.bytes)
        return saved[0] - saved[1]

    cfg = _model().config
    b, heads, groups, d = BATCH, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    kept_k_and_v = 2 * b * groups * seq * d * F64  # the region keeps its inputs k and v (compact)
    probs = b * heads * seq * seq * F64
    expanded_kv = 2 * b * heads * seq * d * F64
    causal_mask = seq * seq  # bool
    assert freed("eager") == LAYERS * (probs + expanded_kv + causal_mask - kept_k_and_v)
    # SDPA keeps no s x s tensor: recompute frees only its log-sum-exp (q, k and v are the
    # region's inputs, its output is the projection's input).
    logsumexp = b * heads * seq * F64
    with pytest.warns(remat.RematWarning, match="almost nothing"):
        assert freed("sdpa") == LAYERS * logsumexp


def test_apply_can_change_and_clear_the_plan() -> None:
    model = _model()
    batch = _batch(model)
    none = run_step(model, *batch, seed=0).saved.bytes
    remat.apply(model, _selective("mlp"))
    mlp = run_step(model, *batch, seed=0).saved.bytes
    remat.apply(model, _full("uniform", 1))
    full = run_step(model, *batch, seed=0).saved.bytes
    remat.apply(model, None)
    assert full < mlp < none == run_step(model, *batch, seed=0).saved.bytes
    assert all(s.action is None for s in find_sites(model).layers)


def test_apply_rejects_labels_the_model_does_not_have_and_changes_nothing() -> None:
    model = _model()
    remat.apply(model, _selective("mlp"))
    before = [s.action for group in find_sites(model).inner for s in group]
    with pytest.raises(ConfigError, match="moe_act"):
        remat.apply(
            model,
            RecomputeConfig(
                recompute_granularity="selective",
                recompute_modules=["mlp", "moe_act"],
                facts=TrainingFacts(moe_grouped_gemm=True),
            ),
        )
    assert [s.action for group in find_sites(model).inner for s in group] == before


def test_apply_range_checks_recompute_num_layers_against_the_model() -> None:
    with pytest.raises(ConfigError, match="recompute_num_layers"):
        remat.apply(_model(), _full("uniform", LAYERS + 1))


def test_full_recompute_is_per_virtual_stage() -> None:
    facts = TrainingFacts(layout=ParallelLayout(pp=2))
    cfg = RecomputeConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=1, facts=facts)
    assert remat.apply(_model(), cfg).full_recompute == [(0, 1), (2, 3)]
    cfg = RecomputeConfig(
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=2,
        facts=TrainingFacts(num_layers=LAYERS),
    )
    assert remat.apply(_model(), cfg).full_recompute == [(0, 2), (2, 4)]


@pytest.mark.parametrize("plan", [_full("uniform", 2), _selective("layernorm", "mlp", "core_attn")])
def test_no_grad_runs_plain(plan, monkeypatch) -> None:
    """Without autograd nothing is saved, so no region opens: the same result (dropout on, same
    seed) and no replay state captured."""
    model = _model(dropout=0.1)
    ids, labels = _batch(model)
    torch.manual_seed(3)
    with torch.no_grad():
        plain = model(ids, labels)
    captured = []
    capture = ReplayState.capture.__func__
    monkeypatch.setattr(ReplayState, "capture", classmethod(lambda cls, t: captured.append(1) or capture(cls, t)))
    remat.apply(model, plan)
    torch.manual_seed(3)
    with torch.no_grad():
        loss = model(ids, labels)
    assert torch.equal(loss, plain) and not loss.requires_grad and not captured
    model(ids, labels).backward()  # with autograd the plan's regions do open
    assert captured


def test_an_aborted_forward_leaves_no_full_recompute_group_open() -> None:
    model = _model()
    remat.apply(model, _full("uniform", 2))
    batch = _batch(model)
    expected = run_step(model, *batch, seed=0)
    layer = model.decoder.layers[1]
    real = layer.mlp.forward
    layer.mlp.forward = lambda *a: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("simulated"))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        model(*batch)
    layer.mlp.forward = real
    groups = {id(s.action.group): s.action.group for s in find_sites(model).layers}
    assert all(g.region is None for g in groups.values())
    again = run_step(model, *batch, seed=0)
    assert torch.equal(again.loss, expected.loss) and again.saved == expected.saved


def test_verify_reports_a_lost_gradient_as_a_difference() -> None:
    from remat.run.verify import VerifyReport

    model = _model()
    report = verify(model, _selective("mlp"), *_batch(model))
    lost = next(iter(report.candidate.grads))
    crippled = type(report.candidate)(
        report.candidate.loss, {n: g for n, g in report.candidate.grads.items() if n != lost}, report.candidate.saved
    )
    broken = VerifyReport(report.plan, report.baseline, crippled)
    assert not broken.bit_identical and broken.max_grad_diff == float("inf")
