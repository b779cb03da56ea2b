"""FP8 with current scaling (`-c fp8_cs`) through torchao's float8 training, on CPU (torch's
scaled matmul there): the layers' linears swapped and nothing else, recompute bit-identical to FP8
without it for every label and full recompute with dropout on, on remat's Llama, MoE and MLA
families and an adapted Hugging Face model; the estimate on meta equal to the trace byte for
byte; first and last layers kept in bf16; every refusal with its reason."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")

import remat  # noqa: E402
from remat.config.precision import Precision  # noqa: E402
from remat.config.recompute import RecomputeConfig  # noqa: E402
from remat.core.labels import recompute_labels  # noqa: E402
from remat.core.problems import ConfigError  # noqa: E402
from remat.run.fp8 import fp8_run_problems, layer_modules, to_fp8  # noqa: E402
from remat.sites.apply import find_sites  # noqa: E402

FP8 = Precision("fp8_cs")
TORCHAO = Precision("fp8_cs", fp8_keep_inputs=False)  # torchao's Float8Linear as it is
DROPOUT = {"attention_dropout": 0.1, "hidden_dropout": 0.1}


def _fp8_linears(module: torch.nn.Module) -> int:
    return sum(type(m).__name__ in ("Float8Linear", "Fp8Linear") for m in module.modules())


def _model(recipe: str, precision: Precision = FP8, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = remat.models.build(recipe, dtype=torch.bfloat16, **overrides)
    to_fp8(model, precision)
    return model


def _ids(model: torch.nn.Module, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))


def _labels(model: torch.nn.Module) -> list[str]:
    """The model's labels a selective recompute takes."""
    return sorted(set().union(*find_sites(model).model_sites.labels) & set(recompute_labels()))


