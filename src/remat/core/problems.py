"""Problems with what a user gave remat, reported all at once, each naming what to change.

Every check in remat is a small function yielding `Problem`s; whoever runs the checks raises one
`ConfigError` holding all of them. Advice (valid, but probably not what was meant) goes out as a
`RematWarning` through `advise`.
"""

from __future__ import annotations

import difflib
import json
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

_PACKAGE = str(Path(__file__).parents[1])  # remat/, from remat/core/problems.py


class RematWarning(UserWarning):
    """Advice about a configuration that is valid but probably not what was meant."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the setting at fault, what is wrong and what to change."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ConfigError(ValueError):
    """Every problem found, raised together."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def raise_if_any(problems: Iterable[Problem]) -> None:
    """ConfigError with every problem (each once, in order), if there is one."""
    found = list(dict.fromkeys(problems))
    if found:
        raise ConfigError(found)


def warn(message: str) -> None:
    """A RematWarning pointing at the first caller outside remat (dataclass __init__s are "<string>")."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and (
        frame.f_code.co_filename.startswith(_PACKAGE) or frame.f_code.co_filename == "<string>"
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RematWarning, stacklevel=level)


def advise(problems: Iterable[Problem]) -> None:
    """Each problem as a RematWarning: advice, not an error."""
    for problem in problems:
        warn(str(problem))


def not_an_option(name: str, value: str, choices: Sequence[str]) -> Problem:
    """`value` of setting `name` is none of `choices`."""
    return Problem(name, f"{value!r} is not an option{did_you_mean(value, choices)}; use one of {one_of(choices)}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 layer', '4 layers': a number with its noun agreeing."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def one_of(choices: Iterable[str]) -> str:
    return ", ".join(repr(c) for c in choices)


def read_file(path: Path, parse: Callable[[bytes], Any], kind: str) -> Any:
    """parse(the file's bytes); ConfigError naming the file when it cannot be read or parsed."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError([Problem(str(path), f"cannot read the file ({err}); check the path")]) from None
    try:
        return parse(raw)
    except Exception as err:  # whatever the parser raises, the file is not what it should be
        raise ConfigError([Problem(str(path), f"is not valid {kind} ({err}); check the file")]) from None


def load_mapping(path: Path) -> Mapping[str, Any]:
    """The top-level mapping of a YAML or JSON file; ConfigError saying what is wrong otherwise."""
    kind = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}.get(path.suffix.lower())
    if kind is None:
        raise ConfigError([Problem(str(path), "unsupported file type; use a .yaml, .yml or .json file")])
    data = read_file(path, json.loads if kind == "JSON" else yaml.safe_load, kind)
    if not isinstance(data, Mapping):
        raise ConfigError(
            [
                Problem(
                    str(path),
                    "must hold a mapping at the top level, e.g. 'recompute_granularity: selective' or 'remat_plan: 1'",
                )
            ]
        )
    return data
