"""Parts and arrows (docs/design.md): which package may import which, read from the
source with `ast` (every import statement, at module level or inside a function,
including `if TYPE_CHECKING:` blocks), so a forbidden arrow fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(source: str, package: str) -> set[str]:
    """The absolute module names a module of `package` imports (relative ones resolved)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def arrows_from(folder: str, *, into: str) -> list[str]:
    """`file: module` for every import under `folder` of `into` or anything inside it."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        for name in sorted(imported_modules(path.read_text(encoding="utf-8"), package)):
            if name == into or name.startswith(into + "."):
                found.append(f"{path.relative_to(ROOT)}: {name}")
    return found


def test_supervisor_never_imports_the_rank():
    assert arrows_from("services/supervisor", into="services.rank") == []


def test_rank_never_imports_the_supervisor():
    assert arrows_from("services/rank", into="services.supervisor") == []


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    source = ("import services.rank.io\n"
              "def f():\n    from services.rank import loop\n"
              "from ...rank import env\nfrom .. import lifecycle\n")
    names = imported_modules(source, "services.supervisor.commands")
    assert {"services.rank.io", "services.rank.loop", "services.rank.env",
            "services.supervisor.lifecycle"} <= names
