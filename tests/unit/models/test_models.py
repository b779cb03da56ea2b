"""Reference Llama model, recipes and the chunked loss head (CPU, float64 where exactness matters)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.models import build, recipe_config, recipes
from remat.models.kernels.loss import chunked_linear_cross_entropy, compiled_loss_kernels
from remat.models.llama import LlamaConfig, LlamaModel, TransformerLayer
from remat.sites.site import Site


def _loss_inputs(n: int = 11, hidden: int = 6, vocab: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[1, 4, 7]] = -100
    return h, w, labels


def _grads(loss_fn, h, w, labels, need_h=True, need_w=True):
    h, w = h.clone().requires_grad_(need_h), w.clone().requires_grad_(need_w)
    loss = loss_fn(h, w, labels)
    (loss * 3.0).backward()  # a grad_output other than 1 checks the backward scaling
    return loss.detach(), h.grad, w.grad


def _reference(h, w, labels):
    return F.cross_entropy(h @ w.T, labels, ignore_index=-100)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 11, 64])
def test_chunked_loss_matches_full_logits(chunk_size):
    h, w, labels = _loss_inputs()
    ref = _grads(_reference, h, w, labels)
    got = _grads(lambda *a: chunked_linear_cross_entropy(*a, chunk_size), h, w, labels)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_kernels_match_full_logits(dtype):
    """The compiled chunk (gradients written over low-precision logits) and compiled scaling."""
    h, w, labels = (t.to(dtype) if t.is_floating_point() else t for t in _loss_inputs(n=23, vocab=40))
    ref = _grads(_reference, h.double(), w.double(), labels)
    got = _grads(lambda *a: chunked_linear_cross_entropy(*a, 5, kernels=compiled_loss_kernels()), h, w, labels)
    tolerance = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g.double(), r, **tolerance)


def test_chunked_loss_holds_one_chunk_of_logits_at_a_time():
    """A chunk whose gradients overwrite its logits (float64 in place here; the compiled chunk on
    CUDA) leaves the loss head's peak at its outputs plus one chunk: chunks do not pile up."""
    from remat.memory import peak_during
    from remat.models.kernels.loss import _loss_and_grads, chunk_loss_in_place

    h, w, labels = _loss_inputs(n=64, hidden=8, vocab=500)
    _, peak = peak_during(lambda: _loss_and_grads(h, w, labels, 16, -100, True, True, chunk_loss_in_place))
    kept = (h.numel() + w.numel()) * 8  # grad_hidden and the float64 weight-gradient accumulator
    one_chunk = 16 * 500 * 8
    assert kept + one_chunk <= peak < kept + one_chunk + 4096  # + per-token statistics


def test_chunked_loss_of_no_tokens_is_nan_with_zero_gradients():
    h, w, labels = _loss_inputs()
    loss, grad_h, grad_w = _grads(lambda *a: chunked_linear_cross_entropy(*a, 4), h[:0], w, labels[:0])
    assert loss.isnan() and grad_h.shape == (0, 6) and torch.equal(grad_w, torch.zeros_like(w))


@pytest.mark.parametrize("need_h,need_w", [(True, False), (False, True)])
def test_chunked_loss_frozen_input_gets_no_grad(need_h, need_w):
    h, w, labels = _loss_inputs()
    ref = _grads(_reference, h, w, labels, need_h, need_w)
    got = _grads(lambda *a: chunked_linear_cross_entropy(*a, 4), h, w, labels, need_h, need_w)
    torch.testing.assert_close(got[0], ref[0])
    assert (got[1] is None) == (not need_h) and (got[2] is None) == (not need_w)
    torch.testing.assert_close(got[1] if need_h else got[2], ref[1] if need_h else ref[2])


def test_chunked_loss_float32_and_no_grad():
    h, w, labels = (t.float() if t.is_floating_point() else t for t in _loss_inputs())
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, w, labels, 5)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, _reference(h, w, labels))


