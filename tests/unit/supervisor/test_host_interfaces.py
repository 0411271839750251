"""The admin commands see the supervisor only as `interfaces.CommandHost`, the
orchestration (lifecycle, after_failure, remote_ops) only as `interfaces.LifecycleHost`:
every member they use is declared there, and `Supervisor` provides every declared member
(read from the source with `ast`: the supervisor sets most of them in `__init__`/`start`).
Only the entry point imports `service`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.supervisor import interfaces
from services.supervisor.service import Supervisor

SUPERVISOR = Path(interfaces.__file__).parent
USERS = {
    "CommandHost": sorted((SUPERVISOR / "commands").glob("*.py")),
    "LifecycleHost": [SUPERVISOR / f"{m}.py" for m in ("lifecycle", "after_failure",
                                                        "remote_ops")],
}


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def declared(protocol: str) -> set[str]:
    cls = next(n for n in tree(Path(interfaces.__file__)).body
               if isinstance(n, ast.ClassDef) and n.name == protocol)
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def used(paths: list[Path]) -> dict[str, set[str]]:
    """`sup.<member>` in each module, by member."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(tree(path)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "sup"):
                found.setdefault(node.attr, set()).add(path.name)
    return found


def provided_by_supervisor() -> set[str]:
    names = {n for n in dir(Supervisor) if not n.startswith("__")}
    for node in ast.walk(tree(SUPERVISOR / "service.py")):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return names


@pytest.mark.parametrize("protocol", sorted(USERS))
def test_its_users_use_only_what_the_interface_declares(protocol):
    uses = used(USERS[protocol])
    assert uses  # the walk sees them
    assert {m: f for m, f in uses.items() if m not in declared(protocol)} == {}


@pytest.mark.parametrize("protocol", sorted(USERS))
def test_the_supervisor_provides_every_declared_member(protocol):
    assert declared(protocol) - provided_by_supervisor() == set()


def test_only_the_entry_point_imports_the_service():
    importers = []
    for path in sorted(SUPERVISOR.rglob("*.py")):
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ImportFrom) and (
                    node.module == "services.supervisor.service"
                    or (node.module == "services.supervisor"
                        and any(a.name == "service" for a in node.names))):
                importers.append(path.relative_to(SUPERVISOR).as_posix())
    assert importers == ["__main__.py"]
