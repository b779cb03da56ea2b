"""remat on Hugging Face transformers models, built from small configs (no download), in one
process: the sites each family gets, core_attn under each attention implementation, the exact
bytes mlp frees and what moe frees, unadapt, HF's gradient checkpointing turned off, the cache and
eval mode, the chunked loss head against HF's (loss to 1e-6, gradients to 1e-5 relative), LoRA
adapters and Trainer steps with gradient accumulation bit-identical to the unmodified model, and
the messages for mistakes and a missing transformers.

The launches, the runs through the command line and the exhaustive sweeps: tests/integration/test_hf_runs.py."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers.hf import BATCH, DROPOUT, LABELS, LAYERS, SEQ, batch, build, full, selective, transformers

import remat  # noqa: E402
from remat.config.recompute import RecomputeConfig  # noqa: E402
from remat.core.problems import ConfigError  # noqa: E402
from remat.models.hf.configs import TINY, hf_config  # noqa: E402
from remat.models.hf.family import _matmul_params  # noqa: E402
from remat.run.verify import run_step, verify  # noqa: E402
from remat.sites.apply import find_sites  # noqa: E402
from remat.sites.placement import site_map_of  # noqa: E402


def test_every_family_has_its_labels_and_every_layer() -> None:
    assert set(LABELS) == set(TINY)
    for family, labels in LABELS.items():
        model_sites = find_sites(remat.adapt(build(family))).model_sites
        assert model_sites.num_layers == LAYERS, family
        assert frozenset().union(*model_sites.labels) == frozenset(labels), family


@pytest.mark.parametrize(
    "attention",
    [
        "eager",
        "sdpa",
        pytest.param(
            "flex_attention",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="FlexAttention has no backward on CPU; benchmarks/hf_grads.py runs it on CUDA",
            ),
        ),
    ],
)
def test_core_attn_goes_through_each_attention_implementation(attention) -> None:
    model = build("llama", attention=attention, dropout=0.0 if attention == "flex_attention" else DROPOUT)
    if attention == "flex_attention":  # on CUDA, where flex has a backward (compiled: float32)
        model = model.float().cuda()
    ids, labels = (t.to(model.device) for t in batch(model))
    plain = run_step(model, ids, labels, seed=5)
    remat.adapt(model)
    report = verify(model, selective("core_attn"), ids, labels, seed=5)
    assert report.bit_identical and torch.equal(plain.loss, report.candidate.loss)
    if attention == "eager":  # the scores and probabilities it saved are gone
        assert report.freed_bytes >= LAYERS * 2 * BATCH * model.config.num_attention_heads * SEQ * SEQ * 8


def test_gemma2_soft_capped_eager_attention_is_recomputed_exactly() -> None:
    model = build("gemma2", attention="eager")
    assert model.config.attn_logit_softcapping
    plain = run_step(model, *batch(model), seed=5)
    report = verify(remat.adapt(model), selective("core_attn"), *batch(model), seed=5)
    assert report.bit_identical and torch.equal(plain.loss, report.candidate.loss) and report.freed_bytes > 0


def test_moe_frees_the_experts_activations() -> None:
    model = remat.adapt(build("mixtral", dropout=0.0))
    assert (
        verify(model, selective("moe"), *batch(model)).freed_bytes
        > verify(model, selective("moe_act"), *batch(model)).freed_bytes
        > 0
    )


def test_unadapt_restores_the_attention_functions_and_the_model() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    model = build("llama", dropout=0.0)
    plain = run_step(model, *batch(model), seed=1)
    remat.adapt(model)
    assert site_map_of(model)["core_attn"] == ("model.layers.*.self_attn",)
    remat.apply(model, selective("core_attn"))
    remat.unadapt(model)
    assert dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == before
    assert torch.equal(run_step(model, *batch(model), seed=1).loss, plain.loss)


def test_hf_gradient_checkpointing_is_turned_off_and_said_and_refused_if_turned_on_again() -> None:
    model = build("llama")
    model.gradient_checkpointing_enable()
    with pytest.warns(remat.RematWarning, match="remat turned off LlamaForCausalLM's gradient checkpointing"):
        remat.adapt(model)
    assert not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable()
    with pytest.raises(
        ConfigError,
        match="has remat's Sites and HF gradient checkpointing on at once; call"
        r" model.gradient_checkpointing_disable\(\)",
    ):
        model(*batch(model))
    model.gradient_checkpointing_disable()
    remat.unadapt(model)
    assert model.is_gradient_checkpointing  # unadapt puts back what adapt turned off


def _cache(out) -> object:
    """The key/value cache an output carries (transformers 5.25 calls it cache, 5.17 past_key_values)."""
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def test_training_runs_without_a_cache_and_eval_keeps_it() -> None:
    model = remat.adapt(build("llama", dropout=0.0))
    ids, _ = batch(model)
    assert _cache(model(ids, use_cache=True)) is None
    model.eval()
    assert _cache(model(ids, use_cache=True)) is not None


def test_switching_to_eval_and_back_under_a_plan() -> None:
    plain = build("llama")
    ids, labels = batch(plain)
    plain.eval()
    expected = plain(ids).logits
    model = remat.adapt(build("llama"))
    remat.apply(model, full("uniform", 1))
    model.eval()  # dropout off, gradients on: the plan still runs, and changes nothing
    assert torch.equal(model(ids).logits, expected)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    model.train()
    report = verify(model, full("uniform", 1), ids, labels, seed=5)
    assert report.bit_identical


def test_an_unknown_family_and_a_bad_override_are_named() -> None:
    with pytest.raises(ConfigError, match=r"'lama' is neither a family \(did you mean 'llama'\?\)"):
        hf_config("lama")
    with pytest.raises(ConfigError, match="num_layer: is not a field of LlamaConfig"):
        hf_config("llama", num_layer=2)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "qwen3"])
def test_the_chunked_loss_head_gives_hf_loss_and_gradients(family) -> None:
    model = build(family, dropout=0.0, output_router_logits=True) if family == "mixtral" else build(family, dropout=0.0)
    model.config.use_cache = False
    # more tokens than half the hidden size: fewer keep HF's head (test below)
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    plain = run_step(model, ids, labels, seed=0)
    counted = model(ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss
    remat.adapt(model, loss_head=True)
    chunked = run_step(model, ids, labels, seed=0)
    out = model(ids, labels=labels, num_items_in_batch=torch.tensor(40))
    assert out.logits is None
    # HF upcasts the logits to float32 (even a float64 model's): equal to float32's precision
    torch.testing.assert_close(chunked.loss.float(), plain.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss.float(), counted, rtol=1e-6, atol=1e-6)
    for name, grad in plain.grads.items():
        torch.testing.assert_close(chunked.grads[name], grad, rtol=1e-5, atol=1e-7)
    # what the step keeps: the chunked head keeps the weight's and hidden states' gradients (computed
    # in forward), not tokens x vocabulary logits; so it saves less once tokens outnumber the width
    long_ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    chunked_long = run_step(model, long_ids, long_ids, seed=0).saved.bytes
    remat.unadapt(model)
    assert chunked_long < run_step(model, long_ids, long_ids, seed=0).saved.bytes


def test_a_micro_batch_of_few_tokens_keeps_hf_loss_head() -> None:
    model = remat.adapt(build("llama", dropout=0.0), loss_head=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    # hidden size 64: at 32 tokens the output layer's gradient would outweigh the logits, at 96 not
    assert model(ids[:, :16], labels=ids[:, :16]).logits is not None
    assert model(ids, labels=ids).logits is None


def test_the_loss_head_is_refused_where_logits_are_soft_capped() -> None:
    model = build("gemma2")
    with pytest.raises(ConfigError, match="Gemma2ForCausalLM soft-caps its logits"):
        remat.adapt(model, loss_head=True)
    assert not any(isinstance(m, remat.Site) for m in model.modules()) and "forward" not in model.__dict__


def test_lora_adapters_get_the_same_gradients_inside_recomputed_regions() -> None:
    peft = pytest.importorskip("peft")

    def lora_model() -> torch.nn.Module:
        base = build("llama")
        base.config.use_cache = False
        torch.manual_seed(1)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]
        )
        return peft.get_peft_model(base, config).train()

    plain = run_step(lora_model(), *batch(build("llama")), seed=3)
    assert plain.grads and all("lora_" in name for name in plain.grads)  # the base is frozen
    model = remat.adapt(lora_model())
    for config in (full("uniform", 1), selective("mlp", "core_attn", "layernorm")):
        report = verify(model, config, *batch(build("llama")), seed=3)
        assert report.bit_identical and torch.equal(plain.loss, report.candidate.loss)
        assert all(torch.equal(plain.grads[n], g) for n, g in report.candidate.grads.items())
        assert report.candidate.grads.keys() == plain.grads.keys()


def test_two_trainer_steps_with_gradient_accumulation_match_the_unmodified_model(tmp_path) -> None:
    pytest.importorskip("accelerate")
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (8, SEQ), generator=g)]

    def train(plan: RecomputeConfig | None) -> dict[str, torch.Tensor]:
        model = build("llama")
        model.float()
        if plan is not None:
            remat.apply(remat.adapt(model), plan)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / ("plan" if plan else "plain")),
            max_steps=2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            seed=7,
            dataloader_num_workers=0,
        )
        transformers.Trainer(model=model, args=args, train_dataset=rows).train()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    plain = train(None)
    for plan in (full("block", 2), selective("core_attn", "layernorm", "mlp")):
        trained = train(plan)
        assert trained.keys() == plain.keys()
        assert all(torch.equal(plain[n], p) for n, p in trained.items())


def test_the_command_line_names_hf_mistakes(capsys) -> None:
    from remat.cli import main

    assert main(["bench", "--hf_config", "llama", "--no_history", "--device", "cpu"]) == 1
    assert "hf_config: names a Hugging Face config; add -m hf" in capsys.readouterr().err
    assert main(["estimate", "-m", "hf", "--hf_config", "mistral", "-cp", "2"]) == 1
    assert "MistralConfig has sliding-window layers, whose mask torch's ring attention" in capsys.readouterr().err


def test_importing_remat_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = "import sys, remat; remat.models.recipes(); print('transformers' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


def test_mlp_recompute_frees_exactly_the_mlp_intermediates() -> None:
    """gate_proj's output (SiLU's input), SiLU's output and up_proj's output (the product's inputs)
    and the product (down_proj's input): four [b, s, ffn] float64 tensors a layer."""
    model = remat.adapt(build("llama", dropout=0.0))
    report = verify(model, selective("mlp"), *batch(model))
    assert report.freed_bytes == LAYERS * 4 * BATCH * SEQ * model.config.intermediate_size * 8


def test_without_transformers_the_message_says_how_to_install_it(monkeypatch) -> None:
    import sys

    from remat.models.hf.configs import transformers_module

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"^Hugging Face models need transformers: pip install 'remat\[hf\]'$"):
        transformers_module()


@pytest.mark.parametrize(
    "family, field, value",
    [
        ("granite", "logits_scaling", 8.0),  # divides its logits
        ("granitemoe", "logits_scaling", 4.0),
        ("hyperclovax", "logits_scaling", 2.0),  # multiplies by a field of the same name
        ("cohere", "logit_scale", 0.25),
    ],
)
def test_the_chunked_loss_head_scales_the_logits_as_the_model_head_does(family, field, value) -> None:
    model = build(family, dropout=0.0, **{field: value})
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    plain = run_step(model, ids, ids, seed=0)
    remat.adapt(model, loss_head=True)
    for _ in range(2):  # the first call reads the scale, the next ones apply it
        chunked = run_step(model, ids, ids, seed=0)
        torch.testing.assert_close(chunked.loss.float(), plain.loss, rtol=1e-6, atol=1e-6)


def test_a_head_whose_logits_no_scale_explains_is_refused_on_the_first_call() -> None:
    model = build("llama", dropout=0.0)
    model.lm_head.register_forward_hook(lambda module, args, out: out + 1.0)  # a bias HF's head would add
    remat.adapt(model, loss_head=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ConfigError, match="no scale of its output layer's gives"):
        model(ids, labels=ids)


def test_the_forward_keeps_its_signature_and_the_trainer_trains_with_the_loss_head(tmp_path) -> None:
    pytest.importorskip("accelerate")
    model = build("llama", dropout=0.0)
    model.float()
    before = inspect.signature(model.forward)
    remat.adapt(model, loss_head=True)
    assert inspect.signature(model.forward) == before
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (4, 48), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    result = transformers.Trainer(model=model, args=args, train_dataset=rows).train()
    assert torch.isfinite(torch.tensor(result.training_loss))


@pytest.mark.parametrize(
    "family, present, absent",
    [
        ("gpt_neox", {"core_attn": "gpt_neox.layers.*.attention"}, ()),  # attention by what it calls
        ("granitemoe", {"moe": "model.layers.*.block_sparse_moe"}, ("mlp",)),  # the block holding experts
        ("olmo2", {}, ("layernorm",)),  # post-norms: their output goes into the residual add
        ("gemma2", {"layernorm": "model.layers.*.pre_feedforward_layernorm"}, ()),
        ("deepseek_v3", {}, ("mla_up_proj",)),  # HF's up-projections run inline: a Site frees nothing
    ],
)
def test_sites_are_found_by_what_the_modules_do(family, present, absent) -> None:
    from remat.models.hf.adapter import ADAPTER

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    found = ADAPTER.site_map(model)
    for label, pattern in present.items():
        assert pattern in found[label], (label, found[label])
    assert not set(absent) & set(found)
    if family == "gemma2":  # its post_attention_layernorm is a post-norm
        assert "model.layers.*.post_attention_layernorm" not in found["layernorm"]


def test_a_config_without_model_facts_is_judged_by_the_model_it_is_applied_to() -> None:
    moe_act = RecomputeConfig(recompute_granularity="selective", recompute_modules=["moe_act"])
    report = remat.verify(remat.adapt(build("mixtral")), moe_act, *batch(build("mixtral")))
    assert report.bit_identical and report.freed_bytes > 0
    with pytest.raises(ConfigError, match="'moe_act' matches no site in LlamaForCausalLM"):
        remat.apply(remat.adapt(build("llama")), moe_act)


def test_a_fused_gate_up_projection_counts_as_dense_and_phi3_runs_from_the_command_line(capsys) -> None:
    from remat.cli import main
    from remat.models.hf.family import FAMILY

    config = FAMILY.config("hf:phi3")
    dense, routed = _matmul_params(config)
    assert routed == 0 and dense > 0
    code = main(["verify", "-mr", "hf:phi3", "-rl", "1", "--recompute_method", "uniform"])
    assert code == 0, capsys.readouterr().err


def test_the_families_come_from_transformers_mappings_and_the_others_say_why() -> None:
    from remat.models.hf import catalog

    families = catalog.decoder_families()
    assert {"llama", "gpt_neox", "olmo2", "granitemoe", "cohere"} <= set(families)
    assert catalog.scope("bart") == "an encoder-decoder model"
    assert catalog.scope("bert") == "an encoder (masked LM) that can run as a decoder"
    assert catalog.scope("mllama").startswith("multimodal")
    with pytest.raises(ConfigError, match="'bart' is an encoder-decoder model; remat adapts decoder-only"):
        hf_config("bart")
    # a tiny config sets only the fields a family has, token ids inside the vocabulary
    assert hf_config("gpt2").n_embd == 64 and hf_config("gpt2").eos_token_id < catalog.VOCAB
    assert hf_config("deepseek_v3").kv_lora_rank == 16  # multi-latent attention, by its fields
    assert catalog.scope("musicgen").startswith("a composite model (its decoder is set in decoder, text_encoder)")
    with pytest.raises(ConfigError, match="transformers refuses this recurrent_gemma config"):
        hf_config("recurrent_gemma")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_fast_path_experts_give_transformers_loss_and_gradients(family) -> None:
    """remat's permutation around transformers' grouped GEMMs: loss and gradients to float32
    rounding (a token's slots are summed in another order in backward)."""
    from remat.models.hf import fusions

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(family),
        dtype=torch.float32,
        experts_implementation="grouped_mm",  # no float64 grouped GEMM
    )
    ids, labels = batch(model)
    plain = run_step(model, ids, labels, seed=0)
    assert fusions.use_grouped_experts(model) == 1
    assert fusions.use_grouped_experts(model) == 0  # switched once
    fast = run_step(model, ids, labels, seed=0)
    torch.testing.assert_close(fast.loss, plain.loss)  # float32's default tolerances
    for name, grad in plain.grads.items():
        torch.testing.assert_close(fast.grads[name], grad)


