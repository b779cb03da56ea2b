"""What remat runs where: each model family under each parallel layout and precision. A cell is
`refused` where the code refuses it (asked of the family, its plan for a built model, the layout
and the precision themselves, as a run asks them), otherwise it names where it is checked: `CPU`
(one process, tests), `gloo` (CPU processes under torchrun, tests), `GPU` (measured on one GPU,
benchmarks/results), `NCCL` (measured on several). `remat support` prints the table; the README
holds it, and a test checks both it and every piece of evidence named here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from remat import models
from remat.config.parallel import ParallelLayout
from remat.config.precision import Precision
from remat.core.problems import ConfigError, Problem
from remat.run.fp8 import fp8_run_problems
from remat.run.spec import parallel_meta_model

# A representative recipe of each family (None: a factory's, which needs a model of the user's).
FAMILIES: dict[str, str | None] = {"llama": "llama3_tiny", "moe": "moe_tiny", "hf": "hf:llama", "module": None}
LAYOUTS: dict[str, ParallelLayout] = {
    "1 device": ParallelLayout(),
    "FSDP2": ParallelLayout(num_gpus=2),
    "TP": ParallelLayout(tp=2),
    "TP+SP": ParallelLayout(tp=2, sp=True),
    "PP": ParallelLayout(pp=2),
    "PP+VP": ParallelLayout(pp=2, vp=2),
    "CP": ParallelLayout(cp=2),
    "EP": ParallelLayout(ep=2, num_gpus=2),
}
PRECISIONS: tuple[str, ...] = ("bf16", "fp8_cs")
# the shape each family's cells are judged on: no dropout (context parallelism refuses attention
# dropout by name, as a property of the run rather than of the family)
SHAPE: dict[str, dict[str, float]] = {
    "llama": {"attention_dropout": 0.0, "hidden_dropout": 0.0},
    "moe": {"attention_dropout": 0.0, "hidden_dropout": 0.0},
    "hf": {"attention_dropout": 0.0},
}

# Where each cell that runs is checked: (kind, evidence), the evidence a test ("module::test") or a
# results file. A bf16 cell is checked in fp32/fp64 on CPU; the dtype does not change the layout.
EVIDENCE: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("llama", "1 device"): (
        ("CPU", "test_apply::test_every_config_is_bit_identical_to_no_recompute"),
        ("GPU", "benchmarks/results/w1_h200.json"),
    ),
    ("llama", "FSDP2"): (
        ("gloo", "test_parallel_runs::test_every_plan_under_fsdp2_is_bit_identical_to_fsdp2_without_recompute"),
    ),
    ("llama", "TP"): (
        (
            "gloo",
            "test_tensor_parallel_runs::test_every_plan_under_tensor_parallelism_is_bit_identical_to_it_without_recompute",
        ),
    ),
    ("llama", "TP+SP"): (
        (
            "gloo",
            "test_tensor_parallel_runs::test_every_plan_under_tensor_parallelism_is_bit_identical_to_it_without_recompute",
        ),
    ),
    ("llama", "PP"): (("gloo", "test_pipeline_runs::test_a_pipeline_step_is_the_whole_models_step_bit_for_bit"),),
    ("llama", "PP+VP"): (("gloo", "test_pipeline_runs::test_a_pipeline_step_is_the_whole_models_step_bit_for_bit"),),
    ("llama", "CP"): (
        ("gloo", "test_context_parallel_runs::test_every_plan_under_context_parallelism_is_bit_identical_to_none"),
    ),
    ("moe", "1 device"): (
        ("CPU", "test_moe_runs::test_every_label_combination_and_full_recompute_is_bit_identical_with_dropout"),
        ("GPU", "benchmarks/results/moe_slices_qwen3_h100.json"),
    ),
    ("moe", "FSDP2"): (
        (
            "gloo",
            "test_moe_parallel_runs::test_the_expert_bias_stays_the_same_on_every_data_parallel_rank_and_as_one_process",
        ),
    ),
    ("moe", "TP"): (
        ("gloo", "test_tensor_parallel_models_runs::test_every_plan_is_bit_identical_to_the_split_without_recompute"),
    ),
    ("moe", "TP+SP"): (
        ("gloo", "test_tensor_parallel_models_runs::test_every_plan_is_bit_identical_to_the_split_without_recompute"),
    ),
    ("moe", "PP"): (
        ("gloo", "test_moe_parallel_runs::test_a_pipelined_moe_step_is_the_whole_models_step_bit_for_bit"),
    ),
    ("moe", "PP+VP"): (
        ("gloo", "test_moe_parallel_runs::test_a_pipelined_moe_step_is_the_whole_models_step_bit_for_bit"),
    ),
    ("moe", "CP"): (
        ("gloo", "test_context_parallel_runs::test_every_moe_plan_under_context_parallelism_is_bit_identical_to_none"),
    ),
    ("moe", "EP"): (
        (
            "gloo",
            "test_expert_parallel_runs::test_every_plan_under_expert_parallelism_is_bit_identical_to_it_without_recompute",
        ),
    ),
    ("hf", "1 device"): (
        ("CPU", "test_adapt_runs::test_every_plan_on_an_adapted_model_is_bit_identical_to_the_unmodified_model"),
        ("GPU", "benchmarks/results/hf_llama_h100.json"),
    ),
    ("hf", "FSDP2"): (
        ("gloo", "test_hf_pipeline_runs::test_a_tied_embedding_on_stages_sharded_by_fsdp2_matches_one_process"),
    ),
    ("hf", "TP"): (
        (
            "gloo",
            "test_hf_tensor_parallel_runs::test_every_plan_on_a_split_hf_model_is_bit_identical_to_it_without_recompute",
        ),
    ),
    ("hf", "TP+SP"): (
        (
            "gloo",
            "test_hf_tensor_parallel_runs::test_every_plan_on_a_split_hf_model_is_bit_identical_to_it_without_recompute",
        ),
    ),
    ("hf", "PP"): (
        ("gloo", "test_hf_pipeline_runs::test_every_plan_on_hf_stages_with_dropout_is_bit_identical_to_none"),
    ),
    ("hf", "PP+VP"): (
        ("gloo", "test_hf_pipeline_runs::test_every_plan_on_hf_stages_with_dropout_is_bit_identical_to_none"),
    ),
    ("hf", "CP"): (
        ("gloo", "test_hf_context_parallel_runs::test_every_plan_under_context_parallelism_is_bit_identical_to_none"),
    ),
    ("module", "1 device"): (("CPU", "test_adapt_runs::test_any_model_runs_through_the_command_line_from_a_factory"),),
}
# FP8 (torchao's float8 linears): replays on one device, and losses beside the other layouts
_FP8_LAYOUTS = "test_layouts_runs::test_fp8_steps_as_one_process_under_every_layout_and_recomputes_bit_identically"
FP8_EVIDENCE: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    **{
        (family, "1 device"): (("CPU", f"test_fp8::{test}"),)
        for family, test in (
            ("llama", "test_every_label_and_full_recompute_replay_fp8_bit_identically"),
            ("moe", "test_every_label_and_full_recompute_replay_fp8_bit_identically"),
            ("hf", "test_an_adapted_hf_model_turns_fp8_and_saves_loads_and_moves_as_before"),
        )
    },
    ("module", "1 device"): (("CPU", "test_adapt_runs::test_a_factory_model_trains_in_fp8_through_the_command_line"),),
    **{
        (family, layout): (("gloo", _FP8_LAYOUTS),)
        for family in ("llama", "moe", "hf")
        for layout in ("FSDP2", "TP", "TP+SP", "PP", "PP+VP", "CP", "EP")
        if not (layout == "EP" and family != "moe")  # expert parallelism: the MoE family's
    },
}


@dataclass(frozen=True)
class Cell:
    family: str
    layout: str
    precision: str
    refused: tuple[Problem, ...]  # why the code refuses it; empty where it runs
    evidence: tuple[tuple[str, str], ...]  # where it is checked, where it runs

    @property
    def status(self) -> str:
        if self.refused:
            return "refused"
        return ", ".join(dict.fromkeys(kind for kind, _ in self.evidence)) or "untested"


def refusals(family_name: str, layout: ParallelLayout, precision: str) -> tuple[Problem, ...]:
    """What the code says against a family's representative model under `layout` in `precision`."""
    family, recipe = models.FAMILIES[family_name], FAMILIES[family_name]
    found = [*layout.problems(), *Precision(precision).compute_problems()]
    found += fp8_run_problems(Precision(precision), "cpu")
    if recipe is None:
        return tuple(found + list(family.layout_problems(None, layout)))
    config = family.config(recipe, **SHAPE[family_name])
    found += family.layout_problems(config, layout)
    if not found:
        found += family.parallelism(parallel_meta_model(family, config, layout), layout).problems()
    return tuple(found)


def _evidence(precision: str) -> dict[tuple[str, str], tuple[tuple[str, str], ...]]:
    return FP8_EVIDENCE if precision == "fp8_cs" else EVIDENCE


def cells() -> Iterator[Cell]:
    """Every family x precision x layout, in table order."""
    for family in FAMILIES:
        for precision in PRECISIONS:
            for name, layout in LAYOUTS.items():
                try:
                    refused = refusals(family, layout, precision)
                except (ConfigError, ValueError) as err:  # a model the family cannot build (transformers missing)
                    refused = tuple(err.problems) if isinstance(err, ConfigError) else (Problem("model", str(err)),)
                yield Cell(
                    family, name, precision, refused, () if refused else _evidence(precision).get((family, name), ())
                )


def markdown() -> str:
    """The table as the README holds it: a row per family and precision, a column per layout."""
    header = ["family", "precision", *LAYOUTS]
    rows = [header, ["---"] * len(header)]
    table: dict[tuple[str, str], list[str]] = {}
    for cell in cells():
        table.setdefault((cell.family, cell.precision), []).append(cell.status)
    rows += [[family, precision, *statuses] for (family, precision), statuses in table.items()]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)