def test_chunked_loss_rejects_bad_shapes():
    h, w, labels = _loss_inputs()
    with pytest.raises(ValueError, match="same h"):
        chunked_linear_cross_entropy(h, w[:, :3], labels, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_linear_cross_entropy(h, w, labels, 0)


def _batch(config: LlamaConfig, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_length), generator=g)
    labels = torch.randint(0, config.vocab_size, (batch, config.seq_length), generator=g)
    labels[:, -3:] = -100
    return ids, labels


def test_loss_at_init_is_near_uniform():
    torch.manual_seed(0)
    model = build("llama3_tiny")
    loss = model(*_batch(model.config))
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 0.1


def test_init_is_deterministic_from_global_seed():
    torch.manual_seed(3)
    a = build("llama3_tiny", num_layers=1)
    torch.manual_seed(3)
    b = build("llama3_tiny", num_layers=1)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def _loss_and_grads(model: LlamaModel, ids, labels):
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_eager_and_sdpa_attention_agree_in_float64():
    torch.manual_seed(0)
    sdpa = build("llama3_tiny", dtype=torch.float64, num_layers=2, seq_length=16, loss_chunk_size=7)
    eager = build("llama3_tiny", dtype=torch.float64, num_layers=2, seq_length=16, attention_backend="eager")
    eager.load_state_dict(sdpa.state_dict())
    batch = _batch(sdpa.config)
    loss_s, grads_s = _loss_and_grads(sdpa, *batch)
    loss_e, grads_e = _loss_and_grads(eager, *batch)
    torch.testing.assert_close(loss_e, loss_s, rtol=1e-12, atol=1e-12)
    for name, grad in grads_s.items():
        torch.testing.assert_close(grads_e[name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_dropout_only_in_train_mode(backend):
    torch.manual_seed(0)
    model = build(
        "llama3_tiny", dtype=torch.float64, attention_dropout=0.2, hidden_dropout=0.2, attention_backend=backend
    )
    plain = build("llama3_tiny", dtype=torch.float64, attention_backend=backend)
    plain.load_state_dict(model.state_dict())
    batch = _batch(model.config)
    reference = plain(*batch)
    model.eval()
    assert torch.equal(model(*batch), reference)
    model.train()
    assert not torch.allclose(model(*batch), reference)


def test_build_dtype_and_sequence_limit():
    model = build("llama3_tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary_pos_emb.cos.dtype == torch.bfloat16
    ids = torch.zeros(1, model.config.seq_length + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_length"):
        model(ids, ids)


def test_recipes_and_overrides():
    names = recipes()
    assert {"llama3_8b", "llama3_70b", "llama31_405b", "llama3_tiny"} <= set(names)
    assert any("tiny" in n for n in names)
    config = recipe_config("llama3_8b", num_layers=8, seq_length=4096, attention_backend="eager")
    assert (config.num_layers, config.seq_length, config.hidden_size) == (8, 4096, 4096)
    assert build("llama3_tiny", num_layers=2).config.num_layers == 2


def test_unknown_names_suggest_the_valid_ones():
    with pytest.raises(ValueError, match=r"did you mean 'num_layers'.*valid: .*hidden_size"):
        recipe_config("llama3_tiny", num_layer=2)
    with pytest.raises(ValueError, match=r"did you mean 'llama3_8b'.*valid: .*llama3_70b"):
        build("llama3-8b")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(hidden_size=65), "hidden_size: .* must be divisible by num_attention_heads"),
        (dict(num_query_groups=3), "num_query_groups: .* must be divisible by num_query_groups"),
        (dict(hidden_size=60, num_attention_heads=4, num_query_groups=4), "hidden_size: head dim 15 must be even"),
        (dict(kv_channels=15), "kv_channels: head dim 15 must be even"),
        (dict(kv_channels=0), "kv_channels: must be a positive integer or None"),
        (dict(num_layers=0), "num_layers: must be a positive integer"),
        (dict(loss_chunk_size=True), "loss_chunk_size: must be a positive integer"),
        (dict(norm_epsilon=0.0), "norm_epsilon: must be positive"),
        (dict(attention_dropout=1.0), r"attention_dropout: must be in \[0, 1\)"),
        (dict(attention_backend="flash"), "attention_backend: must be one of sdpa, eager"),
    ],
)
def test_invalid_shapes_say_what_to_change(overrides, message):
    with pytest.raises(remat.ConfigError, match=message):
        recipe_config("llama3_tiny", **overrides)


def test_every_shape_problem_is_reported_at_once():
    with pytest.raises(remat.ConfigError) as info:
        recipe_config("llama3_tiny", num_layers=0, hidden_dropout=1.0, vocab_size=-1)
    assert [p.field for p in info.value.problems] == ["num_layers", "vocab_size", "hidden_dropout"]


def test_meta_build_of_large_recipes():
    assert build("llama3_8b", device="meta").num_parameters() == 8_030_261_248
    model = build("llama31_405b", device="meta", dtype=torch.bfloat16)
    assert next(model.parameters()).is_meta
    assert model.num_parameters() == 405_853_388_800


def _site_map(layer: TransformerLayer) -> dict[str, tuple[str, bool]]:
    return {name: (m.label, m.fused) for name, m in layer.named_modules() if isinstance(m, Site)}


@pytest.mark.parametrize("backend,fused", [("sdpa", True), ("eager", False)])
def test_every_layer_has_exactly_the_megatron_sites_and_mlp_act(backend, fused):
    model = build("llama3_tiny", attention_backend=backend)
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    assert len(layers) == model.config.num_layers
    for layer in layers:
        assert _site_map(layer) == {
            "layer_site": ("layer", False),
            "input_norm_site": ("layernorm", False),
            "pre_mlp_norm_site": ("layernorm", False),
            "mlp_site": ("mlp", False),
            "self_attention.core_attn_site": ("core_attn", fused),
            "mlp.act_site": ("mlp_act", False),
        }
    sites_outside_layers = sum(isinstance(m, Site) for m in model.modules()) - 6 * len(layers)
    assert sites_outside_layers == 0


def test_megatron_module_names():
    names = set(dict(build("llama3_tiny", num_layers=1).named_parameters()))
    assert names == {
        "embedding.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
        *(
            f"decoder.layers.0.{n}.weight"
            for n in (
                "input_layernorm",
                "self_attention.linear_qkv",
                "self_attention.linear_proj",
                "pre_mlp_layernorm",
                "mlp.linear_fc1",
                "mlp.linear_fc2",
            )
        ),
    }


def test_meta_then_to_empty_and_init_weights_equals_direct_build():
    torch.manual_seed(5)
    direct = build("llama3_tiny", num_layers=1)
    deferred = build("llama3_tiny", num_layers=1, device="meta").to_empty(device="cpu")
    torch.manual_seed(5)
    deferred.init_weights()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(tensor, deferred.state_dict()[name]), name
    assert torch.equal(direct.rotary_pos_emb.cos, deferred.rotary_pos_emb.cos)


def test_init_weights_refills_the_rope_tables_in_place():
    # context parallelism holds these tensors to shard with each batch: new ones would go unsharded
    model = build("llama3_tiny", num_layers=1)
    tables = model.rotary_pos_emb.cos, model.rotary_pos_emb.sin
    expected = [t.clone() for t in tables]
    for t in tables:
        t.zero_()
    model.init_weights()
    assert model.rotary_pos_emb.cos is tables[0] and model.rotary_pos_emb.sin is tables[1]
    assert all(torch.equal(t, e) for t, e in zip(tables, expected, strict=True))


def test_fusable_chunk_loss_matches_the_in_place_one() -> None:
    from remat.models.kernels.loss import chunk_loss_fusable, chunk_loss_in_place

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    valid = labels % 5 != 0
    scale = valid.to(torch.float64) / valid.sum()
    in_place = chunk_loss_in_place(logits.clone(), labels, valid, scale, True)
    assert chunk_loss_fusable(logits.clone(), labels, valid, scale, False)[1] is None
    buffer = logits.clone()
    fusable = chunk_loss_fusable(buffer, labels, valid, scale, True)
    assert torch.equal(in_place[0], fusable[0]) and torch.equal(in_place[1], fusable[1])
    assert fusable[1] is buffer  # the gradients overwrite the logits: no second buffer


def test_compiled_regions_compose_with_recompute_bit_identically() -> None:
    import remat
    from remat.run.verify import verify

    torch.manual_seed(0)
    model = build(
        "llama3_tiny", dtype=torch.float32, num_layers=2, seq_length=16, hidden_dropout=0.1, attention_dropout=0.1
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 17))
    eager = verify(model, None, ids[:, :-1], ids[:, 1:]).baseline
    model.compile_regions()
    for modules in (["core_attn", "layernorm"], ["mlp"]):
        config = remat.RecomputeConfig(recompute_granularity="selective", recompute_modules=modules)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)  # core_attn under SDPA
            report = verify(model, config, ids[:, :-1], ids[:, 1:])
        assert report.bit_identical
    assert torch.allclose(report.baseline.loss, eager.loss, rtol=1e-5)


