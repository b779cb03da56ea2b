"""remat.core.version: the installed version, or a marker from a source tree."""

from __future__ import annotations

import importlib.metadata

import pytest

from remat.core import version


def test_the_installed_version_is_pyprojects() -> None:
    assert version.remat_version() == importlib.metadata.version("remat") != version.SOURCE_VERSION


def test_a_source_tree_reports_it_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version, "version", missing)
    assert version.remat_version() == version.SOURCE_VERSION
