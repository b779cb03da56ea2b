"""remat's version: the installed distribution's, or a marker when run from a source tree."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# What a source tree on PYTHONPATH (as benchmarks run on a device machine) reports: not installed.
SOURCE_VERSION = "0+source"


def remat_version() -> str:
    """The installed remat's version (pyproject.toml's), else SOURCE_VERSION."""
    try:
        return version("remat")
    except PackageNotFoundError:
        return SOURCE_VERSION
