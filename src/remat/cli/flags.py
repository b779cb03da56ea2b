"""Command-line flags derived from the settings they set: each flag is the declaration of its
field (`remat.config.fields.setting`), so a setting added to a config is a flag of every command
that takes its config, under one spelling."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from remat.config.fields import Setting, public_name, settings
from remat.core.problems import ConfigError, Problem

# Every whole-number flag fits a signed 64-bit integer: torch, NumPy and SQLite store it as one,
# and a larger value fails deep inside them ("Overflow when unpacking long long"), naming no flag.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def whole_number(text: str) -> int:
    """argparse's `type` for every whole-number flag: int(text) within INT_MIN..INT_MAX, or an
    error that argparse prints under the flag's name."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid whole number: {text!r}") from None
    if not INT_MIN <= value <= INT_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a whole number from {INT_MIN} to {INT_MAX}")
    return value


def _long_flag(name: str, meta: Setting) -> str:
    return meta.flag if isinstance(meta.flag, str) else f"--{name}"


def add_settings(
    group: argparse._ActionsContainer,
    cls: Any,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """A flag for each setting of `cls` declared as one (`only` those named, none of `skip`, by
    field name). Each flag's value lands under the setting's public name, None when not given
    (or `defaults[public name]`), so that what a command line says is told from the defaults."""
    wanted, skipped, defaults = set(only) if only is not None else None, set(skip), defaults or {}
    for f, meta in settings(cls):
        if not meta.flag or f.name in skipped or (wanted is not None and f.name not in wanted):
            continue
        name = public_name(f)
        flags = [*([meta.short] if meta.short else []), _long_flag(name, meta)]
        help_text = meta.help() if callable(meta.help) else meta.help
        options: dict[str, Any] = dict(dest=name, default=defaults.get(name), help=help_text)
        if meta.negatable:
            options["action"] = argparse.BooleanOptionalAction
        elif meta.flag_type is None:  # a switch: on, or off where its flag says --no_
            options["action"] = "store_false" if flags[-1].startswith("--no_") else "store_true"
        else:
            options.update(
                type=str if meta.text else whole_number if meta.flag_type is int else meta.flag_type,
                metavar=meta.metavar,
                choices=list(meta.choices) if meta.choices and not meta.text else None,
            )
        group.add_argument(*flags, **options)


def given(cls: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The settings of `cls` a command line gives, by field name; a flag's text converted as its
    setting says (every conversion's problem raised at once, under the flag's public name)."""
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for f, meta in settings(cls):
        value = getattr(args, public_name(f), None)
        if value is None:
            continue
        if meta.text is not None and isinstance(value, str):
            try:
                value = meta.text(value)
            except ConfigError as err:
                problems += err.problems
                continue
        values[f.name] = value
    if problems:
        raise ConfigError(problems)
    return values
