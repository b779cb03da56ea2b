"""The MoE family (moe_tiny: Qwen3-MoE-like, softmax router; deepseek_tiny: DeepSeek-V3-like, MLA,
sigmoid group-limited router with expert bias, dense first layer) in one process: the labels each
recipe has; the exact bytes moe_act, mla_up_proj and shared_experts free; expert_fc1 refused as a
recompute; the router's replay; the expert bias's token counts and its update (by the bench step
too); the auxiliary losses; grouped GEMMs; config problems; FLOPs; validate's labels.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_moe_runs.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.moe import (
    BATCH,
    F64,
    LABELS,
    RECIPES,
    SEQ,
    TOKENS,
    _batch,
    _full,
    _model,
    _moe_layers,
    _random_expert_bias,
    _selective,
)

import remat
from remat.cli import main
from remat.config.parallel import ParallelLayout
from remat.config.plan import Plan
from remat.core.problems import ConfigError
from remat.models import build, family_of, recipe_config
from remat.models.moe.config import MoEConfig
from remat.models.moe.moe_layer import GroupedExperts, TopKRouter, grouped_mm_loop, grouped_mm_torch
from remat.run.verify import run_step
from remat.sites.calls import forward_loss

pytestmark = pytest.mark.usefixtures("deterministic")


OFFLOAD_ONLY = ("expert_fc1",)  # sites kept or offloaded, never recomputed


def test_each_recipe_has_exactly_the_labels_tested() -> None:
    from remat.sites.apply import find_sites

    for recipe in RECIPES:
        model = _model(recipe)
        model_sites = find_sites(model).model_sites
        assert model_sites.num_layers == 3
        assert frozenset().union(*model_sites.labels) == frozenset(LABELS[recipe] + OFFLOAD_ONLY), recipe
        assert [model.config.is_moe_layer(i) for i in range(3)] == [False, True, True]


def _saved(model, plan) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)  # the dense layer 0 has no MoE sites
        remat.apply(model, plan)
    return run_step(model, *_batch(), seed=0).saved.bytes


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_act_frees_the_activation_and_the_swiglu_intermediates_of_each_moe_layer(recipe) -> None:
    model = _model(recipe, dropout=0.0)
    c = model.config
    slots, ffn = TOKENS * c.moe_router_topk, c.expert_ffn  # rows of the experts' GEMMs: [tokens x topk, ffn]
    freed = _saved(model, None) - _saved(model, _selective(model, "moe_act"))
    # The discard region drops its output act(FC1) x probs [slots, ffn] (FC2 saved it) and what the
    # call saved inside: silu(gate) [slots, ffn] (saved by the product with up) and silu(gate) x up
    # [slots, ffn] (saved by the product with the probabilities, which need a gradient). Its inputs
    # FC1's output and the permuted probabilities stay saved as before (SiLU and FC1's backward).
    # So 3 x, not 1 x, the output's bytes: counted independently on one call of the activation.
    experts = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    fc1 = torch.randn(slots, 2 * ffn, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(slots, dtype=torch.float32, requires_grad=True)
    out, per_call = remat.measure_saved(lambda: experts.activation(fc1, probs))
    assert out.shape == (slots, ffn) and per_call.bytes == 3 * slots * ffn * F64
    assert freed == _moe_layers(model) * per_call.bytes == 2 * 3 * slots * ffn * F64


def test_mla_up_proj_frees_q_k_and_v_less_the_rotary_key_input_it_keeps() -> None:
    model = _model("deepseek_tiny", dropout=0.0)
    c = model.config
    heads, qk, rope, v_dim = c.num_attention_heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
    freed = _saved(model, None) - _saved(model, _selective(model, "mla_up_proj"))
    # Core attention (eager) saves q and k [b, heads, s, qk + rope] (QK^T) and v [b, heads, s, v]
    # (PV): the region's outputs, which the discard drops, in every layer (MLA in all 3). Nothing
    # else of the up projections is saved (their outputs are split and copied by cat/contiguous;
    # RoPE saves only the cos/sin buffers). The region keeps its inputs: the q and kv latents are
    # norm outputs the up projections saved anyway, but k_rope is a slice of the kv down
    # projection's output, which the region copies (keeping its own bytes, not the buffer's):
    # b x s x rope more.
    q = k = TOKENS * heads * (qk + rope)
    v = TOKENS * heads * v_dim
    k_rope = TOKENS * rope
    assert freed == c.num_layers * (q + k + v - k_rope) * F64


@pytest.mark.parametrize("recipe", RECIPES)
def test_shared_experts_frees_what_the_shared_mlp_saves(recipe) -> None:
    model = _model(recipe, dropout=0.0)
    c = model.config
    shared_ffn, h = c.moe_shared_expert_intermediate_size, c.hidden_size
    freed = _saved(model, None) - _saved(model, _selective(model, "shared_experts"))
    shared = model.decoder.layers[1].mlp.shared_experts
    x = torch.randn(BATCH, SEQ, h, dtype=torch.float64, requires_grad=True)
    out, alive = remat.measure_saved(lambda: shared(x))
    # what the shared MLP's call leaves alive, but its output (the sum with the routed output saves
    # nothing): FC1's output (2 ffn), silu(gate) and the product FC2 saves (ffn each); its input is
    # the routed experts' too, kept either way
    per_layer = alive.bytes - out.numel() * F64
    assert per_layer == 4 * TOKENS * shared_ffn * F64
    assert freed == _moe_layers(model) * per_layer


def test_a_model_without_shared_experts_has_no_shared_experts_site_and_says_so() -> None:
    model = _model("moe_tiny", dropout=0.0, moe_shared_expert_intermediate_size=None)
    assert all("shared_experts" not in labels for labels in remat.find_sites(model).model_sites.labels)
    with pytest.raises(ConfigError, match="'shared_experts' matches no site in MoEModel .*drop 'shared_experts'"):
        remat.apply(model, _selective(model, "shared_experts"))


def test_expert_fc1_is_refused_as_a_recompute_label_and_as_a_plan_recompute() -> None:
    model = _model("moe_tiny")
    with pytest.raises(
        ConfigError, match="'expert_fc1' is an offload module: recomputing it frees nothing; move it to offload_modules"
    ):
        _selective(model, "expert_fc1")
    with pytest.raises(
        ConfigError,
        match=r"layers\[1\].expert_fc1: 'expert_fc1' marks a place to offload from;"
        " use 'offload' or 'keep'",
    ):
        remat.apply(model, Plan([{}, {"expert_fc1": "recompute"}, {}]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_replayed_router_chooses_the_experts_of_the_forward(recipe, monkeypatch) -> None:
    model = _model(recipe)
    if model.config.moe_router_enable_expert_bias:  # deepseek_tiny: sigmoid, group-limited, bias
        assert model.config.moe_router_num_groups and model.config.moe_router_score_function == "sigmoid"
        chosen_without_bias = _router_choices(model, monkeypatch, None)
        _random_expert_bias(model)
        chosen_with_bias = _router_choices(model, monkeypatch, None)
        assert not torch.equal(torch.cat(chosen_without_bias[0]), torch.cat(chosen_with_bias[0]))
    for plan in (_selective(model, "moe"), _full(model, "uniform", 1)):
        in_forward, in_backward = _router_choices(model, monkeypatch, plan)
        assert len(in_forward) == len(in_backward) == _moe_layers(model)  # each router replayed once
        for first, replayed in zip(in_forward, in_backward):
            assert torch.equal(first, replayed)


def _router_choices(model, monkeypatch, plan) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The experts each router chose in a forward, and in the backward (its replays, which run
    layers in reverse), by router in the model's order."""
    calls: list[tuple[TopKRouter, torch.Tensor]] = []
    real = TopKRouter.forward

    def recording(self, *args, **kwargs):
        probs, experts, tokens_per_expert = real(self, *args, **kwargs)
        calls.append((self, experts.clone()))
        return probs, experts, tokens_per_expert

    monkeypatch.setattr(TopKRouter, "forward", recording)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        remat.apply(model, plan)
    torch.manual_seed(3)
    loss = forward_loss(model, *_batch())
    forward_calls = len(calls)
    loss.backward()
    monkeypatch.setattr(TopKRouter, "forward", real)
    routers = model.routers()

    def by_router(recorded):
        assert sorted(routers.index(r) for r, _ in recorded) == list(range(len(routers)))  # each once
        return [experts for _, experts in sorted(recorded, key=lambda call: routers.index(call[0]))]

    return by_router(calls[:forward_calls]), by_router(calls[forward_calls:]) if plan is not None else []