def test_the_loss_head_is_refused_where_the_forward_computes_its_own_loss() -> None:
    """TrOCR's forward computes a cross-entropy of its own (labels not shifted): the chunked head,
    which computes transformers' causal LM loss, would train on another loss (5.57 against 4.74)."""
    model = build("trocr")
    with pytest.raises(ConfigError, match="TrOCRForCausalLM computes its own loss"):
        remat.adapt(model, loss_head=True)
    assert "forward" not in model.__dict__


@pytest.mark.slow
def test_layers_returning_tuples_get_every_window_traced() -> None:
    """Bloom's blocks return (hidden, cache): the last layer's backward window starts at the
    gradient of the hidden state, the tuple's first element."""
    model = remat.adapt(build("bloom"))
    ids, labels = batch(model)
    trace = remat.trace(model, (ids, labels), timing_repeats=1)
    names = [w.name for w in trace.windows]
    assert [f"bwd{i}" for i in reversed(range(LAYERS))] == [n for n in names if n.startswith("bwd")]
    assert names.index("head") < names.index(f"bwd{LAYERS - 1}") < names.index("tail")


def test_a_step_that_reads_tensor_values_is_refused_by_estimate_and_verified_unchecked(capsys) -> None:
    """BioGPT's mask check calls .item(), which meta tensors cannot answer: `estimate` (shapes only)
    says so by name; `verify` runs without the host-memory check it predicts on meta, and says so."""
    from remat.cli import main

    assert main(["estimate", "-mr", "hf:biogpt", "-sl", "16", "--no_progress"]) == 1
    err = capsys.readouterr().err
    assert "BioGptForCausalLM's step reads tensor values" in err and "Tensor.item()" in err
    assert main(["verify", "-mr", "hf:biogpt", "-sl", "16"]) == 0
    assert "warning: not checked against this machine's free memory" in capsys.readouterr().err