def test_pipeline_stages_chained_equal_the_whole_model() -> None:
    """Megatron's pre_process/post_process stages: embedding first, final norm and head last."""
    torch.manual_seed(0)
    whole = build("llama3_tiny", dtype=torch.float64, num_layers=4)
    config = recipe_config("llama3_tiny", num_layers=2)
    first = LlamaModel(config, dtype=torch.float64, post_process=False)
    last = LlamaModel(config, dtype=torch.float64, pre_process=False)
    assert first.output_layer is None and first.decoder.final_layernorm is None and last.embedding is None
    state = whole.state_dict()
    first.load_state_dict(
        {
            k: v
            for k, v in state.items()
            if not k.startswith(("output_layer", "decoder.final"))
            and not k.startswith(("decoder.layers.2", "decoder.layers.3"))
        }
    )
    last.load_state_dict(
        {
            k.replace("layers.2", "layers.0").replace("layers.3", "layers.1"): v
            for k, v in state.items()
            if not k.startswith("embedding") and not k.startswith(("decoder.layers.0", "decoder.layers.1"))
        }
    )
    ids = torch.randint(0, config.vocab_size, (2, 16))
    hidden = first(ids, ids)
    assert hidden.shape == (2, 16, config.hidden_size)
    assert torch.equal(last(hidden, ids), whole(ids, ids))


