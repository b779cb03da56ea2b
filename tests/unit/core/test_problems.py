"""remat.core.problems: every problem at once, advice pointed at the user's line, files read safely."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from remat.core.problems import (
    ConfigError,
    Problem,
    RematWarning,
    advise,
    count,
    did_you_mean,
    load_mapping,
    not_an_option,
    raise_if_any,
)

A, B = Problem("a", "first"), Problem("b", "second")


def test_raise_if_any_raises_every_problem_once_in_order() -> None:
    with pytest.raises(ConfigError) as caught:
        raise_if_any([A, B, A])
    assert caught.value.problems == [A, B]
    assert str(caught.value) == "a: first\nb: second"


def test_raise_if_any_is_quiet_without_problems() -> None:
    raise_if_any(iter([]))


def test_advice_points_at_the_line_outside_remat() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        advise([A, B])
    assert [str(w.message) for w in caught] == ["a: first", "b: second"]
    assert {w.category for w in caught} == {RematWarning}
    assert {w.filename for w in caught} == {__file__}


def test_a_bad_option_names_the_nearest_and_every_choice() -> None:
    problem = not_an_option("method", "unifrom", ("uniform", "block"))
    assert problem == Problem(
        "method", "'unifrom' is not an option (did you mean 'uniform'?); use one of 'uniform', 'block'"
    )
    assert did_you_mean("zzz", ("uniform", "block")) == ""


@pytest.mark.parametrize("n, text", [(1, "1 layer"), (0, "0 layers"), (4096, "4,096 layers")])
def test_count_agrees_with_its_number(n, text) -> None:
    assert count(n, "layer") == text
    assert count(2, "copy", "copies") == "2 copies"


def test_load_mapping_reads_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("recompute_granularity: selective\n")
    (tmp_path / "c.json").write_text('{"recompute_granularity": "full"}')
    assert load_mapping(tmp_path / "c.yaml") == {"recompute_granularity": "selective"}
    assert load_mapping(tmp_path / "c.json") == {"recompute_granularity": "full"}


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("c.toml", "x = 1", "unsupported file type; use a .yaml, .yml or .json file"),
        ("c.yaml", "- a\n- b\n", "must hold a mapping at the top level"),
        ("c.yaml", "a: [", "is not valid YAML"),
        ("c.json", "{", "is not valid JSON"),
        ("c.yml", b"\xff\xfe\x00", "is not valid YAML"),
        ("missing.yaml", None, "cannot read the file"),
    ],
)
def test_load_mapping_says_what_is_wrong_with_the_file(tmp_path: Path, name, content, message) -> None:
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as caught:
        load_mapping(path)
    assert [p.field for p in caught.value.problems] == [str(path)]
