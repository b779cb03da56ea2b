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
        super().__init__("\n".join([*map(str, self.shown), *self.more]))

    @property
    def shown(self) -> list[Problem]:
        """The problems a message prints in full (SHOWN_PROBLEMS)."""
        return self.problems[:SHOWN_PROBLEMS]

    @property
    def more(self) -> list[str]:
        """A line counting the problems past those shown, if any."""
        rest = len(self.problems) - SHOWN_PROBLEMS
        return [f"... and {count(rest, 'more problem')}"] if rest > 0 else []


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


# A config, plan or site map file is kilobytes; past this it is not one (and parsing it would take
# minutes and gigabytes).
MAX_FILE_BYTES = 4 * 2**20
# Nodes a YAML document may expand to through its aliases: a plan of thousands of layers is far
# below; nine nested aliases of nine ("billion laughs") are a billion.
MAX_YAML_NODES = 1_000_000
# Problems printed in full; the rest are counted.
SHOWN_PROBLEMS = 50


def read_file(path: Path, parse: Callable[[bytes], Any], kind: str, limit: int = MAX_FILE_BYTES) -> Any:
    """parse(the file's bytes); ConfigError naming the file when it cannot be read or parsed, or
    is over `limit` bytes (larger than any file of its kind)."""
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as err:
        raise ConfigError([Problem(str(path), f"cannot read the file ({err}); check the path")]) from None
    if len(raw) > limit:
        raise ConfigError(
            [Problem(str(path), f"is over {limit // 2**20:,} MiB, larger than any {kind} file remat reads")]
        )
    try:
        return parse(raw)
    except Exception as err:  # whatever the parser raises, the file is not what it should be
        raise ConfigError([Problem(str(path), f"is not valid {kind} ({err}); check the file")]) from None


def safe_yaml(text: str | bytes) -> Any:
    """yaml.safe_load, refusing a document whose aliases expand it past MAX_YAML_NODES nodes
    (counted on the node graph before anything is built)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_YAML_NODES:
            raise ValueError(f"its aliases expand it to {size:,} nodes, more than {MAX_YAML_NODES:,}")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes under `node` with every alias expanded; each node counted once (sizes by id)."""
    if id(node) not in sizes:
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


def load_mapping(path: Path) -> Mapping[str, Any]:
    """The top-level mapping of a YAML or JSON file; ConfigError saying what is wrong otherwise."""
    kind = {".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}.get(path.suffix.lower())
    if kind is None:
        raise ConfigError([Problem(str(path), "unsupported file type; use a .yaml, .yml or .json file")])
    data = read_file(path, json.loads if kind == "JSON" else safe_yaml, kind)
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