def test_expert_bias_counts_tokens_once_per_micro_batch_whatever_is_recomputed() -> None:
    counts = {}
    for name in ("none", "moe", "full"):
        model = _model("deepseek_tiny")
        _random_expert_bias(model)
        plan = {"none": None, "moe": _selective(model, "moe"), "full": _full(model, "uniform", 1)}[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            remat.apply(model, plan)
        torch.manual_seed(3)
        loss = forward_loss(model, *_batch())
        assert all(not r.local_tokens_per_expert.any() for r in model.routers())  # counted in backward
        loss.backward()
        counts[name] = [r.local_tokens_per_expert.clone() for r in model.routers()]
    assert len(counts["none"]) == 2
    for name in ("moe", "full"):
        assert all(torch.equal(a, b) for a, b in zip(counts["none"], counts[name])), name
    topk = model.config.moe_router_topk
    assert all(c.sum() == TOKENS * topk for c in counts["none"])
    # a second micro-batch adds its own
    torch.manual_seed(4)
    forward_loss(model, *_batch(2)).backward()
    assert all(r.local_tokens_per_expert.sum() == 2 * TOKENS * topk for r in model.routers())


def test_update_expert_bias_moves_each_bias_by_the_rate_towards_the_mean_load() -> None:
    model = _model("deepseek_tiny")
    _random_expert_bias(model)
    torch.manual_seed(3)
    forward_loss(model, *_batch()).backward()
    rate = model.config.moe_router_bias_update_rate
    before = [(r.expert_bias.clone(), r.local_tokens_per_expert.clone()) for r in model.routers()]
    model.update_expert_bias()
    for router, (bias, counts) in zip(model.routers(), before):
        delta = router.expert_bias - bias
        over, under = counts > counts.mean(), counts < counts.mean()
        assert over.any() and under.any()
        torch.testing.assert_close(delta[over], torch.full_like(delta[over], -rate), rtol=0, atol=1e-7)
        torch.testing.assert_close(delta[under], torch.full_like(delta[under], rate), rtol=0, atol=1e-7)
        assert torch.equal(delta[counts == counts.mean()], torch.zeros_like(delta[counts == counts.mean()]))
        assert not router.local_tokens_per_expert.any()
    # a softmax router has no bias to move
    softmax = _model("moe_tiny")
    softmax.routers()[0].local_tokens_per_expert.fill_(3.0)
    softmax.update_expert_bias()
    assert not softmax.routers()[0].expert_bias.any()


def _explicit_aux(
    x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor, c: MoEConfig, sequences: int
) -> torch.Tensor:
    """Megatron's (seq_)aux_loss written out: coeff x E x sum_e(f_e x P_e), f_e the fraction of
    the top-k slots routed to e and P_e the mean score of e, over the micro-batch or over each
    sequence then averaged; sigmoid scores normalized per token. The router's precision (float32)."""
    scores = F.linear(x, weight).float()
    if c.moe_router_score_function == "softmax":
        scores = scores.softmax(-1)
    else:
        scores = scores.sigmoid()
        scores = scores / scores.sum(-1, keepdim=True)
    groups = sequences if c.moe_router_load_balancing_type == "seq_aux_loss" else 1
    total = 0.0
    for seq_scores, seq_experts in zip(scores.chunk(groups), experts.chunk(groups)):
        slots = seq_experts.numel()
        for e in range(c.num_moe_experts):
            total = total + (seq_experts == e).sum() / slots * seq_scores[:, e].mean()
    return c.moe_aux_loss_coeff * c.num_moe_experts * total / groups


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_aux_loss_adds_its_gradient_and_leaves_the_loss(recipe) -> None:
    with_aux = _model(recipe, dropout=0.0, moe_aux_loss_coeff=0.1)
    without = _model(recipe, dropout=0.0, moe_aux_loss_coeff=0.0)
    kind = {"moe_tiny": "aux_loss", "deepseek_tiny": "seq_aux_loss"}[recipe]
    assert with_aux.config.moe_router_load_balancing_type == kind
    assert all(torch.equal(a, b) for a, b in zip(with_aux.state_dict().values(), without.state_dict().values()))
    aux = run_step(with_aux, *_batch(), seed=0)
    lm = run_step(without, *_batch(), seed=0)
    assert torch.equal(aux.loss, lm.loss)  # the value is the LM loss's
    router = "decoder.layers.1.mlp.router.weight"
    assert (aux.grads[router] - lm.grads[router]).abs().max() > 1e-4 * lm.grads[router].abs().max()

    # the model without aux loss, plus the aux losses written out from each router's input
    routed = []
    hooks = [
        r.register_forward_hook(
            lambda m, args, kwargs, out: routed.append((m, args[0], kwargs, out[1])), with_kwargs=True
        )
        for r in without.routers()
    ]
    for p in without.parameters():
        p.grad = None
    loss = forward_loss(without, *_batch())
    for hook in hooks:
        hook.remove()
    explicit = sum(
        _explicit_aux(x, m.weight, experts, with_aux.config, kwargs["sequences"]) for m, x, kwargs, experts in routed
    )
    assert len(routed) == 2 and routed[0][2]["sequences"] == BATCH
    (loss + explicit).backward()
    for name, p in without.named_parameters():
        # the aux part is float32 (the router computes in float32, in a float64 model too), summed
        # in another order: equal to 1e-6 of what the aux loss adds (1e-8 measured); the LM part is
        # float64 and the same ops (parameters the aux loss does not reach: exactly equal)
        added = (aux.grads[name] - lm.grads[name]).abs().max()
        assert (p.grad - aux.grads[name]).abs().max() <= 1e-6 * added, name


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_mm_loop_matches_torch_grouped_mm_with_an_expert_without_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=g)  # 16-byte aligned rows: widths multiples of 4 floats
    weight = torch.randn(4, 12, 8, generator=g)  # [experts, out, in] as GroupedExperts holds them
    for counts in ([4, 0, 16, 4], [0, 8, 8, 8], [24, 0, 0, 0], [5, 7, 0, 12]):
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        fast = grouped_mm_torch(x, weight.transpose(1, 2), offsets)
        loop = grouped_mm_loop(x, weight.transpose(1, 2), offsets)
        assert loop.shape == fast.shape == (24, 12)
        torch.testing.assert_close(loop, fast, rtol=0, atol=1e-5)
        rows = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
        torch.testing.assert_close(loop, torch.einsum("ni,noi->no", x, weight[rows]), rtol=0, atol=1e-5)


