"""The support table: refused where the code refuses, every piece of evidence it names exists, and
the README holds the table the code makes."""

from __future__ import annotations

import re
from pathlib import Path

from remat.bench import support

ROOT = Path(__file__).resolve().parents[1]


while not (ROOT / "pyproject.toml").exists():  # the repository, wherever the tests sit in it
    ROOT = ROOT.parent


MARKER = "<!-- support table -->"


def _missing(evidence: str) -> bool:
    """Whether a piece of evidence is absent: a results file, or a test ("module::function") under tests/."""
    if "::" not in evidence:
        return not (ROOT / evidence).is_file()
    module, function = evidence.split("::")
    return not any(f"def {function}(" in path.read_text() for path in (ROOT / "tests").rglob(f"{module}.py"))


def test_every_piece_of_evidence_exists() -> None:
    named = [e for table in (support.EVIDENCE, support.FP8_EVIDENCE) for pieces in table.values() for _, e in pieces]
    assert [e for e in named if _missing(e)] == []
    assert _missing("test_support::test_that_is_not_here") and _missing("benchmarks/results/none.json")


def test_no_cell_that_runs_is_left_without_evidence_but_the_factory_under_fsdp2_and_in_fp8() -> None:
    untested = [(c.family, c.layout, c.precision) for c in support.cells() if c.status == "untested"]
    assert [cell for cell in untested if cell[2] == "bf16"] == [("module", "FSDP2", "bf16")]
    # FP8: every layout of remat's own families and of Hugging Face models checked on gloo
    assert [cell for cell in untested if cell[2] == "fp8_cs"] == [("module", "FSDP2", "fp8_cs")]


def test_refusals_are_the_code_s_and_evidence_is_only_where_it_runs() -> None:
    cells = {(c.family, c.layout, c.precision): c for c in support.cells()}
    assert {k for k, c in cells.items() if c.refused and k[2] == "bf16"} == {
        ("llama", "EP", "bf16"),
        ("hf", "EP", "bf16"),
        *(("module", layout, "bf16") for layout in ("TP", "TP+SP", "PP", "PP+VP", "CP", "EP")),
    }
    # FP8 refuses what bf16 refuses, no more
    refused_in = {
        p: {(f, layout) for (f, layout, q), c in cells.items() if c.refused and q == p} for p in ("bf16", "fp8_cs")
    }
    assert refused_in["fp8_cs"] == refused_in["bf16"]
    refused = cells[("llama", "EP", "bf16")].refused
    assert [p.field for p in refused] == ["expert_model_parallel_size"]
    assert not any(support.refusals(family, support.LAYOUTS[layout], "bf16") for family, layout in support.EVIDENCE)


def test_the_readme_holds_the_table_the_code_makes() -> None:
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "the README's support section has lost its marker"
    after = text.split(MARKER, 1)[1].lstrip("\n")
    table = "\n".join(re.match(r"((?:\|.*\|\n?)+)", after).group(1).strip().splitlines())  # type: ignore[union-attr]
    assert table == support.markdown(), "run `remat support --markdown` and paste the table under the marker"


def test_the_readme_stays_a_guide_of_at_most_15_kb() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 15 * 1024, "measurements go to benchmarks/README.md"
