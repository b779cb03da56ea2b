"""The house's layers hold: what each part of remat may import (docs/architecture.md), and a light `import remat`."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import remat

PACKAGE = Path(remat.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every remat module `path` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module != "remat":  # `from remat import x` names its modules
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "remat" or name.startswith("remat.")}


MODULES = {_module_name(path): _imports(path) for path in PACKAGE.rglob("*.py")}


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _offenders(where: str, allowed: tuple[str, ...]) -> dict[str, set[str]]:
    """Modules under `where` importing a remat module outside the `allowed` packages."""
    return {module: bad for module, imports in MODULES.items() if _inside(module, where)
            and (bad := {name for name in imports if not any(_inside(name, ok) for ok in allowed)})}


def test_the_engine_imports_nothing_else_of_remat() -> None:
    assert _offenders("remat.engine", ("remat.engine",)) == {}


def test_models_import_only_sites_placement_labels_and_problems() -> None:
    assert _offenders("remat.models", ("remat.models", "remat.sites", "remat.placement", "remat.labels",
                                       "remat.problems")) == {}


def test_nothing_below_the_cli_imports_the_bench() -> None:
    importers = {module for module, imports in MODULES.items()
                 if any(_inside(name, "remat.bench") for name in imports)}
    assert {m for m in importers if not _inside(m, "remat.bench") and not _inside(m, "remat.cli")} == set()


def test_only_the_command_entry_point_imports_the_cli() -> None:
    importers = {module for module, imports in MODULES.items() if any(_inside(n, "remat.cli") for n in imports)}
    assert {m for m in importers if not _inside(m, "remat.cli")} == {"remat.__main__"}


def test_nothing_outside_models_names_a_family() -> None:
    """Outside models/, a family is reached through `remat.models` and its seam alone."""
    seam = {"remat.models", "remat.models.family"}
    for module, imports in MODULES.items():
        if not _inside(module, "remat.models"):
            inside = {name for name in imports if _inside(name, "remat.models") and name not in seam
                      and name.rsplit(".", 1)[0] not in seam}
            assert inside == set(), module


@pytest.mark.parametrize("heavy", ["rich", "scipy", "matplotlib"])
def test_import_remat_is_light(heavy: str) -> None:
    """rich, scipy and matplotlib load when a command or function needs them, not with `import remat`."""
    code = f"import sys, remat; sys.exit({heavy!r} in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_layer_checks_can_fail() -> None:
    """The scans find what is there: apply imports the engine, the CLI the bench, models the registry."""
    assert _offenders("remat.apply", ("remat.engine",))
    assert any(_inside(name, "remat.bench") for name in MODULES["remat.cli.bench"])
    assert "remat.labels" in MODULES["remat.models"]


def test_parallel_imports_only_sites_labels_problems_the_engine_and_the_family_seam() -> None:
    # the distributed layouts act on Sites, as apply does, and reach a family through its seam
    # alone (which modules take which tensor-parallel style); the engine replays their RNG streams;
    # a pipeline calls its chunks as a step calls a model (calls.py, of the sites row)
    assert _offenders("remat.parallel", ("remat.parallel", "remat.sites", "remat.calls", "remat.labels",
                                         "remat.problems", "remat.engine", "remat.models")) == {}
