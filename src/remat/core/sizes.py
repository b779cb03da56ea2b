"""Memory sizes: read from what users write ('60GiB', '80 GB', bytes), written for messages and tables."""

from __future__ import annotations

import re
from typing import Literal

from remat.core.problems import ConfigError, Problem

_UNITS = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


# Said by the help of every size flag (--memory-budget, --host-memory-budget, doctor's --request and
# --limit, --cublas_workspace), which all read a bare number as bytes, as allocator logs print sizes
BARE_IS_BYTES = "a bare number is bytes"


def format_bytes(n: float) -> str:
    """GiB, or MiB below a tenth of a GiB (tiny CPU models), for messages and tables."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


def parse_bytes(
    text: str | int, field: str = "memory_budget", bare: Literal["gib", "b"] = "gib", zero: bool = False
) -> int:
    """'60GiB', '60 GB', '512MiB', 64424509440 (bytes); a bare number in text is in unit `bare`:
    every command-line flag passes "b" (BARE_IS_BYTES), so '2500000' is the same size to each;
    "gib" is the Python API's budgets' default. Problems are reported under `field`; 0 is a size only where `zero`."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0 or text == 0 and not zero:
            raise ConfigError([Problem(field, f"is {text} bytes; give a positive size")])
        return text
    if not isinstance(text, str):  # a float could mean bytes or GiB: make the caller say which
        raise ConfigError(
            [
                Problem(
                    field,
                    f"{text!r} is a {type(text).__name__}; give bytes as an int or text with a unit, like '60GiB'",
                )
            ]
        )
    bare_means = BARE_IS_BYTES if bare == "b" else "a bare number means GiB"
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = (match.group(2) or bare).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            [
                Problem(
                    field, f"cannot read {text!r} as a memory size; write it like 60GiB, 80GB or 512MiB ({bare_means})"
                )
            ]
        )
    amount = float(match.group(1)) * _UNITS[unit]
    if unit == "b" and amount != int(amount):
        raise ConfigError(
            [
                Problem(
                    field,
                    f"{text!r} is not a whole number of bytes ({bare_means}); give a unit, like {match.group(1)}GiB",
                )
            ]
        )
    if amount < 0 or amount == 0 and not zero:
        raise ConfigError([Problem(field, f"{text!r} is no memory; give a positive size")])
    return int(amount)