def _problems(**fields) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        recipe_config("moe_tiny", **fields)
    return {p.field: p.message for p in err.value.problems}


def test_the_moe_rules_report_every_problem_at_once() -> None:
    problems = _problems(
        moe_router_topk=5,
        moe_router_group_topk=2,
        moe_router_enable_expert_bias=True,
        multi_latent_attention=True,
        qk_pos_emb_head_dim=7,
    )
    # expert parallelism is the layout's: the family checks it against the model's experts
    problems.update(
        {
            p.field: p.message
            for p in family_of("moe_tiny").layout_problems(recipe_config("moe_tiny"), ParallelLayout(ep=3))
        }
    )
    assert problems == {
        "moe_router_topk": "(5) exceeds num_moe_experts (4); route to at most as many experts as there are",
        "expert_model_parallel_size": "(3) must divide num_moe_experts (4)",
        "moe_router_group_topk": "group-limited routing needs both moe_router_num_groups and moe_router_group_topk;"
        " set both or neither",
        "moe_router_enable_expert_bias": "the expert bias (DeepSeek-V3's balancing) needs "
        "moe_router_score_function='sigmoid'",
        "qk_pos_emb_head_dim": "(7) must be even for rotary embeddings",
    }


def test_the_layer_pattern_problems_are_reported_with_the_field_checks() -> None:
    problems = _problems(moe_layer_freq="[0]*1+[1]*3", moe_router_score_function="relu")
    assert problems["moe_layer_freq"] == (
        "gives 4 layers but num_layers is 3; give one 0 (dense) or 1 (MoE) per layer, e.g. '[0]*1+[1]*2'"
    )
    assert problems["moe_router_score_function"] == "must be one of softmax, sigmoid, got 'relu'"
    assert _problems(moe_layer_freq="[0]*1,[1]*2") == {
        "moe_layer_freq": "'[0]*1,[1]*2' is not of the form '[0]*3+[1]*58'"
    }
    assert _problems(moe_layer_freq="[0]*1+[2]*2") == {
        "moe_layer_freq": "'[0]*1+[2]*2' is not of the form '[0]*3+[1]*58'"
    }
    assert "moe_layer_freq" in _problems(moe_layer_freq=[0, 1])
    assert "moe_layer_freq" in _problems(moe_layer_freq=0)


