"""Every causal LM family of the installed transformers, from its auto mappings: each decoder-only
family adapted from a tiny config on CPU in float64, every placed label bit-identical and freeing
bytes, full recompute bit-identical, the chunked loss head equal to HF's loss or refused by name,
the layouts remat's checks accept, and the command line (`verify`, `bench -d`, `estimate`).

The rows make docs/hf-support.md; `python tests/integration/test_hf_families.py [FAMILY ...]` writes
it again, whole or the rows named (after a transformers upgrade, or a change to the adapter)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a script: the helpers are beside this folder
    sys.path.insert(0, str(Path(__file__).parents[1]))
pytest.importorskip("transformers")

from helpers.hf_families import check  # noqa: E402

from remat.models.hf import catalog  # noqa: E402

TABLE = Path(__file__).parents[2] / "docs" / "hf-support.md"
# Adapted families whose command-line runs (verify, bench -d, estimate) still end in an error: the
# first that fails and its last line, checked to fail so (a family that starts to run is taken off).
CLI_OPEN: dict[str, str] = {
    "aria_text": "`remat verify`: RuntimeError: Expected inputs of BF16 type but got mat_a.dtype=torch.float64 and mat_b.dtype=torch.float64.",
    "bamba": "`remat estimate`: KeyError: 'bwd1'",
    "biogpt": "`remat verify`: RuntimeError: Tensor.item() cannot be called on meta tensors",
    "bloom": "`remat estimate`: KeyError: 'bwd1'",
    "cpmant": "`remat verify`: RuntimeError: view size is not compatible with input tensor's size and stride (at least one dimension spans across two contiguous subspaces). Use .reshape(...) ",
    "diffllama": "`remat verify`: NotImplementedError: Cannot copy out of meta tensor; no data!",
    "falcon": "`remat estimate`: KeyError: 'bwd1'",
    "falcon_h1": "`remat estimate`: KeyError: 'bwd1'",
    "falcon_mamba": "`remat verify`: AttributeError: 'FalconMambaConfig' object has no attribute 'num_attention_heads'",
    "gemma4_text": "`remat verify`: AttributeError: 'Gemma4TextConfig' object has no attribute 'num_experts_per_tok'",
    "gemma4_unified_text": "`remat verify`: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer attribute and may vary across layers. Access it via the individual layer configs instead (e.g. ",
    "glm_moe_dsa": "`remat estimate`: KeyError: 'bwd1'",
    "gpt_neo": "`remat estimate`: KeyError: 'bwd1'",
    "gpt_neox_japanese": "`remat estimate`: KeyError: 'bwd1'",
    "hrm_text": "`remat verify`: --num_layers: is 16 but the model has 4 layers; set num_layers=4 (--num_layers 4) or leave it unset",
    "hy_v4": "`remat estimate`: KeyError: 'bwd1'",
    "inkling_text": "`remat verify`: RuntimeError: The function '_scaled_dot_product_flash_attention_for_cpu' is not differentiable with respect to argument 'attn_mask'. This input cannot have requ",
    "jetmoe": "`remat verify`: NotImplementedError: Cannot copy out of meta tensor; no data!",
    "kolibri1_1": "`remat verify`: NotImplementedError: aten::_unique2: attempted to run this operator with Meta tensors, but there was no fake impl or Meta kernel registered. You may have run in",
    "llama4_text": "`remat estimate`: error: Llama4ForCausalLM does not support setting experts implementation.",
    "longcat_flash": "`remat verify`: --num_layers: is 56 but the model has 28 layers; set num_layers=28 (--num_layers 28) or leave it unset",
    "mamba": "`remat verify`: AttributeError: 'MambaConfig' object has no attribute 'num_attention_heads'",
    "mamba2": "`remat verify`: AttributeError: 'Mamba2Config' object has no attribute 'num_attention_heads'",
    "mpt": "`remat estimate`: KeyError: 'bwd1'",
    "openai-gpt": "`remat estimate`: KeyError: 'bwd1'",
    "rwkv": "`remat verify`: AttributeError: 'RwkvConfig' object has no attribute 'num_attention_heads'",
    "trocr": "`remat verify`: RuntimeError: view size is not compatible with input tensor's size and stride (at least one dimension spans across two contiguous subspaces). Use .reshape(...) ",
    "xlstm": "`remat verify`: AttributeError: 'xLSTMConfig' object has no attribute 'num_attention_heads'",
    "zaya": "`remat estimate`: KeyError: 'bwd1'",
}
TARGET = 0.9  # of the decoder-only families adapt with every placed site effective
HEADER = (
    "| family | labels (bit-identical, freeing memory) | full recompute | loss head | layouts remat's checks accept |"
)


def _adapts(line: str) -> bool:
    """A table row of a family that adapts with every placed site effective (and at least one)."""
    labels = line.split("|")[2].strip()
    return bool(labels) and not labels.startswith("refused:") and "**" not in line


def document(lines: dict[str, str]) -> str:
    """The page, from each decoder-only family's row."""
    import transformers

    adapted = sum(map(_adapts, lines.values()))
    others = [f"| {t} | {catalog.scope(t)} |" for t in catalog.causal_lm_types() if catalog.scope(t)]
    return "\n".join(
        [
            "# Hugging Face support",
            "",
            f"What `remat.adapt` does with each causal LM family of transformers {transformers.__version__},"
            " enumerated from its auto mappings and checked on CPU from a tiny config (2 layers, float64) by"
            " `tests/integration/test_hf_families.py`, which also writes this page. A label is listed where"
            " its Site gives gradients bit-identical to the run without recompute and frees memory; a bold"
            " entry is one that does not. Layouts: the model-parallel sizes remat's checks accept for the"
            " family (run on gloo for the families of `tests/integration/test_hf_runs.py`).",
            "",
            f"{adapted} of {len(lines)} decoder-only families adapt with every placed site effective.",
            "",
            HEADER,
            "|---|---|---|---|---|",
            *lines.values(),
            "",
            "## Command line",
            "",
            f"`remat verify`, `bench -d` and `estimate` on `-mr hf:FAMILY` run on {adapted - len(CLI_OPEN)} of the"
            f" {adapted} families above; on these {len(CLI_OPEN)} the first that fails ends so (Python's"
            " `remat.adapt`, `apply` and `verify` work on them, as the table says):",
            "",
            "| family | first error |",
            "|---|---|",
            *(f"| {family} | {error} |" for family, error in sorted(CLI_OPEN.items())),
            "",
            "## Not decoder-only",
            "",
            "| family | why remat leaves it |",
            "|---|---|",
            *others,
            "",
        ]
    )


