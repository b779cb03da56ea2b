"""The house's layers hold (docs/architecture.md): each folder of remat imports only its own
modules and the folders below it, no module imports itself back through others, and `import
remat` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import remat

PACKAGE = Path(remat.__file__).parent


# remat's folders, bottom first: each may import the ones before it and nothing after
LAYERS = (
    "core",
    "engine",
    "config",
    "sites",
    "models",
    "parallel",
    "memory",
    "planner",
    "run",
    "estimate",
    "doctor",
    "bench",
    "cli",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every remat module `path` imports: at the top, inside a function or under TYPE_CHECKING."""
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


def _modules(name: str) -> set[str]:
    """The modules a dotted name imported refers to: itself if a module, else its module (an
    imported function or class)."""
    return {name} if name in MODULES else ({name.rsplit(".", 1)[0]} & MODULES.keys())


def _layer(module: str) -> int | None:
    """The index in LAYERS of the folder `module` sits in (None: the package's face, remat and
    remat.__main__, which sit on top)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_every_module_sits_in_a_layer_folder() -> None:
    """The package root holds only its face (remat, remat.__main__): every other module is in a folder of LAYERS."""
    assert {m for m in MODULES if _layer(m) is None} == {"remat", "remat.__main__"}


def _upward() -> dict[str, set[str]]:
    """Module -> the modules of folders above its own that it imports."""
    return {
        module: bad
        for module, imports in MODULES.items()
        if (own := _layer(module)) is not None
        and (bad := {m for name in imports for m in _modules(name) if (layer := _layer(m)) is None or layer > own})
    }


def test_no_folder_imports_a_folder_above_it() -> None:
    assert _upward() == {}


def _cycles() -> list[list[str]]:
    """The strongly connected groups of two or more modules in the import graph (Tarjan's)."""
    graph = {m: sorted({t for name in imports for t in _modules(name)} - {m}) for m, imports in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (top := stack.pop()) != node:
                group.append(top)
            if group:
                groups.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycles() -> None:
    """Not even through an import inside a function or under TYPE_CHECKING."""
    assert _cycles() == []


def test_the_engine_imports_nothing_else_of_remat() -> None:
    assert {
        m: bad
        for m, imports in MODULES.items()
        if _inside(m, "remat.engine") and (bad := {n for n in imports if not _inside(n, "remat.engine")})
    } == {}


def test_nothing_outside_models_names_a_family() -> None:
    """Outside models/, a family is reached through `remat.models` and its seam alone."""
    seam = {"remat.models", "remat.models.family", "remat.models.adapt"}
    for module, imports in MODULES.items():
        if not _inside(module, "remat.models"):
            inside = {
                name
                for name in imports
                if _inside(name, "remat.models") and name not in seam and name.rsplit(".", 1)[0] not in seam
            }
            assert inside == set(), module


def test_only_the_command_entry_point_imports_the_cli() -> None:
    importers = {module for module, imports in MODULES.items() if any(_inside(n, "remat.cli") for n in imports)}
    assert {m for m in importers if not _inside(m, "remat.cli")} == {"remat.__main__"}


@pytest.mark.parametrize("heavy", ["rich", "scipy", "matplotlib"])
def test_import_remat_is_light(heavy: str) -> None:
    """rich, scipy and matplotlib load when a command or function needs them, not with `import remat`."""
    code = f"import sys, remat; sys.exit({heavy!r} in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_layer_checks_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scans find what is there: the CLI imports the bench, models the labels; an import from
    a folder above, or back, is found."""
    assert any(_inside(name, "remat.bench") for name in MODULES["remat.cli.bench"])
    assert "remat.core.labels" in MODULES["remat.models.registry"]
    monkeypatch.setitem(MODULES, "remat.core.problems", {"remat.cli.common"})
    assert _upward() == {"remat.core.problems": {"remat.cli.common"}}
    monkeypatch.setitem(MODULES, "remat.cli.common", MODULES["remat.cli.common"] | {"remat.core.problems"})
    assert any({"remat.cli.common", "remat.core.problems"} <= set(group) for group in _cycles())


# The house's sizes: a module a reader can hold, a function that fits a screen.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 60


def _oversized() -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES, with their sizes."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if (lines := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{_module_name(path)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:  # type: ignore[operator]
                    found.append(f"{_module_name(path)}.{node.name}: {length} lines")
    return found


def test_no_module_over_600_lines_and_no_function_over_60(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _oversized() == []
    monkeypatch.setattr(sys.modules[__name__], "MAX_FUNCTION_LINES", 5)  # the scan finds what is there
    assert _oversized()