def test_a_bad_layer_pattern_does_not_hide_the_routing_problems() -> None:
    problems = _problems(moe_layer_freq="[0]*1+[1]*3", moe_router_topk=5)
    assert set(problems) == {"moe_layer_freq", "moe_router_topk"}


def test_num_layers_overrides_keep_the_dense_first_layers() -> None:
    def pattern(**overrides) -> list[int]:
        c = recipe_config("deepseek_v3", **overrides)
        return [int(c.is_moe_layer(i)) for i in range(c.num_layers)]

    assert pattern()[:4] == [0, 0, 0, 1] and len(pattern()) == 61
    assert pattern(num_layers=4) == [0, 0, 0, 1]
    assert pattern(num_layers=2) == [0, 1]
    assert pattern(num_layers=1) == [1]
    assert pattern(num_layers=3, moe_layer_freq=1) == [1, 1, 1]  # given, not adjusted
    assert pattern(num_layers=5, moe_layer_freq=2) == [1, 0, 1, 0, 1]
    assert pattern(num_layers=3, moe_layer_freq=[0, 1, 0]) == [0, 1, 0]
    # valid variations pass
    config, family, two = recipe_config("moe_tiny", moe_router_topk=4), family_of("moe_tiny"), ParallelLayout(ep=2)
    assert not list(family.layout_problems(config, two))
    assert family.shard(config, two, range(config.num_layers)).local_experts == 2
    assert recipe_config("deepseek_tiny", moe_router_num_groups=2, moe_router_group_topk=1).moe_router_topk == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_flops_are_six_times_the_active_matmul_parameters_per_token_plus_attention(recipe) -> None:
    c = recipe_config(recipe)
    model = build(recipe, device="meta")
    active = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name == "embedding.weight":  # norms; the embedding is a lookup
            continue
        if name.endswith(("experts.weight1", "experts.weight2")):  # [experts, ...]: top-k of them per token
            assert p.shape[0] == c.num_moe_experts
            active += p.numel() // c.num_moe_experts * c.moe_router_topk
        else:
            active += p.numel()
    if c.multi_latent_attention:
        qk, v = c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim
    else:
        qk = v = c.hidden_size // c.num_attention_heads
    s, sequences = 24, 3
    # QK^T and PV: 2 x s^2 x heads x (qk + v) multiply-adds a sequence and layer, x 3 for backward
    attention = 6 * c.num_layers * sequences * s * s * c.num_attention_heads * (qk + v)
    assert family_of(recipe).flops(c, s, sequences) == 6 * active * sequences * s + attention


