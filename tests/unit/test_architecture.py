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


# docs/design.md "Parts and arrows": the top-level parts each may import (bench/ and
# tests/ may import anything; services/__main__ names its subcommands as strings).
PARTS = ("common", "models", "services.rank", "services.gateway", "services.hostagent",
         "services.reaper", "services.supervisor", "services.up", "services.admin")
ALLOWED = {
    "common": {"common"},
    "models": {"common", "models"},
    "services.rank": {"common", "services.rank"},
    "services.gateway": {"common", "services.gateway"},
    "services.hostagent": {"common", "services.hostagent"},
    "services.reaper": {"common", "services.hostagent", "services.reaper"},
    "services.supervisor": {"common", "models", "services.hostagent", "services.reaper",
                            "services.supervisor"},
    "services.up": {"common", "models", "services.supervisor", "services.up"},
    "services.admin": {"common", "services.supervisor", "services.admin"},
}
OURS = ("common", "models", "services", "bench", "tests")


def part_of(module: str) -> str:
    for part in sorted(PARTS, key=len, reverse=True):
        if module == part or module.startswith(part + "."):
            return part
    return module.split(".")[0]


def test_every_arrow_between_parts_is_an_allowed_one():
    bad = []
    for part, allowed in ALLOWED.items():
        for path in sorted((ROOT / part.replace(".", "/")).rglob("*.py")):
            package = ".".join(path.relative_to(ROOT).parts[:-1])
            for name in imported_modules(path.read_text(encoding="utf-8"), package):
                if name.split(".")[0] in OURS and part_of(name) not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert sorted(set(bad)) == []


def test_every_service_folder_is_a_part():
    folders = {f"services.{p.name}" for p in (ROOT / "services").iterdir()
               if (p / "__init__.py").exists()}
    assert folders == {p for p in PARTS if p.startswith("services.")}


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


# --- no import cycles -------------------------------------------------------------------


def module_graph(tops: tuple[str, ...] = ("common", "models", "services")) -> dict[str, set[str]]:
    """Module → the modules of ours it imports (any import statement: module level,
    function-local, under TYPE_CHECKING), each resolved to the longest module that
    exists (`from pkg import mod` is an arrow to pkg.mod; `from mod import name` to mod)."""
    files: dict[str, Path] = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        deps = set()
        for imp in imported_modules(path.read_text(encoding="utf-8"), package):
            bits = imp.split(".")
            found = next((m for k in range(len(bits), 0, -1)
                          if (m := ".".join(bits[:k])) in files), None)
            if found is not None and found != name:
                deps.add(found)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_imports_itself_round_a_circle():
    """Not even for a type: a lower module declares the Protocol it needs instead
    (e.g. services/gateway/core/refusals.py's Backend, services/up/single.py's Up)."""
    assert cycles(module_graph()) == []


def test_the_cycle_check_sees_every_kind_of_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.up.run import Up\n"
    assert "services.up.run" in imported_modules(typed, "services.up")


def test_no_test_module_imports_another():
    """What tests share lives in tests/support (or tests/gwutil.py), never in a test
    module another one imports."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        for name in imported_modules(path.read_text(encoding="utf-8"), package):
            if name.startswith("tests.") and any(
                    part.startswith("test_") for part in name.split(".")[1:]):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert bad == []


# The gateway, laid out by what it serves (issue 42): one package per API, the admin API
# and console, and the core they share. The core imports no API; no API imports another.
GATEWAY = "services.gateway"
GATEWAY_APIS = ("openai", "responses", "anthropic", "admin")
GATEWAY_ALLOWED = {
    "core": {"core"},
    **{api: {"core", api} for api in GATEWAY_APIS},
}


def test_the_gateway_core_imports_no_api_and_no_api_imports_another():
    folder = ROOT / "services" / "gateway"
    subpackages = {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(GATEWAY_ALLOWED), subpackages
    bad = []
    for pkg, allowed in GATEWAY_ALLOWED.items():
        for path in sorted((folder / pkg).rglob("*.py")):
            package = ".".join(path.relative_to(ROOT).parts[:-1])
            for name in imported_modules(path.read_text(encoding="utf-8"), package):
                if not name.startswith(GATEWAY + "."):
                    continue
                first = name.removeprefix(GATEWAY + ".").split(".")[0]
                if first not in allowed:
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert sorted(set(bad)) == []
