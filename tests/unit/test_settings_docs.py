"""The documented settings are the settings classes: every name in README's configuration
table and in each service's full table (docs/*.md, the supervisor's module docstring) is
a field with the documented default, and every field a user can set is documented."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

import pytest

from common.config import ENV_PREFIX
from common.rank_env import HostBlasSettings
from common.rankspec import ENV_OVERRIDES, RankSettings
from services.gateway.core.settings import GatewaySettings
from services.rank.seams import SeamSettings
from services.reaper.__main__ import ReaperSettings
from services.supervisor import settings as supervisor_settings
from services.supervisor.settings import SupervisorSettings
from services.up.settings import UpSettings

REPO = Path(__file__).resolve().parents[2]
# Every class a user sets through CLI / LOCKSTEP_* (RankSettings: only its env overrides).
SERVICES = (GatewaySettings, SupervisorSettings, ReaperSettings, UpSettings, HostBlasSettings)
PLACEHOLDER = {"", "none", "empty", "file", "supervisor.json"}  # "no value" spellings
# One variable read by several services with different defaults, and the ones whose
# default README's table does not give: `lockstep up`'s stop_timeout is its own SIGTERM →
# SIGKILL wait per service (15; the supervisor's per rank: 10); up always gives the
# reaper an events port (7714; a reaper started alone has none).
SHARED_WITH_OTHER_DEFAULTS = {"stop_timeout": {UpSettings},
                              "reaper_events_port": {UpSettings}}


def _fields(cls: type) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str, first: str) -> list[tuple[list[str], str]]:
    """Rows of every markdown table whose first header cell is `first`: (names, default)."""
    rows, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        head = _cells(line) if line.startswith("|") else []
        if not head or head[0] != first or "default" not in head:
            continue
        col = head.index("default")
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = _cells(row)
            names = [n.strip().strip("`") for n in cells[0].split(" / ")]
            rows.append((names, cells[col]))
    return rows


def _clean(doc: str) -> str:
    doc = doc.replace("`", "").strip()
    if doc.startswith("(") and doc.endswith(")"):
        doc = doc[1:-1]  # "(none)", "(empty)"
    doc = re.sub(r"\s*\(.*\)$", "", doc)  # "0 (= 64)", "none (no PUB)"
    return re.sub(r"\s+s$", "", doc).strip()  # "10 s"


def same(doc: str, value: object, name: str) -> bool:
    doc = _clean(doc)
    if name == "home":  # None: resolved by default_home() at start
        return doc == "~/.lockstep" and value in (None, Path("~/.lockstep").expanduser())
    if doc.lower() in PLACEHOLDER:
        return value in (None, "", ())
    if isinstance(value, enum.Enum):
        return doc == value.value
    if isinstance(value, bool):
        return doc.lower() in (("1", "true", "on", "yes") if value else ("0", "false", "off", "no"))
    if isinstance(value, (int, float)):
        m = re.fullmatch(r"([\d.]+)\s*MiB", doc)
        try:
            return float(m.group(1)) * 2**20 == value if m else float(doc) == float(value)
        except ValueError:
            return False
    return doc == str(value)


def _defaults(names: list[str], default: str) -> list[str]:
    parts = [p.strip() for p in default.split(" / ")]
    return parts if len(parts) == len(names) else [parts[0]] * len(names)


def _check(rows: list[tuple[list[str], str | None]], known: dict[str, object], where: str) -> set[str]:
    seen = set()
    for names, default in rows:
        docs = [None] * len(names) if default is None else _defaults(names, default)
        for name, doc in zip(names, docs, strict=True):
            assert name in known, f"{where}: {name!r} is not a setting"
            assert doc is None or same(doc, known[name], name), \
                f"{where}: {name} documented {doc!r}, default {known[name]!r}"
            seen.add(name)
    return seen


def readme_rows() -> list[tuple[list[str], str]]:
    out = []
    for names, default in tables((REPO / "README.md").read_text(), "variable"):
        assert all(n.startswith(ENV_PREFIX) for n in names), names
        out.append(([n[len(ENV_PREFIX):].lower() for n in names], default))
    return out


def test_readme_names_settings_with_their_defaults():
    rows = readme_rows()
    assert rows, "README.md: no configuration table"
    for names, default in rows:
        for name, doc in zip(names, _defaults(names, default), strict=True):
            owners = [c for c in SERVICES if name in _fields(c)]
            assert owners, f"README.md: LOCKSTEP_{name.upper()} is not a setting"
            for cls in owners:
                if cls not in SHARED_WITH_OTHER_DEFAULTS.get(name, set()):
                    _check([([name], doc)], _fields(cls), f"README.md ({cls.__name__})")


def _docstring_rows(module) -> list[tuple[list[str], str]]:
    return tables(module.__doc__, "setting")


def _up_usage() -> list[tuple[list[str], str]]:
    text = (REPO / "docs" / "gateway.md").read_text()
    usage = text[text.index("`lockstep up ["):].split("`\n")[0]
    return [([flag.replace("-", "_")], None if value.isupper() else value)  # DIR, FILE
            for flag, value in re.findall(r"\[--([a-z-]+) ([^\]]+)\]", usage)]


FULL_TABLES = {
    GatewaySettings: lambda: tables((REPO / "docs" / "gateway.md").read_text(), "setting"),
    SupervisorSettings: lambda: _docstring_rows(supervisor_settings),
    ReaperSettings: lambda: tables((REPO / "docs" / "reaper.md").read_text(), "setting"),
    UpSettings: _up_usage,
}


@pytest.mark.parametrize("cls", list(FULL_TABLES), ids=lambda c: c.__name__)
def test_every_setting_is_documented_with_its_default(cls):
    known = _fields(cls)
    seen = _check(FULL_TABLES[cls](), known, cls.__name__)
    readme = {n for names, _ in readme_rows() for n in names}
    undocumented = set(known) - seen - readme - {"log_level"}  # log_level: the CLI's --log-level
    assert not undocumented, f"{cls.__name__}: not documented: {sorted(undocumented)}"


def test_rank_settings_table_and_overrides():
    rank_md = (REPO / "docs" / "rank.md").read_text()
    seen = _check(tables(rank_md, "setting (spec)"), _fields(RankSettings), "docs/rank.md")
    assert set(ENV_OVERRIDES) <= seen
    for name in ENV_OVERRIDES:  # the rank's override is the supervisor's setting, same name
        assert _fields(SupervisorSettings)[name] == _fields(RankSettings)[name]
        assert f"`{ENV_PREFIX}{name.upper()}`" in rank_md
    for cls in (HostBlasSettings, SeamSettings):
        for name in _fields(cls):
            assert f"{ENV_PREFIX}{name.upper()}" in rank_md, f"docs/rank.md: {name}"


def test_a_variable_several_services_read_has_one_default():
    by_name: dict[str, dict[type, object]] = {}
    for cls in SERVICES:
        for name, value in _fields(cls).items():
            by_name.setdefault(name, {})[cls] = value
    for name, owners in by_name.items():
        values = {cls: v for cls, v in owners.items()
                  if cls not in SHARED_WITH_OTHER_DEFAULTS.get(name, set())}
        if name != "home":  # the reaper resolves None through default_home()
            assert len({repr(v) for v in values.values()}) <= 1, f"{name}: {owners}"