def _documented() -> dict[str, str]:
    lines = TABLE.read_text().splitlines() if TABLE.exists() else []
    rows = {m.group(1): line for line in lines if (m := re.match(r"\| (\S+) \|", line)) and line.count("|") == 6}
    rows.pop("family", None)  # the header
    return rows


FAMILIES = catalog.decoder_families()


def test_the_table_lists_every_decoder_only_family_and_meets_the_target() -> None:
    documented = _documented()
    assert sorted(documented) == sorted(FAMILIES), "run python tests/integration/test_hf_families.py"
    adapted = sum(map(_adapts, documented.values()))
    assert adapted >= TARGET * len(FAMILIES), f"{adapted} of {len(FAMILIES)}"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_does_what_the_table_says(family: str) -> None:
    row = check(family)
    assert row.line() == _documented()[family]
    if not row.refused:
        assert row.full


@pytest.mark.parametrize("family", [f for f, line in _documented().items() if _adapts(line)])
def test_the_command_line_runs_each_adapted_family(family: str, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    model = ["-mr", f"hf:{family}", "-sl", "16"]
    for argv in (
        ["verify", *model, "-rl", "1", "--recompute_method", "uniform"],
        ["bench", "-d", "--no_history", "--no_progress", *model],
        ["estimate", *model, "--no_progress"],
    ):
        try:
            code = main(argv)
        except Exception as err:  # an error the command does not catch yet (CLI_OPEN)
            code, message = -1, f"{type(err).__name__}: {err}"
        else:
            message = capsys.readouterr().err
        if family in CLI_OPEN and code != 0:
            command, error = CLI_OPEN[family].split(": ", 1)
            assert command == f"`remat {argv[0]}`" and error[:60] in message, (argv, message[-2000:])
            return
        assert code == 0, (argv, message[-2000:])
    assert family not in CLI_OPEN, f"{family} runs now: take it off CLI_OPEN"


if __name__ == "__main__":  # the whole page, or the rows of the families named
    from concurrent.futures import ProcessPoolExecutor

    rows = _documented()
    with ProcessPoolExecutor() as pool:
        rows.update((row.family, row.line()) for row in pool.map(check, sys.argv[1:] or FAMILIES))
    TABLE.write_text(document({f: rows[f] for f in FAMILIES if f in rows}))
    print(f"wrote {TABLE}")