@pytest.mark.parametrize(
    "recipe", ["llama3_tiny", *(pytest.param(r, marks=pytest.mark.slow) for r in ("moe_tiny", "deepseek_tiny"))]
)
def test_every_label_and_full_recompute_replay_fp8_bit_identically(recipe: str) -> None:
    """With torchao's own linears they free what they free in bf16: torchao keeps a linear's bf16
    input, casting it again in backward, so FP8 changes no saved tensor's size."""
    model = _model(recipe, TORCHAO, **DROPOUT)
    torch.manual_seed(0)
    plain = remat.models.build(recipe, dtype=torch.bfloat16, **DROPOUT)
    ids = _ids(model)
    plans = [RecomputeConfig(recompute_granularity="selective", recompute_modules=[label]) for label in _labels(model)]
    plans.append(RecomputeConfig(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    for plan in plans:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)  # MoE: some labels on some layers only
            report, bf16 = remat.verify(model, plan, ids, ids), remat.verify(plain, plan, ids, ids)
        assert report.bit_identical and report.freed_bytes == bf16.freed_bytes, plan


@pytest.mark.parametrize("recipe", ["llama3_tiny", pytest.param("moe_tiny", marks=pytest.mark.slow)])
def test_linears_keeping_their_fp8_inputs_give_torchaos_gradients_and_replay_bit_identically(recipe: str) -> None:
    kept, torchao = _model(recipe, FP8, **DROPOUT), _model(recipe, TORCHAO, **DROPOUT)
    ids = _ids(kept)
    grads = []
    for model in (kept, torchao):
        torch.manual_seed(0)
        model(input_ids=ids, labels=ids).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    for label in _labels(kept):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            plan = RecomputeConfig(recompute_granularity="selective", recompute_modules=[label])
            assert remat.verify(kept, plan, ids, ids).bit_identical, label


def test_compiled_fp8_linears_give_the_eager_gradients_and_replay_bit_identically() -> None:
    torch.manual_seed(0)
    compiled = remat.models.build("llama3_tiny", dtype=torch.bfloat16, **DROPOUT)
    to_fp8(compiled, FP8, compile_backend="aot_eager")
    eager = _model("llama3_tiny", FP8, **DROPOUT)
    ids = _ids(eager)
    grads = []
    for model in (compiled, eager):
        torch.manual_seed(0)
        model(input_ids=ids, labels=ids).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    for label in ("mlp", "core_attn"):
        plan = RecomputeConfig(recompute_granularity="selective", recompute_modules=[label])
        assert remat.verify(compiled, plan, ids, ids).bit_identical, label


def test_a_kept_fp8_input_saves_a_byte_an_element_less_and_its_scale() -> None:
    """Per token and layer: linear_qkv's and linear_fc1's inputs (hidden) and linear_fc2's (ffn)
    drop to one byte; linear_proj's input is kept in bf16 by attention anyway, so its FP8 copy adds
    one; each kept FP8 input adds its 4-byte scale."""
    from remat.memory import measure_saved

    shape = {"seq_length": 64}
    ids = torch.randint(0, 256, (2, 64))
    saved = []
    for precision in (FP8, TORCHAO):
        model = _model("llama3_tiny", precision, **shape)
        saved.append(measure_saved(lambda m=model: m(input_ids=ids, labels=ids))[1].bytes)
    c = remat.models.recipe_config("llama3_tiny", **shape)
    tokens = ids.numel()
    assert saved[1] - saved[0] == c.num_layers * (tokens * (c.hidden_size + c.ffn_hidden_size) - 4 * 4)


def test_the_timeline_attributes_the_kept_fp8_inputs_and_none_without_fp8(tmp_path: Path) -> None:
    """At the end of the forward each FP8 linear holds its input in FP8 (linear_qkv, linear_proj
    and linear_fc1 a hidden's width, linear_fc2 the FFN's), a byte an element: the FP8 bytes
    `remat doctor --timeline` draws and names."""
    from remat.bench.plot import timeline_plot
    from remat.memory.timeline import timeline

    ids = _ids(_model("llama3_tiny"))
    found = {}
    for precision in (FP8, Precision("bf16")):
        model = _model("llama3_tiny", precision, seq_length=32)
        found[precision.compute_dtype] = timeline(model, (ids, ids))
    fp8 = found["fp8_cs"]
    head = dict((name, i) for i, name in fp8.marks)["head"]
    c = remat.models.recipe_config("llama3_tiny")
    assert fp8.fp8 is not None and fp8.fp8[head] == c.num_layers * ids.numel() * (3 * c.hidden_size + c.ffn_hidden_size)
    assert fp8.fp8_at_peak() == fp8.fp8[fp8.allocated.index(max(fp8.allocated))] > 0
    assert found["bf16"].fp8_at_peak() == 0
    assert timeline_plot(fp8, tmp_path / "fp8.png").read_bytes()[:4] == b"\x89PNG"


def test_only_the_layers_linears_turn_fp8_and_the_state_dict_stays_a_linears() -> None:
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert to_fp8(model, FP8) == 4 * len(layer_modules(model))  # qkv, proj, fc1, fc2
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    # the embedding and the output head stay bf16 modules
    assert _fp8_linears(model) == sum(_fp8_linears(layer) for layer in layer_modules(model))
    assert {type(m).__name__ for layer in layer_modules(model) for m in layer.modules()} >= {"Fp8Linear"}
    assert to_fp8(model, Precision("bf16")) == 0


def test_the_moe_experts_stay_bf16_and_say_so_routers_stay_high_precision() -> None:
    torch.manual_seed(0)
    model = remat.models.build("moe_tiny", dtype=torch.bfloat16)
    with pytest.warns(remat.RematWarning, match="grouped GEMMs run in bf16"):
        to_fp8(model, FP8)
    names = [n for n, m in model.named_modules() if _fp8_linears(m) and not list(m.children())]
    assert names and not any(n.rpartition(".")[2] in ("router", "gate") for n in names)


def test_first_and_last_layers_stay_bf16_by_megatrons_counts() -> None:
    precision = Precision(
        "fp8_cs", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2
    )
    assert precision.bf16_layers(6) == {0, 4, 5} and precision.bf16_layers(2) == {0, 1}
    assert Precision("fp8_cs").bf16_layers(6) == frozenset()
    torch.manual_seed(0)
    model = remat.models.build("llama3_tiny", dtype=torch.bfloat16)
    to_fp8(model, precision)
    assert [_fp8_linears(layer) for layer in layer_modules(model)] == [0, 4, 0, 0]
    # a pipeline stage holding layers 2-3 of 8 keeps its layers in FP8 (their numbers, not its own)
    stage = remat.models.build("llama3_tiny", dtype=torch.bfloat16, num_layers=2)
    to_fp8(stage, precision, layers=[2, 3], num_layers=8)
    assert [_fp8_linears(layer) for layer in layer_modules(stage)] == [4, 4]


@pytest.mark.slow
def test_an_adapted_hf_model_turns_fp8_and_saves_loads_and_moves_as_before(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    keys = list(model.state_dict())
    remat.adapt(model)
    assert to_fp8(model, FP8) == 2 * 7  # q, k, v, o, gate, up, down
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    model.to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    for label in _labels(model):
        plan = RecomputeConfig(recompute_granularity="selective", recompute_modules=[label])
        assert remat.verify(model, plan, ids, ids).bit_identical, label


@pytest.mark.slow
def test_the_estimate_on_meta_counts_fp8_bytes_as_the_trace_does() -> None:
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from helpers.estimate import _quiet, _spec

    from remat.estimate.stages import estimate

    shape = {"num_layers": 2, "seq_length": 32}
    plans = [("none", None), ("mlp", RecomputeConfig(recompute_granularity="selective", recompute_modules=["mlp"]))]
    estimates = _quiet(estimate, _spec(overrides=shape, precision=FP8), plans)
    model = _model("llama3_tiny", **shape)
    ids = torch.randint(0, model.config.vocab_size, (2, 33))
    traced = _quiet(remat.trace, model, (ids[:, :-1], ids[:, 1:].contiguous()), timing_repeats=1)
    bf16 = _quiet(estimate, _spec(overrides=shape, precision=Precision("bf16")), plans)
    for (name, plan), est in zip(plans, estimates):
        predicted = _quiet(traced.predict, plan)
        (stage,) = est.stages
        assert stage.activations == predicted.saved_bytes, name
    # the linears keep FP8 inputs: without recompute, less than bf16 keeps (under `mlp`, the MLP's
    # are not kept in either, and the attention's kept FP8 copies add their scales)
    assert estimates[0].stages[0].activations < bf16[0].stages[0].activations


@pytest.mark.parametrize(
    ("precision", "field", "says"),
    [
        (Precision("fp8_mx"), "compute_dtype", "needs Blackwell tensor cores"),
        (Precision("nvfp4"), "compute_dtype", "needs Blackwell tensor cores"),
        (Precision("fp8_sc"), "compute_dtype", "torchao prototype"),
        (Precision("fp8"), "compute_dtype", "not a compute dtype (did you mean 'fp8_cs'?)"),
        (Precision("fp8_cs", fp8_recipe="delayed"), "fp8_recipe", "amax history"),
        (Precision("fp8_cs", fp8_recipe="blockwise"), "fp8_recipe", "prototype"),
        (Precision("fp8_cs", fp8_recipe="mxfp8"), "fp8_recipe", "fp8_mx"),
        (Precision("fp8_cs", fp8="e5m2"), "fp8", "e4m3"),
        (Precision("fp32", fp8="hybrid"), "fp8", "add -c fp8_cs"),
        (Precision("fp8_cs", num_layers_at_end_in_bf16=-1), "num_layers_at_end_in_bf16", ">= 0"),
    ],
)
def test_each_refusal_names_its_field_and_reason(precision: Precision, field: str, says: str) -> None:
    problems = list(precision.problems())
    assert [p.field for p in problems] == [field] and says in problems[0].message


def test_what_fp8_runs_and_megatrons_bf16_keys_pass() -> None:
    for ok in (
        Precision("fp8_cs"),
        Precision("fp8_cs", fp8="e4m3", fp8_recipe="rowwise"),
        Precision("bf16", fp8="hybrid"),
    ):
        assert list(ok.problems()) == []
    assert (FP8.fp8_format, FP8.recipe) == ("hybrid", "tensorwise")
    assert (Precision("bf16").fp8_format, Precision("bf16").recipe) == (None, "delayed")


def test_fp8_without_torchao_is_refused_with_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list(fp8_run_problems(FP8, "cpu")) == []
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    (problem,) = fp8_run_problems(FP8, "cpu")
    assert "pip install 'remat[fp8]'" in problem.message
    with pytest.raises(ConfigError, match="torchao"):
        to_fp8(remat.models.build("llama3_tiny", device="meta"), FP8)


def test_the_recipes_format_sets_the_output_gradients_dtype() -> None:
    from remat.run.fp8 import float8_config

    grads = Counter(
        str(float8_config(Precision("fp8_cs", fp8=f)).cast_config_grad_output.target_dtype) for f in ("e4m3", "hybrid")
    )
    assert grads == Counter({"torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1})


@pytest.mark.slow
def test_the_meta_estimate_times_fp8_matmuls_at_twice_the_bf16_rate() -> None:
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from helpers.estimate import _quiet, _spec

    from remat.estimate.stages import estimate
    from remat.memory.flops import FP8_SPEEDUP, TimedFlopCounter

    # the counter: one FP8 matmul counts 1/FP8_SPEEDUP of the same bf16 one
    model = _model("llama3_tiny", num_layers=1)
    linear = next(m for m in model.modules() if type(m).__name__ == "Fp8Linear")
    x = torch.randn(32, linear.in_features, dtype=torch.bfloat16)
    with TimedFlopCounter(display=False) as counter:
        linear(x)
    assert counter.get_total_flops() == 2 * 32 * linear.in_features * linear.out_features
    assert counter.time_flops == counter.get_total_flops() / FP8_SPEEDUP
    # a step: faster than bf16's by the layers' linears' share
    times = [
        _quiet(
            estimate, _spec(overrides={"num_layers": 2, "seq_length": 32}, precision=Precision(p)), [("none", None)]
        )[0]
        .stages[0]
        .micro_batch_time_s
        for p in ("bf16", "fp8_cs")
    ]
    assert times[1] < times[0]


def test_an_fp8_tensor_counts_its_fp8_data_and_scale_not_its_wrapper() -> None:
    """torchao's FP8 tensor wraps FP8 data and a scale; its own storage claims bf16 bytes and
    holds none. A replay's or an offload group's detached copy of it used to count those."""
    from remat.memory import measure_saved
    from remat.run.fp8 import torchao_float8

    float8 = torchao_float8()
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    kept: list[torch.Tensor] = []

    def cast_and_keep() -> None:
        cast = float8.float8_scaling_utils.hp_tensor_to_float8_dynamic(
            x, torch.float8_e4m3fn, float8.float8_training_tensor.LinearMMConfig()
        )
        kept.append(cast.detach())

    _, saved = measure_saved(cast_and_keep)
    assert saved.bytes == 64 * 32 + 4


def test_offload_moves_fp8_inputs_to_host_as_their_parts_and_replays_bit_identically(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kept FP8 input goes to host as its FP8 data (the scale, 4 bytes, stays): what the layer
    offload frees is exactly what it copied, and less than bf16 inputs take."""
    from remat.engine.offload import Offloader
    from remat.sites.apply import offloader_of

    offloaded = {}
    for precision, parts in ((FP8, True), (TORCHAO, True), (FP8, False)):
        if not parts:  # FP8 tensors left on the device, as before they went to host
            monkeypatch.setattr(Offloader, "_pack_parts", lambda self, t: None)
        model = _model("llama3_tiny", precision, **DROPOUT)
        ids = _ids(model, 64)
        offload = RecomputeConfig(cpu_offloading=True, cpu_offloading_num_layers=2, min_offloaded_tensor_size=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            report = remat.verify(model, offload, ids, ids)
        stats = offloader_of(model).stats()
        assert report.bit_identical and report.freed_bytes == stats.offloaded_bytes > 0
        offloaded[precision.fp8_keep_inputs, parts] = stats.offloaded_bytes
    assert offloaded[True, False] < offloaded[True, True] < offloaded[False, True]
