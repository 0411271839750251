"""Suite-wide settings. Hypothesis runs derandomized and without its example database, so
`make test` draws the same examples on every machine and every run (a failure prints
its reproduction blob). HYPOTHESIS_PROFILE=explore draws new examples each run. The live
cluster the read-only e2e modules share: `live_cluster` (tests/support/live_cluster.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("fixed", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


# --- the shared live cluster (tests/support/live_cluster.py) ------------------------------

SHARED = "live_cluster"
BOOT_BUDGET_S = 600  # added to the first user's timeout: up's boot and the PP deploy (240 s each)
STOP_BUDGET_S = 240  # added to the last user's: the stop with proof


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that use the shared cluster run one after another (where the first of
    them stood), so it is alive only while they run; its first and last users' timeouts
    include its boot and its stop."""
    mods = {_module_of(it) for it in items if SHARED in getattr(it, "fixturenames", ())}
    if not mods:
        return
    group = [it for it in items if _module_of(it) in mods]
    first = next(i for i, it in enumerate(items) if _module_of(it) in mods)
    rest = [it for it in items if _module_of(it) not in mods]
    items[:] = rest[:first] + group + rest[first:]


def _users(session: pytest.Session) -> list[pytest.Item]:
    return [it for it in session.items if SHARED in getattr(it, "fixturenames", ())]


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    users = _users(session)  # after deselection (-k, -m)
    if users:
        for it, extra in ((users[0], BOOT_BUDGET_S), (users[-1], STOP_BUDGET_S)):
            m = it.get_closest_marker("timeout")
            own = (m.args[0] if m.args else m.kwargs.get("timeout")) if m is not None else None
            own = own if own is not None else session.config.getini("timeout")
            it.add_marker(pytest.mark.timeout(float(own or 300) + extra), append=False)


@pytest.fixture(scope="session")
def _live_cluster_session(tmp_path_factory):
    from tests.support.live_cluster import LiveCluster

    cluster = LiveCluster.start(tmp_path_factory.mktemp("shared-up"))
    try:
        yield cluster
    finally:
        cluster.stop()  # a no-op when its last user stopped it


@pytest.fixture
def live_cluster(_live_cluster_session, request):
    """The shared cluster, idle before and after the test; stopped with proof after the
    last test that uses it."""
    c = _live_cluster_session
    c.check_idle(f"before {request.node.name}", 10)
    yield c
    try:
        c.check_idle(f"after {request.node.name}", 30)
    finally:
        if request.node is _users(request.session)[-1]:
            c.stop()
