"""A deployment's and a rank's mutable state has one owner, `deployment.py`: no other
supervisor module assigns (or item-assigns, or deletes) a field of a `Deployment` or a
`RankState`; they call its methods. Read from the source with `ast`.

Which expressions are a deployment or a rank is read from the code, not guessed from a
field's name (`error` and `teardown` are fields of other records too): a name annotated
`Deployment`/`RankState` in that function, the names the supervisor uses for them
(`dep`, `rs`), a loop variable over `<...>.ranks.values()` / `<...>.deployments.values()`,
and an item of `.ranks[...]` / `.deployments[...]`."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from services.supervisor.deployment import Deployment, RankState

SUPERVISOR = Path(__file__).resolve().parents[3] / "services" / "supervisor"
OWNERS = {"deployment.py", "deployment_state.py"}
FIELDS = {f.name for cls in (Deployment, RankState) for f in dataclasses.fields(cls)}
TYPES = {"Deployment", "RankState"}
CONVENTIONAL = {"dep", "rs"}
TABLES = {"ranks", "deployments"}


def _annotated_names(func: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(func):
        ann, name = None, None
        if isinstance(node, ast.arg):
            ann, name = node.annotation, node.arg
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            ann, name = node.annotation, node.target.id
        if ann is not None and any(isinstance(n, ast.Name) and n.id in TYPES
                                   or isinstance(n, ast.Constant) and n.value in TYPES
                                   for n in ast.walk(ann)):
            names.add(name)
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            it = node.iter  # for rs in dep.ranks.values()
            if (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
                    and it.func.attr == "values" and isinstance(it.func.value, ast.Attribute)
                    and it.func.value.attr in TABLES):
                names.add(node.target.id)
    return names


def _is_deployment(expr: ast.expr, names: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in names
    if isinstance(expr, ast.Subscript):  # dep.ranks[r], sup.deployments[i]
        return isinstance(expr.value, ast.Attribute) and expr.value.attr in TABLES
    return False


def _field_owner(target: ast.expr) -> ast.expr | None:
    """For `<x>.<field> = ` / `<x>.<field>[k] = `: `<x>`."""
    if isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and target.attr in FIELDS:
        return target.value
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign | ast.Delete):
        out = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple | ast.List) else [t])
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def direct_assignments(source: str, name: str = "<src>") -> list[str]:
    found = []
    tree = ast.parse(source)
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for scope in [tree, *scopes]:
        names = CONVENTIONAL | (_annotated_names(scope) if scope is not tree else set())
        body = scope.body
        for stmt in body:
            for node in ast.walk(stmt):
                for target in _targets(node):
                    owner = _field_owner(target)
                    if owner is not None and _is_deployment(owner, names):
                        found.append(f"{name}:{node.lineno}: {ast.unparse(target)}")
    return sorted(set(found))


def test_no_module_but_its_own_assigns_a_deployments_fields():
    found = []
    for path in sorted(SUPERVISOR.rglob("*.py")):
        if path.name not in OWNERS:
            found += direct_assignments(path.read_text(encoding="utf-8"),
                                        path.relative_to(SUPERVISOR).as_posix())
    assert found == []


def test_the_scan_sees_each_form_and_ignores_other_records():
    source = (
        "def f(d: Deployment, other, err):\n"
        "    d.job_dir = 1\n"  # annotated
        "    dep.keys, x = 2, 3\n"  # the supervisor's name for one, in a tuple
        "    dep.rank_endpoints[0] = 4\n"  # an item of a field
        "    dep.ranks[1].phase = 5\n"  # a rank, by its table
        "    for r in dep.ranks.values():\n"
        "        r.error = 'x'\n"  # a loop over the table
        "    sup.deployments['a'].error += 'y'\n"
        "    del dep.teardown['x']\n"
        "    err.teardown = 6\n"  # a LaunchError's field of the same name: not ours
        "    other.error = 7\n"
        "    dep.plan_endpoint == 8\n")  # a comparison, not an assignment
    lines = [line.split(": ", 1)[1] for line in direct_assignments(source)]
    assert sorted(lines) == sorted([
        "d.job_dir", "dep.keys", "dep.rank_endpoints[0]", "dep.ranks[1].phase", "r.error",
        "sup.deployments['a'].error", "dep.teardown['x']"])
