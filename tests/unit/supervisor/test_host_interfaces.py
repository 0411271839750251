"""The admin commands see the supervisor only as `interfaces.CommandHost`; each function
of the orchestration (lifecycle, after_failure, remote_ops) that takes `sup` as the
protocol it is annotated with (`TeardownHost` ⊂ `LaunchHost` ⊂ `LifecycleHost`): every
member it uses is declared there, every orchestration function it hands `sup` to asks
for no more, and `Supervisor` provides every declared member (read from the source with
`ast`: the supervisor sets most of them in `__init__`/`start`). Only the entry point
imports `service`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.supervisor import interfaces
from services.supervisor.service import Supervisor

SUPERVISOR = Path(interfaces.__file__).parent
COMMANDS = sorted((SUPERVISOR / "commands").glob("*.py"))
ORCHESTRATION = [SUPERVISOR / f"{m}.py" for m in ("lifecycle", "after_failure", "remote_ops")]
PROTOCOLS = ("CommandHost", "TeardownHost", "LaunchHost", "LifecycleHost")


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def declared(protocol: str) -> set[str]:
    """Its members and those of the protocols it extends."""
    cls = next(n for n in tree(Path(interfaces.__file__)).body
               if isinstance(n, ast.ClassDef) and n.name == protocol)
    own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id != "Protocol":
            own |= declared(base.id)
    return own


def host_functions(paths: list[Path]) -> dict[tuple[str, str], tuple[str, ast.AST]]:
    """(module, function) -> (the protocol its `sup` is annotated with, its node), for
    every top-level function of `paths` that takes `sup`."""
    out = {}
    for path in paths:
        for node in tree(path).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "sup":
                        ann = ast.unparse(arg.annotation) if arg.annotation else ""
                        out[(path.stem, node.name)] = (ann.strip("'\""), node)
    return out


def members_used(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "sup"}


def handed_sup(module: str, node: ast.AST) -> set[tuple[str, str]]:
    """The (module, function) calls inside `node` that pass `sup` on."""
    out = set()
    for call in ast.walk(node):
        if not (isinstance(call, ast.Call) and any(
                isinstance(a, ast.Name) and a.id == "sup" for a in call.args)):
            continue
        f = call.func
        if isinstance(f, ast.Name):
            out.add((module, f.id))
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            out.add((f.value.id, f.attr))
    return out


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


def test_the_commands_use_only_what_command_host_declares():
    uses = used(COMMANDS)
    assert uses  # the walk sees them
    assert {m: f for m, f in uses.items() if m not in declared("CommandHost")} == {}


def test_each_orchestration_function_uses_only_what_its_host_declares():
    funcs = host_functions(ORCHESTRATION)
    assert {ann for ann, _ in funcs.values()} == {"TeardownHost", "LaunchHost", "LifecycleHost"}
    extra = {f"{m}.{f}": sorted(members_used(node) - declared(ann))
             for (m, f), (ann, node) in funcs.items()}
    assert {k: v for k, v in extra.items() if v} == {}


def test_no_orchestration_function_hands_sup_to_one_that_asks_for_more():
    funcs = host_functions(ORCHESTRATION)
    wider = []
    for (m, f), (ann, node) in funcs.items():
        for callee in handed_sup(m, node):
            if callee in funcs and not declared(funcs[callee][0]) <= declared(ann):
                wider.append(f"{m}.{f} ({ann}) -> {'.'.join(callee)} ({funcs[callee][0]})")
    assert wider == []


def test_the_hosts_are_each_narrower_than_the_next():
    sizes = [len(declared(p)) for p in ("TeardownHost", "LaunchHost", "LifecycleHost")]
    assert declared("TeardownHost") < declared("LaunchHost") < declared("LifecycleHost")
    assert sizes == [9, 15, 21]


@pytest.mark.parametrize("protocol", PROTOCOLS)
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