@pytest.mark.parametrize(("family", "layers"), [("hrm_text", 4), ("longcat_flash", 28)])
def test_the_layer_count_is_the_models_where_num_hidden_layers_counts_otherwise(family, layers) -> None:
    """HRM's num_hidden_layers counts passes through its two stacks, LongCat's half-layers."""
    from remat.models.hf.family import FAMILY

    config = FAMILY.config(f"hf:{family}")
    assert config.hf.num_hidden_layers != layers and config.num_layers == layers
    assert find_sites(FAMILY.build(config, device="meta")).model_sites.num_layers == layers


def test_attention_flops_follow_each_layers_head_size() -> None:
    """Gemma 4's sliding and global layers have their own head_dim (a heterogeneous config)."""
    from remat.models.hf.family import FAMILY

    config = FAMILY.config("hf:gemma4_text", seq_length=16)
    one = FAMILY.flops(config, 16, 1)
    widths = [c.num_attention_heads * 2 * c.head_dim for c in (config.hf.per_layer_config[i] for i in range(2))]
    assert widths[0] != widths[1]
    assert FAMILY.flops(config, 32, 1) - 2 * one == 6 * (32**2 - 2 * 16**2) * sum(widths)


def test_experts_run_as_their_class_allows() -> None:
    """Aria names its expert count moe_num_experts; Llama 4's experts take no implementation."""
    from remat.models.hf.family import FAMILY

    aria = FAMILY.build(FAMILY.config("hf:aria_text"), dtype=torch.float64, device="meta")
    assert aria.config._experts_implementation == "batched_mm"  # no float64 grouped GEMM
    assert FAMILY.config("hf:aria_text").megatron_facts()["moe_grouped_gemm"]
    FAMILY.build(FAMILY.config("hf:llama4_text"), device="meta")


