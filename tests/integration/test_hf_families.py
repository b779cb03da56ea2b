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
# Adapted families whose step reads tensor values (a mask's .item(), routing counts, torch.unique):
# `remat estimate`, which runs shapes only on the meta device, refuses them by name; verify and bench
# run them without the host-memory check (which predicts on meta), and say so.
ESTIMATE_REFUSED = ("biogpt", "diffllama", "jetmoe", "kolibri1_1")
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
            f"`remat verify`, `bench -d` and `estimate` on `-mr hf:FAMILY` exit 0 on each of the {adapted}"
            f" families above, but for `estimate` on {len(ESTIMATE_REFUSED)} ({', '.join(ESTIMATE_REFUSED)}):"
            " their step reads tensor values (a mask's `.item()`, routing counts, `torch.unique`), which the"
            " meta device's shapes-only run lacks, and `estimate` refuses them by name; `verify` and `bench`"
            " run them without the host-memory check (predicted on meta) and say so.",
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
        code = main(argv)
        message = capsys.readouterr().err
        if family in ESTIMATE_REFUSED and argv[0] == "estimate":
            assert code == 1 and "step reads tensor values" in message, message[-2000:]
            continue
        assert code == 0, (argv, message[-2000:])


if __name__ == "__main__":  # the whole page, or the rows of the families named
    from concurrent.futures import ProcessPoolExecutor

    rows = _documented()
    with ProcessPoolExecutor() as pool:
        rows.update((row.family, row.line()) for row in pool.map(check, sys.argv[1:] or FAMILIES))
    TABLE.write_text(document({f: rows[f] for f in FAMILIES if f in rows}))
    print(f"wrote {TABLE}")
