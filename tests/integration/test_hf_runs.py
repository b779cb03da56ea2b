"""remat on Hugging Face transformers models (small configs, no download), the sweeps and the
commands: every label and full recompute bit-identical to the unmodified model in float64 with
dropout on, for every family; the trace's saved bytes against what saved-tensor hooks find and
what each plan leaves allocated (full recompute's groups overcount the shared position_ids by a
known amount); the meta estimate equal to the CPU trace; `remat bench` and `remat verify` on a
transformers model.

The quick tests of the same code: tests/unit/models/test_hf.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.hf import LABELS, LAYERS, SEQ, batch, build, full, selective

import remat  # noqa: E402
from remat.config.precision import Precision  # noqa: E402
from remat.config.recompute import RecomputeConfig  # noqa: E402
from remat.run.verify import run_step, verify  # noqa: E402

CASES = [(family, selective(label)) for family, labels in LABELS.items() for label in labels] + [
    (family, config)
    for family in LABELS
    for config in (full("uniform", 1), full("block", 2), selective(*LABELS[family]))
]


def _case_id(case) -> str:
    family, c = case
    what = (
        ",".join(c.recompute_modules)
        if c.recompute_granularity == "selective"
        else f"{c.recompute_method}{c.recompute_num_layers}"
    )
    return f"{family}-{what}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_every_label_and_full_recompute_is_bit_identical_with_dropout(case) -> None:
    family, config = case
    model = build(family)
    model.config.use_cache = False  # as remat (and HF's own checkpointing) run training
    plain = run_step(model, *batch(model), seed=5)
    remat.adapt(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)  # core_attn on SDPA saves little: said, not wrong
        report = verify(model, config, *batch(model), seed=5)
    assert report.bit_identical, report.max_grad_diff
    assert torch.equal(plain.loss, report.candidate.loss)
    assert plain.grads.keys() == report.candidate.grads.keys()
    assert all(torch.equal(plain.grads[n], g) for n, g in report.candidate.grads.items())


def test_remat_bench_runs_a_transformers_model_from_a_config(capsys) -> None:
    from remat.cli import main

    code = main(
        [
            "bench",
            "-m",
            "hf",
            "--hf_config",
            "qwen3_moe",
            "--num_layers",
            "2",
            "-sl",
            "16",
            "-ms",
            "2",
            "--warmup_steps",
            "1",
            "--recompute_modules",
            "moe",
            "--no_history",
            "--no_progress",
            "--device",
            "cpu",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "moe" in out and "ok" in out


def _trace(model: torch.nn.Module) -> remat.Trace:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        return remat.trace(model, batch(model), timing_repeats=1)


# DeepSeek-V3 (7 labels) traces for minutes on CI's two cores; its sites are checked on CUDA
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_trace_predicts_the_bytes_saved_tensors_hooks_find(family) -> None:
    """Storages the forward saved for backward, still alive when it returns (a router's dropped
    branch saves and frees), besides weights and the batch; plus the loss."""
    import gc
    import weakref

    model = remat.adapt(build(family))
    trace = _trace(model)
    ids, labels = batch(model)
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), ids, labels]}
    packed: list[weakref.ref] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(weakref.ref(t)) or t, lambda t: t):
        loss = model(ids, labels=labels).loss
    gc.collect()
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for ref in packed if (t := ref()) is not None}
    counted = sum(n for ptr, n in alive.items() if ptr not in held) + loss.untyped_storage().nbytes()
    assert trace.predict(None).saved_bytes == counted


@pytest.mark.parametrize("family", ["llama", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_trace_predicts_what_each_plan_leaves_allocated(family) -> None:
    from helpers.trace import _held_by_ops

    model = remat.adapt(build(family))
    trace = _trace(model)
    ids, labels = batch(model)

    def counted(plan: RecomputeConfig) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            remat.apply(model, plan)
        model.zero_grad(set_to_none=True)
        loss, held = _held_by_ops(lambda: model(ids, labels=labels).loss)
        loss.backward()
        return held

    for label in LABELS[family]:
        assert trace.predict(selective(label)).saved_bytes == counted(selective(label)), label
    assert trace.predict(selective(*LABELS[family])).saved_bytes == counted(selective(*LABELS[family]))
    # Known overcount: each full-recompute group keeps the decoder layers' shared position_ids
    # (int64 [1, seq]) as an input, and the trace, measuring one layer, books it once per group.
    position_ids = SEQ * 8
    assert trace.predict(full("uniform", 1)).saved_bytes - counted(full("uniform", 1)) == (LAYERS - 1) * position_ids


@pytest.mark.parametrize("family", ["llama", "gpt2", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_estimate_on_meta_agrees_exactly_with_the_trace_on_cpu(family) -> None:
    from remat.estimate.spec import EstimateSpec
    from remat.estimate.stages import estimate

    overrides, mb = {"num_layers": 2, "seq_length": 32}, 2
    # torch's grouped GEMM on meta takes bf16 only: MoE families are estimated (and traced) in bf16
    dtype = "bf16" if family in ("mixtral", "deepseek_v3") else "fp32"
    plans = [("none", None), ("all", selective(*LABELS[family])), ("full", full("uniform", 1))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", remat.RematWarning)
        estimates = estimate(
            EstimateSpec(
                recipe=f"hf:{family}",
                overrides=overrides,
                micro_batch_size=mb,
                optimizer=False,
                precision=Precision(dtype),
                device="cpu",
            ),
            plans,
        )
        torch.manual_seed(0)
        model = remat.models.build(f"hf:{family}", dtype=Precision(dtype).dtype, **overrides)
        ids = torch.randint(0, model.config.vocab_size, (mb, 32))
        traced = remat.trace(model, (ids, ids.clone()), timing_repeats=1)
        for (name, plan), est in zip(plans, estimates):
            predicted = traced.predict(plan)
            (stage,) = est.stages
            assert (stage.activations, stage.peak, stage.peak_window) == (
                predicted.saved_bytes,
                predicted.peak_bytes,
                predicted.peak_window,
            ), name


def test_remat_verify_takes_moe_labels_on_a_transformers_model(capsys) -> None:
    """The config's facts (grouped GEMM experts) come from the model."""
    from remat.cli import main

    code = main(
        [
            "verify",
            "-m",
            "hf",
            "--hf_config",
            "deepseek_v3",
            "--num_layers",
            "2",
            "-sl",
            "16",
            "--recompute_modules",
            "moe_act,shared_experts",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "bit-identical: True" in out