def test_validate_checks_moe_labels_against_the_recipe(capsys) -> None:
    code = main(["validate", "-mr", "moe_tiny", "--recompute_modules", "moe,shared_experts,layernorm"])
    out = capsys.readouterr().out
    assert code == 0 and "layers 1-2: layernorm=discard, moe=recompute, shared_experts=recompute" in out
    code = main(["validate", "-mr", "moe_tiny", "--recompute_modules", "mla_up_proj"])
    assert code == 1 and "'mla_up_proj'" in capsys.readouterr().err


def test_validate_accepts_the_deepseek_labels(capsys) -> None:
    code = main(["validate", "-mr", "deepseek_tiny", "--recompute_modules", "mla_up_proj,moe_act"])
    assert code == 0, capsys.readouterr().err


def test_the_bench_step_moves_the_expert_bias_after_each_optimizer_step() -> None:
    from remat.sites.calls import after_optimizer_step

    model = build("deepseek_tiny", dtype=torch.float64)
    routers = model.routers()
    for router in routers:
        router.local_tokens_per_expert.copy_(torch.arange(float(len(router.local_tokens_per_expert))))
    after_optimizer_step(model)
    for router in routers:
        assert router.expert_bias.abs().eq(model.config.moe_router_bias_update_rate).all()
        assert not router.local_tokens_per_expert.any()
