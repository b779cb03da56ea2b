"""Settings declared once: a field of a settings dataclass carries its public name (Megatron's or
Megatron Bridge's where it has one), its short flag, help and the parser that checks a value of it.
Config files, `from_megatron`, problems and the command line all read that one declaration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from remat.core.problems import Problem

# Megatron's default min_offloaded_tensor_size, in elements: smaller tensors stay on the device.
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024


class BadValue(Exception):
    """A value of the wrong type; the message says what the field accepts."""


Parser = Callable[[Any], Any]


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise BadValue("true or false")


def parse_int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise BadValue("a whole number")


def parse_float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise BadValue("a number")


def parse_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise BadValue("a string")


def split_labels(text: str) -> list[str]:
    """What CLIs and Hydra overrides produce: "a,b", "[a, b]", "['a', 'b']" or "a"."""
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1]
    items = (item.strip().strip("'\"").strip() for item in inner.split(","))
    return [item for item in items if item]


def parse_labels(value: Any) -> list[str]:
    if isinstance(value, str):
        return split_labels(value)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return list(value)
    raise BadValue("a list of labels, or one string such as 'core_attn,mlp'")


def parse_labels_or_empty(value: Any) -> list[str]:
    return [] if value is None else parse_labels(value)


def parse_label_tuple(value: Any) -> tuple[str, ...]:
    return tuple(parse_labels_or_empty(value))


def optional(parse: Parser) -> Parser:
    """`parse`, or None."""

    def parse_optional(value: Any) -> Any:
        if value is None:
            return None
        try:
            return parse(value)
        except BadValue as bad:
            raise BadValue(f"{bad} or null") from None

    parse_optional.inner = parse  # type: ignore[attr-defined]  # what a command line gives
    return parse_optional


# What a flag's text becomes before its parser checks it; None: a switch, given or not.
_FLAG_TYPES: dict[Parser, Callable[[str], Any] | None] = {
    parse_bool: None,
    parse_int: int,
    parse_float: float,
    parse_str: str,
    parse_labels: str,
    parse_labels_or_empty: str,
    parse_label_tuple: str,
}


@dataclass(frozen=True)
class Setting:
    """How a settings field is spelled outside Python."""

    parse: Parser
    public: str | None = None  # the name in config files and problems; None: the field's
    # on the command line: True as --PUBLIC, or the long flag where Megatron Bridge spells it otherwise
    flag: bool | str = False
    short: str | None = None  # e.g. "-tp"
    help: str | Callable[[], str] | None = None  # callable: text made with the parser (labels registered by then)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    negatable: bool = False  # a switch with a --no- form: given on or off, or left to a default
    text: Callable[[str], Any] | None = None  # what the flag's text becomes, where not its flag_type

    @property
    def flag_type(self) -> Callable[[str], Any] | None:
        """What argparse turns the flag's text into (None: a switch)."""
        return _FLAG_TYPES[getattr(self.parse, "inner", self.parse)]


SETTING = "remat.setting"


def setting(
    default: Any = dataclasses.MISSING,
    *,
    parse: Parser,
    public: str | None = None,
    flag: bool | str = False,
    short: str | None = None,
    help: str | Callable[[], str] | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    negatable: bool = False,
    text: Callable[[str], Any] | None = None,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field declared with its spelling outside Python (see Setting)."""
    meta = {SETTING: Setting(parse, public, flag, short, help, metavar, choices, negatable, text)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def settings(cls: Any) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """The declared settings of a dataclass (or instance), in order."""
    for f in dataclasses.fields(cls):
        if SETTING in f.metadata:
            yield f, f.metadata[SETTING]


def public_name(f: dataclasses.Field[Any]) -> str:
    """A field's name outside Python."""
    meta = f.metadata.get(SETTING)
    return (meta.public if meta is not None else None) or f.name


def public_names(cls: Any) -> dict[str, str]:
    """Public name -> field name, of each declared setting."""
    return {public_name(f): f.name for f, _ in settings(cls)}


def default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def parse_settings(obj: Any) -> tuple[dict[str, Any], list[Problem]]:
    """Each declared setting of `obj` parsed, by field name; a value of the wrong type is reported
    under its public name and falls back to its default."""
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for f, meta in settings(obj):
        raw = getattr(obj, f.name)
        try:
            values[f.name] = meta.parse(raw)
        except BadValue as bad:
            problems.append(Problem(public_name(f), f"got {raw!r} ({type(raw).__name__}); set it to {bad}"))
            values[f.name] = default(f)
    return values, problems


def from_public(cls: Any, keys: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `cls` among `keys` (public names), by field name."""
    names = public_names(cls)
    return {names[k]: v for k, v in keys.items() if k in names}


def to_public(obj: Any) -> dict[str, Any]:
    """The declared settings of `obj` by public name (lists copied)."""
    return {public_name(f): _copy(getattr(obj, f.name)) for f, _ in settings(obj)}


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