def test_kv_channels_sets_the_head_dim_apart_from_the_hidden_size() -> None:
    """A tensor-parallel shard: fewer heads of the same head dim."""
    model = build("llama3_tiny", dtype=torch.float64, num_attention_heads=2, num_query_groups=1, kv_channels=16)
    attention = model.decoder.layers[0].self_attention
    assert attention.linear_qkv.weight.shape == ((2 + 2) * 16, 64)
    assert attention.linear_proj.weight.shape == (64, 2 * 16)
    ids = torch.randint(0, 512, (2, 8))
    model(ids, ids).backward()


@pytest.mark.parametrize("acc_dtype, dtype", [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)])
def test_loss_head_weight_gradient_accumulates_the_product_in_the_accumulators_dtype(acc_dtype, dtype) -> None:
    from remat.models.kernels.loss import _accumulate_mm

    torch.manual_seed(0)
    acc, a, b = torch.randn(6, 5, dtype=acc_dtype), torch.randn(6, 3, dtype=dtype), torch.randn(3, 5, dtype=dtype)
    # bf16 operands hold 8-bit mantissas: their products round in bf16, not in float32
    exact_a, exact_b = a.to(acc_dtype), b.to(acc_dtype)
    expected = torch.addmm(acc, exact_a, exact_b)
    assert _accumulate_mm(acc, a, b, acc_dtype) is acc  # in place
    assert torch.equal(acc, expected)
    first = _accumulate_mm(None, a, b, acc_dtype)  # the first chunk starts the accumulator
    assert first.dtype == acc_dtype and torch.equal(first, exact_a @ exact_b)
    if dtype == torch.bfloat16:  # what the test tells apart: the product rounded to bf16 first
        assert not torch.equal(first, (a @ b).to(acc_dtype))