def test_attention_through_a_model_files_own_registry_is_recomputed() -> None:
    """Doge looks its attention function up in a registry of its own file: core_attn's Site stands
    there too, and frees the scores of its learned mask."""
    model = build("doge")
    ids, labels = batch(model)
    plain = run_step(model, ids, labels, seed=5)
    remat.adapt(model)
    report = verify(model, selective("core_attn"), ids, labels, seed=5)
    assert report.bit_identical and torch.equal(plain.loss, report.candidate.loss) and report.freed_bytes > 0


def test_the_fast_path_compiles_rotary_and_routers_once_with_the_same_math(monkeypatch) -> None:
    """compile_rotary swaps each modeling file's apply_rotary_pos_emb, compile_routers each MoE
    router's forward, once; traced by AOTAutograd without inductor (aot_eager) the step is the
    eager one, bit for bit."""
    import functools

    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from remat.models.hf import fusions

    monkeypatch.setattr(fusions.torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(modeling_qwen3_moe, fusions.ROTARY, modeling_qwen3_moe.apply_rotary_pos_emb)  # restored after
    model = build("qwen3_moe")
    ids, labels = batch(model)
    plain = run_step(model, ids, labels, seed=0)
    assert fusions.compile_rotary(model) == 1 and fusions.compile_rotary(model) == 0
    assert fusions.compile_routers(model) == LAYERS - 1  # qwen3_moe's tiny config: one dense layer first
    assert fusions.compile_routers(model) == 0
    fast = run_step(model, ids, labels, seed=0)
    assert torch.equal(fast.loss, plain.loss)
    assert all(torch.equal(fast.grads[name], grad) for name, grad in plain.grads.items())
